"""``tidespec bench load``: speculation policies under load, through the real server.

Why this exists: the adaptive policies (``analytic``, ``bandit``, ``hybrid``) only earn their
keep if, at every load, they match the best fixed setting for that load — and beat every fixed
setting when the load changes. This drives ``tidespec serve`` (one subprocess per configuration)
with the open-loop client of ``tidespec bench serve`` and compares, per configuration:

* a static-load sweep: Poisson arrivals at each ``--rates`` value for ``--duration`` seconds,
  from idle to saturation (rates in ascending order on one server, as a deployment sees load
  grow; adaptive policies keep what they learned);
* a dynamic-rate trace (low -> high -> low with bursts, like Nightjar's Figure 9) on a fresh
  server: throughput and latency over time;
* the analytic model against reality (TIDE Figure 8, ``model_check``): every server counts its
  decode-only steps per batch-size bucket (time by part, tokens; ``tidespec.server.metrics``), scraped
  before and after each run; a speculating run's seconds per token in a bucket over the plain
  run's at the same load is the measured speedup, set against eq. 5 from the profile (measured
  once at the start, ``--profile`` to reuse one), with where the step time went.

Prompts: with ``--fresh-prompts`` (default) each server walks one shuffled pass of the workload
across its runs, so no prompt is sent twice while the workload lasts (a repeated prompt lets
the suffix drafter replay its earlier output and inflates acceptance); every server sees the same
prompts in the same order.

Configurations (``--configs``): ``plain`` (no drafter), ``static-G`` (the drafter at fixed
gamma G), and ``analytic`` / ``bandit`` / ``hybrid`` (the drafter with gamma_max
``--gamma-max``). Throughput is output tokens per second over the span from the first send to
the last completion; latency is end-to-end per request.

Worked example of the verdict: at rate 1.2 req/s plain makes 60 tok/s, static-2 57, hybrid 59:
best static = 60 (plain), best adaptive = 59, ratio 0.983 >= 0.97 -> holds.

Outputs in ``--out``: ``bench_load.json`` (every summary and per-request record), ``README.md``
(tables), ``sweep.png`` (throughput, mean and p99 latency vs rate), ``trace.png`` (throughput
and latency over time per configuration), ``speedup.png`` (predicted vs measured per bucket).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tidespec.bench.report import (
    command_line,
    default_out_dir,
    machine_info,
    machine_line,
    markdown_table,
    new_figure,
    save_figure,
    write_json,
    write_text,
)
from tidespec.bench.serve import (
    RequestRecord,
    _free_port,
    arrival_times,
    launch_server,
    run_load,
    stop_server,
    summarize,
)
from tidespec.config import POLICIES, ConfigError
from tidespec.speculative.policy.speedup import Profile
from tidespec.workloads.loader import load_workload

ADAPTIVE = ("analytic", "bandit", "hybrid")
# (start second, req/s): idle, a ramp to saturation, a burst, back to idle (Nightjar Fig. 9's shape)
DYNAMIC_TRACE: tuple[tuple[float, float], ...] = (
    (0.0, 0.1), (15.0, 0.5), (30.0, 1.5), (45.0, 0.1), (55.0, 3.0), (58.0, 0.1), (70.0, 0.0))


@dataclass
class LoadBenchConfig:
    workload: str = "code"
    model: str | None = None  # checkpoint for every server (None: the embedded model)
    rates: tuple[float, ...] = (0.1, 0.4, 1.5)
    duration: float = 25.0  # seconds of arrivals per rate
    trace: tuple[tuple[float, float], ...] | None = DYNAMIC_TRACE  # None: no trace run
    configs: tuple[str, ...] = ("plain", "static-1", "static-2", "static-3", "static-4", "static-5", *ADAPTIVE)
    drafter: str = "suffix"
    gamma_max: int = 5
    max_tokens: int = 64
    max_num_seqs: int = 16
    threads: int = 2
    max_concurrency: int = 64
    timeout: float = 300.0
    seed: int = 0
    profile: str | None = None  # profile JSON; None: measure once into the output directory
    extra_server_args: str = ""
    fresh_prompts: bool = True  # each server walks one shuffled pass of the workload: no prompt is sent twice
    min_steps: int = 20  # model check: buckets with fewer decode steps (either server) are left out
    repeats: int = 1  # rounds over all configurations (fresh servers each); the verdict uses the means

    def __post_init__(self) -> None:
        if not self.rates or any(not (r > 0 and math.isfinite(r)) for r in self.rates):
            raise ConfigError(f"rates must be finite and > 0, got {self.rates}")
        self.rates = tuple(sorted(self.rates))
        if self.duration <= 0:
            raise ConfigError(f"duration must be > 0, got {self.duration}")
        if not self.configs:
            raise ConfigError("configs must not be empty")
        for name in self.configs:
            server_args(name, self)  # raises on an unknown name
        if not 1 <= self.gamma_max <= 16:
            raise ConfigError(f"gamma_max must be in [1, 16], got {self.gamma_max}")
        if self.drafter == "none":
            raise ConfigError("drafter must be a real drafter (plain decoding is the 'plain' configuration)")
        if self.max_tokens < 1 or self.max_num_seqs < 1 or self.max_concurrency < 1:
            raise ConfigError("max_tokens, max_num_seqs and max_concurrency must be >= 1")
        if self.min_steps < 1 or self.repeats < 1:
            raise ConfigError(f"min_steps and repeats must be >= 1, got {self.min_steps}, {self.repeats}")


def server_args(name: str, cfg: LoadBenchConfig) -> str:
    """Engine flags of configuration ``name``: ``plain``, ``static-G`` or an adaptive policy.

    Example: ``server_args("static-3", LoadBenchConfig())`` ->
    ``"--drafter suffix --policy static --num-speculative-tokens 3"`` (+ the common flags).
    """
    if name == "plain":
        spec = "--drafter none"
    elif name.startswith("static-"):
        try:
            gamma = int(name.removeprefix("static-"))
        except ValueError:
            raise ConfigError(f"bad configuration {name!r}: static-G needs an integer G") from None
        if not 1 <= gamma <= 16:
            raise ConfigError(f"bad configuration {name!r}: G must be in [1, 16]")
        spec = f"--drafter {cfg.drafter} --policy static --num-speculative-tokens {gamma}"
    elif name in POLICIES and name != "static":
        spec = f"--drafter {cfg.drafter} --policy {name} --num-speculative-tokens {cfg.gamma_max}"
    else:
        raise ConfigError(f"unknown configuration {name!r}; use plain, static-G or one of {', '.join(ADAPTIVE)}")
    common = f"--threads {cfg.threads} --max-num-seqs {cfg.max_num_seqs} --max-waiting 1024"
    profile = f" --profile {shlex.quote(cfg.profile)}" if cfg.profile else ""
    model = f" --model {shlex.quote(cfg.model)}" if cfg.model else ""
    extra = f" {cfg.extra_server_args}" if cfg.extra_server_args else ""
    return f"{spec} {common}{model}{profile}{extra}"


@dataclass
class RunResult:
    config: str
    kind: str  # "rate" or "trace"
    rate: float | None
    summary: dict[str, Any]
    speedup: dict[str, dict[str, float]] = field(default_factory=dict)  # bucket -> {measured, predicted, gamma}
    records: list[dict[str, Any]] = field(default_factory=list)
    steps: dict[str, dict[str, float]] = field(default_factory=dict)  # bucket -> decode-step counters of this run
    repeat: int = 0  # which round over the configurations (--repeats)
    policy: dict[str, float] = field(default_factory=dict)  # the policy's stats() at the end of the run


def _client_ns(cfg: LoadBenchConfig, offset: int = 0) -> argparse.Namespace:
    """The knobs ``bench.serve.run_load`` reads; ``offset``: where in the shuffled workload to start."""
    return argparse.Namespace(api_key=None, max_concurrency=cfg.max_concurrency, timeout=cfg.timeout, model=None,
                              shuffle=True, seed=cfg.seed, max_tokens=cfg.max_tokens, temperature=0.0,
                              spec_tokens=None, route_header=True, offset=offset)


# Prometheus series of the decode-step breakdown (tidespec.server.metrics) -> our short names
STEP_SERIES = {"tidespec:decode_steps_total": None, "tidespec:decode_step_seqs_total": None,
               "tidespec:decode_step_seconds_total": "part", "tidespec:decode_step_tokens_total": "kind"}


def scrape_steps(base_url: str) -> dict[str, dict[str, float]]:
    """Per bucket: ``steps``, ``seqs`` (sum of batch sizes), seconds ``total`` / ``forward`` /
    ``draft`` / ``other``, tokens ``emitted`` / ``drafted`` — cumulative since the server started."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name not in STEP_SERIES or "bucket" not in s.labels:
                continue
            label = STEP_SERIES[s.name]
            key = s.labels[label] if label else ("steps" if s.name == "tidespec:decode_steps_total" else "seqs")
            out.setdefault(s.labels["bucket"], {})[key] = float(s.value)
    return out


