"""Structured outputs: a request's constraint (``sampling.StructuredOutputs``) compiled into a
grammar, and the per-sequence matcher the engine masks the target's logits with.

Why a package of its own: the engine (verification), the grammar drafter (forced tokens) and the
server (a 400 for a schema that does not compile, compiled off the engine's thread) all need the
same compiled grammars; none of them should know the grammar library. It sits above the base
layer (it reads ``StructuredOutputs``) and below the models, the drafters and the engine.
"""
