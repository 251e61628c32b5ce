"""``tidespec bench shift``: an EAGLE-3 drafter under a domain shift — frozen vs learning online.

Why this exists: TIDE's claim (Sec. 4.2, Fig. 6) is that a drafter trained online from the
target's own hidden states recovers acceptance after the traffic changes domain, where a drafter
frozen after its bootstrap does not — and that capturing those states costs the serving engine
almost nothing (Sec. 5) and trains faster than recomputing them (Table 2). This benchmark runs one
request trace that changes domain (e.g. code -> chat -> code, one workload JSONL per phase) through
the engine three ways:

* ``plain``  — no speculation (the baseline every ratio is against);
* ``frozen`` — the EAGLE-3 drafter at fixed gamma, never updated (the bootstrap drafter, or a fresh
  head when none is given);
* ``online`` — the same starting drafter with online training on: capture into a signal store,
  TIDE's selective collection, ``tidespec train-drafter`` as a child process, swaps between steps.

Requests run closed-loop with ``concurrency`` in flight, greedy, every request generating exactly
``max_tokens`` tokens (EOS ignored), so every configuration does the same work and greedy outputs
must be identical to plain's (``mismatches`` counts requests that differ). Over the trace it
records every engine step (time, emitted tokens, drafts, accepted tokens, drafter version) and
plots mean acceptance length per window of requests and tokens/s over time, with the phase
boundaries marked.

Two side measurements (each optional):

* capture overhead: the frozen drafter on the first phase's prompts with capture off and with
  capture on (collection forced, a real store), alternated ``overhead_repeats`` times;
  overhead = 1 - throughput(on) / throughput(off), median over the pairs.
* training from signals vs recomputing them (TIDE Table 2): the online run's store (or any
  ``--signal-dir``) read back and trained on for one epoch, against recomputing the same hidden
  states with a target prefill and training the same epoch. Recomputation is what a trainer
  without a store pays every epoch (SpecForge's online mode), so the ratio is per epoch.

Worked example (a short run)::

    cfg = ShiftBenchConfig(workloads="code,chat", requests_per_phase=8, max_tokens=64,
                           bootstrap="runs/boot/drafter")
    doc = run_shift_bench(cfg, resolve_target(None), Path("runs/shift"))
    doc["configs"]["online"]["phases"][1]["mean_acceptance_length"]

Outputs in the output directory: ``bench_shift.json`` (every step and request), ``README.md``
(tables), ``shift.png`` (acceptance and tokens/s over the trace).
"""

from __future__ import annotations

import math
import shlex
import shutil
import statistics
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from tidespec.bench.report import (
    default_out_dir,
    finish_run,
    machine_line,
    markdown_table,
    new_figure,
    rerender_run,
    save_figure,
)
from tidespec.config import CacheConfig, ConfigError, EngineConfig, SpecConfig, opt
from tidespec.engine.engine import LLMEngine
from tidespec.engine.stats import StepStats
from tidespec.llm import build_eagle3_drafter
from tidespec.models.eagle3_checkpoint import (
    head_from_published,
    load_drafter_source,
    publish,
)
from tidespec.models.eagle3_head import Eagle3Config
from tidespec.models.kv_cache import KVCache
from tidespec.models.llama import BatchLayout, LlamaModel
from tidespec.models.loader import LoadedModel
from tidespec.online.collection import CollectionConfig
from tidespec.online.online import (
    OnlineConfig,
    OnlineTraining,
    attach_online_training,
    read_trainer_rounds,
)
from tidespec.online.store import SignalShard, SignalStore
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.eagle3 import Eagle3DrafterConfig
from tidespec.workloads.loader import Prompt, load_prompts

CONFIGS = ("plain", "frozen", "online")
COLORS = {"plain": "tab:gray", "frozen": "tab:blue", "online": "tab:orange"}  # same in both panels


