"""Fuzzing the HTTP API with hypothesis: > 1,000 malformed requests, only 4xx, never 5xx, server alive.

Requests are built three ways: (1) a valid completion/chat request with one to three fields
replaced by values that are each invalid on their own (wrong type, out of range, unknown model,
beyond the context, unsupported feature), so the answer must be a 4xx OpenAI error; (2) arbitrary
bytes and arbitrary JSON documents as the body, which must never produce a 5xx; (3) random
methods and paths. A few valid requests are mixed in (max_tokens <= 2) and must succeed. The
app runs in-process under FastAPI's ``TestClient`` with the tiny model (context 64 tokens).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig, SchedulerConfig
from tidespec.engine.engine import LLMEngine
from tidespec.server.app import ServerConfig, create_app

MODEL = "tiny"
CONTEXT = 64
FUZZ = settings(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = tiny_tokenizer(64)
    tok.chat_template = "{% for m in messages %}t3 {{ m['content'] }} {% endfor %}t2"
    cfg = EngineConfig(cache=CacheConfig(max_model_len=CONTEXT, max_num_seqs=4),
                       scheduler=SchedulerConfig(max_waiting=16))
    engine = LLMEngine(tiny_llama(64), tok, cfg)
    with TestClient(create_app(engine, ServerConfig(served_model_name=MODEL, max_body_bytes=64 * 1024))) as c:
        yield c
        # the server is alive and serves a valid request after the fuzzing
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "t5 t6", "max_tokens": 2})
        assert r.status_code == 200, r.text
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- strategies
scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=12)
not_str = st.none() | st.booleans() | st.integers() | st.floats() | st.lists(scalars, max_size=3) \
    | st.dictionaries(st.text(max_size=4), scalars, max_size=2)
not_int = st.booleans() | st.floats() | st.text(max_size=6) | st.lists(st.integers(), max_size=2) | st.just({})
not_num = st.booleans() | st.text(max_size=6) | st.lists(st.floats(), max_size=2) | st.just({}) \
    | st.sampled_from([float("nan"), float("inf"), float("-inf")])
not_bool = st.integers() | st.floats() | st.text(max_size=6) | st.just([]) | st.just({})

# each value is invalid for its field on its own
BAD_COMMON: dict[str, st.SearchStrategy[Any]] = {
    "model": st.text(max_size=12).filter(lambda s: s != MODEL) | not_str.filter(lambda v: v is not None),
    "max_tokens": st.integers(max_value=0) | st.integers(min_value=CONTEXT) | not_int,
    "temperature": st.floats(max_value=-1e-6) | st.floats(min_value=2.000001) | not_num,
    "top_p": st.floats(max_value=0.0) | st.floats(min_value=1.000001) | not_num,
    "top_k": st.integers(max_value=-2) | not_int,
    "n": st.integers(max_value=0) | st.integers(min_value=65) | not_int,
    "stop": st.just("") | st.lists(st.text(min_size=1, max_size=3), min_size=17, max_size=20)
    | st.lists(st.just(""), min_size=1, max_size=2) | not_int.filter(lambda v: not isinstance(v, (str, list)))
    | st.lists(st.integers(), min_size=1, max_size=2),
    "seed": st.integers(min_value=2**64) | st.integers(max_value=-(2**63) - 1) | not_int,
    "stream": not_bool,
    "stream_options": st.integers() | st.text(max_size=4) | st.fixed_dictionaries({"include_usage": not_bool}),
    "tidespec": st.integers() | st.text(max_size=4)
    | st.fixed_dictionaries({"enabled": not_bool})
    | st.fixed_dictionaries({"num_speculative_tokens": st.integers(max_value=-1) | st.integers(min_value=65) | not_int}),
    "user": not_str.filter(lambda v: v is not None) | st.text(min_size=257, max_size=300),
    "best_of": st.integers(min_value=2, max_value=5),
    "presence_penalty": st.floats(min_value=2.000001) | st.floats(max_value=-2.000001) | not_num,
    "frequency_penalty": st.floats(min_value=2.000001) | st.floats(max_value=-2.000001) | not_num,
    "repetition_penalty": st.floats(max_value=0.0) | not_num,
    "logit_bias": st.dictionaries(st.text(max_size=3).filter(lambda k: not k.isdigit()), st.floats(-1, 1),
                                  min_size=1, max_size=2)
    | st.dictionaries(st.integers(0, 63).map(str), st.floats(min_value=100.001), min_size=1, max_size=2)
    | st.dictionaries(st.integers(min_value=64).map(str), st.floats(-1, 1), min_size=1, max_size=2)
    | st.integers() | st.text(max_size=4) | st.just([]),
    "ignore_eos": not_bool,
}
BAD_COMPLETION = {
    **BAD_COMMON,
    "prompt": st.just("") | st.just([]) | st.lists(st.just(""), min_size=2, max_size=3)
    | st.lists(st.integers(min_value=64), min_size=1, max_size=3)
    | st.lists(st.integers(max_value=-1), min_size=1, max_size=3)
    | st.text(min_size=1, max_size=3).map(lambda w: " ".join(["t5"] * (CONTEXT + 1)))
    | st.none() | st.integers() | st.floats() | st.dictionaries(st.text(max_size=3), scalars, max_size=2),
    "suffix": st.text(min_size=1, max_size=5),
    "logprobs": st.integers(min_value=21) | st.integers(max_value=-1) | st.just(True) | not_num,
    "echo": not_bool,
}
BAD_CHAT = {
    **BAD_COMMON,
    "messages": st.just([]) | st.text(max_size=5) | st.none() | st.integers()
    | st.lists(st.fixed_dictionaries({"role": st.text(max_size=8).filter(
        lambda r: r not in ("system", "developer", "user", "assistant")), "content": st.text(max_size=5)}),
        min_size=1, max_size=2)
    | st.lists(st.fixed_dictionaries({"content": st.text(max_size=5)}), min_size=1, max_size=2)
    | st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.integers() | st.just([])
                                      | st.just([{"type": "image_url", "image_url": {"url": "x"}}])}),
               min_size=1, max_size=2)
    | st.just([{"role": "user", "content": " ".join(["t5"] * CONTEXT)}]),
    "max_completion_tokens": st.integers(max_value=0) | not_int,
    "logprobs": not_bool,
    "top_logprobs": st.integers(min_value=21) | st.integers(max_value=-1) | not_int,
}


@st.composite
def invalid_request(draw: st.DrawFn, chat: bool) -> tuple[str, dict[str, Any]]:
    base: dict[str, Any] = ({"model": MODEL, "messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 2}
                            if chat else {"model": MODEL, "prompt": "t5 t6", "max_tokens": 2})
    bad = BAD_CHAT if chat else BAD_COMPLETION
    keys = draw(st.lists(st.sampled_from(sorted(bad)), min_size=1, max_size=3, unique=True))
    for k in keys:
        base[k] = draw(bad[k])
    if draw(st.booleans()):  # drop a required field instead, sometimes
        base.pop("messages" if chat else "prompt", None)
    return ("/v1/chat/completions" if chat else "/v1/completions"), base


def _check_error(resp: Any) -> None:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)


# ----------------------------------------------------------------------------- tests
def test_fuzz_invalid_completions(client: TestClient) -> None:
    sent: list[int] = []

    @settings(FUZZ, max_examples=500)
    @given(req=invalid_request(chat=False))
    def run(req: tuple[str, dict[str, Any]]) -> None:
        url, body = req
        r = client.post(url, content=json.dumps(body), headers={"content-type": "application/json"})
        sent.append(r.status_code)
        _check_error(r)

    run()
    assert len(sent) >= 500
    assert 404 in sent and 400 in sent


def test_fuzz_invalid_chat(client: TestClient) -> None:
    sent: list[int] = []

    @settings(FUZZ, max_examples=400)
    @given(req=invalid_request(chat=True))
    def run(req: tuple[str, dict[str, Any]]) -> None:
        url, body = req
        r = client.post(url, content=json.dumps(body), headers={"content-type": "application/json"})
        sent.append(r.status_code)
        _check_error(r)

    run()
    assert len(sent) >= 400


def test_fuzz_arbitrary_bodies_and_routes(client: TestClient) -> None:
    sent: list[int] = []
    bodies = (st.binary(max_size=64)
              | json_values.map(lambda v: json.dumps(v).encode())
              | st.dictionaries(st.sampled_from(["prompt", "messages", "model", "max_tokens", "stream", "stop"]),
                                json_values, max_size=4).map(lambda d: json.dumps(d).encode()))
    paths = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"]) \
        | st.from_regex(r"\A/[a-z0-9_./-]{0,16}\Z")

    @settings(FUZZ, max_examples=300)
    @given(method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE"]), path=paths, body=bodies,
           ctype=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded"]))
    def run(method: str, path: str, body: bytes, ctype: str) -> None:
        r = client.request(method, path, content=body if method in ("POST", "PUT") else None,
                           headers={"content-type": ctype})
        sent.append(r.status_code)
        assert r.status_code < 500, (method, path, body, r.status_code, r.text)
        if r.status_code >= 400:
            _check_error(r)

    run()
    assert len(sent) >= 300


def test_valid_requests_mixed_in_succeed(client: TestClient) -> None:
    sent: list[int] = []

    @settings(FUZZ, max_examples=30)
    @given(chat=st.booleans(), max_tokens=st.integers(1, 2), temperature=st.floats(0.0, 2.0),
           top_p=st.floats(0.01, 1.0), top_k=st.integers(-1, 70), seed=st.none() | st.integers(0, 2**40),
           stop=st.none() | st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
           stream=st.booleans(), words=st.lists(st.integers(0, 63), min_size=1, max_size=8),
           n=st.integers(1, 3), logprobs=st.none() | st.integers(0, 20), penalty=st.floats(-2.0, 2.0),
           bias=st.dictionaries(st.integers(0, 63).map(str), st.floats(-100.0, 100.0), max_size=3))
    def run(chat: bool, max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None,
            stop: str | list[str] | None, stream: bool, words: list[int], n: int, logprobs: int | None,
            penalty: float, bias: dict[str, float]) -> None:
        text = " ".join(f"t{w}" for w in words)
        body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                                "top_k": top_k, "seed": seed, "stop": stop, "stream": stream, "n": n,
                                "frequency_penalty": penalty, "logit_bias": bias}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
            body.update({"logprobs": logprobs is not None, "top_logprobs": logprobs})
        else:
            body.update({"prompt": text, "logprobs": logprobs, "echo": bool(logprobs and logprobs % 2)})
        r = client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
        sent.append(r.status_code)
        assert r.status_code == 200, r.text
        if stream:
            assert r.text.endswith("data: [DONE]\n\n")
        else:
            assert r.json()["usage"]["completion_tokens"] <= max_tokens * n
            assert len(r.json()["choices"]) == n

    run()
    assert len(sent) >= 30
