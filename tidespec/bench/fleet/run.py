"""``tidespec bench fleet``: does a fleet learn faster than as many servers that each learn alone?

Why this exists: TIDE's case for a fleet is that one trainer fed by every replica's traffic
gets a better drafter sooner than each server training on its own share. This benchmark runs the
same trace twice, with the same total trainer compute:

* ``fleet``: ``tidespec fleet --replicas R`` (one trainer with ``--trainer-threads`` threads,
  reading every replica's signals; each version goes to every replica);
* ``independent``: R ``tidespec serve`` processes, each with its own publish root, signal store and
  trainer child of ``--trainer-threads / R`` threads, never paused (``--trainer-share 1``, as the
  fleet's trainer is never paused either).

Both start from the same drafter (``--bootstrap``, published as v1 of every root, or a fresh head).
R client threads each send their share of the trace one request at a time: in ``fleet`` through
the ingress, in ``independent`` each to its own server. Per request it records the drafted and
accepted tokens (the response's ``usage``), the drafter version and the replica. Requests are
ordered by completion; "requests per replica" after the j-th is j / R. The report gives each
configuration's acceptance (accepted / drafted tokens) over a rolling window, and the requests per
replica until that window first reaches the recovered level (``--target``, default 90 % of the
best configuration's last-quarter acceptance). The servers run as processes (``--engine-args``
as for ``serve``), so this module never imports Ray.

Worked example::

    tidespec bench fleet --engine-args "--drafter eagle3 --threads 1" --workload code_unseen \\
        --requests-per-replica 32 --trainer-args "--min-signals 1024"
    # runs/bench-fleet-*/table.md: per configuration, versions published, acceptance first/last
    # quarter, requests per replica to the recovered level; plot.png: acceptance over requests
"""

from __future__ import annotations

import shlex
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tidespec.bench.common.report import command_line, machine_info, machine_line, markdown_table, save_report
from tidespec.bench.serve.run import free_port, launch_process, stop_server
from tidespec.config import ConfigError, Section, opt
from tidespec.workloads.loader import WorkloadRecord, load_workload

CONFIGS = ("fleet", "independent")
STOP_S = 90.0  # a fleet shuts Serve and its local Ray cluster down: longer than one server


@dataclass
class FleetBenchConfig(Section):
    engine_args: str = opt("--drafter eagle3 --threads 1 --max-num-seqs 4",
                           "engine flags of every replica and server (model, drafter, threads); the benchmark adds "
                           "--eagle3-dir, --online-training and the trainer's flags")
    bootstrap: str = opt("", "EAGLE-3 checkpoint published as v1 of every publish root (default: a fresh head)")
    workload: str = opt("code_unseen", "comma-separated workloads of the trace, in order (cycled when shorter)")
    replicas: int = opt(2, "replicas of the fleet = independent servers", min=2)
    requests_per_replica: int = opt(32, "requests each replica (each client thread) sends", min=4)
    max_tokens: int = opt(64, "tokens per request (EOS ignored)", min=1)
    trainer_threads: int = opt(2, "trainer compute of each configuration in all: the fleet's one trainer runs this "
                                  "many threads, each independent server's trainer this / --replicas (at least 1)",
                               min=1)
    trainer_args: str = opt("", "extra train-drafter flags of every trainer (e.g. --min-signals 1024)")
    window: int = opt(8, "requests per replica in the rolling acceptance", min=1)
    target: float = opt(0.0, "the recovered acceptance level; 0 = 90 %% of the best configuration's last-quarter "
                             "acceptance")
    configs: str = opt("fleet,independent", "configurations to run, in order")
    timeout_s: float = opt(600.0, "start-up and per-request limit in seconds")

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [c for c in self.config_names if c not in CONFIGS]
        if unknown or not self.config_names:
            raise ConfigError(f"configs must be among {', '.join(CONFIGS)}, got {self.configs!r}")
        if not 0.0 <= self.target <= 1.0:
            raise ConfigError(f"target must be in [0, 1], got {self.target}")
        for name in ("engine_args", "trainer_args"):
            try:
                shlex.split(getattr(self, name))
            except ValueError as exc:
                raise ConfigError(f"{name} is not a valid command-line fragment: {exc}") from None
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def config_names(self) -> list[str]:
        return [c.strip() for c in self.configs.split(",") if c.strip()]


@dataclass
class Request:
    """One request of the trace and what came back."""

    client: int
    index: int  # the client's k-th request
    prompt_id: str
    done_s: float = 0.0
    replica: str = ""
    version: int = -1
    draft_tokens: int = 0
    accepted_tokens: int = 0
    error: str | None = None


@dataclass
class Run:
    name: str
    requests: list[Request] = field(default_factory=list)
    wall_s: float = 0.0
    versions: int = 0  # versions published (besides the bootstrap)


