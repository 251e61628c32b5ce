"""A live uvicorn server on a loopback port and the tiny engine behind it, shared by the server tests.

Why this exists: the API, reliability and chaos tests all drive a real server with real clients;
one copy of how it starts, stops, and is watched (engine state read in the engine thread).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import openai
import uvicorn
from fastapi import FastAPI

from tests.helpers import tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.server.async_engine import AsyncEngine
from tidespec.server.graceful import HEADER_TIMEOUT_S, GracefulServer

CHAT_TEMPLATE = ("{% for m in messages %}t3 {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}t2{% endif %}")
MODEL = "tiny"


def tiny_engine(max_num_seqs: int = 16, max_waiting: int = 64, max_model_len: int = 160,
                drafter: Any = None) -> LLMEngine:
    tok = tiny_tokenizer(64)
    tok.chat_template = CHAT_TEMPLATE
    spec = SpecConfig(drafter="ngram" if drafter is not None else "none", num_speculative_tokens=3)
    cfg = EngineConfig(cache=CacheConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs),
                       scheduler=SchedulerConfig(max_waiting=max_waiting), spec=spec)
    return LLMEngine(tiny_llama(64), tok, cfg, drafter=drafter)




class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, app: FastAPI, grace_s: float | None = None, header_timeout_s: float | None = None) -> None:
        self.app = app
        # log_config=None: uvicorn's loggers propagate to the root logger, so caplog sees them
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, log_level="warning", lifespan="on")
        if grace_s is None and header_timeout_s is None:
            self.server = uvicorn.Server(config)
        else:
            self.server = GracefulServer(config, grace_s=10.0 if grace_s is None else grace_s,
                                         header_timeout_s=HEADER_TIMEOUT_S if header_timeout_s is None else header_timeout_s)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)
        self.port = 0

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def aengine(self) -> AsyncEngine:
        return self.app.state.async_engine

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def engine_state(self) -> tuple[float, int, int, int]:
        """(kv usage, running, waiting, known seqs), read in the engine thread."""
        return self.aengine.call(lambda e: (e.kv.usage(), e.num_running, e.num_waiting, len(e.seqs))).result(10)

    def wait_idle(self, timeout: float = 10.0) -> tuple[float, int, int, int]:
        deadline = time.monotonic() + timeout
        state = self.engine_state()
        while state != (0.0, 0, 0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
            state = self.engine_state()
        return state


def stream_text(chunks: Any, chat: bool) -> tuple[str, str | None, Any]:
    text, finish, usage = "", None, None
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            piece = c.delta.content if chat else c.text
            text += piece or ""
            finish = c.finish_reason or finish
    return text, finish, usage
