"""``tidespec bench serve``: an open-loop load generator for the OpenAI-compatible server.

Why this exists: the load-adaptive parts of tidespec only make sense under real concurrent
traffic, and latency under load is what users feel. This sends streaming requests from a workload
file at Poisson arrival times — a constant ``--rate`` or a replayed ``--rate-trace`` — with a
client-side concurrency cap, and measures what a client sees: TTFT (first content chunk), TPOT
(mean gap between later tokens), end-to-end latency, throughput, 429s and errors, plus the
acceptance reported by the server (``usage.draft_tokens`` / ``usage.accepted_tokens``).

It only talks to loopback addresses (127.0.0.0/8, ::1, localhost): it is a benchmark, not a
stress tool for other people's servers. It is bounded in count (``--num-requests``) and time
(``--duration`` for arrivals, ``--timeout`` per request, a hard stop after both).

Arrivals (worked example): with a trace ``[(0, 2.0), (10, 0.0), (20, 5.0)]`` the rate is 2 req/s
during [0, 10), nothing during [10, 20) and 5 req/s from 20 s on. Inter-arrival gaps are drawn
``Exp(rate)``; a gap that crosses a segment boundary is redrawn from the boundary with the next
segment's rate, which is exact for a piecewise-constant Poisson process (memorylessness).

Conversations (``--turns N``, N > 1): each arrival opens a chat of N turns. Turn 1 sends a chat
record as it is; turn k + 1 is sent as soon as turn k's answer has arrived, with the whole history
(the system message, every question, every answer) and the next record's question, as an OpenAI
client resends a chat. What a prefix cache saves shows in the later turns' TTFT and
``cached_tokens``, reported per turn (``bench_serve.json``'s ``summary.by_turn``).

Outputs: a summary on stdout, ``bench_serve.json`` (config, summary, one record per request) and
``bench_serve.png`` (arrival/completion rate, TTFT, output tok/s and acceptance over time) in
``--out DIR``.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import ipaddress
import json
import math
import os
import random
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np

from tidespec.bench.serve.turns import Conversation, chat_records, summarize_turns
from tidespec.config import ConfigError, finite_float, output_dir
from tidespec.workloads.loader import BUILTIN_WORKLOADS, WorkloadRecord, load_workload

ROUTE_HEADER = "X-Tidespec-Route"


@dataclass
class RequestRecord:
    index: int
    item_id: str
    domain: str
    kind: str
    scheduled_s: float  # planned arrival, seconds from the start
    start_s: float = 0.0  # when it was sent (after waiting for a concurrency slot)
    status: int = 0  # HTTP status; 0 = transport error / timeout
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server reused from its prefix cache
    conversation: int = 0  # with --turns N: the conversation this request belongs to
    turn: int = 1  # its turn in that conversation, from 1
    chunk_times_s: list[float] = field(default_factory=list)  # content chunk arrival, seconds from the start


# ----------------------------------------------------------------------------- inputs
def check_loopback(base_url: str) -> str:
    """``base_url`` without a trailing slash if its host is loopback; ``ConfigError`` otherwise."""
    parsed = urlparse(base_url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"--base-url must be an http(s) URL, got {base_url!r}")
    host = parsed.hostname
    ok = host == "localhost"
    if not ok:
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = False
    if not ok:
        raise ConfigError(f"--base-url must point to a loopback address (127.0.0.0/8, ::1, localhost), got {host!r}")
    return base_url.rstrip("/")


def load_rate_trace(path: str | Path) -> list[tuple[float, float]]:
    """(time_s, rate) pairs from CSV (header optional) or JSON lines (``{"time_s", "rate"}`` or ``[t, r]``).

    Sorted by time, must start at time 0 or later, rates >= 0.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"rate trace not found: {p}")
    text = p.read_text(encoding="utf-8")
    rows: list[tuple[float, float]] = []
    try:
        if text.lstrip().startswith(("{", "[")):
            for line in text.splitlines():
                if not line.strip():
                    continue
                rec = json.loads(line)
                t, r = (rec["time_s"], rec["rate"]) if isinstance(rec, dict) else (rec[0], rec[1])
                rows.append((float(t), float(r)))
        else:
            for row in csv.reader(text.splitlines()):
                if not row or not row[0].strip() or row[0].strip().startswith("#"):
                    continue
                try:
                    rows.append((float(row[0]), float(row[1])))
                except ValueError:
                    if rows:  # only the first line may be a header
                        raise
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ConfigError(f"{p}: bad rate trace ({exc}); expected lines of (time_s, rate)") from exc
    rows.sort()
    if not rows:
        raise ConfigError(f"rate trace {p} is empty")
    if rows[0][0] < 0 or any(r < 0 or not math.isfinite(r) or not math.isfinite(t) for t, r in rows):
        raise ConfigError(f"rate trace {p}: times must be >= 0 and rates finite and >= 0")
    return rows


