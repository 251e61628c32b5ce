"""The rest of OpenAI's sampling surface over HTTP, with the official client and LangChain: ``logprobs``
/ ``top_logprobs`` (chat and completions, whole and streamed), ``echo`` with the prompt's
log-probabilities (lm-eval's loglikelihood request), ``n`` (seeded choices reproducible, prompt blocks
shared), batched prompts, penalties and ``logit_bias``; a server with a drafter answers every one of
them with the bytes a plain server answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from tests.helpers import full_logits
from tests.server.live import MODEL, LiveServer, tiny_engine
from tidespec.server.app import ServerConfig, create_app
from tidespec.speculative.drafters.ngram import NgramDrafter

PROMPT = "t5 t6 t7 t5 t6 t7 t5 t6"


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[LiveServer, LiveServer]]:
    """A plain server and one drafting with n-gram lookup (over the same random weights)."""
    with LiveServer(create_app(tiny_engine(), ServerConfig(served_model_name=MODEL))) as plain, \
            LiveServer(create_app(tiny_engine(drafter=NgramDrafter(1, 3)),
                                  ServerConfig(served_model_name=MODEL))) as spec:
        yield plain, spec


def post(s: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{s.url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def strip(resp: dict[str, Any]) -> dict[str, Any]:
    """What must be equal between two servers: the choices (ids, times and draft counts differ)."""
    return {"choices": resp["choices"], "completion_tokens": resp["usage"]["completion_tokens"]}


BODIES = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "logprobs": 5, "temperature": 0}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "logprobs": 2, "echo": True, "temperature": 0,
                         "frequency_penalty": 0.8, "logit_bias": {"9": 3.0, "7": -100}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
                              "temperature": 0, "logprobs": True, "top_logprobs": 3, "presence_penalty": 0.3,
                              "repetition_penalty": 1.05}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "n": 3,
                              "temperature": 0.9, "seed": 5, "logprobs": True, "min_tokens": 10}),
]


@pytest.mark.parametrize("path,body", BODIES, ids=["logprobs", "echo-penalties", "chat-top", "chat-n-seeded"])
def test_a_drafting_server_answers_with_the_plain_servers_bytes(servers, path: str, body: dict[str, Any]) -> None:
    plain, spec = servers
    want = post(plain, path, body)
    got = post(spec, path, body)
    assert strip(got) == strip(want)
    assert got["usage"]["draft_tokens"] > 0, "the drafting server never drafted: nothing was verified"


def test_completion_logprobs_shape_and_values(servers) -> None:
    """OpenAI's completions form; each token's value is its log-softmax (float32) at that position."""
    plain, _ = servers
    resp = plain.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3, temperature=0)
    lp = resp.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == resp.usage.completion_tokens
    # each token decoded alone (this word-level tokenizer drops the spaces a whole decode puts between words)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and tok in top and len(top) <= 4 and max(top.values()) >= value


def test_echo_gives_the_prompts_logprobs_as_lm_eval_reads_them(servers) -> None:
    """lm-eval's loglikelihood payload (token-id prompts in a batch, echo, max_tokens 1, logprobs 1):
    the prompt's first token has none, the others a full forward's log-softmax."""
    plain, spec = servers
    prompts = [[5, 6, 7, 5, 6], [9, 12, 5, 6, 7, 20]]
    body = {"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
    resp = post(plain, "/v1/completions", body)
    assert [c["index"] for c in resp["choices"]] == [0, 1]
    model = tiny_engine().model  # the same seeded random weights
    for ids, choice in zip(prompts, resp["choices"]):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        ref = torch.log_softmax(full_logits(model, ids).float(), -1)
        for i in range(1, len(ids)):
            assert lp["token_logprobs"][i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)
        assert choice["text"].startswith("t5" if ids[0] == 5 else "t9")
    assert strip(post(spec, "/v1/completions", body)) == strip(resp)


def test_streamed_logprobs_are_the_whole_responses(servers) -> None:
    plain, _ = servers
    c = plain.client()
    for chat in (False, True):
        if chat:
            kw: dict[str, Any] = {"messages": [{"role": "user", "content": PROMPT}], "logprobs": True, "top_logprobs": 2}
            create = c.chat.completions.create
        else:
            kw = {"prompt": PROMPT, "logprobs": 2, "echo": True}
            create = c.completions.create
        whole = create(model=MODEL, max_tokens=12, n=2, temperature=0.8, seed=3, **kw)
        parts: dict[int, list[Any]] = {0: [], 1: []}
        texts = {0: "", 1: ""}
        for ch in create(model=MODEL, max_tokens=12, n=2, temperature=0.8, seed=3, stream=True, **kw):
            for choice in ch.choices:
                if choice.logprobs is not None:
                    parts[choice.index] += choice.logprobs.content if chat else choice.logprobs.token_logprobs
                texts[choice.index] += (choice.delta.content or "") if chat else choice.text
        for i, choice in enumerate(whole.choices):
            want = choice.logprobs.content if chat else choice.logprobs.token_logprobs
            assert parts[i] == want
            assert texts[i] == (choice.message.content if chat else choice.text)


def test_n_choices_seeded_reproducible_and_sharing_the_prompts_blocks(servers) -> None:
    plain, _ = servers
    c = plain.client()
    long = [5 + i % 40 for i in range(48)]  # three full 16-token blocks
    kw: dict[str, Any] = {"model": MODEL, "prompt": long, "max_tokens": 10, "temperature": 1.0, "seed": 99}
    a = c.completions.create(n=4, **kw)
    b = c.completions.create(n=4, **kw)
    single = c.completions.create(**kw)
    assert [x.text for x in a.choices] == [x.text for x in b.choices], "choice i is keyed by (seed, i)"
    assert a.choices[0].text == single.choices[0].text, "choice 0 is the request's own seed"
    assert len({x.text for x in a.choices}) > 1, "choices are sampled independently"
    assert a.usage.prompt_tokens == 48, "the prompt counted once"
    greedy = c.completions.create(model=MODEL, prompt=long + [1], max_tokens=8, temperature=0, n=3)
    assert len({x.text for x in greedy.choices}) == 1, "greedy choices are identical, as in vLLM"
    hits = plain.aengine.call(lambda eng: [s.num_prefix_hit_tokens for s in eng.history]).result(10)
    assert sum(hits[-12:]) >= 2 * 48, "choices 1..n reuse the first choice's prompt blocks"


def test_langchain_reads_logprobs(servers) -> None:
    from langchain_openai import ChatOpenAI

    plain, _ = servers
    llm = ChatOpenAI(model=MODEL, base_url=f"{plain.url}/v1", api_key="x", max_tokens=6, temperature=0,
                     logprobs=True, top_logprobs=2)
    msg = llm.invoke(PROMPT)
    content = msg.response_metadata["logprobs"]["content"]
    assert content and all(entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2 for entry in content)
