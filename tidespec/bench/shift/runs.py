"""Running ``tidespec bench shift``'s trace: the closed loop, and the engine of each configuration.

Why this exists: the configurations (plain, frozen, online, the draft vocabularies) and the capture-overhead runs
of ``bench.shift.measure`` must drive the engine the same way — the same closed loop, greedy
sampling with EOS ignored, the same record of every step and request — or their tokens/s and
acceptance would not compare; ``run_trace`` is that one loop, and the engine builders here give
every configuration the same cache sizing and the same starting drafter (``seed_publish_root``).

Worked example::

    engine = learned_engine(model, tokenizer, trace_engine_config(trace, cfg, model, cfg.gamma), root, 8192)
    run = run_trace(engine, trace, concurrency=4, max_tokens=128, desc="frozen")
    run.requests[0]["accepted"], run.steps[-1]["version"]
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shlex
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from tidespec.bench.shift.config import ShiftBenchConfig, TraceItem, served_label
from tidespec.config import (
    CacheConfig,
    CollectionConfig,
    ConfigError,
    DraftVocabConfig,
    EngineConfig,
    ModelConfig,
    PolicyConfig,
    SpecConfig,
)
from tidespec.engine.engine import LLMEngine
from tidespec.engine.observer import Hooks
from tidespec.llm import build_engine, draft_vocab_of
from tidespec.models.eagle3.checkpoint import seed_root
from tidespec.models.eagle3.lora import LORA_DIR
from tidespec.models.loading.loader import LoadedModel
from tidespec.models.medusa.heads import MedusaHeads, publish_heads
from tidespec.models.target import TargetModel
from tidespec.online.serving.attach import OnlineConfig, OnlineTraining, attach_online_training
from tidespec.online.serving.governor import GovernorConfig
from tidespec.online.signals import read_trainer_log, read_trainer_rounds
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.eagle3_options import Eagle3Options, with_eagle3
from tidespec.speculative.drafters.medusa import MedusaOptions, seed_medusa_root
from tidespec.speculative.drafters.suffix import SuffixOptions
from tidespec.stats import RequestStats, StepStats


@dataclass
class TraceRun:
    config: str
    wall_s: float = 0.0
    steps: list[dict[str, Any]] = field(default_factory=list)  # t, emitted, drafts, accepted, version, by_drafter (+ accepted), taps
    requests: list[dict[str, Any]] = field(default_factory=list)  # in trace order
    outputs: list[list[int]] = field(default_factory=list)  # in trace order
    turns: list[tuple[float, float]] = field(default_factory=list)  # wall-clock (perf_counter) span of each turn
    online: dict[str, Any] = field(default_factory=dict)
    vocab: dict[str, Any] = field(default_factory=dict)  # the draft vocabulary's counters at the end (vocab-*)


class TraceLoop:
    """The loop over ``trace`` with at most ``concurrency`` requests in flight -- closed, or open with
    ``arrivals`` (request i is admitted once the loop's clock reaches ``arrivals[i]``; while nothing
    has arrived the engine is idle, as a server between requests) -- run in turns:
    ``run_turn(end)`` admits requests up to trace index ``end`` and returns once they all finished,
    so several configurations can take turns on the same slices of the trace. Times are on the
    loop's own clock, which only advances during its turns (so tokens/s of a phase does not count
    other configurations' turns). A progress line shows finished requests, recent acceptance
    length, tokens/s and the drafter version.

    Example (two configurations interleaved in turns of 8 requests)::

        loops = [TraceLoop(e, trace, 4, 128, name) for name, e in engines.items()]
        for end in range(8, len(trace) + 8, 8):
            for loop in loops:
                loop.run_turn(min(end, len(trace)))
        runs = [loop.finish() for loop in loops]
    """

    def __init__(self, engine: LLMEngine, trace: list[TraceItem], concurrency: int, max_tokens: int, desc: str,
                 progress: bool = True, status: Callable[[], str] | None = None, ignore_eos: bool = True,
                 adapter: Callable[[], int] | None = None, arrivals: list[float] | None = None) -> None:
        self.engine, self.trace, self.concurrency = engine, trace, concurrency
        # open loop: request i arrives at arrivals[i] seconds of the loop's clock (None: closed loop)
        self.arrivals = arrivals
        self.adapter = adapter or (lambda: 0)  # the LoRA adapter merged into the served version (0 = none)
        self.params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        self.run = TraceRun(desc)
        self.status = status
        self.pending = deque(enumerate(trace))
        self.live: dict[str, tuple[int, float]] = {}
        self.results: dict[int, dict[str, Any]] = {}
        self.outputs: dict[int, list[int]] = {}
        self.elapsed = 0.0  # seconds of this loop's turns so far
        self.bar = tqdm(total=len(trace), desc=desc, unit="req", disable=not progress, leave=True, dynamic_ncols=True)
        self.vocab = draft_vocab_of(engine)

    def warm_up(self, max_tokens: int = 8) -> None:
        """One short untimed, unrecorded request (the trace's first prompt): first-call costs of the
        kernels and the drafters are paid before the first turn, by every configuration alike."""
        self.engine.add_request(self.trace[0].prompt.token_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def run_turn(self, end: int) -> None:
        """Run until every request with trace index < ``end`` has finished."""
        engine, t_turn = self.engine, time.perf_counter()

        def clock() -> float:
            return self.elapsed + time.perf_counter() - t_turn

        def on_step(st: StepStats) -> None:
            self.run.steps.append({"t": clock(), "emitted": st.num_emitted_tokens, "drafts": st.num_drafts,
                                   "accepted": st.num_accepted_tokens,
                                   "version": float(engine.drafter.version if engine.drafter is not None else 0),
                                   "adapter": self.adapter(),
                                   "batch": st.batch_size, "decode_seqs": st.num_decode_seqs,
                                   "by_drafter": {n: sum(1 for _, d, _ in o if d)
                                                  for n, o in st.drafter_outcomes.items()},
                                   "accepted_by_drafter": {n: sum(a for _, d, a in o if d)
                                                           for n, o in st.drafter_outcomes.items()},
                                   "taps": st.taps, "draft_s": st.draft_time, "draft_tokens": st.num_draft_tokens})

        def due(idx: int) -> float:
            """When request ``idx`` arrives on the loop's clock (closed loop: now)."""
            return self.arrivals[idx] if self.arrivals is not None else clock()

        observer = engine.add_observer(Hooks(step_end=on_step))
        try:
            while (self.pending and self.pending[0][0] < end) or engine.has_unfinished_requests():
                while (self.pending and self.pending[0][0] < end and len(self.live) < self.concurrency
                       and due(self.pending[0][0]) <= clock()):
                    idx, item = self.pending.popleft()
                    rid = engine.add_request(item.prompt.token_ids, self.params, label=item.prompt.record.domain)
                    self.live[rid] = (idx, min(due(idx), clock()))  # open loop: latency from the arrival
                if not engine.has_unfinished_requests():  # open loop, nothing has arrived: serving is idle
                    time.sleep(max(0.0, min(0.05, due(self.pending[0][0]) - clock())))
                    continue
                for out in engine.step():
                    if out.finished:
                        self._finished(out.request_id, out.token_ids, out.stats, clock())
        finally:
            engine.remove_observer(observer)
            self.elapsed = clock()
            self.run.turns.append((t_turn, time.perf_counter()))

    def _finished(self, request_id: str, token_ids: list[int], st: RequestStats, now: float) -> None:
        idx, t_in = self.live.pop(request_id)
        item = self.trace[idx]
        self.results[idx] = {"index": idx, "phase": item.phase, "workload": item.workload, "id": item.prompt.record.id,
                             "t_start": t_in, "t_end": now, "tokens": len(token_ids), "drafts": st.num_drafts,
                             "draft_tokens": st.num_draft_tokens, "accepted": st.num_accepted_tokens,
                             "version": int(self.engine.drafter.version if self.engine.drafter is not None else 0),
                             "adapter": self.adapter()}
        if self.engine.policy is not None:  # cumulative counters and the latest estimates, as at this finish
            self.results[idx]["policy"] = {k: v for k, v in self.engine.policy.stats().items() if math.isfinite(v)}
        if self.vocab is not None:  # cumulative: a phase's coverage is the difference across it
            self.results[idx].update(vocab_verified=self.vocab.stats.verified, vocab_covered=self.vocab.stats.covered)
        self.outputs[idx] = list(token_ids)
        self.bar.update(1)
        self.bar.set_postfix_str(_progress_line(self.run, self.status), refresh=False)

    def finish(self) -> TraceRun:
        """The run's record, once every turn is done."""
        self.bar.close()
        self.run.wall_s = self.elapsed
        self.run.requests = [self.results[i] for i in range(len(self.trace))]
        self.run.outputs = [self.outputs[i] for i in range(len(self.trace))]
        if self.vocab is not None:
            self.vocab.drain()
            st, arc = self.vocab.stats, self.vocab.arc.stats
            self.run.vocab = {"size": self.vocab.snapshot.size, "core": len(self.vocab.core),
                              "dynamic": self.vocab.cfg.dynamic, "coverage": st.coverage, "oov_events": st.oov_events,
                              "published": st.published, "retrievals": st.retrievals,
                              "mean_retrieval_ms": st.mean_retrieval_ms, "mean_build_ms": st.mean_build_ms,
                              "dropped": st.dropped, "errors": st.errors,
                              "admitted": arc.admitted, "evicted": arc.evicted}
        return self.run


def run_trace(engine: LLMEngine, trace: list[TraceItem], concurrency: int, max_tokens: int, desc: str,
              progress: bool = True, status: Callable[[], str] | None = None, ignore_eos: bool = True) -> TraceRun:
    """The whole trace in one turn (``TraceLoop``)."""
    loop = TraceLoop(engine, trace, concurrency, max_tokens, desc, progress, status, ignore_eos)
    loop.run_turn(len(trace))
    return loop.finish()


def _progress_line(run: TraceRun, status: Callable[[], str] | None) -> str:
    recent = run.steps[-200:]
    span = recent[-1]["t"] - recent[0]["t"] if len(recent) > 1 else 0.0
    tok_s = sum(s["emitted"] for s in recent[1:]) / span if span > 0 else 0.0
    drafts = sum(s["drafts"] for s in recent)
    accept = (sum(s["accepted"] for s in recent) + drafts) / drafts if drafts else float("nan")
    served = served_label(int(recent[-1]["version"]), recent[-1].get("adapter", 0)) if recent else "v0"
    line = f"accept len {accept:.2f}, drafter {served}, {tok_s:.1f} tok/s" if drafts else f"{tok_s:.1f} tok/s"
    return line + (f", {status()}" if status is not None else "")


# ----------------------------------------------------------------------------------------------
# engines per configuration
# ----------------------------------------------------------------------------------------------


def trace_engine_config(trace: list[TraceItem], cfg: ShiftBenchConfig, model: TargetModel, gamma: int,
                        drafter: str | None = None) -> EngineConfig:
    """The engine settings of every configuration: ``concurrency`` KV slots just long enough for
    the trace's longest prompt plus ``max_tokens`` and speculation slack; ``drafter`` (default: the
    EAGLE-3 configurations' ``cfg.drafter``, under ``cfg.policy``) at ``gamma`` (0 = plain decoding).
    A drafter other than ``cfg.drafter`` (the static ngram / suffix configurations) runs static."""
    longest = max(len(t.prompt.token_ids) for t in trace) + cfg.max_tokens + cfg.gamma + 2
    if cfg.max_model_len and cfg.max_model_len < longest:
        raise ConfigError(f"max_model_len {cfg.max_model_len} is below the trace's longest request ({longest} tokens "
                          f"with --max-tokens and speculation)")
    max_len = min(model.cfg.max_position_embeddings, cfg.max_model_len or longest)
    name = drafter or cfg.drafter
    return EngineConfig(model=ModelConfig(compile=cfg.compile),
                        cache=CacheConfig(max_model_len=max_len, max_num_seqs=cfg.concurrency),
                        spec=SpecConfig(drafter=name if gamma else "none", num_speculative_tokens=gamma, tree=cfg.tree,
                                        options={"eagle3": Eagle3Options(min_draft_prob=cfg.eagle3_min_draft_prob)}),
                        policy=PolicyConfig(name=cfg.policy, profile=cfg.profile, per_sequence=cfg.per_sequence)
                        if name == cfg.drafter else PolicyConfig(name="static"))


def no_learning_config(ecfg: EngineConfig) -> EngineConfig:
    """The ``no-learning`` configuration's engine settings: ``ecfg`` with a suffix drafter that keeps
    no tree of past outputs (it matches the request's own tokens only); its EAGLE-3 head is the frozen
    one. Example: the suffix drafter's ``max_tree_tokens`` 20000 -> 0, everything else unchanged."""
    suffix = dataclasses.replace(ecfg.spec.options_for("suffix", SuffixOptions), max_tree_tokens=0)
    return dataclasses.replace(ecfg, spec=ecfg.spec.with_options("suffix", suffix))


def static_engine(target: LoadedModel, ecfg: EngineConfig) -> LLMEngine:
    """Plain decoding or one model-free drafter at a static gamma."""
    return build_engine(ecfg, target.model, target.tokenizer)


def seed_publish_root(root: Path, bootstrap: str | None, target: TargetModel, learned: str = "eagle3") -> int | None:
    """Publish the bootstrap drafter as the first version of a new root (so frozen and online
    start from the same weights); None without a bootstrap. Returns the version published. Medusa
    (``learned``): the heads directory ``bootstrap`` names, else the ones a server starts from (shipped on
    the embedded model, else zero: ``seed_medusa_root``), always published."""
    if learned == "medusa" and bootstrap is not None:
        return publish_heads(root, MedusaHeads.load(bootstrap), {"bootstrap": bootstrap})
    if learned == "medusa":
        return seed_medusa_root(MedusaOptions(dir=str(root)), target)
    if bootstrap is None:
        return None
    return seed_root(root, bootstrap, target.cfg, target.dtype, target.device)


def learned_engine(model: TargetModel, tokenizer: Any, ecfg: EngineConfig, root: Path, draft_vocab: int) -> LLMEngine:
    """An engine whose learned drafter (EAGLE-3, else Medusa: ``SpecConfig.online_drafter``) drafts with
    publish root ``root``'s newest version (EAGLE-3 without one: a fresh head of ``draft_vocab`` tokens, 0 = the
    target's), beside the other drafters ``ecfg.spec.drafter`` names, under ``ecfg.policy`` (``llm.build_engine``)."""
    if ecfg.spec.online_drafter == "medusa":
        medusa = dataclasses.replace(ecfg.spec.options_for("medusa", MedusaOptions), dir=str(root))
        spec = ecfg.spec.with_options("medusa", medusa)
    else:
        spec = with_eagle3(ecfg.spec, dir=str(root), draft_vocab=draft_vocab)
    return build_engine(dataclasses.replace(ecfg, spec=spec), model, tokenizer)


def vocab_engine(model: TargetModel, tokenizer: Any, ecfg: EngineConfig, root: Path, cfg: ShiftBenchConfig,
                 config: str) -> LLMEngine:
    """The frozen EAGLE-3 engine of ``root`` over the draft vocabulary ``config`` names (vocab-static:
    a frequency core as large as vocab-dynamic's core + buffer, or as its auto |V_t| bound;
    vocab-full: every target token;
    vocab-static:CORE, vocab-dynamic:CORE:BUFFER: those sizes).
    The HNSW index is built (or read from its cache) here, before any turn is timed."""
    if ":" in config:  # vocab-static:CORE or vocab-dynamic:CORE:BUFFER (a size sweep)
        kind, *sizes = config.split(":")
        mode, core, buffer = kind.removeprefix("vocab-"), int(sizes[0]), int(sizes[1]) if len(sizes) > 1 else 0
    else:
        static_core = cfg.vocab_core + cfg.vocab_buffer if cfg.vocab_core else 0  # 0: auto, dynamic's |V_t| bound
        mode, core = {"vocab-static": ("static", static_core),
                      "vocab-dynamic": ("dynamic", cfg.vocab_core),
                      "vocab-full": ("static", model.cfg.vocab_size)}[config]
        buffer = cfg.vocab_buffer
    vocab = DraftVocabConfig(mode=mode, core=core, buffer=buffer or DraftVocabConfig.buffer, corpus=cfg.vocab_corpus)
    spec = dataclasses.replace(ecfg.spec, vocab=vocab)
    engine = learned_engine(model, tokenizer, dataclasses.replace(ecfg, spec=spec), root, cfg.draft_vocab)
    dv = draft_vocab_of(engine)
    if dv is not None:
        dv.prepare()
    return engine


def lora_extra_vocab(engine: LLMEngine) -> int:
    """The tokens outside its head's vocabulary a LoRA trainer learns for ``engine``: its dynamic
    draft vocabulary's buffer capacity (the engine as built, whatever sizes its configuration named),
    0 without one."""
    dv = draft_vocab_of(engine)
    return dv.cfg.buffer.capacity if dv is not None and dv.cfg.dynamic else 0


@dataclass
class OnlineSetup:
    """The ``online`` configuration's engine with capture, collection and a supervised trainer."""

    engine: LLMEngine
    online: OnlineTraining
    root: Path
    signals: Path


def start_online(target: LoadedModel, trace: list[TraceItem], cfg: ShiftBenchConfig, work: Path,
                 name: str = "online") -> OnlineSetup:
    """Build an online configuration and start its trainer child (yielding to its engine):
    ``online`` trains full rounds, and with ``cfg.online_lora`` LoRA adapters between them;
    ``vocab-*-lora`` serves over that draft vocabulary and its trainer only aligns LoRA adapters
    (EvoSpec path B; no full round ever runs), from signals collected all the time. A LoRA trainer
    reads signals cut into small shards."""
    from tidespec.online.serving.launch import start_trainer_process

    root, signals = work / "drafter", work / "signals"
    seeded = seed_publish_root(root, cfg.bootstrap, target.model, cfg.learned or "eagle3")
    ecfg = trace_engine_config(trace, cfg, target.model, cfg.gamma)
    lora_only = name.endswith("-lora")
    lora = lora_only or cfg.online_lora
    engine = (vocab_engine(target.model, target.tokenizer, ecfg, root, cfg, name.removesuffix("-lora")) if lora_only
              else learned_engine(target.model, target.tokenizer, ecfg, root, cfg.draft_vocab))
    online = attach_online_training(engine, OnlineConfig(
        publish_root=str(root), signal_dir=str(signals), poll_s=1.0, capture_prompt=cfg.capture_prompt,
        capture_idle_share=cfg.capture_idle_share,
        capture_flush_rows=256 if lora else OnlineConfig.capture_flush_rows, lora=lora and cfg.learned == "eagle3",
        drafter=cfg.learned or "eagle3",
        lora_extra_vocab=lora_extra_vocab(engine),
        collection=CollectionConfig(n_init=cfg.collect_n_init, epsilon=cfg.collect_epsilon,
                                    n_threshold=cfg.min_signals, force=cfg.collect_force or lora_only,
                                    bootstrap=seeded is None)))
    extra = ["--threads", str(cfg.trainer_threads), "--epochs", str(cfg.trainer_epochs), "--poll-s", "2",
             "--seed", str(cfg.seed), "--heldout-frac", "0.2", "--batch-segments", "2"]
    if lora_only:
        extra += ["--min-signals", str(1 << 40)]
    extra += shlex.split(cfg.trainer_args)
    dtype = str(target.model.dtype).removeprefix("torch.")
    log = work / "trainer.log"
    online.supervise_trainer(functools.partial(start_trainer_process, online.config, target.path, dtype=dtype,
                                               draft_vocab=cfg.draft_vocab, extra_args=extra, log_path=log),
                             log_path=log, yield_to=GovernorConfig(share=cfg.trainer_share))
    return OnlineSetup(engine, online, root, signals)


def finish_online(run: TraceRun, setup: OnlineSetup) -> TraceRun:
    """Stop the trainer and file the online state, rounds and signal directory with ``run``."""
    online = setup.online
    online.close()
    run.online = {k: v for k, v in online.state().items() if k != "collector"}
    run.online["collector"] = online.selective.state()
    run.online["rounds"] = read_trainer_rounds(setup.root)
    run.online["judgements"] = read_trainer_log(setup.root, "judgements")
    run.online["adapters"] = adapter_records(setup.root)
    run.online["signal_dir"] = str(setup.signals)
    return run


def adapter_records(root: Path) -> list[dict[str, Any]]:
    """Every LoRA adapter published under ``root`` with its metrics (``lora/v{N}/a{M}/meta.json``)."""
    out = []
    for meta in sorted((root / LORA_DIR).glob("v*/a*/meta.json"), key=lambda p: p.stat().st_mtime):
        try:
            out.append(json.loads(meta.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return out


def online_status(online: OnlineTraining) -> str:
    st = online.capture.stats()
    on = "on" if online.selective.collection_enabled else "off"
    paused = " (paused)" if online.governor is not None and online.governor.state()["paused"] else ""
    return f"collect {on}, {st['num_captured']} signals, trainer{paused}"