def arrival_times(trace: list[tuple[float, float]], num_requests: int, duration: float | None,
                  rng: random.Random) -> list[float]:
    """Poisson arrival times (seconds) for a piecewise-constant rate; see the module docstring.

    ``trace`` = [(t0, r0), (t1, r1), ...] sorted by time; rate 0 before t0; an infinite rate sends
    all remaining requests at the segment start. Stops at ``num_requests`` arrivals, at
    ``duration`` seconds, or when the last segment's rate is 0.

    Example: ``arrival_times([(0.0, math.inf)], 3, None, rng) == [0.0, 0.0, 0.0]``.
    """
    out: list[float] = []
    seg = 0
    t = trace[0][0]
    while len(out) < num_requests:
        seg_end = trace[seg + 1][0] if seg + 1 < len(trace) else math.inf
        rate = trace[seg][1]
        if rate <= 0:
            if seg_end == math.inf:
                break
            t, seg = seg_end, seg + 1
            continue
        nxt = t if math.isinf(rate) else t + rng.expovariate(rate)
        if nxt >= seg_end:
            t, seg = seg_end, seg + 1
            continue
        if duration is not None and nxt > duration:
            break
        out.append(nxt)
        t = nxt
    return out


# ----------------------------------------------------------------------------- requests
async def _one_request(client: httpx.AsyncClient, rec: RequestRecord, item: WorkloadRecord, ns: argparse.Namespace,
                       model: str, t0: float, messages: list[dict[str, str]] | None = None) -> str:
    """Send ``item`` (or, for a later turn, ``messages``) and fill ``rec``; returns the text generated."""
    body: dict[str, Any] = {"model": model, "max_tokens": ns.max_tokens, "temperature": ns.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if ns.seed is not None:
        body["seed"] = ns.seed + rec.index
    if ns.spec_tokens is not None:
        body["tidespec"] = {"enabled": ns.spec_tokens > 0, "num_speculative_tokens": ns.spec_tokens}
    pieces: list[str] = []
    if item.kind == "chat":
        url = "/v1/chat/completions"
        body["messages"] = messages if messages is not None else item.messages()
    else:
        url = "/v1/completions"
        body["prompt"] = item.text
    headers = {ROUTE_HEADER: _route_label(item.domain)} if ns.route_header else {}
    start = time.perf_counter()
    rec.start_s = start - t0
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=ns.timeout) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                rec.error = _error_message(raw, resp.status_code)
                return ""
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data.strip() == "[DONE]":
                    rec.ok = rec.error is None
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = str(chunk["error"].get("message", chunk["error"]))
                    continue
                now = time.perf_counter()
                for choice in chunk.get("choices", []):
                    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if text:
                        if rec.ttft_s is None:
                            rec.ttft_s = now - start
                        rec.chunk_times_s.append(now - t0)
                        pieces.append(text)
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    rec.completion_tokens = int(usage.get("completion_tokens", 0))
                    rec.draft_tokens = int(usage.get("draft_tokens", 0))
                    rec.accepted_tokens = int(usage.get("accepted_tokens", 0))
                    rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except (httpx.HTTPError, json.JSONDecodeError, asyncio.TimeoutError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
        return ""
    end = time.perf_counter()
    rec.e2e_s = end - start
    if not rec.ok and rec.error is None:
        rec.error = "stream ended without [DONE]"
    if rec.ttft_s is not None and rec.completion_tokens > 1:
        rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (rec.completion_tokens - 1)
    return "".join(pieces)


def _route_label(domain: str) -> str:
    clean = "".join(c if c.isalnum() or c in "_.:/-" else "_" for c in domain)[:64]
    return clean or "default"


def _error_message(raw: bytes, status: int) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}"