def diff_steps(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """``after - before`` per bucket and counter; buckets with no new steps are dropped.

    Example: after {"4": {"steps": 10, "total": 2.0}}, before {"4": {"steps": 4, "total": 0.5}}
    -> {"4": {"steps": 6, "total": 1.5}}.
    """
    out = {}
    for bucket, cur in after.items():
        prev = before.get(bucket, {})
        d = {k: v - prev.get(k, 0.0) for k, v in cur.items()}
        if d.get("steps", 0.0) > 0:
            out[bucket] = d
    return out


def scrape_speedup(base_url: str) -> dict[str, dict[str, float]]:
    """Per-bucket measured/predicted speedup and last gamma from the server's ``/metrics``."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out: dict[str, dict[str, float]] = {}
    names = {"tidespec:spec_policy_measured_speedup": "measured",
             "tidespec:spec_policy_predicted_speedup": "predicted", "tidespec:spec_policy_gamma": "gamma"}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in names and "bucket" in s.labels:
                out.setdefault(s.labels["bucket"], {})[names[s.name]] = float(s.value)
    return out


def scrape_policy(base_url: str) -> dict[str, float]:
    """The policy's own statistics (``spec_policy_stat{stat}``: per-bucket gamma, alpha, rho, ...)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {s.labels["stat"]: float(s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "tidespec:spec_policy_stat" and "stat" in s.labels}


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


def _run(base_url: str, items: list[Any], arrivals: list[float], cfg: LoadBenchConfig,
         name: str, kind: str, rate: float | None, offset: int, repeat: int) -> RunResult:
    before = scrape_steps(base_url)
    records, wall_s, _ = asyncio.run(run_load(_client_ns(cfg, offset), base_url, items, arrivals))
    summary = summarize(records, wall_s)
    return RunResult(name, kind, rate, summary, scrape_speedup(base_url), [asdict(r) for r in records],
                     diff_steps(scrape_steps(base_url), before), repeat, scrape_policy(base_url))


def _line(r: RunResult) -> str:
    s = r.summary
    what = f"rate {r.rate:g}" if r.rate is not None else "trace"
    mean = s["e2e_s"]["mean"]
    name = r.config if not r.repeat else f"{r.config} #{r.repeat + 1}"
    return (f"[{name:>9s} {what:>9s}] {s['completed']}/{s['num_requests']} ok, "
            f"{s['output_tok_per_s']:.1f} tok/s, e2e mean {mean if mean is None else round(mean, 2)} s")


def ensure_profile(cfg: LoadBenchConfig, out_dir: Path) -> str:
    """Path of the profile every server loads: ``cfg.profile`` or one measured now (cached)."""
    if cfg.profile:
        return cfg.profile
    import torch

    from tidespec.config import EngineConfig, ModelConfig, SpecConfig
    from tidespec.llm import build_engine
    from tidespec.speculative.policy.profiler import load_or_measure

    torch.set_num_threads(cfg.threads)
    engine = build_engine(EngineConfig(model=ModelConfig(model=cfg.model, threads=cfg.threads),
                                       spec=SpecConfig(drafter=cfg.drafter, num_speculative_tokens=cfg.gamma_max)))
    prof, _ = load_or_measure(engine.model, engine.drafter, progress=lambda m: print(m, file=sys.stderr))
    path = out_dir / "profile.json"
    prof.save(path)
    return str(path)


def run_load_bench(cfg: LoadBenchConfig, out_dir: Path | None = None, command: str = "") -> dict[str, Any]:
    """Run every configuration (trace first on a fresh server, then the rate sweep); with
    ``cfg.repeats`` > 1, round after round over all configurations (ABAB..., so a slow spell of
    the machine hits every configuration alike)."""
    out_dir = out_dir or default_out_dir("load")
    out_dir.mkdir(parents=True, exist_ok=True)
    items = load_workload(cfg.workload)
    cfg.profile = ensure_profile(cfg, out_dir)
    results: list[RunResult] = []
    t_start = time.perf_counter()
    rounds = [(rep, ci, name) for rep in range(cfg.repeats) for ci, name in enumerate(cfg.configs)]
    for rep, ci, name in rounds:
        port = _free_port()
        base_url = f"http://127.0.0.1:{port}"
        what = f"round {rep + 1}/{cfg.repeats}, " if cfg.repeats > 1 else ""
        print(f"[{what}{ci + 1}/{len(cfg.configs)}] {name}: tidespec serve {server_args(name, cfg)}", file=sys.stderr)
        log = out_dir / (f"server-{name}.log" if cfg.repeats == 1 else f"server-{name}-r{rep + 1}.log")
        proc = launch_server(server_args(name, cfg), port, None, 600.0, log)
        try:
            warm = arrival_times([(0.0, math.inf)], 2, None, random.Random(0))
            asyncio.run(run_load(_client_ns(cfg), base_url, items, warm))  # first-request costs out of the way
            offset = len(warm) if cfg.fresh_prompts else 0  # every server gets the same prompts in the same order
            if cfg.trace is not None:
                arrivals = arrival_times(list(cfg.trace), 100_000, None, random.Random(cfg.seed))
                results.append(_run(base_url, items, arrivals, cfg, name, "trace", None, offset, rep))
                offset += len(arrivals) if cfg.fresh_prompts else 0
                print(_line(results[-1]), file=sys.stderr)
            for rate in cfg.rates:
                arrivals = arrival_times([(0.0, rate)], 100_000, cfg.duration, random.Random(cfg.seed + 1))
                results.append(_run(base_url, items, arrivals, cfg, name, "rate", rate, offset, rep))
                offset += len(arrivals) if cfg.fresh_prompts else 0
                print(_line(results[-1]) + f"  ({time.perf_counter() - t_start:.0f} s so far)", file=sys.stderr)
            if cfg.fresh_prompts and offset > len(items):
                print(f"note: {offset} requests on {len(items)} prompts: {offset - len(items)} prompts were sent twice "
                      "(a larger workload avoids repeats)", file=sys.stderr)
        finally:
            stop_server(proc)
    profile = Profile.load(cfg.profile)
    doc = {"config": asdict(cfg), "machine": machine_info("float32"), "command": command,
           "results": [asdict(r) for r in results], "profile": profile.to_dict()}
    doc["model_check"] = model_check(results, profile, cfg.min_steps)
    doc["verdict"] = verdict(results, cfg, doc["model_check"])
    write_json(out_dir, "bench_load.json", {k: v for k, v in doc.items() if k not in ("command", "machine")},
               command, doc["machine"])
    print(_render(doc, results, cfg, out_dir))
    print(f"wrote {out_dir}/bench_load.json, README.md and plots", file=sys.stderr)
    return doc


# ----------------------------------------------------------------------------- analysis
def _tput(r: RunResult) -> float:
    return float(r.summary["output_tok_per_s"])


def _mean_e2e(r: RunResult) -> float:
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
        summary["tok_s_runs"] = [_tput(r) for r in rs]
        summary["output_tok_per_s"] = float(np.mean(summary["tok_s_runs"]))
        summary["e2e_s"] = {**summary["e2e_s"], "mean": float(np.mean([_mean_e2e(r) for r in rs]))}
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
        static = [r for r in at if r.config not in ADAPTIVE]
        adaptive = [r for r in at if r.config in ADAPTIVE]
        if not static or not adaptive:
            continue
        bs, ba = max(static, key=_tput), max(adaptive, key=_tput)
        row = {"rate": rate, "best_static": bs.config, "best_static_tok_s": _tput(bs), "best_adaptive": ba.config,
               "best_adaptive_tok_s": _tput(ba), "ratio": _tput(ba) / _tput(bs) if _tput(bs) else None,
               "best_static_runs": bs.summary["tok_s_runs"], "best_adaptive_runs": ba.summary["tok_s_runs"]}
        plain = next((r for r in at if r.config == "plain"), None)
        if plain is not None and _tput(plain):
            row["adaptive_over_plain"] = _tput(ba) / _tput(plain)
        out["per_rate"].append(row)
    trace = [r for r in results if r.kind == "trace"]
    static = [r for r in trace if r.config not in ADAPTIVE]
    adaptive = [r for r in trace if r.config in ADAPTIVE]
    if static and adaptive:
        bs, ba = max(static, key=_tput), max(adaptive, key=_tput)
        fastest = min(static, key=_mean_e2e)
        out["trace"] = {"best_static": bs.config, "best_static_tok_s": _tput(bs), "best_adaptive": ba.config,
                        "best_adaptive_tok_s": _tput(ba), "throughput_margin": _tput(ba) / _tput(bs) - 1.0,
                        "lowest_latency_static": fastest.config, "static_mean_e2e_s": _mean_e2e(fastest),
                        "adaptive_mean_e2e_s": _mean_e2e(ba),
                        "latency_margin": 1.0 - _mean_e2e(ba) / _mean_e2e(fastest)}
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
            if x["kind"] == "trace" and x.get("repeat", 0) == rep and x["config"] not in ADAPTIVE:
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
            t1, tq, d0 = profile.verify(b, 1), profile.verify(b, 1.0 + d), profile.d0()
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
    states = [r for r in results if r.policy and r.config in ADAPTIVE]
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
        style = "-" if name in ADAPTIVE else "--"
        xs = [r.rate for r in rs]
        axes[0].plot(xs, [_tput(r) for r in rs], style, marker="o", label=name)
        axes[1].plot(xs, [_mean_e2e(r) for r in rs], style, marker="o", label=name)
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
        style = "-" if name in ADAPTIVE else "--"
        axes[0].plot(edges[:-1] + bin_s / 2, toks, style, label=name)
        axes[1].scatter([x.start_s for x in ok], [x.e2e_s for x in ok], s=8, label=name,
                        marker="o" if name in ADAPTIVE else "x")
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


# ----------------------------------------------------------------------------- CLI
def add_args(p: argparse.ArgumentParser) -> None:
    d = LoadBenchConfig()
    p.add_argument("--workload", default=d.workload, help="JSONL path, or a built-in name: code, chat")
    p.add_argument("--model", default=None, help="checkpoint for every server (default: the embedded model)")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in d.rates), help="arrival rates, req/s, comma-separated")
    p.add_argument("--duration", type=float, default=d.duration, help="seconds of arrivals per rate")
    p.add_argument("--trace", default="dynamic",
                   help="rate trace for the dynamic run: 'dynamic' (built in), 'none', or a CSV/JSONL of (time_s, rate)")
    p.add_argument("--configs", default=",".join(d.configs), help="plain, static-G, analytic, bandit, hybrid")
    p.add_argument("--drafter", default=d.drafter, help="drafter of the speculating configurations")
    p.add_argument("--gamma-max", type=int, default=d.gamma_max, help="gamma_max of the adaptive policies")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="max_tokens of every request")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="server's batch limit")
    p.add_argument("--threads", type=int, default=d.threads, help="server's torch threads")
    p.add_argument("--seed", type=int, default=d.seed, help="arrival/shuffle seed")
    p.add_argument("--profile", default=None, help="profile JSON every server loads (default: measured once)")
    p.add_argument("--server-args", default="", help="extra engine flags for every server")
    p.add_argument("--fresh-prompts", action=argparse.BooleanOptionalAction, default=d.fresh_prompts,
                   help="each server walks one shuffled pass of the workload (no prompt twice while it lasts); "
                        "--no-fresh-prompts restarts the shuffled order at every run")
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="rounds over all configurations, each on fresh servers; the verdict compares means")
    p.add_argument("--min-steps", type=int, default=d.min_steps,
                   help="model check: leave out buckets with fewer decode steps than this")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: runs/bench-load-<time>)")
    p.add_argument("--replot", type=Path, default=None, metavar="DIR",
                   help="only re-render README.md and the plots of an earlier run in DIR")


