"""The OpenAI-compatible server against a real uvicorn on a loopback port, driven by the official client.

Most tests use the tiny random model from ``tests/helpers.py`` (word-level tokens ``t0 .. t63``,
``t0`` = EOS) behind a minimal chat template; one integration test repeats the core checks on the
embedded SmolLM2-135M. Concurrency tests use httpx's async client; errors must be OpenAI error
objects; a disconnecting client must leave no KV behind.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import pkgutil
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from tests.server.live import MODEL, LiveServer, stream_text, tiny_engine
from tidespec.config import CacheConfig, EngineConfig
from tidespec.engine.engine import LLMEngine
from tidespec.engine.observer import Hooks
from tidespec.llm import build_engine
from tidespec.models.loading.loader import LoadedModel
from tidespec.server import routes
from tidespec.server.app import ServerConfig, create_app
from tidespec.speculative.drafters.ngram import NgramDrafter


@pytest.fixture(scope="module")
def srv() -> Iterator[LiveServer]:
    engine = tiny_engine()
    with LiveServer(create_app(engine, ServerConfig(served_model_name=MODEL))) as s:
        yield s


# ----------------------------------------------------------------------------- basic API
def test_models_and_health(srv: LiveServer) -> None:
    models = srv.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}


def test_models_retrieve(srv: LiveServer) -> None:
    """The official client's ``models.retrieve`` (``GET /v1/models/{id}``) used to be a 404."""
    assert srv.client().models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as nf:
        srv.client().models.retrieve("gpt-17")
    assert nf.value.body["code"] == "model_not_found"  # type: ignore[index]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.9, "seed": 1234}])
def test_completion_stream_equals_nonstream(srv: LiveServer, sampling: dict[str, Any]) -> None:
    c = srv.client()
    full = c.completions.create(model=MODEL, prompt="t5 t6 t7", max_tokens=20, **sampling)
    stream = c.completions.create(model=MODEL, prompt="t5 t6 t7", max_tokens=20, stream=True,
                                  stream_options={"include_usage": True}, **sampling)
    text, finish, usage = stream_text(stream, chat=False)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert text == full.choices[0].text and text
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens == 3


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}])
def test_chat_stream_equals_nonstream(srv: LiveServer, sampling: dict[str, Any]) -> None:
    c = srv.client()
    msgs = [{"role": "system", "content": "t9"}, {"role": "user", "content": "t5 t6"}]
    full = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, **sampling)
    stream = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, stream=True,
                                       stream_options={"include_usage": True}, **sampling)
    text, finish, usage = stream_text(stream, chat=True)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert text == full.choices[0].message.content and text
    assert finish == full.choices[0].finish_reason
    # template: "t3 t9 t3 t5 t6 t2" -> 6 prompt tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens == 6
    assert usage.completion_tokens == full.usage.completion_tokens