async def _resolve_model(client: httpx.AsyncClient, model: str | None) -> str:
    if model:
        return model
    resp = await client.get("/v1/models", timeout=30)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


async def run_load(ns: argparse.Namespace, base_url: str, items: list[WorkloadRecord],
                   arrivals: list[float]) -> tuple[list[RequestRecord], float, str]:
    """Send one request per arrival time; returns the records, the wall time and the model name."""
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    limits = httpx.Limits(max_connections=ns.max_concurrency + 4, max_keepalive_connections=ns.max_concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=ns.timeout) as client:
        model = await _resolve_model(client, ns.model)
        sem = asyncio.Semaphore(ns.max_concurrency)
        order = list(range(len(items)))
        if ns.shuffle:
            random.Random(ns.seed or 0).shuffle(order)
        offset = getattr(ns, "offset", 0)  # bench load: where this run starts in the shuffled workload

        def item(i: int) -> WorkloadRecord:
            return items[order[(offset + i) % len(items)]]

        turns = getattr(ns, "turns", 1)
        # conversation c's turn k asks item c * turns + k's question; with one turn, request i is item i
        records = [RequestRecord(c * turns + k, item(c * turns + k).id, item(c * turns).domain, "chat" if turns > 1
                                 else item(c).kind, t, conversation=c, turn=k + 1)
                   for c, t in enumerate(arrivals) for k in range(turns)]
        t0 = time.perf_counter()

        async def launch(c: int) -> None:
            first = records[c * turns]
            delay = first.scheduled_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            chat = Conversation(item(c * turns))
            for rec in records[c * turns:(c + 1) * turns]:
                if rec.turn > 1 and not chat.ask(item(rec.index)):
                    rec.error = "an earlier turn of its conversation failed"
                    continue
                async with sem:
                    answer = await _one_request(client, rec, item(rec.index), ns, model, t0,
                                                chat.messages if turns > 1 else None)
                chat.answer(answer if rec.ok else None)

        tasks = [asyncio.create_task(launch(c)) for c in range(len(arrivals))]
        hard_stop = (arrivals[-1] if arrivals else 0.0) + ns.timeout + 5.0
        done, pending = await asyncio.wait(tasks, timeout=hard_stop)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for rec in records:
            if rec.status == 0 and rec.error is None:
                rec.error = "not finished before the hard stop"
        return records, time.perf_counter() - t0, model


# ----------------------------------------------------------------------------- report
def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)),
            "p99": float(np.percentile(arr, 99))}


