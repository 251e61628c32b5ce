"""Where a per-sequence step's time goes, against suffix alone and plain decoding: the engines' step records.

Runs plain, suffix alone and the per-sequence hybrid (suffix + the shipped EAGLE-3 head, analytic policy)
on one workload at batch 1 (``--batch B``: in waves of B; then only the steps with B sequences count) in turn
per wave (as ``bench spec --hybrid`` does), then splits each
configuration's decode steps by kind (a step where a draft was verified, by the drafters that drafted it, or
none) and reports per kind the
steps, milliseconds in drafting / the forward and verification / the rest (planning, offers, policy,
drafters' observe), and tokens per step; and the per-sequence policy's route counts and calibrations.

    PYTHONPATH=. .venv/bin/python docs/benchmarks/hybrid_steps.py sql_help 8 [--compile] [--no-measured-routes] [--batch 4]

Before / after a change: the same script with ``PYTHONPATH`` at a ``git worktree`` of the older commit,
alternating with the newer one.
"""
import argparse
import dataclasses

from tidespec.bench.decode.run import bench_engine_config, wave_indices
from tidespec.bench.spec.waves import WaveRun, run_rounds, run_wave, warm_up, wave_target
from tidespec.config import ModelConfig, PolicyConfig, SpecConfig
from tidespec.llm import build_engine
from tidespec.sampling import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("workload")
ap.add_argument("limit", type=int)
ap.add_argument("--compile", action="store_true")
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--measured-routes", action=argparse.BooleanOptionalAction, default=True)
ns = ap.parse_args()
mc = ModelConfig(quantization="w4a8", threads=2, compile=ns.compile)
target, prompts = wave_target(mc, None, ns.workload, ns.limit)
configs = {"plain": ("none", None), "suffix": ("suffix", None), "per-sequence": ("suffix,eagle3", True)}
runs = []
for label, (drafter, per_seq) in configs.items():
    spec = dataclasses.replace(SpecConfig(), drafter=drafter, num_speculative_tokens=4 if drafter != "none" else 0)
    # (an older checkout, run with PYTHONPATH at it for a before/after, has no measured_routes)
    extra = {"measured_routes": ns.measured_routes} if "measured_routes" in PolicyConfig.__dataclass_fields__ else {}
    pc = PolicyConfig() if per_seq is None else PolicyConfig(name="analytic", per_sequence=True, **extra)
    econf = bench_engine_config(prompts, 128, ns.batch, target.model.cfg.max_position_embeddings, mc, None, spec, pc)
    runs.append(WaveRun(label, ns.batch, build_engine(econf, model=target.model, tokenizer=target.tokenizer)))
for r in runs:
    warm_up(r, prompts, lambda _p: SamplingParams(max_tokens=8),
            wave_indices(len(prompts), ns.batch) if ns.compile else ([0],))
    r.engine.history.clear()
steps: dict[str, list] = {r.label: [] for r in runs}


def each(run: WaveRun, wave: list[int]) -> None:
    run_wave(run, prompts, wave, lambda _p: SamplingParams(max_tokens=128))
    steps[run.label] += [s for s in run.engine.history if s.num_decode_seqs == ns.batch and not s.num_prefill_tokens]
    run.engine.history.clear()


run_rounds(runs, len(prompts), (ns.batch,), "hybrid steps", each, True)
print("| configuration | tok/s | step kind | steps | ms / step | draft | forward + verify | rest | tokens / step |")
print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
for r in runs:
    routes = sorted({"+".join(sorted(set(s.seq_drafters.values()))) for s in steps[r.label] if s.num_drafts > 0})
    kinds = [(f"drafted: {route}", lambda s, route=route: s.num_drafts > 0
              and "+".join(sorted(set(s.seq_drafters.values()))) == route) for route in routes]
    for kind, keep in (*kinds, ("no draft", lambda s: s.num_drafts == 0)):
        group = [s for s in steps[r.label] if keep(s)]
        if not group:
            continue
        n = len(group)
        ms = [1000 * sum(getattr(s, f) for s in group) / n for f in ("total_time", "draft_time", "verify_time",
                                                                        "other_time")]
        print(f"| {r.label} | {r.tokens / r.wall:.1f} | {kind} | {n} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[2]:.2f} | "
              f"{ms[3]:.2f} | {sum(s.num_emitted_tokens for s in group) / n:.2f} |")
plain = runs[0].outputs
for r in runs[1:]:
    print(f"{r.label}: outputs = plain {sum(r.outputs[i] == plain[i] for i in plain)}/{len(plain)}")
stats = runs[2].engine.policy.stats() if runs[2].engine.policy is not None else {}
print({k: round(v, 3) for k, v in stats.items() if k.startswith(("routed_", "calibration_", "route_speed_", "probe"))})