def test_stop_strings(srv: LiveServer) -> None:
    c = srv.client()
    full = c.completions.create(model=MODEL, prompt="t8 t9", max_tokens=24, temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 6
    stop = words[4]
    expected = full[:full.find(stop)]
    got = c.completions.create(model=MODEL, prompt="t8 t9", max_tokens=24, temperature=0, stop=[stop, "zzz"])
    assert got.choices[0].text == expected and got.choices[0].finish_reason == "stop"
    streamed, finish, _ = stream_text(c.completions.create(model=MODEL, prompt="t8 t9", max_tokens=24,
                                                            temperature=0, stop=stop, stream=True), chat=False)
    assert streamed == expected and finish == "stop"


def test_usage_counts(srv: LiveServer) -> None:
    c = srv.client()
    r = c.completions.create(model=MODEL, prompt="t4 t5 t6 t7 t8", max_tokens=7, temperature=0,
                             extra_body={"ignore_eos": True, "tidespec": {"enabled": False}})
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (5, 7, 12)
    assert r.choices[0].finish_reason == "length"
    assert len(r.choices[0].text.split()) == 7
    extra = u.model_extra or {}
    assert extra["draft_tokens"] == 0 and extra["accepted_tokens"] == 0
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t4"}],
                                     max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (3, 3)
    # prompt as a one-element list and as token ids: same tokens, same greedy output
    a = c.completions.create(model=MODEL, prompt=["t4 t5"], max_tokens=5, temperature=0)
    b = c.completions.create(model=MODEL, prompt=[4, 5], max_tokens=5, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == 2


# ----------------------------------------------------------------------------- errors
def test_a_resent_prompt_reports_its_cached_tokens(srv: LiveServer) -> None:
    """As OpenAI and vLLM: ``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens
    served from the prefix cache; /metrics counts lookups and hits; the text does not change."""
    c = srv.client()
    prompt = " ".join(f"t{3 + (7 * i) % 59}" for i in range(37))  # 37 tokens: 2 full blocks of 16
    registry = srv.app.state.metrics.registry
    hits0 = registry.get_sample_value("tidespec:prefix_cache_hits_total") or 0.0
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0,
                            "extra_body": {"ignore_eos": True}}
    first, second = c.completions.create(**body), c.completions.create(**body)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert second.usage.prompt_tokens_details.cached_tokens == 32  # type: ignore[union-attr]
    assert second.choices[0].text == first.choices[0].text
    assert registry.get_sample_value("tidespec:prefix_cache_hits_total") - hits0 == 32
    assert registry.get_sample_value("tidespec:prefix_cache_queries_total") >= 2 * 37


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_errors_are_openai_style(srv: LiveServer) -> None:
    c = srv.client()
    bad: list[tuple[dict[str, Any], str]] = [
        (dict(prompt="t5", temperature=5.0), "temperature"),
        (dict(prompt="t5", n=65), "n"),
        (dict(prompt=["t5"] * 9, n=8), "choices"),
        (dict(prompt=""), "prompt is empty"),
        (dict(prompt="t5 t6", max_tokens=400), "exceeds the context length"),
        (dict(prompt="t5", max_tokens=0), "max_tokens"),
        (dict(prompt="t5", top_p=0.0), "top_p"),
        (dict(prompt="t5", stop=""), "stop"),
        (dict(prompt=[1, 2, 64]), "vocab size"),
        (dict(prompt="t5", extra_body={"tidespec": {"num_speculative_tokens": -1}}), "num_speculative_tokens"),
    ]
    for kwargs, needle in bad:
        with pytest.raises(openai.BadRequestError) as ei:
            c.completions.create(model=MODEL, **kwargs)
        assert ei.value.status_code == 400
        assert needle in ei.value.body["message"], (kwargs, ei.value.body)  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as nf:
        c.completions.create(model="gpt-17", prompt="t5")
    assert nf.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as em:
        c.chat.completions.create(model=MODEL, messages=[])
    assert "messages" in em.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "t5"}])  # type: ignore[list-item]
    # raw HTTP: malformed JSON, a non-object body, unknown route and method, bad route header
    url = f"{srv.url}/v1/completions"
    assert "invalid JSON" in _error(httpx.post(url, content=b'{"prompt": ', headers={
        "content-type": "application/json"}), 400)["message"]
    _error(httpx.post(url, json=[1, 2]), 400)
    _error(httpx.get(f"{srv.url}/v1/nothing"), 404)
    _error(httpx.delete(f"{srv.url}/v1/models"), 405)
    _error(httpx.post(url, json={"prompt": "t5"}, headers={"X-Tidespec-Route": "bad label!"}), 400)
    assert _error(httpx.post(url, content=b"x" * (5 * 2**20), headers={"content-type": "application/json"}),
                  413)["code"] == "body_too_large"
    chunked = (b"x" * 2**20 for _ in range(5))  # no Content-Length: sent with chunked transfer encoding
    assert _error(httpx.post(url, content=chunked, headers={"content-type": "application/json"}),
                  413)["code"] == "body_too_large"  # was a 400
    small = (part for part in (b'{"model": "tiny", "prompt": "t5", ', b'"max_tokens": 2}'))
    assert httpx.post(url, content=small, headers={"content-type": "application/json"}).status_code == 200
    assert srv.wait_idle() == (0.0, 0, 0, 0)


