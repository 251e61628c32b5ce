"""The OpenAI-compatible HTTP API (FastAPI): a thin translation between HTTP and ``AsyncEngine``.

Why this exists: users reach an inference engine through the OpenAI API and watch it through
Prometheus. This module only translates — validation lives in ``protocol``, scheduling in the
engine, numbers in ``tidespec.server.metrics`` — and guarantees the contract a server owes its clients:

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
  ``/dashboard`` after its login prompt).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /health``,
``GET /metrics``, ``GET /dashboard`` (a live page, ``tidespec.server.dashboard``). Header
``X-Tidespec-Route: <label>`` buckets a request in the per-route metrics.
``/health`` is 200 while the engine loop runs; with online training its body also says whether the
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
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidespec.config import ConfigError
from tidespec.engine.engine import LLMEngine, RequestError
from tidespec.engine.exactness import RESULTS, ExactnessChecker
from tidespec.engine.output import RequestOutput
from tidespec.engine.scheduler import QueueFullError
from tidespec.errors import check_at_least
from tidespec.llm import draft_vocab_of
from tidespec.sampling import SamplingParams, SamplingParamsError
from tidespec.server.async_engine import AsyncEngine, EngineRequestError, EngineStoppedError, RequestStream
from tidespec.server.dashboard import DASHBOARD_PATH, basic_auth_password, register_dashboard
from tidespec.server.metrics import Metrics
from tidespec.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
)
from tidespec.speculative.policy.factory import policy_profile

if TYPE_CHECKING:
    from tidespec.online.attach import OnlineTraining

ROUTE_HEADER = "x-tidespec-route"
EXACTNESS_TICK_S = 0.02  # the longest an exactness-check tick runs before the engine thread looks for requests
_ROUTE_RE = re.compile(r"[A-Za-z0-9_.:/-]{1,64}")
_STATUS_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
                 404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
                 415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}

_UNION_HINTS = {
    "prompt": "prompt must be a string, a list holding one string (n=1 only), or a non-empty list of token ids",
    "stop": "stop must be a non-empty string or a list of at most 16 non-empty strings",
    "logprobs": "logprobs are not supported",
}

ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]


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

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ConfigError("served_model_name must be non-empty")
        check_at_least(1024, max_body_bytes=self.max_body_bytes)
        check_at_least(1, default_completion_max_tokens=self.default_completion_max_tokens)
        if self.disconnect_poll_s <= 0:
            raise ConfigError(f"disconnect_poll_s must be > 0, got {self.disconnect_poll_s}")
        if not 0.0 <= self.exactness_check <= 1.0:
            raise ConfigError(f"--exactness-check must be a fraction in [0, 1], got {self.exactness_check}")


class ApiError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _STATUS_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type_: str | None = None) -> dict[str, Any]:
    err = ApiError(status, message, param, code, type_)
    return ErrorResponse(error=ErrorInfo(message=err.message, type=err.type, param=err.param,
                                         code=err.code)).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


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


class _Guard:
    """ASGI middleware: API key on every route but ``/health``, request body size bound."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 on_reject: Callable[[str], None]) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope.get("path") != "/health":
            auth = headers.get("authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get("x-api-key", b"")
            if auth[:6].lower() == b"basic ":
                token = basic_auth_password(auth[6:])
            if not secrets.compare_digest(token, self.api_key):
                self.on_reject("unauthorized")
                # a browser opening the dashboard answers a Basic challenge with its login prompt
                page = str(scope.get("path", "")).startswith(DASHBOARD_PATH)
                resp = JSONResponse(error_body(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                               code="invalid_api_key"), status_code=401,
                                    headers={"WWW-Authenticate": 'Basic realm="tidespec"' if page else "Bearer"})
                await resp(scope, receive, send)
                return
        length = headers.get("content-length")
        if length is not None and not length.isdigit():
            await error_response(400, "invalid Content-Length header")(scope, receive, send)
            return
        if length is not None and int(length) > self.max_body_bytes:
            resp = error_response(413, f"request body exceeds {self.max_body_bytes} bytes", code="body_too_large")
            await resp(scope, receive, send)
            return
        if length is None:  # a chunked body: read it here, bounded, so an oversized one is a 413 too
            body = await self._read_bounded(receive)
            if body is None:
                resp = error_response(413, f"request body exceeds {self.max_body_bytes} bytes", code="body_too_large")
                await resp(scope, receive, send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    async def _read_bounded(self, receive: Callable[[], Awaitable[Any]]) -> bytes | None:
        """The whole request body, or None as soon as it exceeds ``max_body_bytes``."""
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message.get("type") != "http.request":  # the client went away: nothing more will come
                break
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        return b"".join(chunks)


def _replay(body: bytes, receive: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
    """An ASGI ``receive`` that hands over ``body`` as one message, then defers to ``receive``
    (which reports the client's disconnect)."""
    sent = False

    async def replayed() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class _EventStream(StreamingResponse):
    """SSE response that runs ``on_close`` however it ends (done, client gone, cancelled)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(obj: BaseModel | dict[str, Any]) -> str:
    data = obj.model_dump(exclude_none=False) if isinstance(obj, BaseModel) else obj
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _usage(out: RequestOutput) -> Usage:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c, draft_tokens=out.stats.num_draft_tokens,
                 accepted_tokens=out.stats.num_accepted_tokens)


class _Server:
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
        self.vocab_size = engine.model.cfg.vocab_size

    @property
    def drafter_version(self) -> str | None:
        """The drafter's version now (online training swaps versions between steps)."""
        version = getattr(self.engine.drafter, "version", None) if self.engine.drafter is not None else None
        return None if version is None else str(version)

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

    @staticmethod
    def params(build: Callable[[], SamplingParams]) -> SamplingParams:
        try:
            return build()
        except SamplingParamsError as exc:
            raise ApiError(400, str(exc).splitlines()[0]) from exc

    async def submit(self, prompt: str | list[int], params: SamplingParams, spec_tokens: int | None,
                     label: str | None, fit_max_tokens: bool, prefix: str) -> RequestStream:
        try:
            return await self.aengine.add_request(prompt, params, spec_tokens=spec_tokens, label=label,
                                                  fit_max_tokens=fit_max_tokens, prefix=prefix)
        except QueueFullError as exc:
            self.metrics.on_rejected("queue_full")
            raise ApiError(429, str(exc).splitlines()[0], code="rate_limit_exceeded") from exc
        except (RequestError, SamplingParamsError) as exc:
            raise ApiError(400, str(exc).splitlines()[0], param="prompt") from exc
        except EngineStoppedError as exc:
            raise ApiError(503, str(exc)) from exc

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
                    raise ApiError(503, str(exc)) from exc
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

    # ------------------------------------------------------------------ completions
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        label = self.route_label(request)
        prompt = body.prompt_input()
        if isinstance(prompt, list) and max(prompt) >= self.vocab_size:
            raise ApiError(400, f"prompt token ids must be < vocab size {self.vocab_size}", param="prompt")
        params = self.params(lambda: body.sampling_params(self.config.default_completion_max_tokens))
        stream = await self.submit(prompt, params, body.spec_tokens(), label, False, "cmpl")
        model = self.config.served_model_name
        if body.stream:
            return _EventStream(self._stream_completion(stream, model, body.include_usage),
                                lambda: self.aengine.abort(stream.request_id))
        out = await self.collect(stream, request)
        resp = CompletionResponse(id=stream.request_id, created=int(time.time()), model=model,
                                  choices=[CompletionChoice(text=out.text, finish_reason=out.finish_reason)],
                                  usage=_usage(out), drafter_version=self.drafter_version)
        return JSONResponse(resp.model_dump())

    def _stream_completion(self, stream: RequestStream, model: str, include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(text: str, finish: str | None, usage: Usage | None = None,
                  choices: bool = True) -> str:
            return _sse(CompletionResponse(
                id=stream.request_id, created=created, model=model,
                choices=[CompletionChoice(text=text, finish_reason=finish)] if choices else [], usage=usage,
                drafter_version=self.drafter_version))

        def render(out: RequestOutput) -> list[str]:
            chunks = []
            if out.delta_text or out.finished:
                chunks.append(chunk(out.delta_text, out.finish_reason if out.finished else None))
            if out.finished and include_usage:
                chunks.append(chunk("", None, _usage(out), choices=False))
            return chunks

        return self._sse_events(stream, [], render)

    async def _sse_events(self, stream: RequestStream, first: list[str],
                          render: Callable[[RequestOutput], list[str]]) -> AsyncIterator[str]:
        """The event stream of one request: ``first``, each engine output rendered into chunks, then
        ``[DONE]``; an engine failure becomes an error event before ``[DONE]``; a request the client
        left unfinished is aborted."""
        try:
            for event in first:
                yield event
            async for out in stream:
                for event in render(out):
                    yield event
            yield "data: [DONE]\n\n"
        except (EngineRequestError, EngineStoppedError) as exc:
            yield _sse(error_body(500, str(exc), code="engine_error"))
            yield "data: [DONE]\n\n"
        finally:
            if not stream.finished:
                self.aengine.abort(stream.request_id)

    # ------------------------------------------------------------------ chat
    def chat_prompt(self, body: ChatCompletionRequest) -> str:
        try:
            rendered = self.engine.tokenizer.apply_chat_template(body.template_messages(), add_generation_prompt=True,
                                                                 tokenize=False)
        except (ValueError, TypeError, KeyError, jinja2.TemplateError) as exc:
            raise ApiError(400, f"cannot apply the chat template: {str(exc).splitlines()[0] if str(exc) else exc!r}",
                           param="messages") from exc
        if not isinstance(rendered, str):
            raise ApiError(400, "the chat template did not render to text", param="messages")
        return rendered

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        label = self.route_label(request)
        params = self.params(lambda: body.sampling_params(1))
        prompt = await self.aengine.prepare(self.chat_prompt, body)  # a template can be slow: off the event loop
        stream = await self.submit(prompt, params, body.spec_tokens(), label, not body.max_tokens_given, "chatcmpl")
        model = self.config.served_model_name
        if body.stream:
            return _EventStream(self._stream_chat(stream, model, body.include_usage),
                                lambda: self.aengine.abort(stream.request_id))
        out = await self.collect(stream, request)
        resp = ChatCompletionResponse(
            id=stream.request_id, created=int(time.time()), model=model,
            choices=[ChatChoice(message=AssistantMessage(content=out.text), finish_reason=out.finish_reason)],
            usage=_usage(out), drafter_version=self.drafter_version)
        return JSONResponse(resp.model_dump())

    def _stream_chat(self, stream: RequestStream, model: str, include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(delta: DeltaMessage | None, finish: str | None, usage: Usage | None = None) -> str:
            choices = [ChatChunkChoice(delta=delta, finish_reason=finish)] if delta is not None else []
            return _sse(ChatCompletionChunk(id=stream.request_id, created=created, model=model, choices=choices,
                                            usage=usage, drafter_version=self.drafter_version))

        def render(out: RequestOutput) -> list[str]:
            chunks = []
            if out.delta_text or out.finished:
                delta = DeltaMessage(content=out.delta_text) if out.delta_text else DeltaMessage()
                chunks.append(chunk(delta, out.finish_reason if out.finished else None))
            if out.finished and include_usage:
                chunks.append(chunk(None, None, _usage(out)))
            return chunks

        return self._sse_events(stream, [chunk(DeltaMessage(role="assistant", content=""), None)], render)


def create_app(engine: LLMEngine, config: ServerConfig | None = None, metrics: Metrics | None = None,
               on_shutdown: Callable[[], None] | None = None, online: OnlineTraining | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; the engine loop starts and stops with the app's lifespan.

    ``on_shutdown`` runs after the engine loop stopped (e.g. stopping online training's trainer
    child): uvicorn re-raises SIGTERM once the app has shut down, so code after ``uvicorn.run``
    never runs on a SIGTERM. ``online``: the online training attached to ``engine``, whose state
    ``/health`` and ``/metrics`` show."""
    config = config or ServerConfig()
    metrics = metrics or Metrics()
    if online is not None:
        metrics.attach_online(online)
    if engine.policy is not None and metrics.policy is None:
        metrics.attach_policy(engine.policy, policy_profile(engine.policy))
    if engine.drafter is not None and hasattr(engine.drafter, "version"):
        metrics.attach_drafter(engine.drafter)
    vocab = draft_vocab_of(engine)
    if vocab is not None and metrics.vocab is None:
        metrics.attach_vocab(vocab)
    server = _Server(engine, config, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.step_listeners.append(metrics.on_step)
        server.aengine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await server.aengine.shutdown()
            if vocab is not None:
                vocab.close()  # its worker thread: nothing records into it once the engine loop stopped
            if metrics.on_step in engine.step_listeners:
                engine.step_listeners.remove(metrics.on_step)
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="tidespec", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API of the tidespec engine")
    app.state.server = server
    app.state.async_engine = server.aengine
    app.state.metrics = metrics
    app.state.engine = engine

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 429 else None
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

    @app.get("/health")
    async def health() -> Response:
        if not server.aengine.running:
            return error_response(503, "engine loop is not running")
        if online is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok", "online": online.health()})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card() -> ModelCard:
        return ModelCard(id=config.served_model_name, created=server.created, max_model_len=engine.max_model_len)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
    async def model(model_id: str) -> ModelCard:
        """The OpenAI client's ``models.retrieve``; model ids may contain ``/`` (HF names)."""
        server.check_model(model_id)
        return card()

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={400: {"model": ErrorResponse}, 429: {"model": ErrorResponse}})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={400: {"model": ErrorResponse}, 429: {"model": ErrorResponse}})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(body, request)

    register_dashboard(app, engine, config.served_model_name, metrics, online)
    app.add_middleware(_Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       on_reject=metrics.on_rejected)
    return app
