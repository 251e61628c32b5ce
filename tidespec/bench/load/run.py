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

This module runs the servers, scrapes their metrics and holds the CLI; the settings and a run's
result are in ``bench.load.config``, the verdict and model check in ``bench.load.analysis``,
the README and plots in ``bench.load.report``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tidespec.bench.common.report import command_line, default_out_dir, finish_run
from tidespec.bench.load.analysis import model_check, verdict
from tidespec.bench.load.config import DYNAMIC_TRACE, ConfigName, LoadBenchConfig, RunResult, server_args
from tidespec.bench.load.report import plot_run, render_run, report
from tidespec.bench.serve.run import arrival_times, free_port, launch_server, run_load, stop_server, summarize
from tidespec.config import ConfigError, finite_float, output_dir
from tidespec.speculative.policy.speedup import Profile
from tidespec.workloads.loader import BUILTIN_WORKLOADS, load_workload


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

    from tidespec.config import ModelConfig, SpecConfig
    from tidespec.llm import build_drafter, load_target
    from tidespec.speculative.policy.profiler import ProfilerConfig, load_or_measure

    torch.set_num_threads(cfg.threads)
    spec = SpecConfig(drafter=cfg.drafter, num_speculative_tokens=cfg.gamma_max)
    # no policy needs building here (several drafters would refuse the static one): only the drafter
    model = load_target(ModelConfig(model=cfg.model, threads=cfg.threads)).model
    max_len = min(2048, model.cfg.max_position_embeddings)
    drafter = build_drafter(spec, model, cfg.max_num_seqs, max_len)
    prof, _ = load_or_measure(model, drafter, ProfilerConfig().fitted(max_len, cfg.max_num_seqs),
                              progress=lambda m: print(m, file=sys.stderr))
    path = out_dir / "profile.json"
    prof.save(path)
    return str(path)


def _online_root(cfg: LoadBenchConfig, name: str, root: Path) -> str | None:
    """A fresh publish root for a configuration that trains online (None for the others), seeded
    with ``cfg.eagle3_dir``'s drafter as version 1 when given (else the server starts a fresh head)."""
    if not ConfigName.parse(name, cfg.drafter).online:
        return None
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    if cfg.eagle3_dir:
        from tidespec.bench.shift.runs import seed_publish_root
        from tidespec.config import ModelConfig
        from tidespec.llm import load_target

        seed_publish_root(root, cfg.eagle3_dir, load_target(ModelConfig(model=cfg.model)).model)
    return str(root)


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
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        what = f"round {rep + 1}/{cfg.repeats}, " if cfg.repeats > 1 else ""
        tag = name.replace(":", "-").replace("+", "-") + ("" if cfg.repeats == 1 else f"-r{rep + 1}")
        root = _online_root(cfg, name, out_dir / f"eagle3-{tag}")
        args = server_args(name, cfg, root)
        print(f"[{what}{ci + 1}/{len(cfg.configs)}] {name}: tidespec serve {args}", file=sys.stderr)
        proc = launch_server(args, port, None, 600.0, out_dir / f"server-{tag}.log")
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
    doc: dict[str, Any] = {"config": asdict(cfg), "results": [asdict(r) for r in results],
                           "profile": profile.to_dict()}
    doc["model_check"] = model_check(results, profile, cfg.min_steps)
    doc["verdict"] = verdict(results, cfg, doc["model_check"])
    finish_run(out_dir, "load", doc, command, "float32", lambda d: report(d, command),
               lambda d, o: plot_run(d, results, cfg, o), print)
    print(f"wrote {out_dir}/bench_load.json, README.md and plots", file=sys.stderr)
    return doc


# ----------------------------------------------------------------------------- CLI
def add_args(p: argparse.ArgumentParser) -> None:
    d = LoadBenchConfig()
    p.add_argument("--workload", default=d.workload,
                   help="JSONL path, or a built-in name (" + ", ".join(BUILTIN_WORKLOADS) + ")")
    p.add_argument("--model", default=None, help="checkpoint for every server (default: the embedded model)")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in d.rates), help="arrival rates, req/s, comma-separated")
    p.add_argument("--duration", type=finite_float, default=d.duration, help="seconds of arrivals per rate")
    p.add_argument("--trace", default="dynamic",
                   help="rate trace for the dynamic run: 'dynamic' (built in), 'none', or a CSV/JSONL of (time_s, rate)")
    p.add_argument("--configs", default=",".join(d.configs),
                   help="plain, static-G, analytic, bandit, hybrid; each optionally DRAFTERS: first (suffix+eagle3:"
                        "analytic) and :online last (EAGLE-3 training online while it serves)")
    p.add_argument("--drafter", default=d.drafter, help="drafter(s) of the speculating configurations that name "
                                                        "none (e.g. suffix,eagle3: the profile prices each)")
    p.add_argument("--eagle3-dir", default=None, help="EAGLE-3 checkpoint or publish root for configurations with "
                                                      "eagle3 (and the starting drafter of ...:online ones)")
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
    p.add_argument("--out", type=output_dir, default=None, help="output directory (default: runs/bench-load-<time>)")
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
    render_run(doc, results, cfg, out_dir)
    return doc


def run(ns: argparse.Namespace) -> int:
    from tidespec.bench.serve.run import load_rate_trace

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
                          eagle3_dir=ns.eagle3_dir,
                          gamma_max=ns.gamma_max, max_tokens=ns.max_tokens, max_num_seqs=ns.max_num_seqs,
                          threads=ns.threads, seed=ns.seed, profile=ns.profile, extra_server_args=ns.server_args,
                          fresh_prompts=ns.fresh_prompts, min_steps=ns.min_steps, repeats=ns.repeats)
    run_load_bench(cfg, ns.out, command_line())
    return 0