def test_unsupported_fields_are_refused_and_neutral_values_accepted(srv: LiveServer) -> None:
    """An OpenAI feature tidespec does not implement is a 400 naming the field, never
    a 200 that silently ignores it; the values clients send by default still work."""
    url = f"{srv.url}/v1/chat/completions"
    base = {"model": MODEL, "messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 2}
    refused = {"functions": [{"name": "f"}], "function_call": {"name": "f"},
               "modalities": ["audio"], "audio": {"voice": "x"},
               "service_tier": "flex"}
    for field, value in refused.items():
        err = _error(httpx.post(url, json={**base, field: value}), 400)
        assert err["param"] == field and "not supported" in err["message"], (field, err)
    neutral = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": {},
               "modalities": ["text"], "top_logprobs": 0, "service_tier": "auto"}
    assert httpx.post(url, json={**base, **neutral}).status_code == 200
    # tools are served (tests/server/test_tools.py), but this model's template renders none: a 400
    err = _error(httpx.post(url, json={**base, "tools": [{"type": "function", "function": {"name": "f"}}]}), 400)
    assert err["param"] == "tools" and "chat template" in err["message"], err
    # structured outputs are served, but this model's word-level tokenizer is not one a grammar can
    # run over: a 400 naming the field, not a 500
    err = _error(httpx.post(url, json={**base, "response_format": {"type": "json_object"}}), 400)
    assert err["param"] == "response_format" and "tokenizer" in err["message"], err
    assert srv.wait_idle() == (0.0, 0, 0, 0)


def test_lone_surrogate_is_a_400_error_object(srv: LiveServer) -> None:
    """JSON may carry a lone UTF-16 surrogate ("\\ud800") that no tokenizer can
    encode; it is an OpenAI error object naming where it is, not a plain-text 500."""
    for path, body in (("completions", b'{"model": "%s", "prompt": "t5 \\ud800", "max_tokens": 2}'),
                       ("chat/completions", b'{"model": "%s", "max_tokens": 2, "messages": '
                                            b'[{"role": "user", "content": "\\ud800"}]}')):
        resp = httpx.post(f"{srv.url}/v1/{path}", content=body % MODEL.encode(),
                          headers={"content-type": "application/json"})
        err = _error(resp, 400)
        assert "not valid Unicode" in err["message"] and ("prompt" in err["message"] or "messages[0]" in
                                                          err["message"])
    assert srv.wait_idle() == (0.0, 0, 0, 0)


def test_api_key() -> None:
    engine = tiny_engine(max_num_seqs=2, max_waiting=2)
    with TestClient(create_app(engine, ServerConfig(served_model_name=MODEL, api_key="s3cret"))) as client:
        assert client.get("/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/openapi.json"):
            err = _error(client.get(path), 401)  # type: ignore[arg-type]
            assert err["code"] == "invalid_api_key"
        _error(client.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)  # type: ignore[arg-type]
        assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        r = client.post("/v1/completions", json={"prompt": "t5", "max_tokens": 2},
                        headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# ----------------------------------------------------------------------------- concurrency
def test_concurrent_streams_with_disconnects(srv: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    rng = random.Random(0)
    prompts = [f"t{rng.randrange(2, 64)} t{rng.randrange(2, 64)} t{rng.randrange(2, 64)}" for _ in range(32)]
    leavers = set(rng.sample(range(32), 11))
    cut_at = {i: rng.randrange(1, 12) for i in leavers}
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    aborts_before = _abort_count(srv)
    slow = _slow_steps(srv, 0.005)  # leave room for clients to disconnect mid-stream
    try:
        async def one(client: httpx.AsyncClient, i: int) -> tuple[str, str | None, bool]:
            text, finish, chunks = "", None, 0
            async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompts[i], "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        return text, finish, True
                    ch = json.loads(line[6:])
                    assert "error" not in ch, ch
                    text += ch["choices"][0]["text"]
                    finish = ch["choices"][0]["finish_reason"] or finish
                    chunks += 1
                    if i in leavers and chunks >= cut_at[i]:
                        return text, finish, False  # leaving the context closes the connection
            return text, finish, False

        async def main() -> list[tuple[str, str | None, bool]]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60,
                                         limits=httpx.Limits(max_connections=64)) as client:
                return list(await asyncio.gather(*(one(client, i) for i in range(32))))

        results = asyncio.run(main())
    finally:
        slow()
    assert srv.wait_idle() == (0.0, 0, 0, 0)  # every KV slot is free again, nothing left running
    assert _abort_count(srv) - aborts_before >= 1  # disconnects really aborted engine requests
    refs = _greedy_refs(srv, [prompts[i] for i in range(32) if i not in leavers], body)
    for i, (text, finish, done) in enumerate(results):
        if i in leavers:
            continue
        assert done and finish == "length", (i, text)
        assert text == refs[prompts[i]], i
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def _slow_steps(srv: LiveServer, seconds: float) -> Callable[[], None]:
    """Make every engine step take at least ``seconds`` (a step listener); returns the undo."""
    def sleep(_stats: object) -> None:
        time.sleep(seconds)
    observer = Hooks(step_end=sleep)
    srv.aengine.call(lambda e: e.add_observer(observer)).result(10)
    return lambda: srv.aengine.call(lambda e: e.remove_observer(observer)).result(10)


def _abort_count(srv: LiveServer) -> float:
    v = srv.app.state.metrics.registry.get_sample_value("tidespec:request_success_total", {"finish_reason": "abort"})
    return 0.0 if v is None else v


def _greedy_refs(srv: LiveServer, prompts: list[str], body: dict[str, Any]) -> dict[str, str]:
    async def main() -> dict[str, str]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            rs = await asyncio.gather(*(client.post("/v1/completions", json={**body, "prompt": p}) for p in prompts))
        return {p: r.json()["choices"][0]["text"] for p, r in zip(prompts, rs)}
    return asyncio.run(main())


def test_nonstreaming_disconnect_aborts(srv: LiveServer) -> None:
    aborts_before = _abort_count(srv)
    slow = _slow_steps(srv, 0.02)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "t5", "max_tokens": 120,
                                                          "ignore_eos": True}, timeout=0.5)
        assert srv.wait_idle(timeout=5.0) == (0.0, 0, 0, 0)
    finally:
        slow()
    assert _abort_count(srv) == aborts_before + 1


