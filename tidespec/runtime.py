"""Assembles an engine from an ``EngineConfig``: model, tokenizer, drafter, threads.

Why this exists: the CLI, the server, the benchmarks and the ``LLM`` facade all build the same
engine the same way; this is that one way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedTokenizerBase

from tidespec.config import EngineConfig, SpecConfig
from tidespec.control.policy import GuardConfig, PolicyOptions, SpeculationPolicy, make_policy
from tidespec.control.profiler import STATEFUL_DRAFTERS, load_or_measure
from tidespec.control.speedup import Profile
from tidespec.engine.engine import LLMEngine
from tidespec.models.llama import LlamaModel
from tidespec.models.loader import load_model
from tidespec.spec.proposal import Drafter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def build_drafter(spec: SpecConfig, target: LlamaModel, max_num_seqs: int, max_model_len: int) -> Drafter | None:
    """The drafter named by ``spec.drafter`` (None for "none")."""
    if spec.drafter == "none":
        return None
    if spec.drafter == "ngram":
        from tidespec.spec.drafters.ngram import NgramDrafter
        return NgramDrafter(min_n=spec.ngram_min, max_n=spec.ngram_max)
    if spec.drafter == "suffix":
        from tidespec.spec.drafters.suffix import SuffixDrafter
        return SuffixDrafter(max_tree_tokens=spec.suffix_max_tree_tokens, min_prob=spec.suffix_min_prob,
                             factor=spec.suffix_factor)
    if spec.drafter == "eagle3":
        from tidespec.adapt.online import build_eagle3_drafter
        from tidespec.spec.drafters.eagle3 import Eagle3DrafterConfig
        return build_eagle3_drafter(target, spec.eagle3_dir, spec.eagle3_draft_vocab, Eagle3DrafterConfig(
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, tree_depth=spec.eagle3_tree_depth,
            tree_top_k=spec.eagle3_tree_top_k))
    from tidespec.spec.drafters.draft_model import DraftModelDrafter
    if spec.draft_layers:
        draft = target.truncated(spec.draft_layers)
    elif spec.draft_model:
        loaded = load_model(spec.draft_model, dtype=target.dtype, device=str(target.device))
        if loaded.model.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(f"draft model vocab ({loaded.model.cfg.vocab_size}) differs from the target's "
                             f"({target.cfg.vocab_size}): drafter and target must share a tokenizer")
        draft = loaded.model
    else:
        draft = target.truncated(max(1, target.cfg.num_layers // 4))
    return DraftModelDrafter(draft, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                             tree_top_k=spec.tree_top_k)


def build_policy(spec: SpecConfig, model: LlamaModel, drafter: Drafter | None,
                 progress: Callable[[str], None] | None = None) -> SpeculationPolicy | None:
    """The speculation-length policy with guards; profiles the model first when the policy needs
    costs (analytic, hybrid; bandit for the switching cost of a stateful drafter)."""
    if drafter is None:
        return None
    profile: Profile | None = None
    needs_profile = spec.policy in ("analytic", "hybrid") or (
        spec.policy == "bandit" and drafter.name in STATEFUL_DRAFTERS)
    if spec.profile:
        profile = Profile.load(spec.profile)
    elif needs_profile:
        profile, _ = load_or_measure(model, drafter, progress=progress)
    guards = GuardConfig(kv_threshold=spec.guard_kv_usage, temperature_threshold=spec.guard_temperature,
                         gamma_max=spec.num_speculative_tokens)
    return make_policy(spec.policy, PolicyOptions(gamma_max=spec.num_speculative_tokens, profile=profile,
                                                  guards=guards))


def build_engine(config: EngineConfig, model: LlamaModel | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None, drafter: Drafter | None = None) -> LLMEngine:
    """Load (unless given) the model and tokenizer and wire the configured drafter and policy."""
    mc = config.model
    if mc.threads:
        torch.set_num_threads(mc.threads)
    if model is None or tokenizer is None:
        loaded = load_model(mc.model, dtype=DTYPES[mc.dtype], device=mc.device)
        model, tokenizer = loaded.model, loaded.tokenizer
    max_len = min(config.cache.max_model_len, model.cfg.max_position_embeddings)
    if drafter is None:
        drafter = build_drafter(config.spec, model, config.cache.max_num_seqs, max_len)
    policy = build_policy(config.spec, model, drafter) if config.spec.num_speculative_tokens else None
    return LLMEngine(model, tokenizer, config, drafter=drafter, policy=policy)
