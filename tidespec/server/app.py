"""The OpenAI-compatible HTTP API (FastAPI): a thin translation between HTTP and ``AsyncEngine``.

Why this exists: users reach an inference engine through the OpenAI API and watch it through
Prometheus. This module only translates — validation lives in the request models (``protocol``,
and each route's in ``routes``), scheduling in the engine, numbers in ``tidespec.server.metrics`` —
and guarantees the contract a server owes its clients:

* every error is an OpenAI error object ``{"error": {"message", "type", "param", "code"}}`` with a
  4xx status when the client can fix it (malformed JSON, wrong types/ranges, unknown model,
  prompt + max_tokens beyond the context, empty prompt/messages, unknown route), 401 for a wrong
  API key, 413 for an oversized body, 429 when the bounded queue is full, and 5xx only for
  genuine engine failures, which fail the affected request only;
* ``stream: true`` answers with server-sent events ``data: {...}\\n\\n`` ending in ``data: [DONE]``,
  plus a usage chunk (``choices: []``) when ``stream_options.include_usage``;
* a client that disconnects — streaming or not — gets its request aborted in the engine, which
  frees its KV slot;
* an optional API key guards every route except ``/health``: ``Authorization: Bearer <key>``,
  ``X-API-Key: <key>``, or HTTP Basic auth with the key as password (what a browser sends for
  ``/dashboard`` after its login prompt); the key, the body's size and time bounds and the
  server's phase (loading, draining: 503) are checked before any route (``guard``);
* unknown request fields are ignored, as vLLM does, and named in the ``X-Tidespec-Ignored-Fields``
  response header and (once per name) the log; ``strict_fields`` refuses them with a 400;
* every 400 names in ``param`` the field at fault, as the request spelled it (``messages`` for a
  chat prompt that fills the context, ``max_completion_tokens`` when that was sent).

Routes (one ``APIRouter`` module per concern in ``tidespec.server.routes``, which ``create_app``
assembles): ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /health``,
``GET /metrics``, ``GET /dashboard`` (a live page, ``tidespec.server.dashboard``). Header
``X-Tidespec-Route: <label>`` buckets a request in the per-route metrics.
``/health`` is 200 while the engine loop runs (503 ``{"status": "loading" | "draining"}`` while the
model loads or the server drains); with online training its body also says whether the
trainer child runs (``{"status": "ok", "online": {"trainer": {"state": "restarting", ...}, ...}}``):
serving goes on without training, so a dead trainer is shown, not failed.

Worked example::

    engine = build_engine(EngineConfig(scheduler=SchedulerConfig(max_waiting=64)))
    app = create_app(engine, ServerConfig(served_model_name="smollm2"))
    uvicorn.run(app, host="127.0.0.1", port=8000)
    # then: openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-").completions.create(
    #           model="smollm2", prompt="def fib(n):", max_tokens=32)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidespec.config import ConfigError
from tidespec.engine.engine import LLMEngine, RequestError
from tidespec.engine.exactness import RESULTS, ExactnessChecker
from tidespec.engine.output import RequestOutput
from tidespec.engine.scheduler import QueueFullError
from tidespec.errors import check_at_least
from tidespec.llm import draft_vocab_of
from tidespec.sampling import SamplingParams, SamplingParamsError, choice_seed
from tidespec.server.api_errors import ApiError, error_body, error_response
from tidespec.server.async_engine import AsyncEngine, EngineRequestError, EngineStoppedError, RequestStream
from tidespec.server.dashboard import dashboard_router
from tidespec.server.guard import RETRY_AFTER_S, Admission, AdmissionGate, RequestGuard
from tidespec.server.logprobs import LogprobText
from tidespec.server.metrics import Metrics
from tidespec.server.protocol import SamplingRequest
from tidespec.server.routes import chat, completions, health, models
from tidespec.server.sse import EventStream, merged, sse
from tidespec.speculative.policy.factory import policy_profile
from tidespec.structured.grammar import GrammarError
from tidespec.structured.tool_calls import parser_for

if TYPE_CHECKING:
    from tidespec.online.serving.attach import OnlineTraining

ROUTE_HEADER = "x-tidespec-route"
IGNORED_FIELDS_HEADER = "X-Tidespec-Ignored-Fields"
MAX_HEADER_CHARS = 1024
MAX_WARNED_FIELDS = 256  # distinct unknown field names logged (once each); a fuzzer cannot flood the log
SHUTDOWN_CODE = "server_shutting_down"  # requests the shutdown ended: 503 (or a stream's error event)
log = logging.getLogger("tidespec.server")
EXACTNESS_TICK_S = 0.02  # the longest an exactness-check tick runs before the engine thread looks for requests
_ROUTE_RE = re.compile(r"[A-Za-z0-9_.:/-]{1,64}")
_UNION_HINTS = {
    "prompt": "prompt must be a string, a list holding one string (n=1 only), or a non-empty list of token ids",
    "stop": "stop must be a non-empty string or a list of at most 16 non-empty strings",
    "logprobs": "logprobs are not supported",
}


@dataclass
class ServerConfig:
    """HTTP-side settings (engine settings live in ``EngineConfig``)."""

    served_model_name: str = "tidespec"
    api_key: str | None = None  # None or "" = no authentication
    max_body_bytes: int = 4 * 2**20
    default_completion_max_tokens: int = 16  # OpenAI's default for /v1/completions
    disconnect_poll_s: float = 0.5  # how often a non-streaming request checks its client is still there
    max_in_flight: int | None = None  # None = engine max_num_seqs + max_waiting (unbounded if max_waiting == 0)
    # fraction of finished greedy requests re-decoded plainly in idle time and compared token by
    # token (engine/exactness.py); 0 = off
    exactness_check: float = 0.0
    body_timeout_s: float = 30.0  # a request body not complete this long after its headers: 408
    strict_fields: bool = False  # unknown request fields: a 400 (default: ignored, named in a header and the log)
    trim_memory: bool = True  # hand freed heap pages back to the OS after large requests (guard.MemoryTrimmer)
    chat_template: str | None = None  # a chat template's text that replaces the tokenizer's (--chat-template FILE)
    tool_call_parser: str = "auto"  # the tool-call format (server/tools/parsers.py); auto: the template's

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ConfigError("served_model_name must be non-empty")
        check_at_least(1024, max_body_bytes=self.max_body_bytes)
        check_at_least(1, default_completion_max_tokens=self.default_completion_max_tokens)
        if self.disconnect_poll_s <= 0:
            raise ConfigError(f"disconnect_poll_s must be > 0, got {self.disconnect_poll_s}")
        if not 0.0 <= self.exactness_check <= 1.0:
            raise ConfigError(f"--exactness-check must be a fraction in [0, 1], got {self.exactness_check}")
        if not self.body_timeout_s > 0:
            raise ConfigError(f"--body-timeout must be > 0, got {self.body_timeout_s}")


def special_token_id(tokenizer: Any, token: str) -> int | None:
    """The id of ``token`` when the tokenizer has it as one special token, else None."""
    ids = tokenizer.convert_tokens_to_ids([token])
    tid = ids[0] if ids else None
    return tid if isinstance(tid, int) and tid != tokenizer.unk_token_id and token in tokenizer.all_special_tokens \
        else None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One clear line for the first validation error and the parameter it concerns."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return f"invalid JSON body: {e.get('ctx', {}).get('error', e.get('msg', ''))}", None
    # drop pydantic's union-branch tags ("str", "list[str]", "function-after[...]") from the path
    param_parts = [x for x in loc if not re.fullmatch(r"[a-z_-]+\[.*\]|str|int|float|bool|list|dict|none", x)]
    param = ".".join(param_parts) or e.get("ctx", {}).get("param")  # a model-level check names its field
    msg = e.get("msg", "invalid value")
    top = param_parts[0] if param_parts else None
    same_field = [x for x in errors if [str(y) for y in x.get("loc", ())][1:2] == [top]]
    if top in _UNION_HINTS and len(same_field) > 1:  # a union: no single branch's message is the right one
        return _UNION_HINTS[top], top
    if e.get("type") == "missing":
        msg = "field required"
    text = f"{param}: {msg}" if param else msg
    more = len(errors) - 1
    if more:
        text += f" (and {more} more error{'s' if more > 1 else ''})"
    return text, param


def _stopped(exc: EngineStoppedError) -> ApiError:
    """The 503 of a request the server's shutdown ended (or that arrived once the engine stopped)."""
    return ApiError(503, str(exc), code=SHUTDOWN_CODE, headers={"Retry-After": str(RETRY_AFTER_S)})