def summarize(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Throughput, latency percentiles, acceptance and error counts over ``records``.

    Example: two ok requests of 10 and 30 output tokens in a 4 s run -> ``output_tok_per_s == 10``.
    """
    ok = [r for r in records if r.ok]
    ends = [r.start_s + r.e2e_s for r in ok if r.e2e_s is not None]
    span = max(ends) - min(r.start_s for r in ok) if ok and ends else wall_s
    span = span if span > 0 else max(wall_s, 1e-9)
    out_tokens = sum(r.completion_tokens for r in ok)
    drafts = sum(r.draft_tokens for r in ok)
    accepted = sum(r.accepted_tokens for r in ok)
    by_domain: dict[str, dict[str, float]] = {}
    for r in ok:
        d = by_domain.setdefault(r.domain, {"requests": 0, "draft_tokens": 0, "accepted_tokens": 0})
        d["requests"] += 1
        d["draft_tokens"] += r.draft_tokens
        d["accepted_tokens"] += r.accepted_tokens
    for d in by_domain.values():
        d["acceptance_rate"] = d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0.0
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "rejected_429": sum(1 for r in records if r.status == 429),
        "errors": sum(1 for r in records if not r.ok and r.status != 429),
        "duration_s": span,
        "wall_s": wall_s,
        "request_throughput": len(ok) / span,
        "output_tok_per_s": out_tokens / span,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "ttft_s": _pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        # TTFT of the requests whose prompt hit the server's prefix cache, and of the others
        "ttft_hit_s": _pcts([r.ttft_s for r in ok if r.ttft_s is not None and r.cached_tokens]),
        "ttft_miss_s": _pcts([r.ttft_s for r in ok if r.ttft_s is not None and not r.cached_tokens]),
        "tpot_s": _pcts([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": _pcts([r.e2e_s for r in ok if r.e2e_s is not None]),
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        "by_domain": by_domain,
        "by_turn": summarize_turns(records),
        "error_samples": sorted({r.error for r in records if r.error and r.status != 429})[:5],
    }


def _fmt(v: float | None, scale: float = 1000.0) -> str:
    return "-" if v is None else f"{v * scale:.1f}"


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"requests {s['num_requests']}: completed {s['completed']}, 429 {s['rejected_429']}, errors {s['errors']}",
        f"throughput {s['request_throughput']:.2f} req/s, {s['output_tok_per_s']:.1f} output tok/s "
        f"over {s['duration_s']:.1f} s",
    ]
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "e2e")):
        p = s[key]
        lines.append(f"{name:5s} ms  mean {_fmt(p['mean'])}  p50 {_fmt(p['p50'])}  p90 {_fmt(p['p90'])}  "
                     f"p99 {_fmt(p['p99'])}")
    if s.get("cached_prompt_tokens"):
        hit, miss = s["ttft_hit_s"], s["ttft_miss_s"]
        lines.append(f"prefix cache: {s['cached_prompt_tokens']}/{s['total_prompt_tokens']} prompt tokens reused; "
                     f"TTFT p50 {_fmt(hit['p50'])} ms on a hit, {_fmt(miss['p50'])} ms on a miss")
    for turn, t in s.get("by_turn", {}).items():
        lines.append(f"turn {turn}: {t['requests']} requests, TTFT p50 {_fmt(t['ttft_p50_s'])} ms, "
                     f"{t['cached_prompt_tokens']}/{t['prompt_tokens']} prompt tokens reused")
    if s["draft_tokens"]:
        lines.append(f"acceptance {s['acceptance_rate']:.1%} ({s['accepted_tokens']}/{s['draft_tokens']} draft tokens)")
    for err in s["error_samples"]:
        lines.append(f"error: {err}")
    return "\n".join(lines)


def plot(records: list[RequestRecord], wall_s: float, path: Path) -> None:
    """Arrivals/completions, TTFT, output tok/s and acceptance over time (PNG, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bin_s = max(0.1, wall_s / 40)
    nbins = max(1, int(math.ceil(wall_s / bin_s)))
    edges = np.arange(nbins + 1) * bin_s
    mids = edges[:-1] + bin_s / 2
    sent = np.histogram([r.start_s for r in records], edges)[0] / bin_s
    ok = [r for r in records if r.ok and r.e2e_s is not None]
    done = np.histogram([r.start_s + (r.e2e_s or 0.0) for r in ok], edges)[0] / bin_s
    rejected = np.histogram([r.start_s for r in records if r.status == 429], edges)[0] / bin_s
    chunk_t = [t for r in ok for t in r.chunk_times_s]
    per_chunk = [r.completion_tokens / len(r.chunk_times_s) for r in ok for _ in r.chunk_times_s]
    toks = np.histogram(chunk_t, edges, weights=per_chunk)[0] / bin_s  # a speculative chunk holds several tokens
    drafted = np.histogram([r.start_s + (r.e2e_s or 0.0) for r in ok], edges, weights=[r.draft_tokens for r in ok])[0]
    accepted = np.histogram([r.start_s + (r.e2e_s or 0.0) for r in ok], edges,
                            weights=[r.accepted_tokens for r in ok])[0]
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    axes[0].plot(mids, sent, label="sent")
    axes[0].plot(mids, done, label="completed")
    axes[0].plot(mids, rejected, label="429")
    axes[0].set_ylabel("req/s")
    axes[0].legend(loc="upper right")
    axes[1].scatter([r.start_s for r in ok if r.ttft_s is not None],
                    [r.ttft_s * 1000 for r in ok if r.ttft_s is not None], s=6)
    axes[1].set_ylabel("TTFT ms (by send time)")
    axes[2].plot(mids, toks)
    axes[2].set_ylabel("output tok/s")
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where(drafted > 0, accepted / np.maximum(drafted, 1), np.nan)
    axes[3].plot(mids, rate, marker=".")
    axes[3].set_ylabel("acceptance")
    axes[3].set_ylim(0, 1)
    axes[3].set_xlabel("time since start (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- launch
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_server(engine_args: str, port: int, api_key: str | None, timeout: float,
                  log_path: Path | None) -> subprocess.Popen[bytes]:
    """Start ``tidespec serve`` on 127.0.0.1:port and wait for /health; RuntimeError if it fails."""
    cmd = [sys.executable, "-m", "tidespec.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           *shlex.split(engine_args)]
    env = dict(os.environ)
    if api_key:
        env["TIDESPEC_API_KEY"] = api_key
    return launch_process(cmd, port, timeout, log_path, env)


def launch_process(cmd: list[str], port: int, timeout: float, log_path: Path | None,
                   env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``cmd`` (a server listening on 127.0.0.1:port: ``serve``, ``fleet``) and wait until its
    /health answers 200; RuntimeError (naming ``log_path``) if it exits or times out first."""
    if log_path is not None:
        with log_path.open("wb") as out:  # the child keeps its own descriptor
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    else:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{port}/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} during start-up"
                               + (f"; see {log_path}" if log_path else ""))
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"server did not become healthy within {timeout:.0f} s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# ----------------------------------------------------------------------------- CLI
def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``tidespec bench serve``."""
    g = parser.add_argument_group("load")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL, loopback only")
    g.add_argument("--model", default=None, help="model name to send; None = the server's first model")
    g.add_argument("--api-key", default=None, help="API key; env TIDESPEC_API_KEY when not given")
    g.add_argument("--workload", required=True,
                   help="workload JSONL {id, domain, kind: completion|chat, prompt}, or a built-in name ("
                        + ", ".join(BUILTIN_WORKLOADS) + ")")
    g.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True,
                   help="shuffle the workload order (seeded)")
    g.add_argument("--rate", type=float, default=math.inf, help="Poisson arrival rate, req/s (inf = all at once)")
    g.add_argument("--rate-trace", default=None, help="CSV or JSON lines of (time_s, rate) to replay instead of --rate")
    g.add_argument("--max-concurrency", type=int, default=32, help="most requests in flight from this client")
    g.add_argument("--num-requests", type=int, default=100,
                   help="requests to send at most (with --turns N: conversations, of N requests each)")
    g.add_argument("--turns", type=int, default=1,
                   help="turns per conversation: turn k+1 resends the history with the next chat record's question")
    g.add_argument("--duration", type=finite_float, default=None, help="stop sending after this many seconds")
    g.add_argument("--timeout", type=finite_float, default=300.0, help="per-request timeout, seconds")
    g.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    g.add_argument("--temperature", type=finite_float, default=0.0, help="sampling temperature of every request")
    g.add_argument("--seed", type=int, default=0, help="arrival/shuffle seed; request i gets seed + i")
    g.add_argument("--spec-tokens", type=int, default=None,
                   help="per-request tidespec.num_speculative_tokens (0 = disable; None = the server's)")
    g.add_argument("--route-header", action=argparse.BooleanOptionalAction, default=True,
                   help=f"send each record's domain as {ROUTE_HEADER}")
    g.add_argument("--out", type=output_dir, default=None, help="directory for bench_serve.json and bench_serve.png")
    g.add_argument("--launch", action="store_true", help="start a server subprocess for the run and stop it after")
    g.add_argument("--launch-args", default="", help="engine flags for --launch, e.g. \"--drafter ngram\"")
    g.add_argument("--launch-cmd", default=None,
                   help="with --launch: another server's command line instead of tidespec serve, {port} standing "
                        "for the port (e.g. \"vllm serve DIR --port {port}\"); it must answer /health")
    g.add_argument("--launch-timeout", type=finite_float, default=600.0, help="seconds to wait for a launched server")


def _validate(ns: argparse.Namespace) -> None:
    if ns.num_requests < 1:
        raise ConfigError(f"--num-requests must be >= 1, got {ns.num_requests}")
    if ns.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be >= 1, got {ns.max_concurrency}")
    if not ns.rate > 0:
        raise ConfigError(f"--rate must be > 0, got {ns.rate}")
    if ns.duration is not None and ns.duration <= 0:
        raise ConfigError(f"--duration must be > 0, got {ns.duration}")
    if ns.timeout <= 0:
        raise ConfigError(f"--timeout must be > 0, got {ns.timeout}")
    if ns.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {ns.max_tokens}")
    if ns.turns < 1:
        raise ConfigError(f"--turns must be >= 1, got {ns.turns}")
    if ns.launch_cmd is not None and ("{port}" not in ns.launch_cmd or not ns.launch):
        raise ConfigError("--launch-cmd needs --launch and a {port} in the command line")


def run(ns: argparse.Namespace) -> int:
    """Run the benchmark described by ``ns`` (see ``add_args``); returns the exit code."""
    _validate(ns)
    if ns.api_key is None:
        ns.api_key = os.environ.get("TIDESPEC_API_KEY") or None
    items = load_workload(ns.workload)
    if ns.turns > 1:
        items = chat_records(items, ns.workload)
    trace = load_rate_trace(ns.rate_trace) if ns.rate_trace else [(0.0, ns.rate)]
    arrivals = arrival_times(trace, ns.num_requests, ns.duration, random.Random(ns.seed))
    if not arrivals:
        raise ConfigError("the rate settings produce no arrivals")
    out_dir: Path | None = ns.out  # already a Path (output_dir)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    proc: subprocess.Popen[bytes] | None = None
    if ns.launch:
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        log = out_dir / "server.log" if out_dir is not None else None
        if ns.launch_cmd:
            print(f"launching {ns.launch_cmd.split()[0]} on {base_url}", file=sys.stderr)
            proc = launch_process(shlex.split(ns.launch_cmd.replace("{port}", str(port))), port, ns.launch_timeout,
                                  log)
        else:
            print(f"launching server on {base_url} ({ns.launch_args or 'default engine flags'})", file=sys.stderr)
            proc = launch_server(ns.launch_args, port, ns.api_key, ns.launch_timeout, log)
    else:
        base_url = check_loopback(ns.base_url)
    try:
        records, wall_s, model = asyncio.run(run_load(ns, base_url, items, arrivals))
    finally:
        if proc is not None:
            stop_server(proc)
    summary = summarize(records, wall_s)
    print(format_summary(summary))
    if out_dir is not None:
        config = {k: v for k, v in vars(ns).items() if k not in ("func", "api_key") and not callable(v)}
        config.update(base_url=base_url, model=model, rate=None if math.isinf(ns.rate) else ns.rate)
        report = {"config": config, "summary": summary, "rate_trace": trace if ns.rate_trace else None,
                  "requests": [asdict(r) for r in records]}
        (out_dir / "bench_serve.json").write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
        plot(records, wall_s, out_dir / "bench_serve.png")
        print(f"wrote {out_dir / 'bench_serve.json'} and {out_dir / 'bench_serve.png'}", file=sys.stderr)
    return 0 if summary["completed"] else 1
