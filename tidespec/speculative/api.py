"""Data contracts between the engine and drafters (vLLM's words: accepted / recovered / bonus).

Why this exists: adding a drafter must never touch the engine loop. A drafter sees a list of
``DraftInput`` (one per sequence that should speculate this step) and returns one
``DraftProposal``; after verification the engine tells it what was kept through ``observe``.
Everything else the engine, the policies and the server ask of a drafter is in ``Drafter`` too
(a single drafter is a set of one: ``members``), with its defaults in ``DrafterBase``, so none of
them imports or probes a concrete drafter class. How a drafter is found and built:
``speculative.registry``.

A proposal per sequence is a flattened tree in topological order: ``parents[j]`` is the index
of token j's parent in the same list, or -1 for a child of the last verified token. A chain is
the special case ``parents = [-1, 0, 1, ...]`` (stored as ``None``).

Worked example: the tree  last -> a -> b, last -> c  is
``draft_token_ids=[a, c, b]``, ``parent_indices=[-1, -1, 0]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from tidespec.sampling import SamplingParams
from tidespec.speculative.tree import check_parents, tree_depths

if TYPE_CHECKING:
    from tidespec.models.eagle3.head import Eagle3Head
    from tidespec.models.target import TargetModel
    from tidespec.speculative.vocab.dynamic import DynamicVocab


@dataclass
class DraftInput:
    """What a drafter may look at for one sequence."""

    seq_id: int
    token_ids: list[int]  # prompt + output so far; the last one is not yet in the target's KV
    num_speculative_tokens: int  # gamma for this sequence this step (>= 1)
    params: SamplingParams
    tree: bool = False  # whether a tree-shaped proposal is allowed
    num_prompt_tokens: int = 0  # where the prompt ends in token_ids (0 = unknown)
    drafter: str | None = None  # which drafter of a ``MultiDrafter`` drafts it (None = its first)
    # a model-free drafter may see token_ids end in tokens a constrained request's grammar forces, not
    # yet verified (``speculative/forced.py``): it drafts past them, and the engine puts them first


@dataclass
class SeqDraft:
    """One sequence's proposal."""

    token_ids: list[int]  # [n] draft tokens, topological order
    parent_indices: list[int] | None = None  # [n] parent index (-1 = root); None = chain
    draft_probs: torch.Tensor | None = None  # [n, V] draft distribution each token was drawn from; None = point mass
    score: float | None = None  # the drafter's own estimate of the tokens verification accepts (suffix: its path
    # probabilities' sum); None: it has none (per-sequence drafting then takes the draft's length)
    token_probs: list[float] | None = None  # [n] the drafter's probability that the path to each token is accepted
    # (never above its parent's); None: it has none (``policy/trim.py`` then keeps the draft whole)

    def __post_init__(self) -> None:
        if self.parent_indices is not None:
            if len(self.parent_indices) != len(self.token_ids):
                raise ValueError("parent_indices must have one entry per draft token")
            check_parents(self.parent_indices)
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.token_ids):
            raise ValueError("draft_probs must have one row per draft token")
        if self.token_probs is not None and len(self.token_probs) != len(self.token_ids):
            raise ValueError("token_probs must have one entry per draft token")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def depth(self) -> int:
        """Longest root-to-leaf path: the most tokens verification can accept (= length for chains).

        Example: parents [-1, 0, 0, 1] (a root with two children, one with a child) -> 3.
        """
        if self.parent_indices is None:
            return len(self.token_ids)
        return 1 + max(tree_depths(self.parent_indices), default=-1)

    @property
    def is_tree(self) -> bool:
        return self.parent_indices is not None and any(p != j - 1 for j, p in enumerate(self.parent_indices))


@dataclass
class DraftProposal:
    """Drafts for a batch, keyed by sequence id. A missing or empty entry means no speculation."""

    drafts: dict[int, SeqDraft] = field(default_factory=dict)
    # sequences the drafter could not draft for yet because it lacks their context (a feature
    # drafter after a step without taps): not a short draft, the policy should not learn from it
    cold: set[int] = field(default_factory=set)

    @property
    def num_draft_tokens(self) -> int:
        return sum(d.num_tokens for d in self.drafts.values())


@dataclass
class Observation:
    """What the engine reports to drafters after a step, per sequence: the tokens that are now
    final (verified prompt chunk or accepted drafts + bonus/recovered) and, when the drafter
    asked for taps, the target's hidden taps at the positions that produced them."""

    seq_id: int
    token_ids: list[int]  # full context after this step (prompt + output)
    num_new_cached: int  # tokens whose target KV became final this step
    taps: torch.Tensor | None = None  # [num_new_cached, num_taps * H] or None
    start: int = -1  # cache position of the first newly cached token (-1 = unknown)
    # [num_new_cached, H] the target's final (normed) hidden state at those positions — row j
    # produced token ``token_ids[start + j + 1]`` — when the drafter ``wants_hidden``, else None
    hidden: torch.Tensor | None = None
    num_prompt_tokens: int = 0  # positions before this are the prompt's (not generated)