class Server:
    """Request handling state shared by the routes of one app."""

    def __init__(self, engine: LLMEngine, config: ServerConfig, metrics: Metrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.checker = (ExactnessChecker(engine, config.exactness_check, on_result=metrics.on_exactness_check)
                        if config.exactness_check > 0 else None)
        if self.checker is not None:  # every result's series from the start, at 0 (an alert can watch mismatch)
            metrics.init_exactness_checks(RESULTS)
        self.aengine = AsyncEngine(engine, max_in_flight=config.max_in_flight,
                                   on_finished=metrics.on_request_finished, on_idle=self._idle,
                                   idle_work=self._check_exactness if self.checker is not None else None)
        self.created = int(time.time())
        self.warned_fields: set[str] = set()
        self.vocab_size = engine.model.cfg.vocab_size
        self.chat_template = config.chat_template
        self.tool_parser = parser_for(config.tool_call_parser, config.chat_template or engine.tokenizer.chat_template)
        self.tool_special_token = special_token_id(engine.tokenizer, "[TOOL_CALLS]")  # Mistral's call marker
        self.logprob_text = LogprobText(engine.tokenizer)  # token texts of log-probabilities, decoded once per id

    @property
    def drafter_version(self) -> str | None:
        """The drafter's version now (online training swaps versions between steps)."""
        drafter = self.engine.drafter
        return str(drafter.version) if drafter is not None and drafter.versioned else None

    def _idle(self, eng: LLMEngine) -> None:
        self.metrics.set_load(eng.num_running, eng.num_waiting, eng.kv.usage())

    def _check_exactness(self, eng: LLMEngine) -> bool:
        """Idle work: a few forwards of the exactness checker's re-decodes (``--exactness-check``)."""
        assert self.checker is not None
        return self.checker.tick(EXACTNESS_TICK_S)

    # ------------------------------------------------------------------ shared request steps
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.config.served_model_name!r}", param="model", code="model_not_found")

    @staticmethod
    def route_label(request: Request) -> str | None:
        label = request.headers.get(ROUTE_HEADER)
        if label is None:
            return None
        if not _ROUTE_RE.fullmatch(label):
            raise ApiError(400, "X-Tidespec-Route must be 1-64 characters of [A-Za-z0-9_.:/-]",
                           param="X-Tidespec-Route")
        return label

    def ignored_fields(self, body: SamplingRequest, request_id_prefix: str) -> dict[str, str]:
        """The response header naming the request's unknown fields (ignored, as vLLM does; each new
        name is logged once), or a 400 for the first of them under ``strict_fields``."""
        unknown = body.unknown_fields()
        if not unknown:
            return {}
        if self.config.strict_fields:
            raise ApiError(400, f"unknown field {unknown[0]!r} (the server runs with --strict-fields)",
                           param=unknown[0], code="unknown_field")
        new = [f for f in unknown if f not in self.warned_fields]
        if new and len(self.warned_fields) < MAX_WARNED_FIELDS:
            self.warned_fields.update(new)
            log.warning("%s request: ignored unknown field(s) %s (logged once per name; --strict-fields refuses them)",
                        request_id_prefix, ", ".join(map(repr, new)))
        # names come from clients: percent-encoded (RFC 3986) into a header-safe ASCII list
        return {IGNORED_FIELDS_HEADER: ",".join(quote(f, safe="[]._-:/@$") for f in unknown)[:MAX_HEADER_CHARS]}

    @staticmethod
    def params(build: Callable[[], SamplingParams], body: SamplingRequest) -> SamplingParams:
        try:
            return build()
        except SamplingParamsError as exc:
            raise ApiError(400, str(exc).splitlines()[0], param=body.api_param(exc.param)) from exc

    async def submit(self, prompt: str | list[int], params: SamplingParams, body: SamplingRequest,
                     label: str | None, prefix: str) -> RequestStream:
        try:
            return await self.aengine.add_request(prompt, params, spec_tokens=body.spec_tokens(), label=label,
                                                  fit_max_tokens=body.fills_context, prefix=prefix)
        except QueueFullError as exc:
            self.metrics.on_rejected("queue_full")
            raise ApiError(429, str(exc).splitlines()[0], code="rate_limit_exceeded") from exc
        except (RequestError, SamplingParamsError, GrammarError) as exc:
            raise ApiError(400, str(exc).splitlines()[0], param=body.api_param(exc.param)) from exc
        except EngineStoppedError as exc:
            raise _stopped(exc) from exc

    async def submit_choices(self, prompts: list[str | list[int]], params: SamplingParams, body: SamplingRequest,
                             label: str | None, prefix: str) -> list[RequestStream]:
        """One stream per choice: ``body.n`` per prompt, in OpenAI's order (prompt-major). Choice ``i`` of
        a seeded request is seeded ``choice_seed(seed, i)``. Where the prefix cache can share a prompt,
        a prompt's first choice goes first and the others once it was prefilled, so that they reuse its
        blocks instead of computing the prompt n times. Nothing stays queued when one is refused."""
        if body.prediction is not None and body.prediction.text():
            ids = await self.aengine.prepare(self.engine.tokenizer.encode, body.prediction.text(), add_special_tokens=False)
            params = dataclasses.replace(params, prediction=ids)
        streams: list[RequestStream] = []
        try:
            for prompt in prompts:
                for i in range(body.n):
                    p = params if i == 0 or params.seed is None else dataclasses.replace(
                        params, seed=choice_seed(params.seed, i))
                    streams.append(await self.submit(prompt, p, body, label, prefix))
                    if i == 0 and body.n > 1 and self.engine.prefix_cache is not None and p.prompt_logprobs is None:
                        await streams[-1].moved.wait()
        except BaseException:
            for stream in streams:
                self.aengine.abort(stream.request_id)
            raise
        return streams

    async def collect(self, stream: RequestStream, request: Request) -> RequestOutput:
        """Wait for the final output; abort if the client goes away."""
        poll = self.config.disconnect_poll_s
        next_check = time.monotonic() + poll
        try:
            while True:
                try:
                    out = await stream.get(timeout=poll)
                except StopAsyncIteration:
                    break
                except EngineRequestError as exc:
                    raise ApiError(500, str(exc), code="engine_error") from exc
                except EngineStoppedError as exc:
                    raise _stopped(exc) from exc
                if out is not None and out.finished:
                    return out
                if time.monotonic() >= next_check:
                    if await request.is_disconnected():
                        break
                    next_check = time.monotonic() + poll
            raise ApiError(499, "client disconnected")
        finally:
            if not stream.finished:
                self.aengine.abort(stream.request_id)

    def abort_all(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.aengine.abort(stream.request_id)

    async def respond(self, body: SamplingRequest, streams: list[RequestStream], request: Request,
                      headers: dict[str, str], events: Callable[[], AsyncIterator[str]],
                      whole: Callable[[list[RequestOutput]], BaseModel]) -> Response:
        """The answer to submitted choices: their event stream (``events()``) when ``body.stream``, else
        ``whole`` of their final outputs once all finished (all aborted if the client goes away or one fails)."""
        if body.stream:
            return EventStream(events(), lambda: self.abort_all(streams), headers)
        try:
            outs = await asyncio.gather(*(self.collect(stream, request) for stream in streams))
        finally:
            self.abort_all(streams)
        return JSONResponse(whole(list(outs)).model_dump(), headers=headers)

    async def sse_events(self, streams: list[RequestStream], first: list[str],
                         render: Callable[[int, RequestOutput], list[str]],
                         last: Callable[[list[RequestOutput]], list[str]]) -> AsyncIterator[str]:
        """The event stream of submitted choices: ``first``, each engine output of choice ``i`` rendered
        into chunks as it comes, ``last`` of the final outputs, then ``[DONE]``; an engine failure
        becomes an error event before ``[DONE]``; choices the client left unfinished are aborted."""
        try:
            for event in first:
                yield event
            async for i, out in merged(streams):
                for event in render(i, out):
                    yield event
            for event in last([stream.last for stream in streams if stream.last is not None]):
                yield event
            yield "data: [DONE]\n\n"
        except EngineRequestError as exc:
            yield sse(error_body(500, str(exc), code="engine_error"))
            yield "data: [DONE]\n\n"
        except EngineStoppedError as exc:
            yield sse(error_body(503, str(exc), code=SHUTDOWN_CODE))
            yield "data: [DONE]\n\n"
        finally:
            self.abort_all(streams)


def create_app(engine: LLMEngine, config: ServerConfig | None = None, metrics: Metrics | None = None,
               on_shutdown: Callable[[], None] | None = None, online: OnlineTraining | None = None,
               admission: Admission | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; the engine loop starts and stops with the app's lifespan.

    ``on_shutdown`` runs after the engine loop stopped (e.g. stopping online training's trainer
    child): uvicorn re-raises SIGTERM once the app has shut down, so code after ``uvicorn.run``
    never runs on a SIGTERM. ``online``: the online training attached to ``engine``, whose state
    ``/health`` and ``/metrics`` show. ``admission``: the server's phase, shared with the loading
    app and the drain of ``tidespec serve`` (default: a new one, serving)."""
    config = config or ServerConfig()
    admission = admission or Admission("serving")
    metrics = metrics or Metrics()
    if online is not None:
        metrics.attach_online(online)
    if engine.policy is not None and metrics.policy is None:
        metrics.attach_policy(engine.policy, policy_profile(engine.policy))
    if engine.drafter is not None and engine.drafter.versioned:
        metrics.attach_drafter(engine.drafter)
    vocab = draft_vocab_of(engine)
    if vocab is not None and metrics.vocab is None:
        metrics.attach_vocab(vocab)
    server = Server(engine, config, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.add_observer(metrics)
        server.aengine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await server.aengine.shutdown()
            if vocab is not None:
                vocab.close()  # its worker thread: nothing records into it once the engine loop stopped
            engine.remove_observer(metrics)
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="tidespec", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API of the tidespec engine")
    app.state.server = server
    app.state.async_engine = server.aengine
    app.state.metrics = metrics
    app.state.engine = engine
    app.state.admission = admission

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 429 else exc.headers
        if exc.status == 400:
            metrics.on_rejected("invalid")
        return error_response(exc.status, exc.message, exc.param, exc.code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        metrics.on_rejected("invalid")
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    for routes in (health.router(server, metrics, online), models.router(server), completions.router(server),
                   chat.router(server), dashboard_router(engine, config.served_model_name, metrics, online)):
        app.include_router(routes)
    app.add_middleware(RequestGuard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       body_timeout_s=config.body_timeout_s, on_reject=metrics.on_rejected,
                       trim_memory=config.trim_memory)
    app.add_middleware(AdmissionGate, admission=admission)  # added last: outermost, before the key check
    return app
