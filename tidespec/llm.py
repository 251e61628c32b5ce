"""The offline ``LLM`` facade and the one way to assemble an engine: model, tokenizer, drafter, policy.

Why this exists: the CLI, the server, the benchmarks and the ``LLM`` facade all build the same
engine the same way; this is that one way. It sits above ``engine`` and ``speculative`` and below
``online``, ``server`` and ``bench`` (which call ``build_engine``): serving a frozen drafter never
imports the online-training machinery.

Worked example::

    llm = LLM(EngineConfig(spec=SpecConfig(drafter="ngram")))
    outs = llm.generate(["def fib(n):"], SamplingParams(max_tokens=32))
    outs[0].text, outs[0].stats.mean_acceptance_length
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from tidespec.config import DraftVocabConfig, EngineConfig, ModelConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.engine.output import RequestOutput
from tidespec.errors import ConfigError
from tidespec.models.eagle3.checkpoint import is_checkpoint_dir, seed_root, shipped_head_for
from tidespec.models.execution.executor import ExecutorOptions
from tidespec.models.loading.loader import DTYPES, LoadedModel, load_model
from tidespec.models.quant.quantize import Int8Linear
from tidespec.models.target import TargetConfig, TargetModel, output_matrix
from tidespec.sampling import SamplingParams
from tidespec.speculative.api import Drafter
from tidespec.speculative.drafters.eagle3_options import eagle3_options, with_eagle3
from tidespec.speculative.drafters.medusa import medusa_options, seed_medusa_root
from tidespec.speculative.policy.api import SpeculationPolicy
from tidespec.speculative.policy.factory import PolicyOptions, make_policy, policy_profile
from tidespec.speculative.policy.guards import GuardConfig
from tidespec.speculative.policy.profiler import ProfilerConfig, load_or_measure
from tidespec.speculative.policy.speedup import Profile
from tidespec.speculative.policy.trim import DraftTrim
from tidespec.speculative.registry import build_drafter, check_config, stateful_names
from tidespec.speculative.vocab.arc import ArcConfig
from tidespec.speculative.vocab.dynamic import DynamicVocab, DynamicVocabConfig
from tidespec.speculative.vocab.graph import CooccurrenceGraph
from tidespec.workloads.loader import load_prompts

log = logging.getLogger(__name__)


def load_target(mc: ModelConfig) -> LoadedModel:
    """The target model ``mc`` names: loaded in ``mc.dtype`` on ``mc.device``, its linear layers
    quantized as ``mc.quantization`` says (what every engine, server and benchmark serves)."""
    return load_model(mc.model, dtype=DTYPES[mc.dtype], device=mc.device, quantization=mc.quantization,
                      quant_group_size=mc.quant_group_size)


def attach_draft_vocab(drafter: Drafter | None, vc: DraftVocabConfig, target: TargetModel,
                       tokenizer: PreTrainedTokenizerBase) -> DynamicVocab | None:
    """Give the first member of ``drafter`` whose output layer can draft over a vocabulary
    (``Drafter.vocab_output``; in a ``MultiDrafter``, the first such member in its order) the
    draft vocabulary ``vc`` asks for (None for mode "off"): the core and the co-occurrence graph
    from ``vc.corpus``'s tokens (the member's own trained tokens first), its output rows as the
    member says. A member that drafts in int8 (or int4) drafts over V_t in int8 as well: each
    published V_t carries an ``Int8Linear`` of its rows, built on the vocabulary's worker thread."""
    if vc.mode == "off":
        return None
    members = drafter.members.values() if drafter is not None else ()
    lm = output_matrix(target)
    found = next(((d, out) for d in members if (out := d.vocab_output(lm)) is not None), None)
    if found is None:
        raise ConfigError(f"--draft-vocab-mode {vc.mode} needs a drafter whose output layer can draft over it "
                          f"(eagle3 or draft-model)")
    user, out = found
    graph = CooccurrenceGraph()
    for name in (c.strip() for c in vc.corpus.split(",")):
        if name:
            for prompt in load_prompts(name, tokenizer):
                graph.add(prompt.token_ids)
    cfg = DynamicVocabConfig(core_size=vc.core_size(len(out.own) if out.own else target.cfg.vocab_size),
                             dynamic=vc.mode == "dynamic",
                             buffer=ArcConfig(capacity=vc.buffer, max_insert=vc.max_insert,
                                              min_residency=vc.min_residency))
    vocab = DynamicVocab.from_graph(cfg, graph, target.cfg.vocab_size, out.rows_for,
                                    index_rows=lm if cfg.dynamic else None, own=out.own, start=cfg.dynamic,
                                    output_for=Int8Linear.from_weight if out.quantized else None,
                                    output_join=Int8Linear.concat if out.quantized else None)
    user.vocab = vocab
    return vocab