def replot(out_dir: Path) -> dict[str, Any]:
    """Re-render README.md and the plots of an earlier run from its ``bench_load.json``."""
    path = out_dir / "bench_load.json"
    if not path.is_file():
        raise ConfigError(f"no bench_load.json in {out_dir}")
    doc = json.loads(path.read_text(encoding="utf-8"))
    c = doc["config"]
    cfg = LoadBenchConfig(**{**c, "rates": tuple(c["rates"]), "configs": tuple(c["configs"]),
                             "trace": None if c["trace"] is None else tuple(tuple(x) for x in c["trace"])})
    results = [RunResult(**r) for r in doc["results"]]
    profile = Profile.from_dict(doc["profile"]) if doc.get("profile") else None
    doc["model_check"] = model_check(results, profile, cfg.min_steps)
    doc["verdict"] = verdict(results, cfg, doc["model_check"]) if profile is not None else []
    _render(doc, results, cfg, out_dir)
    return doc


def _render(doc: dict[str, Any], results: list[RunResult], cfg: LoadBenchConfig, out_dir: Path) -> str:
    """Write README.md and the plots of one run; returns the README text."""
    text = report(doc, doc.get("command", ""))
    write_text(out_dir, "README.md", text)
    plot_sweep(results, cfg, out_dir)
    if cfg.trace is not None:
        plot_trace(results, cfg, out_dir)
    plot_speedup(doc.get("model_check", []), out_dir)
    return text


def run(ns: argparse.Namespace) -> int:
    from tidespec.bench.serve import load_rate_trace

    if ns.replot is not None:
        replot(ns.replot)
        print(f"re-rendered {ns.replot}/README.md and plots", file=sys.stderr)
        return 0

    if ns.trace == "none":
        trace = None
    elif ns.trace == "dynamic":
        trace = DYNAMIC_TRACE
    else:
        trace = tuple(load_rate_trace(ns.trace))
    try:
        rates = tuple(float(x) for x in ns.rates.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--rates must be comma-separated numbers, got {ns.rates!r}") from None
    cfg = LoadBenchConfig(workload=ns.workload, model=ns.model, rates=rates, duration=ns.duration, trace=trace,
                          configs=tuple(x.strip() for x in ns.configs.split(",") if x.strip()), drafter=ns.drafter,
                          gamma_max=ns.gamma_max, max_tokens=ns.max_tokens, max_num_seqs=ns.max_num_seqs,
                          threads=ns.threads, seed=ns.seed, profile=ns.profile, extra_server_args=ns.server_args,
                          fresh_prompts=ns.fresh_prompts, min_steps=ns.min_steps, repeats=ns.repeats)
    run_load_bench(cfg, ns.out, command_line())
    return 0
