"""Operations against a live server: slow bodies, the drain on SIGTERM, the parameter
each 400 names, unknown fields, the KV reservation check, and the port bound before the model loads.

Each test drives a real server (uvicorn on a loopback port, or ``tidespec serve`` in a child
process where the exit code or the start-up order is the point) with raw sockets or httpx.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.helpers import tiny_hf_model, tiny_llama, tiny_tokenizer, write_tiny_checkpoint
from tests.server.live import CHAT_TEMPLATE, MODEL, LiveServer, tiny_engine
from tests.server.test_reliability import POISON, _disconnect, _innocent, _poisoned, _read_until_closed
from tidespec.bench.serve import run as bench_serve
from tidespec.bench.serve.run import free_port, launch_server, stop_server
from tidespec.config import CacheConfig, ConfigError, EngineConfig, ModelConfig
from tidespec.engine.engine import LLMEngine
from tidespec.engine.observer import Hooks
from tidespec.models.kv.paged import PagedKVCache
from tidespec.server.app import IGNORED_FIELDS_HEADER, ServerConfig, create_app
from tidespec.server.guard import Admission, MemoryTrimmer
from tidespec.server.loading import DeferredApp


def _partial_body(port: int, key: str | None) -> tuple[bytes, float]:
    """Headers announcing 100 body bytes, 10 of them sent, then silence: (the answer, seconds until closed)."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                      "Content-Length: 100\r\n\r\n").encode() + b'{"model": ')
        t0 = time.monotonic()
        answer = _read_until_closed(sock, 20.0)
        return answer, time.monotonic() - t0


# ----------------------------------------------------------------------------- 1. body timeout
def test_a_body_that_does_not_arrive_gets_a_408_and_the_connection_is_closed() -> None:
    """Headers then a partial body, then silence, held the connection forever
    (with or without a valid key); now a 408 after --body-timeout (or the 401, then a close), and the
    engine never saw the request."""
    engine = tiny_engine()
    app = create_app(engine, ServerConfig(served_model_name=MODEL, api_key="sk-1", body_timeout_s=0.5))
    with LiveServer(app, header_timeout_s=1.0) as s:
        results: dict[str, tuple[bytes, float]] = {}
        threads = [threading.Thread(target=lambda k=k: results.__setitem__(str(k), _partial_body(s.port, k)))
                   for k in ("sk-1", "wrong", None) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        answer, seconds = results["sk-1"]
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer
        assert b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert 0.4 < seconds < 5.0
        for key in ("wrong", "None"):  # refused at once, then closed when the rest of the body never comes
            answer, seconds = results[key]
            assert answer.startswith(b"HTTP/1.1 401"), answer
            assert seconds < 5.0
        metrics = httpx.get(f"{s.url}/metrics", headers={"Authorization": "Bearer sk-1"}).text
        assert 'tidespec:request_rejected_total{reason="body_timeout"} 8.0' in metrics
        assert s.engine_state() == (0.0, 0, 0, 0)
        # a client sending its body in pieces within the limit is served
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            payload = json.dumps({"model": MODEL, "prompt": "t5 t6", "max_tokens": 2}).encode()
            sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-1\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode())
            for i in range(0, len(payload), 8):
                sock.sendall(payload[i:i + 8])
                time.sleep(0.02)
            sock.settimeout(10)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")


