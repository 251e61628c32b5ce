"""Where each configuration's decode steps go, plain decoding against policies that may decide not to draft.

Runs the configurations given (``LABEL=DRAFTERS:POLICY[:FLAG...]``, e.g. ``e3=eagle3:analytic``,
``perseq=suffix,eagle3:analytic:perseq``, ``plain=none:static``; the first is the reference) in turn per wave
(as ``bench spec --hybrid`` does), then splits each one's full-batch decode steps into the analytic policy's
probes, the other drafted steps and the steps where nobody drafted, and reports per kind the steps, milliseconds
in drafting / the forward and verification / the rest, tokens per step, the drafts that came back cold and the
steps that computed the target's taps; then the median forward + verification by rows verified against the policy's
profile; then the outputs against the first configuration's and each policy's probe, routing and acceptance
statistics.

    PYTHONPATH=. .venv/bin/python docs/benchmarks/policy_steps.py ar_topics 16 --batch 4 --compile --max-tokens 64 \\
        --configs plain=none:static e3=eagle3:analytic perseq=suffix,eagle3:analytic:perseq

Flags, to take a per-sequence configuration apart (each turns one part off or fixes it, in this process only):
``perseq`` (per-sequence drafting), ``nogate`` (``--no-gate-model-drafters``: the model drafters routed and probed in
every step), ``notrim`` (``--no-trim-drafts``), ``noprobe`` (the analytic policy never probes),
``takeall`` (the router's choice replaced by the model-free drafter's offer whenever it has one, else no draft: suffix
alone's decisions, with the per-sequence machinery around them), ``span=N`` (the acceptance estimates forget per
``N`` drafts: ``span=1`` at batch 1 is the per-step memory before 2026-12-07), ``rows=T1/ROW/D0`` (milliseconds: the profile's
batch-1 row of T(1, q) set to T1 + (q - 1) ROW and the model drafter's D0 at batch 1 to D0, e.g. what this engine's
own steps measured).

    PYTHONPATH=. .venv/bin/python docs/benchmarks/policy_steps.py chat 16 --compile --configs plain=none:static \
        suffix=suffix:static perseq=suffix,eagle3:analytic:perseq takeall=suffix,eagle3:analytic:perseq:noprobe:takeall

Before / after a change: the same command with ``PYTHONPATH`` at a ``git worktree`` of the older commit, one after
the other; compare ratios to plain within a run.
"""
import argparse
import dataclasses
import statistics
from typing import Any

from tidespec.bench.decode.run import bench_engine_config, wave_indices
from tidespec.bench.spec.waves import WaveRun, run_rounds, run_wave, warm_up, wave_target
from tidespec.config import ModelConfig, PolicyConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.llm import build_engine
from tidespec.sampling import SamplingParams
from tidespec.speculative.policy.api import PlanInput, bucket_of
from tidespec.stats import StepStats

ap = argparse.ArgumentParser()
ap.add_argument("workload")
ap.add_argument("limit", type=int)
ap.add_argument("--compile", action="store_true")
ap.add_argument("--quantization", default="w4a8",
                help="the target's path (none: float32, the fastest exact path on a CPU without AVX512-VNNI)")
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--max-tokens", type=int, default=128)
ap.add_argument("--configs", nargs="+", required=True)
ns = ap.parse_args()
mc = ModelConfig(quantization=ns.quantization, threads=2, compile=ns.compile)


def taken_apart(engine: LLMEngine, flags: list[str]) -> None:
    """The flags ``span=``, ``noprobe``, ``takeall`` and ``rows=`` of the module docstring, applied to an engine's
    analytic policy (and, for ``rows=``, to its draft trim)."""
    policy: Any = getattr(engine.policy, "inner", engine.policy)
    for flag in flags:
        if flag.startswith("span="):  # the acceptance estimates forget per span drafts (span=1 at batch 1: per step)
            for tracker in policy.trackers.trackers.values():
                tracker.span = int(flag[len("span="):])
    if "noprobe" in flags:
        policy.probe_every = 0
    router = getattr(policy, "router", None)
    if "takeall" in flags and router is not None:
        def offer_if_any(batch_size: int, models: dict, offers: dict, seq_id: int = -1) -> tuple[str, int]:
            name, (_, length) = next(iter(offers.items()), ("", (0.0, 0)))
            router._routes.append((name or "none", 1.0))
            return (name, length) if length > 0 else ("", 0)
        router.choose = offer_if_any
    for flag in flags:
        if flag.startswith("rows="):
            t1, row, d0 = (float(x) / 1e3 for x in flag[len("rows="):].split("/"))
            old = policy.profile
            verify = {**old.verify_latency, **{(1, q): t1 + (q - 1) * row for b, q in old.verify_latency if b == 1}}
            model = [d for d in policy.drafters if d is not None and d not in policy.shadowed]
            new = dataclasses.replace(old, verify_latency=verify, draft_cost={**old.draft_cost, **{d: d0 for d in model}},
                                      draft_batch_cost={**old.draft_batch_cost, **{(d, 1): d0 for d in model}})
            for holder in (policy, policy.probes, router, getattr(router, "meter", None), engine.trim):
                if holder is not None:
                    holder.profile = new
            policy._tables.clear()
