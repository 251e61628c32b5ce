"""ASGI guards in front of the API: admission (loading, serving, draining), the API key, and a
request body bounded in size and in time.

Why this exists: what must be refused before a route runs is refused here, once, for every route:

* ``AdmissionGate`` answers for the server's phase. While the model loads (the port is bound
  first, ``tidespec serve``) and while it drains after SIGTERM, ``/health`` is 503 with
  ``{"status": "loading" | "draining"}`` and every other request a 503 OpenAI error with
  ``Retry-After`` and ``Connection: close``; it counts the API requests inside the app, so the
  drain (``graceful``) knows when the last one has finished.
* ``RequestGuard`` checks the API key (``Authorization: Bearer``, ``X-API-Key``, or HTTP Basic with
  the key as password) on every route but ``/health``, and reads the whole body before the route
  sees it: larger than ``max_body_bytes`` is a 413, not complete ``body_timeout_s`` after the
  headers is a 408. Either way the connection is closed (the rest of the body is never read), so
  a client that sends headers and then a trickle of body, or nothing, holds neither a worker nor an
  engine slot: the request reaches the engine only with its whole body.

Worked example::

    admission = Admission("serving")
    app = AdmissionGate(RequestGuard(app, api_key="sk-1", max_body_bytes=4 << 20, body_timeout_s=30.0,
                                     on_reject=print), admission)
    admission.phase = "draining"      # SIGTERM: /health 503 "draining", new requests 503 + Retry-After
    admission.active                  # API requests still inside the app
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Literal

from fastapi.responses import JSONResponse

from tidespec.config import ConfigError
from tidespec.heap import find_malloc_trim
from tidespec.server.api_errors import error_body, error_response
from tidespec.server.dashboard import DASHBOARD_PATH, basic_auth_password

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Phase = Literal["loading", "serving", "draining"]
PHASES = ("loading", "serving", "draining")
API_PREFIX = "/v1/"
RETRY_AFTER_S = 5  # what a 503 of a loading or draining server tells the client to wait
CLOSE = {"Connection": "close"}
TRIM_BODY_BYTES = 256 * 1024  # a body this large leaves its parse, tokenization and copies behind
TRIM_EVERY_S = 1.0
log = logging.getLogger("tidespec.server")


class MemoryTrimmer:
    """Hands freed heap memory back to the OS after requests with large bodies.

    Why: a ~1 MB prompt is copied, parsed, rendered and tokenized (hundreds of thousands of
    tokens, in the tokenizer's threads) and then freed; glibc keeps the freed pages in its arenas,
    so resident memory settled 25-60 % above its post-warm-up level after a few hundred such
    requests and stayed there. glibc's ``malloc_trim(0)`` returns the free pages of every arena; it
    runs on a worker thread (it takes milliseconds), at most once per ``every_s``, after a large
    request has been answered. Where there is no glibc (musl, macOS) it is a no-op.
    """

    def __init__(self, every_s: float = TRIM_EVERY_S) -> None:
        self.every_s = every_s
        self._last = 0.0
        self._pending = False
        self._trim = find_malloc_trim()

    def after_large_request(self) -> None:
        """Schedule a trim on the running loop's executor: now, or ``every_s`` after the last one
        (one pending at a time, so the last request of a burst is always followed by a trim)."""
        if self._trim is None or self._pending:
            return
        self._pending = True
        loop = asyncio.get_running_loop()
        delay = max(0.0, self._last + self.every_s - time.monotonic())
        loop.call_later(delay, loop.run_in_executor, None, self._run)

    def _run(self) -> None:
        try:
            assert self._trim is not None
            self._trim(0)
        finally:
            self._last = time.monotonic()
            self._pending = False


class Admission:
    """The server's phase and the API requests inside the app (mutated on the event loop only)."""

    def __init__(self, phase: Phase = "serving") -> None:
        if phase not in PHASES:
            raise ConfigError(f"phase must be one of {PHASES}, got {phase!r}")
        self.phase: Phase = phase
        self.active = 0

    def refusal(self, path: str) -> JSONResponse | None:
        """The 503 for a request arriving in this phase, or None while serving."""
        if self.phase == "serving":
            return None
        if path == "/health":
            return JSONResponse({"status": self.phase}, status_code=503)
        message = ("the model is still loading; retry shortly" if self.phase == "loading"
                   else "the server is shutting down and admits no new requests")
        code = "model_loading" if self.phase == "loading" else "server_shutting_down"
        return error_response(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_S), **CLOSE})


class AdmissionGate:
    """ASGI middleware: 503 outside the serving phase (``Admission.refusal``); counts API requests."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        refusal = self.admission.refusal(path) if path != "/metrics" else None  # scrapes go on while draining
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if not path.startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return
        self.admission.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.active -= 1


class _BodyTooLarge(Exception):
    pass


class RequestGuard:
    """ASGI middleware: API key on every route but ``/health``; the body read whole, bounded in
    bytes and in seconds, before the route runs (module docstring)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, body_timeout_s: float,
                 on_reject: Callable[[str], None], trim_memory: bool = True) -> None:
        if not body_timeout_s > 0:
            raise ConfigError(f"body_timeout_s must be > 0, got {body_timeout_s}")
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.on_reject = on_reject
        self.trimmer = MemoryTrimmer() if trim_memory else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope.get("path") != "/health" and not self._authorized(headers):
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
        too_large = error_response(413, f"request body exceeds {self.max_body_bytes} bytes", code="body_too_large")
        if length is not None and int(length) > self.max_body_bytes:
            self.on_reject("body_too_large")
            await too_large(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read_body(receive)
        except TimeoutError:
            self.on_reject("body_timeout")
            resp = error_response(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                                  code="request_timeout", headers=CLOSE)
            await resp(scope, receive, send)
            return
        except _BodyTooLarge:
            self.on_reject("body_too_large")
            await too_large(scope, receive, send)
            return
        if body is None:  # the client went away before its body was complete: no one to answer
            return
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            if self.trimmer is not None and len(body) >= TRIM_BODY_BYTES:
                del body
                self.trimmer.after_large_request()

    def _authorized(self, headers: dict[str, bytes]) -> bool:
        assert self.api_key is not None
        auth = headers.get("authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get("x-api-key", b"")
        if auth[:6].lower() == b"basic ":
            token = basic_auth_password(auth[6:])
        return secrets.compare_digest(token, self.api_key)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole request body; None if the client disconnected first; ``_BodyTooLarge`` as soon
        as it exceeds ``max_body_bytes`` (a chunked body announces no length)."""
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message.get("type") != "http.request":  # http.disconnect
                return None
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
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