@dataclass
class ShiftBenchConfig:
    """Flags of ``tidespec bench shift`` (one field = one ``--flag``)."""

    workloads: str = opt("code_unseen,chat,code_unseen", "phases of the trace: comma-separated workload JSONLs or "
                                                       "built-in names, each optionally NAME:N for N requests")
    requests_per_phase: int = opt(16, "requests of a phase that gives no :N")
    offset: int = opt(0, "skip the first N records of every workload (e.g. the ones a bootstrap drafter saw)")
    max_tokens: int = opt(128, "tokens generated per request (EOS ignored)")
    gamma: int = opt(4, "speculation length of the EAGLE-3 configurations (chains)")
    concurrency: int = opt(4, "requests in flight (closed loop)")
    configs: str = opt("plain,frozen,online", "comma-separated subset of plain, frozen, online; 'none' runs only "
                                             "the capture-overhead and signals-vs-recompute measurements")
    bootstrap: str | None = opt(None, "starting drafter: a publish root or an exported EAGLE-3 checkpoint "
                                     "(default: a fresh random head)")
    draft_vocab: int = opt(8192, "draft vocabulary of a fresh head (0 = the target's)")
    min_signals: int = opt(4096, "online: new signal rows that trigger a training round")
    collect_n_init: int = opt(8, "online: requests averaged before shift detection starts")
    collect_epsilon: float = opt(0.02, "online: short-vs-long EMA acceptance drop that means a shift")
    collect_force: bool = opt(False, "online: collect all the time, not only after a detected shift")
    capture_prompt: bool = opt(False, "online: also capture prompt positions (default: the target's outputs only)")
    trainer_threads: int = opt(1, "online: torch threads of the trainer child process")
    trainer_epochs: float = opt(4.0, "online: passes over each round's signals")
    trainer_args: str = opt("", "online: extra train-drafter flags")
    window: int = opt(8, "requests per point of the acceptance curve")
    bin_s: float = opt(15.0, "seconds per point of the tokens/s curve")
    overhead_repeats: int = opt(2, "capture overhead: off/on pairs (0 = skip)")
    overhead_requests: int = opt(8, "capture overhead: requests per run")
    recompute_rows: int = opt(4096, "signals vs recompute: rows timed (0 = skip)")
    signal_dir: str | None = opt(None, "signals vs recompute: store to read (default: the online run's)")
    seed: int = opt(0, "seed of the trainer")

    def __post_init__(self) -> None:
        if not self.phases:
            raise ConfigError("workloads must name at least one workload")
        unknown = [c for c in self.config_names if c not in CONFIGS]
        if unknown or not (self.config_names or self.configs.strip() == "none"):
            raise ConfigError(f"configs must be a subset of {', '.join(CONFIGS)} (or 'none': only the side "
                              f"measurements), got {self.configs!r}")
        for name in ("requests_per_phase", "max_tokens", "gamma", "concurrency", "min_signals", "collect_n_init",
                     "trainer_threads", "window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("offset", "draft_vocab", "overhead_repeats", "overhead_requests", "recompute_rows"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.gamma > 16:
            raise ConfigError(f"gamma must be <= 16, got {self.gamma}")
        if not 0.0 <= self.collect_epsilon < 1.0:
            raise ConfigError(f"collect_epsilon must be in [0, 1), got {self.collect_epsilon}")
        if self.trainer_epochs <= 0 or self.bin_s <= 0:
            raise ConfigError("trainer_epochs and bin_s must be > 0")
        for name in ("bootstrap", "signal_dir"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_dir():
                raise ConfigError(f"{name} {value} is not a directory")

    @property
    def phase_specs(self) -> list[tuple[str, int]]:
        """``[(workload, requests)]``; ``"chat:32"`` -> ``("chat", 32)``, ``"chat"`` -> ``("chat", requests_per_phase)``."""
        out = []
        for w in (w.strip() for w in self.workloads.split(",")):
            if not w:
                continue
            name, sep, count = w.rpartition(":")
            if sep and count.isdigit() and name:
                if int(count) < 1:
                    raise ConfigError(f"phase {w!r}: the request count must be >= 1")
                out.append((name, int(count)))
            else:
                out.append((w, self.requests_per_phase))
        return out

    @property
    def phases(self) -> list[str]:
        return [name for name, _ in self.phase_specs]

    @property
    def config_names(self) -> list[str]:
        return [c.strip() for c in self.configs.split(",") if c.strip() and c.strip() != "none"]


# ----------------------------------------------------------------------------------------------
# the trace
# ----------------------------------------------------------------------------------------------


@dataclass
class TraceItem:
    phase: int
    workload: str
    prompt: Prompt


def build_trace(cfg: ShiftBenchConfig, tokenizer: Any) -> list[TraceItem]:
    """Phase i takes the next N (its ``:N``, else ``requests_per_phase``) unused records of its workload (after
    ``offset``), so a workload that comes back (code -> chat -> code) brings new prompts.

    Example: workloads "code,chat:2,code", 4 per phase, offset 10 -> code 10..13, chat 10..11, code 14..17.
    """
    cursor: dict[str, int] = {}
    cache: dict[str, list[Prompt]] = {}
    items: list[TraceItem] = []
    specs = cfg.phase_specs
    for i, (name, n) in enumerate(specs):
        if name not in cache:
            need = cfg.offset + sum(k for w, k in specs if w == name)
            cache[name] = load_prompts(name, tokenizer, need)
        start = cfg.offset + cursor.get(name, 0)
        chunk = cache[name][start:start + n]
        if len(chunk) < n:
            raise ConfigError(f"workload {name} has {len(cache[name])} records; phase {i + 1} needs records "
                              f"{start}..{start + n - 1} (ask fewer requests of that phase, or a lower --offset)")
        cursor[name] = cursor.get(name, 0) + n
        items += [TraceItem(i, Path(name).stem, p) for p in chunk]
    return items


# ----------------------------------------------------------------------------------------------
# running a trace
# ----------------------------------------------------------------------------------------------


@dataclass
class TraceRun:
    config: str
    wall_s: float = 0.0
    steps: list[dict[str, float]] = field(default_factory=list)  # t, emitted, drafts, accepted, version
    requests: list[dict[str, Any]] = field(default_factory=list)  # in trace order
    outputs: list[list[int]] = field(default_factory=list)  # in trace order
    online: dict[str, Any] = field(default_factory=dict)


def run_trace(engine: LLMEngine, trace: list[TraceItem], concurrency: int, max_tokens: int, desc: str,
              progress: bool = True, status: Callable[[], str] | None = None) -> TraceRun:
    """Closed loop over ``trace`` with ``concurrency`` requests in flight; a progress line shows
    finished requests, recent acceptance length, tokens/s and the drafter version."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    run = TraceRun(desc)
    t0 = time.perf_counter()

    def on_step(st: StepStats) -> None:
        run.steps.append({"t": time.perf_counter() - t0, "emitted": st.num_emitted_tokens, "drafts": st.num_drafts,
                          "accepted": st.num_accepted_tokens, "version": float(getattr(engine.drafter, "version", 0)),
                          "batch": st.batch_size})

    engine.step_listeners.append(on_step)
    pending = deque(enumerate(trace))
    live: dict[str, tuple[int, float]] = {}
    results: dict[int, dict[str, Any]] = {}
    outputs: dict[int, list[int]] = {}
    try:
        with tqdm(total=len(trace), desc=desc, unit="req", disable=not progress, leave=True,
                  dynamic_ncols=True) as bar:
            while pending or engine.has_unfinished_requests():
                while pending and len(live) < concurrency:
                    idx, item = pending.popleft()
                    rid = engine.add_request(item.prompt.token_ids, params, label=item.prompt.record.domain)
                    live[rid] = (idx, time.perf_counter() - t0)
                for out in engine.step():
                    if not out.finished:
                        continue
                    idx, t_in = live.pop(out.request_id)
                    item = trace[idx]
                    st = out.stats
                    results[idx] = {"index": idx, "phase": item.phase, "workload": item.workload,
                                    "id": item.prompt.record.id, "t_start": t_in,
                                    "t_end": time.perf_counter() - t0, "tokens": len(out.token_ids),
                                    "drafts": st.num_drafts, "draft_tokens": st.num_draft_tokens,
                                    "accepted": st.num_accepted_tokens,
                                    "version": int(getattr(engine.drafter, "version", 0))}
                    outputs[idx] = list(out.token_ids)
                    bar.update(1)
                    bar.set_postfix_str(_progress_line(run, status), refresh=False)
    finally:
        engine.step_listeners.remove(on_step)
    run.wall_s = time.perf_counter() - t0
    run.requests = [results[i] for i in range(len(trace))]
    run.outputs = [outputs[i] for i in range(len(trace))]
    return run


def _progress_line(run: TraceRun, status: Callable[[], str] | None) -> str:
    recent = run.steps[-200:]
    span = recent[-1]["t"] - recent[0]["t"] if len(recent) > 1 else 0.0
    tok_s = sum(s["emitted"] for s in recent[1:]) / span if span > 0 else 0.0
    drafts = sum(s["drafts"] for s in recent)
    accept = (sum(s["accepted"] for s in recent) + drafts) / drafts if drafts else float("nan")
    version = int(recent[-1]["version"]) if recent else 0
    line = f"accept len {accept:.2f}, drafter v{version}, {tok_s:.1f} tok/s" if drafts else f"{tok_s:.1f} tok/s"
    return line + (f", {status()}" if status is not None else "")


# ----------------------------------------------------------------------------------------------
# engines per configuration
# ----------------------------------------------------------------------------------------------


def _engine_config(trace: list[TraceItem], cfg: ShiftBenchConfig, model: LlamaModel, gamma: int) -> EngineConfig:
    longest = max(len(t.prompt.token_ids) for t in trace) + cfg.max_tokens + cfg.gamma + 2
    max_len = min(model.cfg.max_position_embeddings, longest)
    return EngineConfig(cache=CacheConfig(max_model_len=max_len, max_num_seqs=cfg.concurrency),
                        spec=SpecConfig(drafter="eagle3" if gamma else "none", num_speculative_tokens=gamma))


def seed_publish_root(root: Path, bootstrap: str | None, target: LlamaModel) -> int | None:
    """Publish the bootstrap drafter as the first version of a new root (so frozen and online
    start from the same weights); None without a bootstrap. Returns the version published."""
    if bootstrap is None:
        return None
    pub = load_drafter_source(bootstrap, target.cfg)
    if pub is None:
        raise ConfigError(f"bootstrap {bootstrap} holds no valid EAGLE-3 drafter for this target")
    head = head_from_published(pub, target.dtype, target.device)
    return publish(root, head, {"bootstrap": str(bootstrap), "bootstrap_version": pub.version})


def _eagle3_engine(model: LlamaModel, tokenizer: Any, ecfg: EngineConfig, root: Path, draft_vocab: int) -> LLMEngine:
    drafter = build_eagle3_drafter(model, root, draft_vocab, Eagle3DrafterConfig(
        max_num_seqs=ecfg.cache.max_num_seqs, max_model_len=ecfg.cache.max_model_len))
    return LLMEngine(model, tokenizer, ecfg, drafter=drafter)


def run_online(target: LoadedModel, trace: list[TraceItem], cfg: ShiftBenchConfig, work: Path,
               progress: bool = True) -> TraceRun:
    """The ``online`` configuration: capture + selective collection + a trainer child process."""
    from tidespec.online.trainer import start_trainer_process

    root, signals = work / "drafter", work / "signals"
    seeded = seed_publish_root(root, cfg.bootstrap, target.model)
    ecfg = _engine_config(trace, cfg, target.model, cfg.gamma)
    engine = _eagle3_engine(target.model, target.tokenizer, ecfg, root, cfg.draft_vocab)
    online = attach_online_training(engine, OnlineConfig(
        publish_root=str(root), signal_dir=str(signals), poll_s=1.0, capture_prompt=cfg.capture_prompt,
        collection=CollectionConfig(n_init=cfg.collect_n_init, epsilon=cfg.collect_epsilon,
                                    n_threshold=cfg.min_signals, force=cfg.collect_force,
                                    bootstrap=seeded is None)))
    extra = ["--threads", str(cfg.trainer_threads), "--epochs", str(cfg.trainer_epochs), "--poll-s", "2",
             "--seed", str(cfg.seed), "--heldout-frac", "0.2", "--batch-segments", "4"] + shlex.split(cfg.trainer_args)
    dtype = str(target.model.dtype).removeprefix("torch.")
    online.trainer = start_trainer_process(online.config, target.path, dtype=dtype, draft_vocab=cfg.draft_vocab,
                                           extra_args=extra,
                                           log_path=work / "trainer.log")
    try:
        run = run_trace(engine, trace, cfg.concurrency, cfg.max_tokens, "online", progress,
                        status=lambda: _online_status(online))
    finally:
        online.close()
    run.online = {k: v for k, v in online.state().items() if k != "collector"}
    run.online["collector"] = online.selective.state()
    run.online["rounds"] = read_trainer_rounds(root)
    run.online["signal_dir"] = str(signals)
    return run


def _online_status(online: OnlineTraining) -> str:
    st = online.capture.stats()
    on = "on" if online.selective.collection_enabled else "off"
    return f"collect {on}, {st['num_captured']} signals"


# ----------------------------------------------------------------------------------------------
# side measurements
# ----------------------------------------------------------------------------------------------


def measure_capture_overhead(target: LoadedModel, trace: list[TraceItem], cfg: ShiftBenchConfig, root: Path,
                             progress: bool = True) -> dict[str, Any]:
    """Throughput of the frozen drafter with capture off vs on (forced), alternated."""
    items = trace[:cfg.overhead_requests]
    ecfg = _engine_config(items, cfg, target.model, cfg.gamma)
    pairs: list[dict[str, float]] = []
    dropped = 0
    warm = _eagle3_engine(target.model, target.tokenizer, ecfg, root, cfg.draft_vocab)
    run_trace(warm, items[:1], 1, min(8, cfg.max_tokens), "capture warm-up", False)
    for rep in range(cfg.overhead_repeats):
        pair: dict[str, float] = {}
        for mode in (("off", "on") if rep % 2 == 0 else ("on", "off")):  # alternate who goes first
            engine = _eagle3_engine(target.model, target.tokenizer, ecfg, root, cfg.draft_vocab)
            online: OnlineTraining | None = None
            with tempfile.TemporaryDirectory(prefix="tidespec-capture-") as tmp:
                if mode == "on":
                    online = attach_online_training(engine, OnlineConfig(
                        publish_root=str(root), signal_dir=str(Path(tmp) / "signals"), poll_s=3600.0,
                        collection=CollectionConfig(force=True)), start=False)
                run = run_trace(engine, items, cfg.concurrency, cfg.max_tokens, f"capture {mode} ({rep + 1})",
                                progress)
                if online is not None:
                    online.close()
                    dropped += online.capture.stats()["num_dropped"]
            pair[mode] = sum(r["tokens"] for r in run.requests) / run.wall_s
        pairs.append(pair)
    ratios = [p["on"] / p["off"] for p in pairs]
    return {"pairs": pairs, "ratio_on_off": statistics.median(ratios), "overhead": 1 - statistics.median(ratios),
            "requests": len(items), "dropped_rows": dropped}


def recompute_taps(model: LlamaModel, token_ids: list[int], tap_layers: tuple[int, ...]) -> torch.Tensor:
    """[len, 3H] the target's taps over one whole sequence, by one prefill (what a trainer without a
    signal store recomputes)."""
    kv = KVCache.for_model(model.cfg, 1, len(token_ids), model.dtype, model.device)
    ids = torch.tensor(token_ids, device=model.device)
    out = model(ids, BatchLayout.build([len(token_ids)], [0], [0], device=model.device), kv,
                logits_rows=torch.empty(0, dtype=torch.int64, device=model.device), tap_layers=tap_layers)
    assert out.taps is not None
    return out.taps


def measure_training_sources(target: LoadedModel, signal_dir: Path, cfg: ShiftBenchConfig,
                             progress: bool = True) -> dict[str, Any]:
    """One training epoch from stored signals vs from recomputed hidden states (TIDE Table 2).

    Only sequences captured from position 0 without gaps can be recomputed (a prefill needs the
    whole prefix); up to ``recompute_rows`` of their rows are used, cut into training segments.
    Both sides train a copy of the same fresh head with the same segments, batches and seed, so
    the difference is where the hidden states come from.
    """
    from tidespec.models.eagle3_checkpoint import fresh_head
    from tidespec.online.eagle3_train import SignalSegment
    from tidespec.online.trainer import (
        DraftTrainer,
        TrainerConfig,
        cut_segment,
        segments_by_sequence,
    )

    store = SignalStore(signal_dir, 1 << 40)
    t0 = time.perf_counter()
    shards: list[SignalShard] = [shard for _, shard in store.iter_shards()]
    by_seq = segments_by_sequence(shards, 1 << 30)
    load_s = time.perf_counter() - t0
    whole: list[SignalSegment] = []
    rows = 0
    for segs in by_seq.values():
        if len(segs) == 1 and segs[0].start_position == 0 and rows < cfg.recompute_rows:
            whole.append(segs[0])
            rows += segs[0].num_positions
    if not whole:
        return {"error": f"no sequence in {signal_dir} was captured from position 0 without gaps (the online run "
                         "captures generated positions only unless --capture-prompt; point --signal-dir at a store "
                         "written with prompts, e.g. by train-drafter --from-workload)"}
    load_s *= rows / max(1, sum(s.num_positions for segs in by_seq.values() for s in segs))  # this share only
    tap_layers = Eagle3Config.for_target(target.config).tap_layers
    with tempfile.TemporaryDirectory(prefix="tidespec-train-src-") as tmp:
        tcfg = TrainerConfig(signal_dir=str(Path(tmp) / "s"), publish_root=str(Path(tmp) / "p"),
                             draft_vocab=cfg.draft_vocab, epochs=1.0, seed=cfg.seed, progress=progress)
        trainer = DraftTrainer(tcfg, target.config, target.model.embed_tokens)

        def train(segments: list[SignalSegment]) -> float:
            head = fresh_head(target.config, cfg.draft_vocab or None, trainer.dtype, trainer.device)
            pieces = [p for s in segments for p in cut_segment(s, tcfg.max_segment_len)]
            t = time.perf_counter()
            trainer.train_head(head, pieces, seed=cfg.seed)
            return time.perf_counter() - t

        train(whole[:1])  # warm-up (first autograd and optimizer calls), not timed
        train_stored_s = train(whole)
        t = time.perf_counter()
        recomputed = []
        for seg in tqdm(whole, desc="recompute taps", unit="seq", disable=not progress, leave=False):
            ids = seg.token_ids[:-1].tolist()
            taps = recompute_taps(target.model, ids, tap_layers).to(torch.float32)
            recomputed.append(SignalSegment(taps, seg.token_ids, None, 0))
        recompute_s = time.perf_counter() - t
        train_recomputed_s = train(recomputed)
    stored = load_s + train_stored_s
    again = recompute_s + train_recomputed_s
    return {"rows": rows, "sequences": len(whole), "load_s": load_s, "train_stored_s": train_stored_s,
            "recompute_s": recompute_s, "train_recomputed_s": train_recomputed_s,
            "epoch_from_signals_s": stored, "epoch_recomputing_s": again, "speedup": again / stored}


# ----------------------------------------------------------------------------------------------
# the benchmark
# ----------------------------------------------------------------------------------------------


def summarize_run(run: TraceRun, trace: list[TraceItem], plain: TraceRun | None) -> dict[str, Any]:
    """Per phase and overall: tokens/s, mean acceptance length, speedup over plain, mismatches."""

    def acc(reqs: list[dict[str, Any]]) -> float:
        d = sum(r["drafts"] for r in reqs)
        return (sum(r["accepted"] for r in reqs) + d) / d if d else float("nan")

    phases = []
    for p in sorted({t.phase for t in trace}):
        reqs = [r for r in run.requests if r["phase"] == p]
        t_a, t_b = min(r["t_start"] for r in reqs), max(r["t_end"] for r in reqs)
        half = reqs[len(reqs) // 2:]
        phases.append({"phase": p + 1, "workload": reqs[0]["workload"], "requests": len(reqs),
                       "tok_s": sum(r["tokens"] for r in reqs) / max(1e-9, t_b - t_a),
                       "mean_acceptance_length": acc(reqs), "second_half_acceptance_length": acc(half),
                       "versions": sorted({r["version"] for r in reqs})})
    tok_s = sum(r["tokens"] for r in run.requests) / run.wall_s
    doc: dict[str, Any] = {"wall_s": run.wall_s, "tok_s": tok_s, "mean_acceptance_length": acc(run.requests),
                           "phases": phases}
    if plain is not None:
        doc["speedup"] = tok_s / (sum(r["tokens"] for r in plain.requests) / plain.wall_s)
        doc["mismatches"] = sum(a != b for a, b in zip(run.outputs, plain.outputs))
        for ph, base in zip(phases, summarize_run(plain, trace, None)["phases"]):
            ph["speedup"] = ph["tok_s"] / base["tok_s"]
    if run.online:
        doc["online"] = run.online
    return doc


def run_shift_bench(cfg: ShiftBenchConfig, target: LoadedModel, out_dir: Path | None = None, command: str = "",
                    progress: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the configurations, the side measurements, and write the report (see module docstring)."""
    out_dir = out_dir or default_out_dir("shift")
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = build_trace(cfg, target.tokenizer)
    log(f"trace: {' -> '.join(f'{Path(w).stem} x{n}' for w, n in cfg.phase_specs)}, {cfg.max_tokens} tokens each, "
        f"{cfg.concurrency} in flight")
    frozen_root = out_dir / "frozen-drafter"
    if frozen_root.exists():
        shutil.rmtree(frozen_root)
    seed_publish_root(frozen_root, cfg.bootstrap, target.model)
    runs: dict[str, TraceRun] = {}
    for name in cfg.config_names:
        if name == "plain":
            engine = LLMEngine(target.model, target.tokenizer, _engine_config(trace, cfg, target.model, 0))
            runs[name] = run_trace(engine, trace, cfg.concurrency, cfg.max_tokens, "plain", progress)
        elif name == "frozen":
            engine = _eagle3_engine(target.model, target.tokenizer, _engine_config(trace, cfg, target.model, cfg.gamma),
                                    frozen_root, cfg.draft_vocab)
            runs[name] = run_trace(engine, trace, cfg.concurrency, cfg.max_tokens, "frozen", progress)
        else:
            work = out_dir / "online"
            if work.exists():
                shutil.rmtree(work)
            runs[name] = run_online(target, trace, cfg, work, progress)
    plain = runs.get("plain")
    doc: dict[str, Any] = {"config": asdict(cfg), "phases": [Path(w).stem for w in cfg.phases],
                           "phase_sizes": [(Path(w).stem, n) for w, n in cfg.phase_specs],
                           "configs": {n: summarize_run(r, trace, plain if n != "plain" else None)
                                       for n, r in runs.items()},
                           "runs": {n: {"steps": r.steps, "requests": r.requests} for n, r in runs.items()}}
    if cfg.overhead_repeats:
        doc["capture_overhead"] = measure_capture_overhead(target, trace, cfg, frozen_root, progress)
    signal_dir = Path(cfg.signal_dir) if cfg.signal_dir else (out_dir / "online" / "signals")
    if cfg.recompute_rows and signal_dir.is_dir():
        doc["training_sources"] = measure_training_sources(target, signal_dir, cfg, progress)

    return finish_run(out_dir, "shift", doc, command, str(target.model.dtype).removeprefix("torch."), report,
                      plot_shift, log)


def replot(out_dir: Path) -> dict[str, Any]:
    """Re-render README.md and shift.png of an earlier run from its ``bench_shift.json``."""
    return rerender_run(out_dir, "shift", report, plot_shift)


# ----------------------------------------------------------------------------------------------
# report and plot
# ----------------------------------------------------------------------------------------------


def _fmt(v: Any, digits: int = 2) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{digits}f}"


