"""``tidespec bench load``'s report: README.md tables, and the sweep, trace and speedup plots.

Why this exists: a run is expensive and its ``bench_load.json`` holds everything measured, so
the rendering is kept apart from the running: ``bench.load.run`` renders after the runs, and
``--replot`` (``render_run``) again from an earlier run's JSON alone.

Outputs: ``README.md`` (per-run table, policy state, verdict per rate, trace margins, model
check), ``sweep.png`` (throughput, mean and p99 latency vs rate), ``trace.png`` (throughput and
latency over time per configuration), ``speedup.png`` (predicted vs measured per bucket).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from tidespec.bench.common.report import machine_line, markdown_table, new_figure, save_figure, write_text
from tidespec.bench.load.analysis import averaged, forward_vs_profile, mean_e2e, throughput
from tidespec.bench.load.config import LoadBenchConfig, RunResult, is_adaptive
from tidespec.bench.serve.run import RequestRecord
from tidespec.speculative.policy.speedup import Profile


def report(doc: dict[str, Any], command: str) -> str:
    """Markdown: sweep table, trace table, verdict, model check."""
    results = [RunResult(**r) for r in doc["results"]]
    lines = [f"Command: `{command}`", "", f"Machine: {machine_line(doc['machine'])}", ""]
    rows = []
    rounds = max((r.repeat for r in results), default=0) > 0

    def label(config: str, repeat: int) -> str:
        return f"{config} #{repeat + 1}" if rounds else config

    profile = Profile.from_dict(doc["profile"]) if doc.get("profile") else None
    for r in results:
        s = r.summary
        drift = forward_vs_profile(r.steps, profile) if profile is not None else None
        rows.append([label(r.config, r.repeat), "trace" if r.kind == "trace" else f"{r.rate:g}",
                     f"{s['completed']}/{s['num_requests']}",
                     s["output_tok_per_s"], _ms(s["e2e_s"]["mean"]), _ms(s["e2e_s"]["p99"]),
                     _ms(s["ttft_s"]["mean"]), _ms(s["tpot_s"]["mean"]), f"{s['acceptance_rate']:.2f}",
                     "-" if drift is None else f"{drift:.2f}"])
    lines.append(markdown_table(["config", "rate req/s", "ok", "tok/s", "e2e mean ms", "e2e p99 ms",
                                 "TTFT mean ms", "TPOT mean ms", "acc. rate", "fwd/profile"], rows))
    lines += ["", "fwd/profile: the run's target forwards against the profile's T(b, 1 + drafted) "
              "(`forward_vs_profile`); runs doing the same work at different values saw the machine at different "
              "speeds."]
    states = [r for r in results if r.policy and is_adaptive(r.config)]
    if states:
        lines += ["", "Policy state at the end of each run (per batch-size bucket: gamma chosen last, "
                  "alpha and rho estimated; `spec_policy_stat`):", ""]
        lines.append(markdown_table(["config", "rate", "buckets: gamma / alpha / rho"], [
            [label(r.config, r.repeat), "trace" if r.kind == "trace" else f"{r.rate:g}", policy_state(r.policy)]
            for r in states]))
    v = doc["verdict"]
    lines += ["", "Verdict per rate (best adaptive vs best static; at the top rate also vs plain):", ""]
    lines.append(markdown_table(["rate", "best static", "tok/s", "best adaptive", "tok/s", "ratio", "adaptive/plain"],
                                [[f"{x['rate']:g}", x["best_static"],
                                  _runs(x["best_static_tok_s"], x.get("best_static_runs")),
                                  x["best_adaptive"], _runs(x["best_adaptive_tok_s"], x.get("best_adaptive_runs")),
                                  _r(x["ratio"]), _r(x.get("adaptive_over_plain"))]
                                 for x in v["per_rate"]]))
    if "trace" in v:
        t = v["trace"]
        lines += ["", f"Trace: best adaptive {t['best_adaptive']} {t['best_adaptive_tok_s']:.1f} tok/s vs best static "
                  f"{t['best_static']} {t['best_static_tok_s']:.1f} tok/s (margin {t['throughput_margin']:+.1%}); "
                  f"mean e2e {t['adaptive_mean_e2e_s']:.2f} s vs lowest static {t['lowest_latency_static']} "
                  f"{t['static_mean_e2e_s']:.2f} s (margin {t['latency_margin']:+.1%})."]
        for h in t.get("headroom", []):
            lines.append(f"Headroom, round {h['repeat'] + 1} (`trace_headroom`, decode-only time): the best static "
                         f"gamma per batch-size bucket would run {h['oracle_over_plain']:.3f}x plain, the best single "
                         f"static ({h['best_static']}) {h['best_static_over_plain']:.3f}x.")
    checks = doc.get("model_check", [])
    if checks:
        e = v["model_abs_error"]
        lines += ["", "Analytic model (eq. 5 from the profile, at the measured tokens per step) vs measured speedup "
                  "over the plain server at the same load, per batch-size bucket (TIDE Fig. 8; `model_check`): "
                  f"median |error| {_pct(e['median'])}, max {_pct(e['max'])}, {e['within_15pct']}/{e['n']} "
                  "within 15 %.", ""]
        lines.append(markdown_table(
            ["config", "rate", "bucket", "mean b", "tok/seq-step", "measured", "predicted", "error", "fwd/profile",
             "plain fwd/profile", "draft ms", "D0 ms", "other share"],
            [[label(x["config"], x.get("repeat", 0)), "trace" if x["kind"] == "trace" else f"{x['rate']:g}",
              x["bucket"],
              f"{x['mean_batch']:.1f}",
              f"{x['tokens_per_seq_step']:.2f}", _r(x["measured"]), _r(x["predicted"]),
              _pct(x["predicted"] / x["measured"] - 1.0), f"{x['forward_vs_profile']:.2f}",
              f"{x['plain_forward_vs_profile']:.2f}", f"{x['draft_ms']:.1f}", f"{x['d0_ms']:.2f}",
              f"{x['other_share']:.1%}"] for x in checks]))
    return "\n".join(lines) + "\n"


def policy_state(stats: dict[str, float]) -> str:
    """``b1: 4 / 0.45 / 0.62, b16: 0 / 0.40 / 0.55`` from a policy's stats (buckets it planned for).

    Example: {"gamma_b1": 4, "alpha_b1": 0.451, "rho_b1": 0.62} -> ``b1: 4 / 0.45 / 0.62``."""
    buckets = sorted({int(k[len(p):]) for k in stats for p in ("gamma_b", "alpha_b") if k.startswith(p)})
    parts = []
    for b in buckets:
        vals = [stats.get(f"{name}_b{b}") for name in ("gamma", "alpha", "rho")]
        parts.append(f"b{b}: " + " / ".join("-" if v is None else (f"{v:.0f}" if i == 0 else f"{v:.2f}")
                                            for i, v in enumerate(vals)))
    return ", ".join(parts) if parts else "-"


def _runs(mean: float, runs: list[float] | None) -> str:
    """``32.0`` or, over several rounds, ``32.0 (30.0, 34.0)``."""
    if not runs or len(runs) < 2:
        return f"{mean:.1f}"
    return f"{mean:.1f} ({', '.join(f'{x:.1f}' for x in runs)})"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _r(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1%}"


# ----------------------------------------------------------------------------- plots
def plot_sweep(results: list[RunResult], cfg: LoadBenchConfig, out_dir: Path) -> Path:
    fig, axes = new_figure(3)
    results = averaged(results)
    for name in cfg.configs:
        rs = sorted((r for r in results if r.kind == "rate" and r.config == name), key=lambda r: r.rate or 0.0)
        if not rs:
            continue
        style = "-" if is_adaptive(name) else "--"
        xs = [r.rate for r in rs]
        axes[0].plot(xs, [throughput(r) for r in rs], style, marker="o", label=name)
        axes[1].plot(xs, [mean_e2e(r) for r in rs], style, marker="o", label=name)
        axes[2].plot(xs, [r.summary["e2e_s"]["p99"] or math.nan for r in rs], style, marker="o", label=name)
    for ax, title in zip(axes, ("output tok/s", "mean e2e latency s", "p99 e2e latency s")):
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_title(title)
        ax.set_xscale("log")
    axes[0].legend(fontsize=7)
    return save_figure(fig, out_dir, "sweep.png")


def plot_trace(results: list[RunResult], cfg: LoadBenchConfig, out_dir: Path) -> Path:
    fig, axes = new_figure(2, width_per_col=6.5)
    trace = list(cfg.trace or ())
    end = max((t for t, _ in trace), default=1.0)
    bin_s = max(5.0, end / 20)
    for name in cfg.configs:
        r = next((x for x in results if x.kind == "trace" and x.config == name), None)
        if r is None:
            continue
        recs = [RequestRecord(**x) for x in r.records]
        ok = [x for x in recs if x.ok and x.e2e_s is not None]
        if not ok:
            continue
        span = max(x.start_s + (x.e2e_s or 0.0) for x in ok)
        edges = np.arange(0.0, span + bin_s, bin_s)
        times, weights = token_times(ok)
        toks = np.histogram(times, edges, weights=weights)[0] / bin_s
        style = "-" if is_adaptive(name) else "--"
        axes[0].plot(edges[:-1] + bin_s / 2, toks, style, label=name)
        axes[1].scatter([x.start_s for x in ok], [x.e2e_s for x in ok], s=8, label=name,
                        marker="o" if is_adaptive(name) else "x")
    ax2 = axes[0].twinx()
    ts = [t for t, _ in trace] + [end]
    ax2.step(ts, [r for _, r in trace] + [trace[-1][1] if trace else 0.0], where="post", color="grey", alpha=0.4)
    ax2.set_ylabel("offered req/s (grey)")
    axes[0].set_title("output tokens/s over time")
    axes[1].set_title("e2e latency by send time (s)")
    for ax in axes:
        ax.set_xlabel("time since start (s)")
    axes[0].legend(fontsize=7)
    return save_figure(fig, out_dir, "trace.png")


def token_times(records: list[RequestRecord]) -> tuple[list[float], list[float]]:
    """(chunk arrival times, tokens per chunk): a speculative step streams several tokens in one
    chunk, so each request's completion tokens are spread evenly over its chunks.

    Example: one request of 6 tokens in chunks at 1.0 and 2.0 s -> ([1.0, 2.0], [3.0, 3.0]).
    """
    times: list[float] = []
    weights: list[float] = []
    for r in records:
        if r.chunk_times_s:
            times += r.chunk_times_s
            weights += [r.completion_tokens / len(r.chunk_times_s)] * len(r.chunk_times_s)
    return times, weights


def plot_speedup(checks: list[dict[str, Any]], out_dir: Path) -> Path:
    """Predicted (eq. 5) vs measured speedup over the plain server, one point per (run, bucket)."""
    fig, axes = new_figure(1)
    if checks:
        m, p = [x["measured"] for x in checks], [x["predicted"] for x in checks]
        sc = axes[0].scatter(m, p, c=[math.log2(x["bucket"]) for x in checks], cmap="viridis")
        lo, hi = min(m + p) * 0.9, max(m + p) * 1.1
        axes[0].plot([lo, hi], [lo, hi], "k--", lw=1)
        axes[0].fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="grey", alpha=0.15)
        fig.colorbar(sc, ax=axes[0], label="log2 batch bucket")
    axes[0].set_xlabel("measured speedup over the plain server")
    axes[0].set_ylabel("predicted (eq. 5)")
    axes[0].set_title("analytic model vs measured (±15 % band)")
    return save_figure(fig, out_dir, "speedup.png")


def plot_run(doc: dict[str, Any], results: list[RunResult], cfg: LoadBenchConfig, out_dir: Path) -> None:
    """The plots of one run: ``sweep.png``, ``trace.png`` (with a trace run) and ``speedup.png``."""
    plot_sweep(results, cfg, out_dir)
    if cfg.trace is not None:
        plot_trace(results, cfg, out_dir)
    plot_speedup(doc.get("model_check", []), out_dir)


def render_run(doc: dict[str, Any], results: list[RunResult], cfg: LoadBenchConfig, out_dir: Path) -> str:
    """Write README.md and the plots of one run; returns the README text."""
    text = report(doc, doc.get("command", ""))
    write_text(out_dir, "README.md", text)
    plot_run(doc, results, cfg, out_dir)
    return text