def trace_items(cfg: FleetBenchConfig) -> list[list[WorkloadRecord]]:
    """The prompts of each client: record ``k * R + i`` of the concatenated workloads for client
    ``i``'s k-th request (cycled when the workloads are shorter than the trace)."""
    records = [r for name in cfg.workload.split(",") if name.strip() for r in load_workload(name.strip())]
    if not records:
        raise ConfigError(f"workload {cfg.workload!r} holds no records")
    n = cfg.replicas
    return [[records[(k * n + i) % len(records)] for k in range(cfg.requests_per_replica)] for i in range(n)]


def _body(item: WorkloadRecord, cfg: FleetBenchConfig) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": "any", "max_tokens": cfg.max_tokens, "temperature": 0, "ignore_eos": True}
    if item.kind == "chat":
        body["messages"] = item.messages()
        return "/v1/chat/completions", body
    body["prompt"] = item.text
    return "/v1/completions", body


def _client(i: int, url: str, items: list[WorkloadRecord], cfg: FleetBenchConfig, model: str, t0: float,
            out: list[Request], lock: threading.Lock) -> None:
    with httpx.Client(base_url=url, timeout=cfg.timeout_s) as http:
        for k, item in enumerate(items):
            route, body = _body(item, cfg)
            body["model"] = model
            rec = Request(client=i, index=k, prompt_id=item.id)
            try:
                r = http.post(route, json=body)
                if r.status_code != 200:
                    rec.error = f"{r.status_code}: {r.text[:200]}"
                else:
                    doc = r.json()
                    usage = doc.get("usage") or {}
                    rec.replica = r.headers.get("x-tidespec-replica", f"server-{i}")
                    rec.version = int(doc.get("drafter_version") or 0)
                    rec.draft_tokens = int(usage.get("draft_tokens", 0))
                    rec.accepted_tokens = int(usage.get("accepted_tokens", 0))
            except httpx.HTTPError as exc:
                rec.error = f"{type(exc).__name__}: {exc}"[:200]
            rec.done_s = time.perf_counter() - t0
            with lock:
                out.append(rec)


def _seed(root: Path, bootstrap: str, model: str | None) -> None:
    """Publish ``bootstrap`` as v1 of ``root`` (nothing without one: the replicas start a fresh head)."""
    if not bootstrap:
        return
    from tidespec.bench.shift.runs import seed_publish_root
    from tidespec.models.loading.loader import load_model

    seed_publish_root(root, bootstrap, load_model(model).model)


def _engine_model(engine_args: str) -> str | None:
    args = shlex.split(engine_args)
    return args[args.index("--model") + 1] if "--model" in args[:-1] else None