def report(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = ["# bench shift", "", f"Command: `{doc.get('command', '')}`", "",
             f"Machine: {machine_line(doc['machine'])}", "",
             f"Trace: {' -> '.join(f'{w} x{n}' for w, n in doc['phase_sizes'])}, "
             f"{cfg['max_tokens']} tokens each, {cfg['concurrency']} in flight, gamma {cfg['gamma']} (chains); "
             f"starting drafter: {cfg['bootstrap'] or 'fresh random head'}.", ""]
    rows = []
    for name, s in doc["configs"].items():
        rows.append([name, _fmt(s["tok_s"], 1), _fmt(s.get("speedup")), _fmt(s["mean_acceptance_length"]),
                     str(s.get("mismatches", "-"))]
                    + [f"{_fmt(p['mean_acceptance_length'])} / {_fmt(p['second_half_acceptance_length'])}"
                       for p in s["phases"]])
    heads = ["config", "tok/s", "speedup", "accept len"] + ["mismatches"] + [
        f"phase {i + 1} {w}: accept len (all / 2nd half)" for i, w in enumerate(doc["phases"])]
    lines += [markdown_table(heads, rows), ""]
    if "online" in doc["configs"]:
        on = doc["configs"]["online"]["online"]
        lines += [f"Online: drafter v{on.get('drafter_version')} at the end, {on.get('swaps')} swaps, "
                  f"{on.get('captured')} signals captured ({on.get('dropped')} dropped), collector "
                  f"{on.get('collector', {})}.", ""]
        rounds = on.get("rounds", [])
        if rounds:
            lines += [markdown_table(["round", "train rows", "held-out rows", "accept len before", "after", "published"],
                                     [[r.get("round"), r.get("num_train_rows"), r.get("num_heldout_rows"),
                                       _fmt(r.get("baseline_accept_len")), _fmt(r.get("candidate_accept_len")),
                                       r.get("published_version") or "-"] for r in rounds]), ""]
    ov = doc.get("capture_overhead")
    if ov:
        lines += [f"Capture overhead (frozen drafter, {ov['requests']} requests, capture forced on vs off, "
                  f"{len(ov['pairs'])} pairs): throughput ratio {_fmt(ov['ratio_on_off'], 3)} -> overhead "
                  f"{100 * ov['overhead']:.1f} %; pairs (tok/s off/on): "
                  + ", ".join(f"{p['off']:.1f}/{p['on']:.1f}" for p in ov["pairs"])
                  + f"; rows dropped {ov['dropped_rows']}.", ""]
    ts = doc.get("training_sources")
    if ts and "error" not in ts:
        lines += [f"Training from signals vs recomputing (one epoch, {ts['rows']} rows of {ts['sequences']} "
                  f"sequences): from the store {ts['epoch_from_signals_s']:.1f} s (read {ts['load_s']:.1f} + train "
                  f"{ts['train_stored_s']:.1f}); recomputing {ts['epoch_recomputing_s']:.1f} s (target prefill "
                  f"{ts['recompute_s']:.1f} + train {ts['train_recomputed_s']:.1f}) -> {ts['speedup']:.2f}x.", ""]
    elif ts:
        lines += [f"Training from signals vs recomputing: {ts['error']}", ""]
    return "\n".join(lines)


def _curves(run: dict[str, Any], window: int, bin_s: float) -> tuple[list[float], list[float], list[float], list[float]]:
    reqs = sorted(run["requests"], key=lambda r: r["t_end"])
    xs, ys = [], []
    for i in range(0, len(reqs), window):
        chunk = reqs[i:i + window]
        d = sum(r["drafts"] for r in chunk)
        if d:
            xs.append(i + len(chunk))
            ys.append((sum(r["accepted"] for r in chunk) + d) / d)
    steps = run["steps"]
    ts, rates = [], []
    if steps:
        end = steps[-1]["t"]
        k = 0
        t = 0.0
        while t < end:
            tok = 0
            while k < len(steps) and steps[k]["t"] < t + bin_s:
                tok += steps[k]["emitted"]
                k += 1
            width = min(bin_s, end - t)
            if width > 0:
                ts.append(t + width / 2)
                rates.append(tok / width)
            t += bin_s
    return xs, ys, ts, rates


def plot_shift(doc: dict[str, Any], out_dir: Path) -> Path:
    """Acceptance length per window of finished requests, and tokens/s over time."""
    cfg = doc["config"]
    fig, (ax_a, ax_t) = new_figure(2, width_per_col=6.5)
    edge = 0
    for _, n in doc["phase_sizes"][:-1]:
        edge += n
        ax_a.axvline(edge, color="grey", linestyle=":", linewidth=1)
    for name, run in doc["runs"].items():
        xs, ys, ts, rates = _curves(run, cfg["window"], cfg["bin_s"])
        color = COLORS.get(name)
        if xs:
            ax_a.plot(xs, ys, marker="o", markersize=3, label=name, color=color)
        ax_t.plot(ts, rates, label=name, color=color)
        if name == "online":
            swaps = [s["t"] for a, s in zip(run["steps"], run["steps"][1:]) if s["version"] != a["version"]]
            for j, t in enumerate(swaps):
                ax_t.axvline(t, color=color, linestyle="--", linewidth=0.8,
                             label="online: new drafter" if j == 0 else None)
    ax_a.set_xlabel(f"requests finished (phases: {' -> '.join(doc['phases'])})")
    ax_a.set_ylabel(f"mean acceptance length (window {cfg['window']})")
    ax_a.set_title("acceptance over the trace")
    ax_a.legend()
    ax_t.set_xlabel("seconds")
    ax_t.set_ylabel(f"output tokens/s ({cfg['bin_s']:g} s bins)")
    ax_t.set_title("throughput over time")
    ax_t.legend()
    return save_figure(fig, out_dir, "shift.png")