def test_overload_gets_200_or_429() -> None:
    engine = tiny_engine(max_num_seqs=2, max_waiting=2)
    with LiveServer(create_app(engine, ServerConfig(served_model_name=MODEL))) as s:
        async def main() -> list[int]:
            async with httpx.AsyncClient(base_url=s.url, timeout=60, limits=httpx.Limits(max_connections=80)) as c:
                async def one(i: int) -> int:
                    r = await c.post("/v1/completions", json={"model": MODEL, "prompt": f"t{2 + i % 60} t7",
                                                              "max_tokens": 24, "stream": i % 2 == 0})
                    if r.status_code == 429:
                        assert r.json()["error"]["type"] == "rate_limit_error"
                        assert r.headers["retry-after"] == "1"
                    elif r.status_code == 200 and i % 2 == 0:
                        assert r.text.endswith("data: [DONE]\n\n")
                    return r.status_code
                return list(await asyncio.gather(*(one(i) for i in range(60))))

        statuses = asyncio.run(main())
        assert set(statuses) <= {200, 429}
        # in a burst, admission is bounded by the engine's waiting queue (2) until the loop schedules;
        # at least that many succeed, every other request gets a clean 429
        assert statuses.count(429) >= 1 and statuses.count(200) >= 2
        assert s.aengine.peak_in_flight <= 4  # max_num_seqs + max_waiting: memory stays bounded
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert s.wait_idle() == (0.0, 0, 0, 0)
        ok = s.client().completions.create(model=MODEL, prompt="t5", max_tokens=3)
        assert ok.usage.completion_tokens >= 1


# ----------------------------------------------------------------------------- engine failures
class _PoisonError(RuntimeError):
    def __init__(self, seq_ids: list[int]) -> None:
        super().__init__(f"poisoned sequences {seq_ids}")
        self.seq_ids = seq_ids


def poisoned_engine(poison: int, attributable: bool) -> LLMEngine:
    """An n-gram-drafting engine whose target forward raises in any step that decodes a sequence
    whose first prompt token is ``poison`` (its prefill passes); the error names those sequences
    (``seq_ids``) when ``attributable``, else it is a plain RuntimeError. (The poison cannot sit in
    the drafter: a drafter that raises only costs its sequences their drafts.)"""
    engine = tiny_engine(max_num_seqs=8, drafter=NgramDrafter(1, 3))
    forward = engine.runner.forward

    def poisoned(batch: Any, proposal: Any, tap_layers: Any = ()) -> Any:
        bad = [seq.seq_id for seq in batch.decode if seq.token_ids[0] == poison]
        if bad:
            raise _PoisonError(bad) if attributable else RuntimeError("forward crashed")
        return forward(batch, proposal, tap_layers)

    engine.runner.forward = poisoned  # type: ignore[method-assign]
    return engine