def draft_vocab_of(engine: LLMEngine) -> DynamicVocab | None:
    """The draft vocabulary of the engine's drafter (alone or a ``MultiDrafter`` member), if any."""
    return engine.drafter.vocab if engine.drafter is not None else None


def drafter_max_len(config: EngineConfig, model: TargetModel) -> int:
    """The context a drafter of an engine built from ``config`` is sized for (and profiled within)."""
    return min(config.cache.max_model_len, model.cfg.max_position_embeddings)


def load_profile(config: EngineConfig, model: TargetModel, drafter: Drafter | None, refresh: bool = False,
                 progress: Callable[[str], None] | None = None) -> tuple[Profile, Path]:
    """The start-up profile of an engine built from ``config`` (``profiler.load_or_measure``): its
    forwards as the engine runs them, its drafters timed within the engine's context length and
    sequence count (``ProfilerConfig.fitted``)."""
    return load_or_measure(model, drafter, ProfilerConfig().fitted(drafter_max_len(config, model),
                                                                   config.cache.max_num_seqs), refresh,
                           progress, ExecutorOptions.of(config.model, config.scheduler.max_num_batched_tokens))


def build_policy(config: EngineConfig, model: TargetModel, drafter: Drafter | None,
                 progress: Callable[[str], None] | None = None) -> SpeculationPolicy | None:
    """The speculation-length policy with guards (``config.policy``, gamma_max from ``config.spec``);
    profiles the model first when the policy needs costs (analytic, hybrid; bandit for the
    switching cost of a stateful drafter)."""
    if drafter is None:
        return None
    pc, gamma_max = config.policy, config.spec.num_speculative_tokens
    profile: Profile | None = None
    stateful = drafter.stateful
    needs_profile = pc.name in ("analytic", "hybrid") or (pc.name == "bandit" and stateful)
    if pc.profile:
        profile = Profile.load(pc.profile)
    elif needs_profile:
        profile, _ = load_profile(config, model, drafter, progress=progress)
    guards = GuardConfig(kv_threshold=pc.guard_kv_usage, temperature_threshold=pc.guard_temperature,
                         gamma_max=gamma_max)
    several = tuple(drafter.members) if len(drafter.members) > 1 else ()
    return make_policy(pc.name, PolicyOptions(
        gamma_max=gamma_max, profile=profile, guards=guards, drafters=several, shadowed=drafter.shadowed,
        stateful=stateful_names(drafter), per_sequence=pc.per_sequence,
        measured_routes=pc.measured_routes, gate=pc.gate_model_drafters))


def with_shipped_head(spec: SpecConfig, target_cfg: TargetConfig, online: bool = False) -> SpecConfig:
    """``spec`` with ``--eagle3-dir`` at the shipped head when EAGLE-3 is among its drafters, no
    directory was given and the head fits the target (the embedded model): what ``--drafter eagle3``
    on the embedded model should mean, since a fresh random head drafts nothing that is accepted
    until a trained one is published. With ``online`` (``--online-training``) and an ``--eagle3-dir``
    publish root that holds no drafter yet, the shipped head is published there as v1
    (``seed_root``), so training fine-tunes it rather than a random head. Otherwise ``spec`` unchanged."""
    if "eagle3" not in spec.drafter_names:
        return spec
    boot = shipped_head_for(target_cfg)
    if boot is None:
        return spec
    root = eagle3_options(spec).dir
    if root is None:
        log.info("EAGLE-3: the embedded model's shipped head (%s); --eagle3-dir chooses another", boot)
        return with_eagle3(spec, dir=str(boot))
    if online and not is_checkpoint_dir(root):
        version = seed_root(root, boot, target_cfg)
        if version is not None:
            log.info("online training: %s held no drafter; published the embedded model's shipped head there as "
                     "v%d, which training fine-tunes", root, version)
    return spec


