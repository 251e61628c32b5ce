"""Analysis of ``tidespec bench load``'s runs: repeats averaged, the verdict, the trace's headroom, the model check.

Why this exists: the numbers the benchmark's claims rest on — best adaptive against best static
per rate and on the trace, what an oracle could win per batch-size bucket, and the analytic
model (eq. 5 from the profile) against the measured speedup per bucket (TIDE Figure 8) — are
pure functions of the runs' results, testable without a server; ``bench.load.run`` computes them
after the runs and ``--replot`` again from ``bench_load.json``.

Worked example of the verdict: at rate 1.2 req/s plain makes 60 tok/s, static-2 57, hybrid 59:
best static = 60 (plain), best adaptive = 59, ratio 0.983 >= 0.97 -> holds.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tidespec.bench.load.config import LoadBenchConfig, RunResult, is_adaptive
from tidespec.speculative.policy.speedup import Profile


def forward_vs_profile(steps: dict[str, dict[str, float]], profile: Profile) -> float | None:
    """How much slower than the profile this run's target forwards were, over all its decode
    steps: sum of measured forward seconds / sum of the profile's T(b, 1 + d) for each bucket's
    mean batch b and drafted tokens per sequence-step d. 1.0 = the machine ran as fast as when it
    was profiled; two runs doing the same work at 1.0 and 1.6 differ by machine drift, not by
    configuration. Example: bucket 16 with 100 steps, 2 s of forward, 1000 seqs (b = 10), nothing
    drafted, T(10, 1) = 0.015 s -> 2 / 1.5 = 1.33. None without decode steps."""
    measured = predicted = 0.0
    for st in steps.values():
        if st.get("steps", 0.0) <= 0 or st.get("seqs", 0.0) <= 0:
            continue
        b = st["seqs"] / st["steps"]
        measured += st.get("forward", 0.0)
        predicted += st["steps"] * profile.verify(b, 1.0 + st.get("drafted", 0.0) / st["seqs"])
    return measured / predicted if predicted > 0 else None


def throughput(r: RunResult) -> float:
    """Output tokens per second of a run."""
    return float(r.summary["output_tok_per_s"])


def mean_e2e(r: RunResult) -> float:
    """Mean end-to-end latency of a run in seconds (inf when nothing completed)."""
    v = r.summary["e2e_s"]["mean"]
    return math.inf if v is None else float(v)


def averaged(results: list[RunResult]) -> list[RunResult]:
    """One result per (config, kind, rate): throughput and mean e2e averaged over repeats, the
    per-repeat throughputs kept in ``summary["tok_s_runs"]``.

    Example: static-2 at rate 1.0 made 30 and 34 tok/s in two rounds -> one result at 32 tok/s
    with ``tok_s_runs`` [30, 34].
    """
    groups: dict[tuple[str, str, float | None], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.config, r.kind, r.rate), []).append(r)
    out = []
    for (config, kind, rate), rs in groups.items():
        summary = dict(rs[0].summary)
        summary["tok_s_runs"] = [throughput(r) for r in rs]
        summary["output_tok_per_s"] = float(np.mean(summary["tok_s_runs"]))
        summary["e2e_s"] = {**summary["e2e_s"], "mean": float(np.mean([mean_e2e(r) for r in rs]))}
        out.append(RunResult(config, kind, rate, summary))
    return out


def verdict(results: list[RunResult], cfg: LoadBenchConfig,
            checks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The issue's checks: per rate, best adaptive / best static throughput (>= 0.97), at the top
    rate best adaptive / plain (>= 0.97); on the trace, the best adaptive against the best static
    in throughput and mean latency; with ``checks`` (``model_check``'s rows), the error of the
    analytic model.

    Example: rate 0.4 -> static {plain: 20, static-2: 24}, adaptive {hybrid: 23.5}:
    ratio 23.5 / 24 = 0.979 -> ok. With repeats, each configuration counts with its mean.
    """
    out: dict[str, Any] = {"per_rate": []}
    results_by_round = results
    results = averaged(results)
    for rate in cfg.rates:
        at = [r for r in results if r.kind == "rate" and r.rate == rate]
        static = [r for r in at if not is_adaptive(r.config)]
        adaptive = [r for r in at if is_adaptive(r.config)]
        if not static or not adaptive:
            continue
        bs, ba = max(static, key=throughput), max(adaptive, key=throughput)
        row = {"rate": rate, "best_static": bs.config, "best_static_tok_s": throughput(bs), "best_adaptive": ba.config,
               "best_adaptive_tok_s": throughput(ba), "ratio": throughput(ba) / throughput(bs) if throughput(bs) else None,
               "best_static_runs": bs.summary["tok_s_runs"], "best_adaptive_runs": ba.summary["tok_s_runs"]}
        plain = next((r for r in at if r.config == "plain"), None)
        if plain is not None and throughput(plain):
            row["adaptive_over_plain"] = throughput(ba) / throughput(plain)
        out["per_rate"].append(row)
    trace = [r for r in results if r.kind == "trace"]
    static = [r for r in trace if not is_adaptive(r.config)]
    adaptive = [r for r in trace if is_adaptive(r.config)]
    if static and adaptive:
        bs, ba = max(static, key=throughput), max(adaptive, key=throughput)
        fastest = min(static, key=mean_e2e)
        out["trace"] = {"best_static": bs.config, "best_static_tok_s": throughput(bs), "best_adaptive": ba.config,
                        "best_adaptive_tok_s": throughput(ba), "throughput_margin": throughput(ba) / throughput(bs) - 1.0,
                        "lowest_latency_static": fastest.config, "static_mean_e2e_s": mean_e2e(fastest),
                        "adaptive_mean_e2e_s": mean_e2e(ba),
                        "latency_margin": 1.0 - mean_e2e(ba) / mean_e2e(fastest)}
    if checks is None:
        return out
    headroom = trace_headroom(results_by_round, checks)
    if headroom and "trace" in out:
        out["trace"]["headroom"] = headroom
    errors = [abs(x["predicted"] / x["measured"] - 1.0) for x in checks]
    out["model_abs_error"] = {"n": len(errors), "median": float(np.median(errors)) if errors else None,
                              "max": max(errors) if errors else None,
                              "within_15pct": sum(e <= 0.15 for e in errors)}
    return out