# ----------------------------------------------------------------------------- 2. drain
def test_sigterm_drains_running_requests_and_refuses_new_ones() -> None:
    """Before: during the grace /health said 200 and new requests were served or held.
    Now: /health 503 "draining", new requests 503 + Retry-After at once, the running stream and
    non-streaming request finish normally, a request outlasting the grace ends with a 503 / an
    error event naming the shutdown."""
    engine = tiny_engine()
    engine.add_observer(Hooks(step_start=lambda _e: time.sleep(0.02)))
    s = LiveServer(create_app(engine, ServerConfig(served_model_name=MODEL)), grace_s=2.5)
    short = {"model": MODEL, "prompt": "t5 t6", "max_tokens": 30, "ignore_eos": True}
    long = {"model": MODEL, "prompt": "t7 t6", "max_tokens": 150, "ignore_eos": True}
    outcome: dict[str, Any] = {}
    with s:
        def call(name: str, body: dict[str, Any]) -> None:
            outcome[name] = httpx.post(f"{s.url}/v1/completions", json=body, timeout=30)

        def stream(name: str, body: dict[str, Any]) -> None:
            with httpx.stream("POST", f"{s.url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
                outcome[name] = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]

        workers = [threading.Thread(target=call, args=("short", short)), threading.Thread(target=call, args=("long", long)),
                   threading.Thread(target=stream, args=("short_stream", short)),
                   threading.Thread(target=stream, args=("long_stream", long))]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 10
        while s.aengine.num_in_flight < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        s.server.should_exit = True  # what SIGTERM does
        time.sleep(0.3)
        health = httpx.get(f"{s.url}/health", timeout=5)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        refused = httpx.post(f"{s.url}/v1/completions", json=short, timeout=5)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "server_shutting_down"
        for w in workers:
            w.join(30)
    assert outcome["short"].status_code == 200
    assert outcome["short"].json()["usage"]["completion_tokens"] == 30
    assert outcome["short_stream"][-1] == "[DONE]" and "error" not in json.loads(outcome["short_stream"][-2])
    assert outcome["long"].status_code == 503, outcome["long"].text
    assert outcome["long"].json()["error"]["code"] == "server_shutting_down"
    last = json.loads(outcome["long_stream"][-2])
    assert outcome["long_stream"][-1] == "[DONE]" and last["error"]["code"] == "server_shutting_down"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf, _ = tiny_hf_model("qwen2", torch.float32)
    return write_tiny_checkpoint(hf, tmp_path_factory.mktemp("ops") / "ckpt")