async def _run_mixed(url: str, prompts: list[str], stream: list[bool]) -> list[tuple[int, str, bool]]:
    """(status, text, got an error) per prompt, all sent at once."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async def one(p: str, s: bool) -> tuple[int, str, bool]:
            body = {"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": s}
            r = await c.post("/v1/completions", json=body)
            if not s or r.status_code != 200:
                return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else "", "error" in r.json()
            text, err = "", False
            for line in r.text.splitlines():
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])
                    err = err or "error" in ch
                    text += "" if "error" in ch else ch["choices"][0]["text"]
            return r.status_code, text, err
        return list(await asyncio.gather(*(one(p, s) for p, s in zip(prompts, stream))))


def test_engine_error_fails_only_that_request(caplog: pytest.LogCaptureFixture) -> None:
    engine = poisoned_engine(63, attributable=True)
    with LiveServer(create_app(engine, ServerConfig(served_model_name=MODEL))) as s:
        good = ["t5 t6 t5 t6", "t9 t8 t7", "t11 t12 t11"]
        refs = {p: s.client().completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0,
                                                 extra_body={"ignore_eos": True}).choices[0].text for p in good}
        with caplog.at_level(logging.ERROR, logger="tidespec.server"):
            results = asyncio.run(_run_mixed(s.url, ["t63 t5 t6", *good, "t63 t1"], [True, False, True, False, False]))
        poisoned = [results[0], results[4]]
        assert results[0][0] == 200 and results[0][2]  # streaming: error event after the 200 header
        assert results[4][0] == 500 and results[4][2]
        for p, (status, text, err) in zip(good, results[1:4]):
            assert status == 200 and not err and text == refs[p]
        assert any("engine step failed" in r.getMessage() for r in caplog.records)
        assert len(poisoned) == 2
        assert s.wait_idle() == (0.0, 0, 0, 0)
        assert httpx.get(f"{s.url}/health").status_code == 200


def test_unattributable_engine_error_fails_in_flight_and_recovers() -> None:
    engine = poisoned_engine(63, attributable=False)
    with LiveServer(create_app(engine, ServerConfig(served_model_name=MODEL))) as s:
        results = asyncio.run(_run_mixed(s.url, ["t63 t5", "t9 t8 t7"], [False, False]))
        assert results[0][0] == 500 and results[0][2]
        assert all(status in (200, 500) for status, _, _ in results)
        assert s.wait_idle() == (0.0, 0, 0, 0)
        after = s.client().completions.create(model=MODEL, prompt="t9 t8 t7", max_tokens=4, temperature=0)
        assert after.choices[0].text
        assert s.aengine.num_step_errors >= 1


def test_load_gauges_are_current_after_a_failed_step() -> None:
    """The only request fails in its first decode step (after its prefill step had set the gauges
    to one running request): the gauges return to idle without waiting for another request."""
    engine = poisoned_engine(63, attributable=False)
    with LiveServer(create_app(engine, ServerConfig(served_model_name=MODEL))) as s:
        # ignore_eos: a sampled EOS as the first token would end the request before any decode step
        # (the test then saw a 200: it happened once in a full make test)
        r = httpx.post(f"{s.url}/v1/completions", json={"model": MODEL, "prompt": "t63 t5", "max_tokens": 8,
                                                         "ignore_eos": True})
        assert r.status_code == 500
        assert s.wait_idle() == (0.0, 0, 0, 0)
        gauges = {}
        for line in httpx.get(f"{s.url}/metrics").text.splitlines():
            name, _, value = line.partition(" ")
            if name in ("tidespec:num_requests_running", "tidespec:kv_cache_usage_perc"):
                gauges[name] = float(value)
        assert gauges == {"tidespec:num_requests_running": 0.0, "tidespec:kv_cache_usage_perc": 0.0}


def test_prompts_are_templated_and_tokenized_off_the_engine_thread_and_the_event_loop() -> None:
    """Tokenizing a 4 MiB prompt on the engine thread froze every stream; rendering a huge chat on
    the event loop froze /health. Both now run on the preparation worker."""
    engine = tiny_engine()
    threads: dict[str, set[str]] = {"encode": set(), "template": set()}
    encode, template = engine.tokenizer.encode, engine.tokenizer.apply_chat_template

    def spy_encode(*args: Any, **kwargs: Any) -> Any:
        threads["encode"].add(threading.current_thread().name)
        return encode(*args, **kwargs)

    def spy_template(*args: Any, **kwargs: Any) -> Any:
        threads["template"].add(threading.current_thread().name)
        return template(*args, **kwargs)

    engine.tokenizer.encode = spy_encode  # type: ignore[method-assign]
    engine.tokenizer.apply_chat_template = spy_template  # type: ignore[method-assign]
    with LiveServer(create_app(engine, ServerConfig(served_model_name=MODEL))) as s:
        c = s.client()
        assert c.completions.create(model=MODEL, prompt="t5 t6", max_tokens=3).choices[0].text is not None
        assert c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t4"}], max_tokens=3)
    assert threads["template"] and all(n.startswith("tidespec-prep") for n in threads["template"]), threads
    assert threads["encode"] and all(n.startswith("tidespec-prep") for n in threads["encode"]), threads


def test_shutdown_ends_a_stream_still_running_with_an_error_event() -> None:
    """SIGTERM with a stream longer than the grace period: the stream gets an OpenAI error event and
    [DONE] (it used to be cut mid-body, no error, a traceback in the log); a request that finishes
    within the grace period completes normally."""
    engine = tiny_engine()
    engine.add_observer(Hooks(step_start=lambda _e: time.sleep(0.03)))  # ~30 tokens/s: 150 tokens outlast the grace
    server = LiveServer(create_app(engine, ServerConfig(served_model_name=MODEL)), grace_s=0.5)
    with server as s:
        lines: list[str] = []
        with httpx.stream("POST", f"{s.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "t5 t6", "max_tokens": 150, "stream": True,
                                "ignore_eos": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and not lines:
                    s.server.should_exit = True  # what SIGTERM does, once the stream has started
                lines.append(line)
    data = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    last = json.loads(data[-2])
    assert "error" in last and "shutting down" in last["error"]["message"], last
    assert 1 < len(data) - 2 < 150  # some tokens arrived, not all


def test_every_route_module_is_assembled_and_answers_openapi(monkeypatch: pytest.MonkeyPatch) -> None:
    """A route is one module of ``tidespec.server.routes`` (plus its test): ``create_app`` builds
    each module's router, and the OpenAPI schema (what schemathesis fuzzes) lists their paths."""
    built: set[str] = set()
    names = [m.name for m in pkgutil.iter_modules(routes.__path__)]
    for name in names:
        module = importlib.import_module(f"{routes.__name__}.{name}")

        def recording(*args: Any, _real: Callable[..., Any] = module.router, _name: str = name, **kwargs: Any) -> Any:
            built.add(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(module, "router", recording)
    app = create_app(tiny_engine(), ServerConfig(served_model_name=MODEL))
    assert names and built == set(names)
    assert {"/health", "/metrics", "/v1/models", "/v1/models/{model_id}", "/v1/completions",
            "/v1/chat/completions"} <= set(app.openapi()["paths"])


# ----------------------------------------------------------------------------- embedded model
@pytest.mark.integration
def test_embedded_model_end_to_end(embedded: LoadedModel) -> None:
    engine = build_engine(EngineConfig(cache=CacheConfig(max_model_len=1024, max_num_seqs=4)),
                          model=embedded.model, tokenizer=embedded.tokenizer)
    with LiveServer(create_app(engine, ServerConfig(served_model_name="smollm2"))) as s:
        c = s.client()
        msgs = [{"role": "user", "content": "Name three colors."}]
        for sampling in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 11}):
            full = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=12, **sampling)
            text, finish, usage = stream_text(c.chat.completions.create(
                model="smollm2", messages=msgs, max_tokens=12, stream=True, stream_options={"include_usage": True},
                **sampling), chat=True)
            assert text == full.choices[0].message.content and text.strip()
            assert finish == full.choices[0].finish_reason
            assert usage.completion_tokens == full.usage.completion_tokens <= 12
            expect_prompt = len(embedded.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                                       return_dict=False))
            assert usage.prompt_tokens == full.usage.prompt_tokens == expect_prompt
        prompt = "def fibonacci(n):\n"
        comp = c.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0)
        streamed, _, _ = stream_text(c.completions.create(model="smollm2", prompt=prompt, max_tokens=16,
                                                           temperature=0, stream=True), chat=False)
        assert streamed == comp.choices[0].text
        assert comp.usage.prompt_tokens == len(embedded.tokenizer.encode(prompt, add_special_tokens=False))
        assert comp.usage.total_tokens == comp.usage.prompt_tokens + comp.usage.completion_tokens
        text = comp.choices[0].text
        stop = next(w for w in text.split() if len(w) >= 2 and text.find(w) > 0)
        stopped = c.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
        assert stopped.choices[0].text == text[:text.find(stop)]
        assert stopped.choices[0].finish_reason == "stop"
        assert s.wait_idle() == (0.0, 0, 0, 0)