def trace_headroom(results: list[RunResult], checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What an adaptive policy could win on the trace at best, per round: the plain server's
    decode-only seconds per batch-size bucket, divided by the measured speedup (``model_check``)
    of (a) the best static configuration *in each bucket* — an oracle that knows the answer per
    batch size and can choose plain — and (b) the best single static configuration. Buckets
    without a check row (too few steps) count as break-even (speedup 1.0).

    Example: plain spends 10 s at bucket 1 and 30 s at bucket 16; static-4 measures 1.2x / 0.9x,
    static-1 1.1x / 1.0x. Oracle: 10 / 1.2 + 30 / 1.0 = 38.33 s -> 40 / 38.33 = 1.043x plain;
    static-4: 10 / 1.2 + 30 / 0.9 = 41.67 s -> 0.960x; static-1: 10 / 1.1 + 30 = 39.09 s -> 1.023x:
    the best single static is static-1 at 1.023x, so an adaptive policy has ~2 % to win.
    """
    out = []
    for rep in sorted({r.repeat for r in results if r.kind == "trace" and r.config == "plain"}):
        plain = next(r for r in results if r.kind == "trace" and r.config == "plain" and r.repeat == rep)
        seconds = {b: st["total"] for b, st in plain.steps.items() if st.get("total", 0.0) > 0}
        measured: dict[str, dict[str, float]] = {}
        for x in checks:
            if x["kind"] == "trace" and x.get("repeat", 0) == rep and not is_adaptive(x["config"]):
                measured.setdefault(x["config"], {})[str(x["bucket"])] = x["measured"]
        if not seconds or not measured:
            continue
        total = sum(seconds.values())

        def speedup(per_bucket: dict[str, float]) -> float:
            return total / sum(t / per_bucket.get(b, 1.0) for b, t in seconds.items())

        oracle = {b: max([1.0, *(m[b] for m in measured.values() if b in m)]) for b in seconds}
        single = {name: speedup(m) for name, m in measured.items()}
        best = max(single, key=single.__getitem__)
        out.append({"repeat": rep, "oracle_over_plain": speedup(oracle), "best_static": best,
                    "best_static_over_plain": single[best]})
    return out


def model_check(results: list[RunResult], profile: Profile, min_steps: int = 20) -> list[dict[str, Any]]:
    """TIDE's Figure 8 per batch-size bucket: measured speedup of each speculating run over the
    ``plain`` run at the same load (seconds per emitted token of their decode-only steps in that
    bucket, from the servers' ``decode_step_*`` counters) against eq. 5 from the profile alone at
    the run's measured tokens per step: ``e * T(b, 1) / (T(b, 1 + d) + D0)``, with b the bucket's
    mean batch size, e the emitted and d the drafted tokens per sequence-step.

    Also where the speculating step's time went, to explain an error: its forward against the
    profile's T(b, 1 + d) (and the plain server's forward against T(b, 1): a server slower than
    the profile by the same factor in both cancels out of the ratio), its drafting time against
    D0, and the share of step time outside forward and drafting.

    Worked example: plain bucket 4 with 100 steps, 400 seqs, 10 s total, 8 s forward, 400 emitted
    (25 ms per token); a static-3 run with 50 steps, 200 seqs, 7.5 s, 200 * 2.5 = 500 emitted,
    600 drafted (15 ms per token): measured = 25 / 15 = 1.667. With T(4, 1) = 0.08 s,
    T(4, 4) = 0.11 s, D0 = 0.004 s: predicted = 2.5 * 0.08 / 0.114 = 1.754 (+5.3 %); the plain
    server's forward is 0.08 s per step, 1.0x the profile.
    """
    rows: list[dict[str, Any]] = []
    plain = {(r.kind, r.rate, r.repeat): r for r in results if r.config == "plain"}
    for r in results:
        base = plain.get((r.kind, r.rate, r.repeat))
        if r.config == "plain" or base is None:
            continue
        for bucket, st in sorted(r.steps.items(), key=lambda kv: int(kv[0])):
            pl = base.steps.get(bucket)
            if (pl is None or min(st["steps"], pl["steps"]) < min_steps or not st.get("drafted")
                    or not st.get("emitted") or not pl.get("emitted")):
                continue
            b, b_plain = st["seqs"] / st["steps"], pl["seqs"] / pl["steps"]
            e, d = st["emitted"] / st["seqs"], st["drafted"] / st["seqs"]
            t1, tq, d0 = profile.verify(b, 1), profile.verify(b, 1.0 + d), profile.d0(None, b)
            rows.append({
                "config": r.config, "kind": r.kind, "rate": r.rate, "repeat": r.repeat, "bucket": int(bucket),
                "steps": int(st["steps"]),
                "mean_batch": b, "tokens_per_seq_step": e, "drafted_per_seq_step": d,
                "measured": (pl["total"] / pl["emitted"]) / (st["total"] / st["emitted"]),
                "predicted": e * t1 / (tq + d0),
                "forward_vs_profile": (st["forward"] / st["steps"]) / tq,
                "plain_forward_vs_profile": (pl["forward"] / pl["steps"]) / profile.verify(b_plain, 1),
                "draft_ms": 1000.0 * st["draft"] / st["steps"], "d0_ms": 1000.0 * d0,
                "other_share": st["other"] / st["total"] if st["total"] else 0.0,
                "step_ms": 1000.0 * st["total"] / st["steps"]})
    return rows