@runtime_checkable
class Drafter(Protocol):
    """A speculative drafter: what the engine, the policies, the profiler and the server may ask of it.

    The engine calls ``propose`` for the sequences that speculate this step, ``observe`` after every
    step with every sequence that advanced and did not finish (whether it speculated or not), and
    ``release`` once a sequence finished. Stateless drafters may ignore ``observe`` and ``release``.
    Taps: a drafter with ``tap_layers`` gets the target's taps in ``observe`` for the steps the
    engine computed them; after a step without taps (speculation was off for a while, so the
    engine ran exactly plain decoding) its observations carry ``taps=None`` and the drafter must
    cope (EAGLE-3 restarts its context at the next position that has taps).

    Traits (class attributes of each drafter): ``model_free`` — ``propose`` runs no model forward,
    so a controller may score it on the side for free, and its draft depends only on the context's
    token ids, the gamma and the tree flag (``MultiDrafter`` hands one draft out for offer, route and
    shadow); ``stateful`` — it keeps per-sequence model
    state (a KV cache) that must catch up after a pause, a cost the profiler measures.
    Several drafters behind one (``MultiDrafter``) answer the same protocol; ``members`` names them
    (a single drafter: itself), ``tapped`` the one that reads taps."""

    name: str
    tap_layers: tuple[int, ...]  # target layers whose input hidden states this drafter needs; () = none
    model_free: bool
    stateful: bool
    versioned: bool  # it drafts with published versions that online training swaps (``version``)
    version: int  # the published version it drafts with (0 = never published; 0 when not ``versioned``)
    wants_hidden: bool  # whether observations must carry the target's final hidden states
    drafts_from_hidden: bool  # it drafts from those hidden states (Medusa): the profiler times it with random ones
    vocab: DynamicVocab | None  # its draft vocabulary, when one is attached
    shadowed: frozenset[str]  # members whose drafts are scored on the side (``drain_shadow``)

    @property
    def members(self) -> Mapping[str, Drafter]: ...

    @property
    def tapped(self) -> str | None: ...

    def propose(self, inputs: list[DraftInput]) -> DraftProposal: ...

    def observe(self, observations: list[Observation]) -> None: ...

    def release(self, seq_id: int) -> None: ...

    def drain_shadow(self) -> dict[str, list[tuple[int, int, int]]]: ...

    def warm_up(self, max_gamma: int) -> float: ...

    def cost_signature(self) -> str: ...

    def vocab_output(self, lm: torch.Tensor) -> VocabOutput | None: ...


def network_signature(net: Eagle3Head | TargetModel, quantization: str = "none") -> str:
    """A neural drafter's ``cost_signature``: its network's config and dtype, the precision it drafts
    in, and its device when not the CPU (a ``--drafter-device`` GPU drafter costs otherwise).

    Example: an EAGLE-3 head in float32 drafting in int8 on the CPU -> ``"Eagle3Config(...) torch.float32 int8"``.
    """
    device = next(net.parameters()).device
    return (f"{net.cfg!r} {net.dtype}" + (f" {quantization}" if quantization != "none" else "")
            + (f" {device}" if device.type != "cpu" else ""))


@dataclass(frozen=True)
class VocabOutput:
    """How a drafter's output layer drafts over a draft vocabulary (``Drafter.vocab_output``).

    ``rows_for`` maps target token ids [n] to the output rows [n, H] its logits are computed with;
    ``own`` lists the tokens whose rows it trained itself (None: every token), which the vocabulary's
    core takes first; ``quantized``: it drafts in int8 or int4, so V_t's rows are drafted in int8.

    Example: a draft model with LM head ``W`` [V, H] answers ``VocabOutput(lambda ids: W[ids], None,
    False)``; an EAGLE-3 head pruned to 2,048 tokens gives its own rows for those and the target's
    LM-head rows, mapped into its space, for the others, with ``own`` = its 2,048 ids.
    """

    rows_for: Callable[[torch.Tensor], torch.Tensor]
    own: list[int] | None
    quantized: bool


class DrafterBase:
    """The defaults of ``Drafter`` for a single drafter: a set of one, no taps, no state to release,
    nothing scored on the side, nothing to warm up, costs that depend on its name alone.

    Example: a drafter that always proposes its last token once::

        class Echo(DrafterBase):
            name, model_free = "echo", True

            def propose(self, inputs):
                return DraftProposal({i.seq_id: SeqDraft([i.token_ids[-1]]) for i in inputs})

    ``Echo().members == {"echo": <the Echo>}``, ``Echo().tapped is None``.
    """

    name: str = ""
    tap_layers: tuple[int, ...] = ()
    model_free: bool = False
    side_scored: bool = True  # a model-free drafter a controller may score on the side (not ``grammar``: no grammar there)
    stateful: bool = False
    versioned: bool = False
    version: int = 0
    wants_hidden: bool = False
    drafts_from_hidden: bool = False  # it drafts from the final hidden states it observes (Medusa): the profiler
    # times it with random ones
    vocab: DynamicVocab | None = None
    shadowed: frozenset[str] = frozenset()

    @property
    def members(self) -> Mapping[str, Drafter]:
        return {self.name: self}  # type: ignore[dict-item]  # a DrafterBase subclass implements propose

    @property
    def tapped(self) -> str | None:
        return self.name if self.tap_layers else None

    def observe(self, observations: list[Observation]) -> None:
        """Nothing to follow (a stateless drafter)."""

    def release(self, seq_id: int) -> None:
        """Nothing kept per sequence."""

    def drain_shadow(self) -> dict[str, list[tuple[int, int, int]]]:
        """Outcomes of drafts scored on the side since the last call: only a ``MultiDrafter`` has them."""
        return {}

    def warm_up(self, max_gamma: int) -> float:
        """Seconds spent preparing to draft up to ``max_gamma`` tokens (CUDA graphs); nothing by default."""
        return 0.0

    def cost_signature(self) -> str:
        """What its drafting cost depends on beyond its name (a network's shape, dtype, device): keys
        the cached profile, so the profile of one network is never read for another. "" = the name."""
        return ""

    def vocab_output(self, lm: torch.Tensor) -> VocabOutput | None:
        """How its output layer drafts over a draft vocabulary, given the target's LM-head rows ``lm``
        [V, H]; None (the default): it has no output layer to restrict (n-gram, suffix)."""
        return None