target, prompts = wave_target(mc, None, ns.workload, ns.limit)
runs: list[WaveRun] = []
for item in ns.configs:
    label, rest = item.split("=", 1)
    drafter, policy, *flags = rest.split(":")
    spec = dataclasses.replace(SpecConfig(), drafter=drafter, num_speculative_tokens=4 if drafter != "none" else 0)
    pc = PolicyConfig() if policy == "static" else PolicyConfig(name=policy, per_sequence="perseq" in flags,
                                                                 trim_drafts="notrim" not in flags,
                                                                 gate_model_drafters="nogate" not in flags)
    econf = bench_engine_config(prompts, ns.max_tokens, ns.batch, target.model.cfg.max_position_embeddings, mc, None,
                                spec, pc)
    engine = build_engine(econf, model=target.model, tokenizer=target.tokenizer)
    taken_apart(engine, flags)
    runs.append(WaveRun(label, ns.batch, engine))
probed: dict[str, list[bool]] = {}  # label -> per plan, whether the analytic policy probed
for r in runs:
    warm_up(r, prompts, lambda _p: SamplingParams(max_tokens=8),
            wave_indices(len(prompts), ns.batch) if ns.compile else ([0],))
    r.engine.history.clear()
    inner = getattr(r.engine.policy, "inner", r.engine.policy)
    probed[r.label] = []
    if hasattr(inner, "_probed"):
        def plan(inp: PlanInput, orig=inner.plan_drafters, inner=inner, label=r.label) -> dict[int, tuple[str, int]]:
            out = orig(inp)
            probed[label].append(inner._probed.get(bucket_of(inp.batch_size), False))
            return out
        inner.plan_drafters = plan
steps: dict[str, list[tuple[StepStats, bool]]] = {r.label: [] for r in runs}


def each(run: WaveRun, wave: list[int]) -> None:
    first = len(probed[run.label])
    run_wave(run, prompts, wave, lambda _p: SamplingParams(max_tokens=ns.max_tokens))
    plans = probed[run.label][first:]
    decode = [s for s in run.engine.history if s.num_decode_seqs > 0]  # every such step was planned
    for i, s in enumerate(decode):
        if s.num_decode_seqs == ns.batch and not s.num_prefill_tokens:
            steps[run.label].append((s, plans[i] if i < len(plans) else False))
    run.engine.history.clear()


run_rounds(runs, len(prompts), (ns.batch,), "policy steps", each, True)
print("| configuration | tok/s | step kind | steps | ms / step | draft | forward + verify | rest | tokens / step | cold "
      "| taps |")
print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
kinds = {"probe": lambda s, p: p, "drafted": lambda s, p: not p and s.num_drafts > 0,
         "no draft": lambda s, p: not p and s.num_drafts == 0}
for r in runs:
    for kind, keep in kinds.items():
        group = [s for s, p in steps[r.label] if keep(s, p)]
        if not group:
            continue
        n = len(group)
        ms = [1000 * sum(getattr(s, f) for s in group) / n for f in ("total_time", "draft_time", "verify_time",
                                                                        "other_time")]
        print(f"| {r.label} | {r.tokens / r.wall:.1f} | {kind} | {n} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[2]:.2f} | "
              f"{ms[3]:.2f} | {sum(s.num_emitted_tokens for s in group) / n:.2f} | "
              f"{sum(s.num_cold_drafts for s in group)} | {sum(s.taps for s in group)} |")
print("\n| configuration | rows verified | steps | forward + verify, ms | the profile's T(b, rows / b), ms |")
print("|---|---:|---:|---:|---:|")
for r in runs:  # what a verified row costs in this engine, against what the policy's profile says
    profile = getattr(getattr(r.engine.policy, "inner", r.engine.policy), "profile", None)
    by_rows: dict[int, list[float]] = {}
    for s, _ in steps[r.label]:
        by_rows.setdefault(ns.batch + s.num_draft_tokens, []).append(s.verify_time)
    for rows, times in sorted(by_rows.items()):
        if len(times) >= 20:
            t = f"{1000 * profile.verify(ns.batch, rows / ns.batch):.2f}" if profile is not None else "-"
            print(f"| {r.label} | {rows} | {len(times)} | {1000 * statistics.median(times):.2f} | {t} |")
reference = runs[0]
for r in runs[1:]:
    same = sum(r.outputs[i] == reference.outputs[i] for i in reference.outputs)
    print(f"{r.label}: {r.tokens / r.wall / (reference.tokens / reference.wall):.3f}x {reference.label}, outputs = "
          f"{reference.label}'s {same}/{len(reference.outputs)}")
    if r.engine.policy is not None:
        print({k: round(v, 3) for k, v in r.engine.policy.stats().items()
               if k.startswith(("routed_", "probe", "alpha", "gamma_b", "gate_", "depth_"))})
