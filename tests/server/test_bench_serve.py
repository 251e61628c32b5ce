"""``tidespec bench serve``, the load generator: its arrival schedule and trace files by hand, and whole runs
against a live server on the tiny random model (word-level tokens ``t0 .. t63``, ``tests/helpers.py``)
whose reports must count every request, the drafts and the prefix cache's hits.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
from typing import Any

import numpy as np
import pytest

from tests.server.live import MODEL, LiveServer, tiny_engine
from tidespec.bench.serve import run as bench_serve
from tidespec.bench.serve.run import arrival_times, check_loopback, load_rate_trace
from tidespec.config import ConfigError
from tidespec.engine.engine import LLMEngine
from tidespec.server.app import ServerConfig, create_app
from tidespec.speculative.drafters.ngram import NgramDrafter


def test_arrival_times_hand_traced() -> None:
    rng = random.Random(0)
    assert arrival_times([(0.0, math.inf)], 3, None, rng) == [0.0, 0.0, 0.0]
    # nothing during [0, 10), then all at once at 10 s
    assert arrival_times([(0.0, 0.0), (10.0, math.inf)], 2, None, rng) == [10.0, 10.0]
    # a last segment of rate 0 ends the schedule; rate 0 before the first entry
    assert arrival_times([(5.0, math.inf), (6.0, 0.0)], 4, None, rng) == [5.0] * 4
    assert arrival_times([(0.0, 1000.0), (0.5, 0.0)], 10**6, None, rng)[-1] < 0.5
    assert arrival_times([(0.0, 100.0)], 10**6, 2.0, rng)[-1] <= 2.0
    gaps = np.diff([0.0, *arrival_times([(0.0, 50.0)], 4000, None, random.Random(1))])
    assert abs(gaps.mean() - 1 / 50) < 0.1 / 50  # Exp(50) inter-arrival gaps
    assert abs(gaps.std() - 1 / 50) < 0.1 / 50
    two = arrival_times([(0.0, 10.0), (100.0, 40.0)], 10**6, 200.0, random.Random(2))
    first, second = sum(t < 100 for t in two), sum(t >= 100 for t in two)
    assert 850 < first < 1150 and 3600 < second < 4400  # ~1000 and ~4000 arrivals


def test_check_loopback_and_trace_files(tmp_path: Any) -> None:
    for ok in ("http://127.0.0.1:8000/", "http://127.3.2.1", "http://localhost:1", "http://[::1]:80"):
        assert check_loopback(ok) == ok.rstrip("/")
    for bad in ("http://10.0.0.1:8000", "http://example.com", "ftp://127.0.0.1", "127.0.0.1:8000",
                "http://0.0.0.0:8000"):
        with pytest.raises(ConfigError):
            check_loopback(bad)
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("time_s,rate\n10,2.5\n0,1\n")
    assert load_rate_trace(csv_path) == [(0.0, 1.0), (10.0, 2.5)]
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"time_s": 0, "rate": 3}\n[4, 0.5]\n')
    assert load_rate_trace(jl) == [(0.0, 3.0), (4.0, 0.5)]
    (tmp_path / "bad.csv").write_text("0,-1\n")
    with pytest.raises(ConfigError):
        load_rate_trace(tmp_path / "bad.csv")


def _bench_serve(engine: LLMEngine, workload: Any, out: Any, *args: str) -> dict[str, Any]:
    """``tidespec bench serve`` with ``args`` against ``engine`` behind a live server; its report."""
    with LiveServer(create_app(engine, ServerConfig(served_model_name=MODEL))) as s:
        parser = argparse.ArgumentParser()
        bench_serve.add_args(parser)
        ns = parser.parse_args(["--base-url", s.url, "--workload", str(workload), "--out", str(out), *args])
        assert bench_serve.run(ns) == 0
    return dict(json.loads((out / "bench_serve.json").read_text()))


def test_bench_serve_end_to_end(tmp_path: Any) -> None:
    wl = tmp_path / "wl.jsonl"
    wl.write_text("".join(json.dumps({"id": f"r{i}", "domain": "rep" if i % 2 else "mixed",
                                      "kind": "chat" if i % 3 == 0 else "completion",
                                      "prompt": f"t{i + 2} t5 t{i + 2} t5"}) + "\n" for i in range(6)))
    engine = tiny_engine(max_num_seqs=4, max_waiting=64, drafter=NgramDrafter(1, 3))
    report = _bench_serve(engine, wl, tmp_path / "out", "--rate", "40", "--num-requests", "16", "--max-tokens", "12",
                          "--max-concurrency", "6")
    summ = report["summary"]
    assert summ["completed"] == 16 and summ["errors"] == 0 and summ["rejected_429"] == 0
    assert summ["draft_tokens"] > 0 and 0 <= summ["accepted_tokens"] <= summ["draft_tokens"]
    assert set(summ["by_domain"]) == {"rep", "mixed"}
    assert summ["ttft_s"]["p50"] <= summ["ttft_s"]["p99"] and summ["e2e_s"]["p50"] > 0
    assert all(r["completion_tokens"] <= 12 and r["ok"] for r in report["requests"])
    assert (tmp_path / "out" / "bench_serve.png").stat().st_size > 1000


def test_bench_serve_conversations_resend_their_history(tmp_path: Any) -> None:
    """``--turns 3``: each conversation's later turns carry its history, so their prompts grow and
    the server's prefix cache serves the part it has seen; completions are left out."""
    wl = tmp_path / "wl.jsonl"
    system = " ".join(f"t{3 + (5 * i) % 59}" for i in range(40))  # a shared 40-word system message
    wl.write_text("".join(json.dumps({"id": f"r{i}", "domain": "d", "kind": "chat" if i % 4 else "completion",
                                      "prompt": f"t{i + 2} t5 t{i + 7}", "system": system}) + "\n"
                          for i in range(8)))
    engine = tiny_engine(max_num_seqs=4, max_model_len=160)
    report = _bench_serve(engine, wl, tmp_path / "out", "--num-requests", "3", "--turns", "3", "--max-tokens", "6",
                          "--max-concurrency", "2")
    reqs = report["requests"]
    assert report["summary"]["completed"] == 9 and report["summary"]["errors"] == 0
    assert {(r["conversation"], r["turn"]) for r in reqs} == {(c, t) for c in range(3) for t in (1, 2, 3)}
    assert all(r["kind"] == "chat" for r in reqs)
    for c in range(3):
        turns = sorted((r for r in reqs if r["conversation"] == c), key=lambda r: r["turn"])
        # each later prompt holds the earlier one, its answer and a new question
        assert all(b["prompt_tokens"] > a["prompt_tokens"] + a["completion_tokens"]
                   for a, b in itertools.pairwise(turns))
    by_turn = report["summary"]["by_turn"]
    assert set(by_turn) == {"1", "2", "3"} and all(t["requests"] == 3 for t in by_turn.values())
    assert by_turn["3"]["cached_prompt_tokens"] > 0  # the history is served from the prefix cache


def test_bench_serve_refuses_turns_without_chats_and_a_launch_cmd_without_port(tmp_path: Any) -> None:
    wl = tmp_path / "wl.jsonl"
    wl.write_text(json.dumps({"id": "c", "domain": "d", "kind": "completion", "prompt": "t3 t4"}) + "\n")
    parser = argparse.ArgumentParser()
    bench_serve.add_args(parser)
    with pytest.raises(ConfigError, match="--turns > 1 needs chat records"):
        bench_serve.run(parser.parse_args(["--workload", str(wl), "--turns", "2"]))
    with pytest.raises(ConfigError, match="--turns must be >= 1"):
        bench_serve.run(parser.parse_args(["--workload", str(wl), "--turns", "0"]))
    with pytest.raises(ConfigError, match="--launch-cmd needs --launch and a {port}"):
        bench_serve.run(parser.parse_args(["--workload", str(wl), "--launch", "--launch-cmd", "vllm serve m"]))