def run_config(name: str, cfg: FleetBenchConfig, work: Path) -> Run:
    """Start ``name``'s servers, drive the trace through them, stop them; the run's records."""
    work.mkdir(parents=True, exist_ok=True)
    n, model_path = cfg.replicas, _engine_model(cfg.engine_args)
    procs, urls = [], []
    roots = [work / "drafter"] if name == "fleet" else [work / f"server-{i}" / "drafter" for i in range(n)]
    for root in roots:
        root.parent.mkdir(parents=True, exist_ok=True)
        _seed(root, cfg.bootstrap, model_path)
    try:
        if name == "fleet":
            port = free_port()
            threads = cfg.trainer_threads
            cmd = [sys.executable, "-m", "tidespec.fleet.cli", "fleet", "--replicas", str(n), "--port", str(port),
                   "--trainer-cpus", str(threads), *shlex.split(cfg.engine_args), "--eagle3-dir", str(roots[0]),
                   "--online-training", "--trainer-args", f"--threads {threads} {cfg.trainer_args}"]
            procs.append(launch_process(cmd, port, cfg.timeout_s, work / "fleet.log"))
            urls = [f"http://127.0.0.1:{port}"] * n
        else:
            threads = max(1, cfg.trainer_threads // n)
            for i, root in enumerate(roots):
                port = free_port()
                cmd = [sys.executable, "-m", "tidespec.server.cli", "serve", "--port", str(port),
                       *shlex.split(cfg.engine_args), "--eagle3-dir", str(root), "--online-training",
                       "--trainer-share", "1", "--trainer-args", f"--threads {threads} {cfg.trainer_args}"]
                procs.append(launch_process(cmd, port, cfg.timeout_s, root.parent / "server.log"))
                urls.append(f"http://127.0.0.1:{port}")
        model = httpx.get(f"{urls[0]}/v1/models", timeout=30).json()["data"][0]["id"]
        run, lock, t0 = Run(name), threading.Lock(), time.perf_counter()
        clients = [threading.Thread(target=_client, args=(i, urls[i], items, cfg, model, t0, run.requests, lock))
                   for i, items in enumerate(trace_items(cfg))]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        run.wall_s = time.perf_counter() - t0
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(STOP_S)
            except Exception:  # noqa: BLE001 - a server that will not stop is killed, whatever went wrong
                stop_server(proc)
    run.requests.sort(key=lambda r: r.done_s)
    run.versions = sum(_published(root, bool(cfg.bootstrap)) for root in roots)
    return run


def _published(root: Path, seeded: bool) -> int:
    """Versions in ``root`` that training published (a seeded bootstrap's v1 excluded)."""
    from tidespec.files import list_versions

    return len([v for v in list_versions(root) if v > int(seeded)]) if root.exists() else 0


def rolling_acceptance(requests: list[Request], replicas: int, window: int) -> list[tuple[float, float]]:
    """``(requests per replica, acceptance)`` after each completed request: accepted / drafted
    tokens over the last ``window * replicas`` requests (those that drafted nothing count as
    drafted 0, accepted 0).

    Example: 2 replicas, window 1, requests drafting (4 acc 2), (4 acc 4), (4 acc 0)
    -> [(0.5, 0.5), (1.0, 0.75), (1.5, 0.5)]
    """
    span = window * replicas
    out = []
    for j in range(len(requests)):
        last = requests[max(0, j + 1 - span): j + 1]
        drafted = sum(r.draft_tokens for r in last)
        accepted = sum(r.accepted_tokens for r in last)
        out.append(((j + 1) / replicas, accepted / drafted if drafted else 0.0))
    return out


def requests_to_reach(curve: list[tuple[float, float]], level: float, warm: float) -> float | None:
    """Requests per replica until the rolling acceptance first reaches ``level``, counting only
    points after ``warm`` requests per replica (a window must be full). None if it never does.

    Example: requests_to_reach([(1, 0.2), (2, 0.5), (3, 0.7)], 0.6, 1) -> 3
    """
    for x, a in curve:
        if x >= warm and a >= level:
            return x
    return None


def summarize(runs: list[Run], cfg: FleetBenchConfig) -> dict[str, Any]:
    curves = {r.name: rolling_acceptance(r.requests, cfg.replicas, cfg.window) for r in runs}

    def quarter_mean(run: Run, last: bool) -> float:
        q = max(1, len(run.requests) // 4)
        part = run.requests[-q:] if last else run.requests[:q]
        drafted = sum(r.draft_tokens for r in part)
        return sum(r.accepted_tokens for r in part) / drafted if drafted else 0.0

    level = cfg.target or 0.9 * max((quarter_mean(r, True) for r in runs), default=0.0)
    rows = {}
    for run in runs:
        ok = [r for r in run.requests if r.error is None]
        rows[run.name] = {
            "requests": len(run.requests), "errors": len(run.requests) - len(ok), "wall_s": round(run.wall_s, 1),
            "versions_published": run.versions, "last_version_served": max((r.version for r in ok), default=-1),
            "acceptance_first_quarter": round(quarter_mean(run, False), 4),
            "acceptance_last_quarter": round(quarter_mean(run, True), 4),
            # no level above 0 (nothing was ever accepted): nothing recovered, whatever the curve
            "requests_per_replica_to_level": requests_to_reach(curves[run.name], level, cfg.window) if level > 0
            else None,
        }
    return {"level": round(level, 4), "configs": rows, "curves": curves}


def _plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in doc["summary"]["curves"].items():
        if curve:
            xs, ys = zip(*curve)
            ax.plot(xs, ys, label=name)
    ax.axhline(doc["summary"]["level"], color="grey", linestyle=":", label="recovered level")
    ax.set_xlabel("requests per replica")
    ax.set_ylabel(f"acceptance (accepted / drafted, last {doc['config']['window']} per replica)")
    ax.set_title("one trainer for the fleet vs one per server, same trainer compute")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _text(doc: dict[str, Any]) -> str:
    s, cfg = doc["summary"], doc["config"]
    rows = [[name, r["requests"], r["errors"], r["versions_published"], r["last_version_served"],
             f"{r['acceptance_first_quarter']:.3f}", f"{r['acceptance_last_quarter']:.3f}",
             "never" if r["requests_per_replica_to_level"] is None else f"{r['requests_per_replica_to_level']:.1f}",
             f"{r['wall_s']:.0f}"]
            for name, r in s["configs"].items()]
    table = markdown_table(["config", "requests", "errors", "versions published", "last version served",
                            "acceptance 1st quarter", "acceptance last quarter", "requests/replica to level",
                            "wall s"], rows)
    return (f"# bench fleet\n\n`{doc['command']}`\n\n{doc['machine_line']}\n\n"
            f"{cfg['replicas']} replicas, {cfg['requests_per_replica']} requests each of {cfg['max_tokens']} tokens "
            f"({cfg['workload']}), trainer compute {cfg['trainer_threads']} thread(s) per configuration; "
            f"recovered level {s['level']:.3f}\n\n{table}\n")


def run_fleet_bench(cfg: FleetBenchConfig, out_dir: Path) -> dict[str, Any]:
    runs = []
    for name in cfg.config_names:
        work = out_dir / name
        if work.exists():
            shutil.rmtree(work)
        runs.append(run_config(name, cfg, work))
    info = machine_info()
    doc = {"command": command_line(), "machine": info, "machine_line": machine_line(info),
           "config": asdict(cfg), "summary": summarize(runs, cfg),
           "requests": {r.name: [asdict(q) for q in r.requests] for r in runs}}
    save_report(out_dir, doc, _text(doc), _plot)
    return doc
