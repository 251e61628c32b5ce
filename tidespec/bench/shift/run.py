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
  TIDE's selective collection, ``tidespec train-drafter`` as a child process (paused while its
  engine decodes beyond ``--trainer-share``, ``online.serving.governor``), swaps between steps;
* ``no-learning`` (optional) — frozen's drafters with nothing carried from one request to the next:
  the frozen head, and a suffix drafter over the request's own tokens only (no tree of past
  outputs, ``--suffix-max-tree-tokens 0``). Why: a phase's acceptance by quarter follows its prompts
  (some are easier), so a rise is learning only against the same requests served without it;
* ``ngram`` / ``suffix`` (optional) — that model-free drafter alone at a static gamma;
* ``vocab-static`` / ``vocab-dynamic`` / ``vocab-full`` (optional) — the frozen drafter over a draft
  vocabulary (EvoSpec: FR-Spec's frequency core, core + retrieved buffer, every token; the head's
  rows for tokens outside its own vocabulary are the target's, mapped into its space), and
  ``vocab-static:CORE`` / ``vocab-dynamic:CORE:BUFFER`` of chosen sizes (a size sweep in one run);
* ``vocab-static-lora`` / ``vocab-dynamic-lora`` (optional) — the same, aligned online: capture on,
  a trainer child that only trains LoRA adapters (EvoSpec path B, ``online.training.lora``), adapters
  merged between steps — with the two above, EvoSpec Figure 3's ablation in one run.

``--drafter suffix,eagle3 --policy analytic`` gives frozen and online the suffix drafter beside
EAGLE-3 and the analytic controller, which chooses per step which drafter drafts and how far (or
none): everything on. The configurations take turns on slices of ``--turn`` requests (each keeps
its own engine, drafter and clock across turns), so every phase of every configuration is measured
in the same minutes and a slow spell of the machine hits all of them; each online configuration's
trainer is held paused during the other configurations' turns.

Requests run closed-loop with ``concurrency`` in flight, greedy, every request generating exactly
``max_tokens`` tokens (EOS ignored; ``--no-ignore-eos``: ending at EOS, as served requests do), so
every configuration does the same work and greedy outputs must be identical to plain's
(``mismatches`` counts requests that differ). Over the trace it
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

This module runs the benchmark; the settings and the trace are in ``bench.shift.config``, the
closed loop and the engines in ``bench.shift.runs``, the side measurements in
``bench.shift.measure``, the README and plot in ``bench.shift.report``.
"""

from __future__ import annotations

import functools
import random
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from tidespec.bench.common.report import default_out_dir, finish_run, rerender_run
from tidespec.bench.serve.run import arrival_times
from tidespec.bench.shift.config import ONLINE_CONFIGS, ShiftBenchConfig, TraceItem, build_trace, served_label
from tidespec.bench.shift.measure import measure_capture_overhead, measure_training_sources
from tidespec.bench.shift.report import (
    drafter_acceptance,
    plot_shift,
    quarter_steps,
    quarters_of,
    report,
    tokens_per_step,
)
from tidespec.bench.shift.runs import (
    OnlineSetup,
    TraceLoop,
    TraceRun,
    finish_online,
    learned_engine,
    no_learning_config,
    online_status,
    seed_publish_root,
    start_online,
    static_engine,
    trace_engine_config,
    vocab_engine,
)
from tidespec.models.loading.loader import LoadedModel


def quarter_acceptance(reqs: list[dict[str, Any]], steps: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Mean acceptance length per quarter of a phase's requests (in trace order): ``served`` over all
    its drafts, and each drafter's over the drafts it made in the steps of that quarter
    (``quarter_steps``). Why: under a controller the served figure mixes drafters, so a learning
    drafter's own trend shows only per drafter.

    Example: 8 requests -> quarters of requests 0-1, 2-3, 4-5, 6-7; a quarter's steps in which suffix
    drafted 10 sequences and had 15 tokens accepted -> suffix 2.5 there.
    """
    names = sorted({d for s in steps for d in s.get("accepted_by_drafter", {})})
    out: dict[str, list[float]] = {name: [] for name in ["served", *names]}
    for b, in_q in zip(quarters_of(reqs), quarter_steps(reqs, steps)):
        drafts = sum(r["drafts"] for r in b)
        out["served"].append((sum(r["accepted"] for r in b) + drafts) / drafts if drafts else float("nan"))
        for name, acc in drafter_acceptance(in_q, names).items():
            out[name].append(acc)
    return out


def summarize_run(run: TraceRun, trace: list[TraceItem], plain: TraceRun | None) -> dict[str, Any]:
    """Per phase and overall: tokens/s, mean request latency, mean acceptance length, speedups over plain
    (tokens/s and latency: under open-loop arrivals tokens/s follows the arrival rate, latency does
    not), mismatches."""

    def acc(reqs: list[dict[str, Any]]) -> float:
        d = sum(r["drafts"] for r in reqs)
        return (sum(r["accepted"] for r in reqs) + d) / d if d else float("nan")

    def latency(reqs: list[dict[str, Any]]) -> float:
        """Mean seconds from a request's arrival (closed loop: its admission) to its last token."""
        return sum(r["t_end"] - r["t_start"] for r in reqs) / len(reqs) if reqs else float("nan")

    phases = []
    seen = {"vocab_verified": 0, "vocab_covered": 0}  # the vocabulary's cumulative counters before the phase
    for p in sorted({t.phase for t in trace}):
        reqs = [r for r in run.requests if r["phase"] == p]
        t_a, t_b = min(r["t_start"] for r in reqs), max(r["t_end"] for r in reqs)
        half = reqs[len(reqs) // 2:]
        steps = [s for s in run.steps if t_a <= s["t"] <= t_b]
        draft_tokens = sum(s.get("draft_tokens", 0) for s in steps)
        phase = {"phase": p + 1, "workload": reqs[0]["workload"], "requests": len(reqs),
                 "tok_s": sum(r["tokens"] for r in reqs) / max(1e-9, t_b - t_a), "mean_latency_s": latency(reqs),
                 "mean_acceptance_length": acc(reqs), "second_half_acceptance_length": acc(half),
                 "quarters": quarter_acceptance(reqs, run.steps), "tokens_per_step": tokens_per_step(reqs),
                 "quarter_tokens_per_step": [tokens_per_step(q) for q in quarters_of(reqs)],
                 "versions": sorted({r["version"] for r in reqs}),
                 "served": [served_label(v, a) for v, a in sorted({(r["version"], r.get("adapter", 0)) for r in reqs})],
                 "draft_ms_per_token": 1e3 * sum(s.get("draft_s", 0.0) for s in steps) / draft_tokens
                 if draft_tokens else float("nan")}
        if "vocab_verified" in reqs[-1]:  # requests finish in trace order at concurrency 1; else approximate
            last = max(reqs, key=lambda r: r["vocab_verified"])
            verified = last["vocab_verified"] - seen["vocab_verified"]
            phase["coverage"] = (last["vocab_covered"] - seen["vocab_covered"]) / verified if verified else float("nan")
            seen = {k: last[k] for k in seen}
        phases.append(phase)
    tok_s = sum(r["tokens"] for r in run.requests) / run.wall_s
    draft_tokens = sum(s.get("draft_tokens", 0) for s in run.steps)
    doc: dict[str, Any] = {"wall_s": run.wall_s, "tok_s": tok_s, "mean_latency_s": latency(run.requests),
                           "mean_acceptance_length": acc(run.requests),
                           "draft_ms_per_token": 1e3 * sum(s.get("draft_s", 0.0) for s in run.steps) / draft_tokens
                           if draft_tokens else float("nan"), "phases": phases}
    if plain is not None:  # latency speedups: plain's mean latency on the same requests over this one's
        doc["speedup"] = tok_s / (sum(r["tokens"] for r in plain.requests) / plain.wall_s)
        doc["latency_speedup"] = latency(plain.requests) / doc["mean_latency_s"]
        doc["mismatches"] = sum(a != b for a, b in zip(run.outputs, plain.outputs))
        for ph, base in zip(phases, summarize_run(plain, trace, None)["phases"]):
            ph["speedup"] = ph["tok_s"] / base["tok_s"]
            ph["latency_speedup"] = base["mean_latency_s"] / ph["mean_latency_s"]
    if run.online:
        doc["online"] = run.online
    if run.vocab:
        doc["vocab"] = run.vocab
    return doc


def run_shift_bench(cfg: ShiftBenchConfig, target: LoadedModel, out_dir: Path | None = None, command: str = "",
                    progress: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the configurations, the side measurements, and write the report (see module docstring)."""
    out_dir = out_dir or default_out_dir("shift")
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = build_trace(cfg, target.tokenizer)
    log(f"trace: {' -> '.join(f'{Path(w).stem} x{n}' for w, n in cfg.phase_specs)}, {cfg.max_tokens} tokens each, "
        f"{cfg.concurrency} in flight; " + (f"configurations take turns of {cfg.turn} requests" if cfg.turn else
                                             "configurations one after another"))
    frozen_root = out_dir / "frozen-drafter"
    if frozen_root.exists():
        shutil.rmtree(frozen_root)
    seed_publish_root(frozen_root, cfg.bootstrap, target.model, cfg.learned or "eagle3")
    loops: dict[str, TraceLoop] = {}
    onlines: dict[str, OnlineSetup] = {}
    # open loop: the same seeded Poisson arrival times for every configuration, each on its own clock
    arrivals = (arrival_times([(0.0, cfg.arrival_rate)], len(trace), None, random.Random(cfg.seed))
                if cfg.arrival_rate > 0 else None)
    for name in cfg.config_names:
        status = adapter = None
        if name in ONLINE_CONFIGS:
            work = out_dir / name
            if work.exists():
                shutil.rmtree(work)
            setup = onlines[name] = start_online(target, trace, cfg, work, name)
            engine, status = setup.engine, functools.partial(online_status, setup.online)
            adapters = setup.online.adapters
            adapter = (lambda a=adapters: a.applied) if adapters is not None else None
        elif name.startswith("vocab-"):
            engine = vocab_engine(target.model, target.tokenizer,
                                  trace_engine_config(trace, cfg, target.model, cfg.gamma), frozen_root, cfg, name)
        elif name in ("frozen", "no-learning"):
            ecfg = trace_engine_config(trace, cfg, target.model, cfg.gamma)
            ecfg = no_learning_config(ecfg) if name == "no-learning" else ecfg
            engine = learned_engine(target.model, target.tokenizer, ecfg, frozen_root, cfg.draft_vocab)
        else:  # plain, or a model-free drafter alone at a static gamma
            gamma = 0 if name == "plain" else cfg.gamma
            engine = static_engine(target, trace_engine_config(trace, cfg, target.model, gamma, name))
        loops[name] = TraceLoop(engine, trace, cfg.concurrency, cfg.max_tokens, name, progress, status, cfg.ignore_eos,
                                adapter, arrivals)
    try:
        runs = _take_turns(loops, len(trace), cfg.turn, onlines, cfg.trainer_catchup_s)
    finally:
        for setup in onlines.values():
            setup.online.close()  # no trainer child outlives the run (close is idempotent)
    for name, setup in onlines.items():
        finish_online(runs[name], setup)
    plain = runs.get("plain")
    doc: dict[str, Any] = {"config": asdict(cfg), "phases": [Path(w).stem for w in cfg.phases],
                           "phase_sizes": [(Path(w).stem, n) for w, n in cfg.phase_specs],
                           "configs": {n: summarize_run(r, trace, plain if n != "plain" else None)
                                       for n, r in runs.items()},
                           "runs": {n: {"steps": r.steps, "requests": r.requests, "turns": r.turns}
                                    for n, r in runs.items()}}
    if cfg.learned != "eagle3" and (cfg.overhead_repeats or cfg.recompute_rows):
        log("capture overhead and signals vs recompute: measured for EAGLE-3's taps only; skipped")
    elif cfg.overhead_repeats:
        doc["capture_overhead"] = measure_capture_overhead(target, trace, cfg, frozen_root, progress)
    signal_dir = Path(cfg.signal_dir) if cfg.signal_dir else (out_dir / "online" / "signals")
    if cfg.recompute_rows and signal_dir.is_dir() and cfg.learned == "eagle3":
        doc["training_sources"] = measure_training_sources(target, signal_dir, cfg, progress)

    return finish_run(out_dir, "shift", doc, command, str(target.model.dtype).removeprefix("torch."), report,
                      plot_shift, log)


def _take_turns(loops: dict[str, TraceLoop], n: int, turn: int, onlines: dict[str, OnlineSetup],
                catchup_s: float = 0.0) -> dict[str, TraceRun]:
    """Each configuration warms up, then runs requests ``[k * turn, (k + 1) * turn)`` of the trace in
    turn (all of them at once with ``turn`` 0). An online configuration's trainer is held paused outside
    its turns, so it never shares the CPU with another configuration's measurement; ``catchup_s``: it
    runs alone that long after each of its turns, while every clock is stopped."""
    governors = {name: s.online.governor for name, s in onlines.items() if s.online.governor is not None}
    for governor in governors.values():
        governor.hold(True)
    for loop in loops.values():
        loop.warm_up()
    for end in range(turn or n, n + (turn or n), turn or n):
        for name, loop in loops.items():
            if name in governors:
                governors[name].hold(False)
            loop.run_turn(min(end, n))
            if name in governors:
                time.sleep(catchup_s)  # the engine idles: the governor lets its trainer run
                governors[name].hold(True)
    return {name: loop.finish() for name, loop in loops.items()}


def replot(out_dir: Path) -> dict[str, Any]:
    """Re-render README.md and shift.png of an earlier run from its ``bench_shift.json``."""
    return rerender_run(out_dir, "shift", report, plot_shift)
