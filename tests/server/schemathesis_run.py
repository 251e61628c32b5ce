"""Property-based fuzzing of a real ``tidespec serve`` with schemathesis (``make fuzz``).

Why this exists: the reliability work asks for >= 3,000 generated requests against the OpenAPI schema with no
5xx and no request left without an answer. This is too slow for ``make test`` (the embedded model
answers every valid request), so it is a command of its own: it starts ``tidespec serve`` on the
embedded model (suffix drafter, a short context so that valid requests stay short), runs
``st run`` (all phases: coverage, fuzzing with valid and invalid data, stateful) with the
``not_a_server_error`` check, reads every request/response pair from schemathesis' NDJSON report,
then checks that the server is idle (no request running or waiting, KV usage 0) and that its log
has no traceback. It exits 1 when any of that fails, and writes ``summary.json`` next to the report.

Worked example::

    make fuzz                                     # the defaults below, into runs/fuzz
    .venv/bin/python -m tests.server.schemathesis_run --max-examples 50 --min-requests 500
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tidespec.bench.serve.run import free_port, launch_server, stop_server

DEFAULT_SERVE_ARGS = "--max-model-len 128 --drafter suffix --num-speculative-tokens 4 --max-num-seqs 8"


def read_report(path: Path) -> dict[str, Any]:
    """Every interaction in schemathesis' NDJSON report: counts by operation and status class, the
    requests without a response (a timeout or a dropped connection), and the 5xx bodies."""
    by_status: collections.Counter[str] = collections.Counter()
    by_operation: collections.Counter[str] = collections.Counter()
    unanswered: list[dict[str, Any]] = []
    server_errors: list[dict[str, Any]] = []
    failed_checks: list[str] = []
    for line in path.read_text().splitlines():
        event = json.loads(line)
        done = event.get("ScenarioFinished")
        if done is None:
            continue
        recorder = done["recorder"]
        for check in (recorder.get("checks") or {}).values():
            for c in check if isinstance(check, list) else [check]:
                if isinstance(c, dict) and c.get("status") == "FAILURE":
                    failed_checks.append(f"{recorder['label']}: {c.get('name')}")
        for inter in (recorder.get("interactions") or {}).values():
            by_operation[recorder["label"]] += 1
            resp = inter.get("response")
            if resp is None:
                unanswered.append(inter["request"])
                by_status["none"] += 1
                continue
            code = int(resp["status_code"])
            by_status[f"{code // 100}xx"] += 1
            if code >= 500:
                content = resp.get("content") or {}
                body = base64.b64decode(content["$base64"]).decode(errors="replace") if "$base64" in content else ""
                server_errors.append({"request": inter["request"], "status": code, "body": body[:500]})
    return {"requests": sum(by_operation.values()), "by_status": dict(by_status), "by_operation": dict(by_operation),
            "unanswered": unanswered[:20], "num_unanswered": len(unanswered), "server_errors": server_errors[:20],
            "num_server_errors": len(server_errors), "failed_checks": failed_checks[:20]}


def idle_state(url: str, timeout: float = 30.0) -> dict[str, float]:
    """running / waiting / KV usage from /metrics, once they are 0 or after ``timeout``."""
    names = {"running": "tidespec:num_requests_running", "waiting": "tidespec:num_requests_waiting",
             "kv_usage": "tidespec:kv_cache_usage_perc"}
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        state = {k: float(m.group(1)) if (m := re.search(rf"^{re.escape(n)} (\S+)$", text, re.M)) else -1.0
                 for k, n in names.items()}
        if all(v == 0.0 for v in state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/fuzz", help="report directory (default: runs/fuzz)")
    ap.add_argument("--max-examples", type=int, default=1200, help="schemathesis examples per operation")
    ap.add_argument("--min-requests", type=int, default=3000, help="fail when fewer requests were made")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=300.0,
                    help="seconds after which a request counts as unanswered")
    ap.add_argument("--serve-args", default=DEFAULT_SERVE_ARGS, help="extra `tidespec serve` flags")
    ns = ap.parse_args(argv)
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    if st is None:
        raise SystemExit("schemathesis is not installed in this environment: make fuzz installs it")
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve_log = out / "serve.log"
    serve_args = f"--log-level warning {ns.serve_args}"
    print(f"starting: tidespec serve --port {port} {serve_args}", flush=True)
    server = launch_server(serve_args, port, None, 600, serve_log)
    try:
        report = out / "schemathesis.ndjson"
        st_cmd = [st, "run", f"{url}/openapi.json", "--checks", "not_a_server_error",
                  "--max-examples", str(ns.max_examples), "--workers", str(ns.workers), "--seed", str(ns.seed),
                  "--request-timeout", str(ns.request_timeout), "--generation-database", "none",
                  "--report", "ndjson", "--report-ndjson-path", str(report), "--no-color"]
        print("running:", shlex.join(st_cmd), flush=True)
        t0 = time.monotonic()
        st_rc = subprocess.run(st_cmd, check=False).returncode
        summary = read_report(report)
        summary.update(schemathesis_exit=st_rc, seconds=round(time.monotonic() - t0, 1),
                       idle=idle_state(url), command=shlex.join(st_cmd), serve=serve_args)
    finally:
        stop_server(server)  # SIGTERM: the graceful shutdown, then SIGKILL after 30 s
    log_text = serve_log.read_text(errors="replace")
    summary["log_tracebacks"] = log_text.count("Traceback")
    summary["log_errors"] = len(re.findall(r"\bERROR\b", log_text))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    problems = []
    if summary["requests"] < ns.min_requests:
        problems.append(f"only {summary['requests']} requests (< {ns.min_requests})")
    if summary["num_server_errors"]:
        problems.append(f"{summary['num_server_errors']} responses were 5xx")
    if summary["num_unanswered"]:
        problems.append(f"{summary['num_unanswered']} requests got no answer within {ns.request_timeout:g} s")
    if any(v != 0.0 for v in summary["idle"].values()):
        problems.append(f"the server is not idle afterwards: {summary['idle']}")
    if summary["log_tracebacks"]:
        problems.append(f"{summary['log_tracebacks']} tracebacks in {serve_log}")
    print(f"\n{summary['requests']} requests in {summary['seconds']:.0f} s; by status {summary['by_status']}; "
          f"idle afterwards {summary['idle']}; tracebacks in the log {summary['log_tracebacks']}")
    for op, n in sorted(summary["by_operation"].items()):
        print(f"  {n:6d}  {op}")
    print("FAIL: " + "; ".join(problems) if problems else "OK: no 5xx, every request answered, server idle",
          f"(details: {out / 'summary.json'})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