def test_serve_exits_0_after_a_sigterm_drain(checkpoint: Path, tmp_path: Path) -> None:
    """``tidespec serve`` under SIGTERM with a stream running: the stream completes, the process exits 0 (was 143)."""
    port = free_port()
    proc = launch_server(f"--model {checkpoint} --threads 1 --shutdown-grace 20", port, None, timeout=120,
                         log_path=tmp_path / "server.log")
    try:
        body = {"model": "ckpt", "prompt": "w5 w6", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            lines: list[str] = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    if not lines:
                        proc.send_signal(signal.SIGTERM)
                    lines.append(line)
        assert lines[-1] == "data: [DONE]" and "error" not in lines[-2], lines[-2:]
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"  # all 40 tokens
        assert proc.wait(timeout=60) == 0, (tmp_path / "server.log").read_text()[-2000:]
    finally:
        stop_server(proc)


def test_bench_serve_launches_another_servers_command(checkpoint: Path, tmp_path: Path) -> None:
    """``bench serve --launch --launch-cmd``: any OpenAI server's command line (vLLM's in the docs),
    ``{port}`` filled in, waited for on /health, measured and stopped."""
    wl = tmp_path / "wl.jsonl"
    wl.write_text(json.dumps({"id": "a", "domain": "d", "kind": "completion", "prompt": "w5 w6"}) + "\n")
    cmd = f"{sys.executable} -m tidespec.server.cli serve --model {checkpoint} --threads 1 --port {{port}}"
    parser = argparse.ArgumentParser()
    bench_serve.add_args(parser)
    ns = parser.parse_args(["--launch", "--launch-cmd", cmd, "--workload", str(wl), "--num-requests", "2",
                            "--max-tokens", "4", "--launch-timeout", "120", "--out", str(tmp_path / "out")])
    assert bench_serve.run(ns) == 0
    report = json.loads((tmp_path / "out" / "bench_serve.json").read_text())
    assert report["summary"]["completed"] == 2 and report["config"]["model"] == "ckpt"
    with pytest.raises(httpx.TransportError):  # stopped after the run
        httpx.get(f"{report['config']['base_url']}/health", timeout=5)


# ----------------------------------------------------------------------------- 7. start-up
def test_the_port_answers_loading_until_the_model_is_ready() -> None:
    """The port is bound before the model loads; /health is 503 "loading" (and
    every API request a 503 with Retry-After) until the engine runs, then requests are served."""
    admission = Admission("loading")
    release = threading.Event()

    def load() -> Any:
        release.wait(30)
        return create_app(tiny_engine(), ServerConfig(served_model_name=MODEL), admission=admission)

    app = DeferredApp(load, admission, on_failure=lambda exc: None)
    with LiveServer(app, grace_s=1.0) as s:  # type: ignore[arg-type]
        health = httpx.get(f"{s.url}/health", timeout=5)
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        r = httpx.post(f"{s.url}/v1/completions", json={"model": MODEL, "prompt": "t5", "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "model_loading"
        release.set()
        deadline = time.monotonic() + 30
        while httpx.get(f"{s.url}/health", timeout=5).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = httpx.post(f"{s.url}/v1/completions", json={"model": MODEL, "prompt": "t5", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text


def test_a_kv_cache_larger_than_memory_is_refused_unless_overcommitted() -> None:
    """A server with --max-num-seqs 3000 --max-model-len 8192 (about 1 TB on the embedded model)
    started and died later by the OOM killer. Slots of the full length (a target that is not
    row-invariant) are now refused at start-up, naming both flags; the paged cache of a
    row-invariant target holds what the memory allows and runs that many tokens at once."""
    cache = CacheConfig(max_model_len=512, max_num_seqs=10**7)  # 2.6 TB in float64
    slots = ModelConfig(row_invariant=False)
    with pytest.raises(ConfigError, match="--max-num-seqs or --max-model-len.*--kv-overcommit"):
        LLMEngine(tiny_llama(64), tiny_tokenizer(64), EngineConfig(model=slots, cache=cache))
    LLMEngine(tiny_llama(64), tiny_tokenizer(64), EngineConfig(model=slots, cache=CacheConfig(
        max_model_len=256, max_num_seqs=4, kv_overcommit=True)))
    paged = LLMEngine(tiny_llama(64), tiny_tokenizer(64), EngineConfig(cache=cache))
    assert isinstance(paged.kv, PagedKVCache)
    held = paged.kv.num_blocks * paged.kv.block_size
    assert 0 < held < 10**7 * 512 and paged.kv.num_slots <= paged.kv.num_blocks


def test_serve_reports_a_refused_kv_cache_as_one_line(checkpoint: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "tidespec.server.cli", "serve", "--port", str(free_port()), "--model", str(checkpoint),
           "--max-num-seqs", str(10**7), "--threads", "1", "--no-row-invariant"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: the KV cache of" in done.stderr and "--kv-overcommit" in done.stderr


# ----------------------------------------------------------------------------- 5. params
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "t5 t6", "max_tokens": 4}
BAD_FIELDS: list[tuple[dict[str, Any], str]] = [  # (fields merged into the body, the param the 400 names)
    ({"max_tokens": 9223372036854775808}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 65}, "n"),
    ({"seed": 2**64}, "seed"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 5}, "min_tokens"),
    ({"best_of": 2}, "best_of"),
    ({"prediction": {"type": "text", "content": "x"}}, "prediction.type"),
    ({"user": "u" * 300}, "user"),
    ({"tidespec": {"num_speculative_tokens": 100}}, "tidespec.num_speculative_tokens"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_400_names_its_parameter(chat: bool) -> None:
    """A lone surrogate gave param null, max_tokens 2**63 and a too-long chat
    message gave "prompt" (chat has no prompt); each field's 400 now names that field."""
    base = CHAT if chat else COMPLETION
    path = "/v1/chat/completions" if chat else "/v1/completions"
    cases = list(BAD_FIELDS)
    if chat:
        cases += [({"messages": [{"role": "user", "content": "t5 " * 400}]}, "messages"),
                  ({"messages": [{"role": "user", "content": "t5 \ud800"}]}, "messages[0].content"),
                  ({"messages": []}, "messages"),
                  ({"messages": [{"role": "robot", "content": "t5"}]}, "messages.0.role"),
                  ({"max_tokens": None, "max_completion_tokens": 10**6}, "max_completion_tokens")]
    else:
        cases += [({"prompt": "t5 " * 400}, "prompt"), ({"prompt": "t5 \ud800"}, "prompt"),
                  ({"prompt": [70]}, "prompt"), ({"prompt": ""}, "prompt")]
    with LiveServer(create_app(tiny_engine(), ServerConfig(served_model_name=MODEL))) as s, \
            httpx.Client(base_url=s.url, timeout=30) as c:
        for fields, param in cases:
            r = c.post(path, content=json.dumps({**base, **fields}), headers={"content-type": "application/json"})
            assert r.status_code == 400, (fields, r.text)
            assert r.json()["error"]["param"] == param, (fields, r.json())
        r = c.post(path, json={**base, "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


# ----------------------------------------------------------------------------- 6. unknown fields
def test_unknown_fields_are_named_in_a_header_and_the_log_or_refused(caplog: pytest.LogCaptureFixture) -> None:
    """Unknown fields were dropped silently; now ignored (as vLLM) but named in
    X-Tidespec-Ignored-Fields and logged once per name; --strict-fields makes them a 400."""
    extra = {"guided_decoding_backend": "xgrammar", "reasoning_effort": "low", "top_a": 0.5}
    with LiveServer(create_app(tiny_engine(), ServerConfig(served_model_name=MODEL))) as s, \
            httpx.Client(base_url=s.url, timeout=30) as c, caplog.at_level(logging.WARNING, "tidespec.server"):
        r = c.post("/v1/completions", json={**COMPLETION, **extra})
        assert r.status_code == 200
        assert r.headers[IGNORED_FIELDS_HEADER].split(",") == list(extra)
        chat = {**CHAT, "messages": [{"role": "user", "content": "t5", "refusal": "x"}], "top_a": 1}
        with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers[IGNORED_FIELDS_HEADER] == "top_a,messages[0].refusal"
        assert IGNORED_FIELDS_HEADER not in c.post("/v1/completions", json=COMPLETION).headers
        odd = c.post("/v1/completions", json={**COMPLETION, "x\r\nSet-Cookie: a": 1, "日本": 2, "a,b": 3})
        assert odd.status_code == 200 and "set-cookie" not in odd.headers
        assert odd.headers[IGNORED_FIELDS_HEADER] == "x%0D%0ASet-Cookie:%20a,%E6%97%A5%E6%9C%AC,a%2Cb"
        c.post("/v1/completions", json={**COMPLETION, **extra})  # logged once per name
    warned = [r.getMessage() for r in caplog.records if "unknown field" in r.getMessage()]
    assert len(warned) == 3 and all(name in warned[0] for name in extra), warned
    strict = create_app(tiny_engine(), ServerConfig(served_model_name=MODEL, strict_fields=True))
    with LiveServer(strict) as s:
        r = httpx.post(f"{s.url}/v1/chat/completions", json={**CHAT, "top_a": 0.5}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_a"
        assert r.json()["error"]["code"] == "unknown_field"
        # OpenAI fields sent at their "not used" values are known, not unknown
        assert httpx.post(f"{s.url}/v1/chat/completions", json={**CHAT, "tools": []}, timeout=30).status_code == 200


# ----------------------------------------------------------------------------- chaos with a drain
CKPT_INNOCENT = [  # (body, stream) in the tiny checkpoint's words; long enough to outlast the late probes
    ({"prompt": "w5 w6 w7", "max_tokens": 160, "temperature": 0.0}, True),
    ({"prompt": "w9 w8", "max_tokens": 150, "temperature": 0.9, "top_p": 0.8, "seed": 3}, True),
    ({"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 140, "temperature": 1.0, "seed": 11}, True),
    ({"messages": [{"role": "user", "content": "w7"}], "max_tokens": 150, "temperature": 0.0}, False),
    ({"prompt": "w11 w12 w11 w12", "max_tokens": 160, "temperature": 0.7, "top_k": 5, "seed": 99}, False),
]
CKPT_INNOCENT = [({**body, "ignore_eos": True}, stream) for body, stream in CKPT_INNOCENT]


def _for_checkpoint(body: dict[str, Any] | bytes) -> dict[str, Any] | bytes:
    """A poisoned body of the in-process chaos test, aimed at the tiny checkpoint (its name, its words)."""
    if isinstance(body, bytes):
        return body.replace(b'"tiny"', b'"ckpt"').replace(b'"t5', b'"w5')
    out = {**body, "model": "ckpt"}
    if isinstance(out.get("prompt"), str):
        out["prompt"] = out["prompt"].replace("t5", "w5").replace("t6", "w6")
    return out


# make test-slow: make test keeps the drain (test_sigterm_drains_running_requests_and_refuses_new_ones) and the
# clean exit (test_serve_exits_0_after_a_sigterm_drain); this is their 18 s union under hostile clients
@pytest.mark.slow
def test_chaos_with_a_sigterm_in_the_middle(checkpoint: Path, tmp_path: Path) -> None:
    """The operations chaos run, through ``tidespec serve``: slow-body and slowloris clients, a burst of
    poisoned requests, 60 concurrent streams of which a third disconnect, and a SIGTERM once all are
    under way: every innocent request ends with its quiet-server text, every request after the
    signal gets a 503 naming the shutdown, every poisoned one its 4xx, nothing is left unanswered,
    and the process exits 0."""
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE.replace("t3", "w3").replace("t2", "w4")
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    port = free_port()
    proc = launch_server(f"--model {checkpoint} --threads 1 --drafter suffix --num-speculative-tokens 3 "
                         "--max-num-seqs 8 --max-model-len 256 --body-timeout 1 --header-timeout 1 "
                         "--shutdown-grace 60", port, None, timeout=120, log_path=tmp_path / "server.log")
    url = f"http://127.0.0.1:{port}"
    try:
        async def quiet() -> list[str]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                return [await _innocent(client, body, stream, "ckpt") for body, stream in CKPT_INNOCENT]

        reference = asyncio.run(quiet())

        async def storm(pool: concurrent.futures.ThreadPoolExecutor) -> tuple[list[Any], list[Any]]:
            rng = random.Random(1)
            started: list[int] = []
            limits = httpx.Limits(max_connections=160, max_keepalive_connections=64)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
                loop = asyncio.get_running_loop()  # a thread per socket client, all connected before the signal
                slow = [loop.run_in_executor(pool, _partial_body, port, None) for _ in range(10)]
                slowloris = [loop.run_in_executor(pool, _slowloris, port) for _ in range(10)]
                innocent = [asyncio.ensure_future(_innocent(client, *CKPT_INNOCENT[i % len(CKPT_INNOCENT)], "ckpt", started))
                            for i in range(40)]
                leavers = [asyncio.ensure_future(_disconnect(client, rng.randint(1, 6), "ckpt", "w5 w6")) for _ in range(20)]
                poisoned = [asyncio.ensure_future(_poisoned(client, _for_checkpoint(body), expect,
                                                            chunked=rng.random() < 0.3)) for body, expect in POISON]
                deadline = time.monotonic() + 60
                while len(started) < 40 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                proc.send_signal(signal.SIGTERM)  # with every innocent request under way
                await asyncio.sleep(0.1)
                late = [await client.post("/v1/completions", json={"model": "ckpt", "prompt": "w5", "max_tokens": 2})
                        for _ in range(5)]
                done = await asyncio.wait_for(asyncio.gather(*innocent, *leavers, *poisoned, *slow, *slowloris,
                                                             return_exceptions=True), 240)
            return done, late

        with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
            done, late = asyncio.run(storm(pool))
        failures = [r for r in done if isinstance(r, BaseException)]
        assert not failures, failures[:3]
        for k, text in enumerate(done[:40]):
            assert text == reference[k % len(CKPT_INNOCENT)], k
        for answer, _seconds in done[60 + len(POISON):70 + len(POISON)]:  # the slow bodies
            assert answer.startswith(b"HTTP/1.1 408"), answer
        for r in late:
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
            assert r.headers["retry-after"]
        assert proc.wait(timeout=90) == 0, (tmp_path / "server.log").read_text()[-3000:]
    finally:
        stop_server(proc)
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log, log[-3000:]


def _slowloris(port: int) -> bytes:
    """Header bytes trickled and never finished: the connection gets a 408 and is closed."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        try:
            for _ in range(20):
                time.sleep(0.1)
                sock.sendall(b"X-Slow: a\r\n")
        except OSError:
            pass
        answer = _read_until_closed(sock, 20.0)
    assert answer.startswith(b"HTTP/1.1 408") or answer == b"", answer
    return answer


# ----------------------------------------------------------------------------- 4. memory
def test_the_memory_trimmer_runs_once_per_burst_and_after_its_last_request() -> None:
    """A trim after a large request, at most one per ``every_s``, and always one after a burst's
    last request (the trim itself: glibc's malloc_trim, measured by ``tidespec bench memory``)."""
    trimmer = MemoryTrimmer(every_s=0.3)
    calls: list[float] = []
    trimmer._trim = lambda _pad: calls.append(time.monotonic()) or 1  # type: ignore[assignment]

    async def burst() -> None:
        for _ in range(10):  # 10 large requests within 0.1 s
            trimmer.after_large_request()
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.8)

    asyncio.run(burst())
    assert len(calls) == 2, calls  # the first at once, the trailing one after every_s
    assert calls[1] - calls[0] >= 0.25
