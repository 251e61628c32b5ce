"""Where a decode step's time goes: each configuration's engine parts timed with ``perf_counter`` (no profiler).

Runs the configurations given (``LABEL=DRAFTERS:POLICY``, as ``policy_steps.py`` takes them) prompt by prompt in
one process, batch 1, with each engine part (``step``, ``_plan``, ``_propose``, ``_observe``, ``_record``, the
forward, the policy's ``plan_drafters`` / ``observe``, each drafter's ``observe``) wrapped in a timer, then prints
per configuration the milliseconds per full-batch decode step of each part, and the no-draft steps' median time
with and without the target's taps.

    PYTHONPATH=. .venv/bin/python docs/benchmarks/step_parts.py chat 16 --compile --configs plain=none:static \\
        ss=suffix:static sa=suffix:analytic ctrl=suffix,eagle3:analytic

A step's Python is ``step`` minus ``runner.forward``. The timers cost well under a microsecond each.
"""
import argparse
import collections
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

from tidespec.bench.decode.run import bench_engine_config, wave_indices
from tidespec.bench.spec.waves import WaveRun, run_wave, warm_up, wave_target
from tidespec.config import ModelConfig, PolicyConfig, SpecConfig
from tidespec.llm import build_engine
from tidespec.sampling import SamplingParams
from tidespec.stats import StepStats

ap = argparse.ArgumentParser()
ap.add_argument("workload")
ap.add_argument("limit", type=int)
ap.add_argument("--compile", action="store_true")
ap.add_argument("--quantization", default="w4a8",
                help="the target's path (none: float32, the fastest exact path on a CPU without AVX512-VNNI)")
ap.add_argument("--max-tokens", type=int, default=128)
ap.add_argument("--configs", nargs="+", required=True)
ns = ap.parse_args()
mc = ModelConfig(quantization=ns.quantization, threads=2, compile=ns.compile)
target, prompts = wave_target(mc, None, ns.workload, ns.limit)
seconds: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))


def timed(label: str, owner: Any, name: str, tag: str) -> None:
    """Replace ``owner.name`` with a wrapper adding its time to ``seconds[label][tag]``."""
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[label][tag] += time.perf_counter() - t
    setattr(owner, name, wrapper)


runs: list[WaveRun] = []
for item in ns.configs:
    label, rest = item.split("=", 1)
    drafter, policy = rest.split(":")[:2]
    spec = dataclasses.replace(SpecConfig(), drafter=drafter, num_speculative_tokens=4 if drafter != "none" else 0)
    pc = PolicyConfig() if policy == "static" else PolicyConfig(name=policy)
    econf = bench_engine_config(prompts, ns.max_tokens, 1, target.model.cfg.max_position_embeddings, mc, None, spec,
                                pc)
    engine = build_engine(econf, model=target.model, tokenizer=target.tokenizer)
    run = WaveRun(label, 1, engine)
    warm_up(run, prompts, lambda _p: SamplingParams(max_tokens=8),
            wave_indices(len(prompts), 1) if ns.compile else ([0],))
    engine.history.clear()
    for name in ("step", "_plan", "_want_taps", "_propose", "_observe", "_record"):
        timed(label, engine, name, "engine." + name)
    timed(label, engine.runner, "forward", "runner.forward")
    if engine.policy is not None:
        timed(label, engine.policy, "observe", "policy.observe")
        timed(label, engine.policy, "plan_drafters", "policy.plan_drafters")
    if engine.drafter is not None:
        timed(label, engine.drafter, "observe", "drafter.observe")
        timed(label, engine.drafter, "propose", "drafter.propose")
        for member in engine.drafter.members.values():
            if member is not engine.drafter:
                timed(label, member, "observe", f"{member.name}.observe")
    runs.append(run)
steps: dict[str, list[StepStats]] = {r.label: [] for r in runs}
for i in range(len(prompts)):
    for r in runs:
        run_wave(r, prompts, [i], lambda _p: SamplingParams(max_tokens=ns.max_tokens))
        steps[r.label] += [s for s in r.engine.history if s.num_decode_seqs == 1 and not s.num_prefill_tokens]
        r.engine.history.clear()
for r in runs:
    n = len(steps[r.label])
    print(f"=== {r.label}: {n} decode steps, {r.tokens / r.wall:.1f} tok/s")
    for tag, t in sorted(seconds[r.label].items(), key=lambda kv: -kv[1]):
        print(f"  {tag:28s} {1000 * t / n:8.4f} ms/step")
    for tapped in (False, True):
        group = [s for s in steps[r.label] if s.num_drafts == 0 and bool(s.taps) == tapped]
        if group:
            print(f"  no-draft steps {'with' if tapped else 'without'} taps: {len(group)}, median "
                  f"{1000 * statistics.median(s.total_time for s in group):.3f} ms")