def build_engine(config: EngineConfig, model: TargetModel | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None, drafter: Drafter | None = None) -> LLMEngine:
    """Load (unless given) the model and tokenizer and wire the configured drafter and policy."""
    check_config(config)
    mc = config.model
    if mc.threads:
        torch.set_num_threads(mc.threads)
    if model is None or tokenizer is None:
        loaded = load_target(mc)
        model, tokenizer = loaded.model, loaded.tokenizer
    max_len = drafter_max_len(config, model)
    if drafter is None:
        if mc.model is None:  # the embedded model: its shipped EAGLE-3 head unless --eagle3-dir names one
            config = dataclasses.replace(config, spec=with_shipped_head(config.spec, model.cfg, config.online.enabled))
        if config.online.enabled and config.spec.online_drafter == "medusa":  # training starts from what serves
            seed_medusa_root(medusa_options(config.spec), model)
        drafter = build_drafter(config.spec, model, config.cache.max_num_seqs, max_len, config.model.enforce_eager,
                                config.model.compile)
        attach_draft_vocab(drafter, config.spec.vocab, model, tokenizer)
        if drafter is not None:  # CUDA graphs captured now, the draft vocabulary attached
            seconds = drafter.warm_up(config.spec.num_speculative_tokens)
            if seconds:
                log.info("warmed the drafter up (CUDA graphs captured or its step compiled) in %.1f s", seconds)
    policy = build_policy(config, model, drafter) if config.spec.num_speculative_tokens else None
    return LLMEngine(model, tokenizer, config, drafter=drafter, policy=policy, trim=build_trim(config, policy))


def build_trim(config: EngineConfig, policy: SpeculationPolicy | None) -> DraftTrim | None:
    """The draft trim (``speculative/policy/trim.py``) of a policy that prices steps from a profile (analytic,
    hybrid) with ``--trim-drafts`` on; None otherwise (a static gamma verifies every draft whole)."""
    profile = policy_profile(policy) if policy is not None else None
    if profile is None or not config.policy.trim_drafts or config.policy.name not in ("analytic", "hybrid"):
        return None
    return DraftTrim(profile)


class LLM:
    """Offline facade: ``LLM(config).generate(prompts, params)`` like vLLM's."""

    def __init__(self, config: EngineConfig | None = None, *, model: TargetModel | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None, drafter: Drafter | None = None) -> None:
        from tidespec.llm import build_engine  # late import: runtime imports this module

        self.config = config or EngineConfig()
        self.engine = build_engine(self.config, model=model, tokenizer=tokenizer, drafter=drafter)
        self.tokenizer = self.engine.tokenizer

    def chat_prompt(self, message: str) -> list[int]:
        """Token ids of one user message in the model's chat template."""
        return list(self.tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                                       add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))

    def generate(self, prompts: Iterable[str | list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None,
                 progress: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        plist = [prompts] if isinstance(prompts, str) else list(prompts)
        ps = params if isinstance(params, list) else [params or SamplingParams()] * len(plist)
        ids = [self.engine.add_request(p, sp) for p, sp in zip(plist, ps)]
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for o in self.engine.step():
                if o.finished:
                    final[o.request_id] = o
                    if progress is not None:
                        progress(o)
        return [final[i] for i in ids]

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block, as vLLM's ``LLM.reset_prefix_cache``; returns how many."""
        return self.engine.reset_prefix_cache()
