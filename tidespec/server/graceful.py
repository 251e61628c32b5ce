"""A uvicorn server that drains on SIGTERM/SIGINT, ends every open stream with an error event,
never a cut, exits 0, and closes connections whose request headers do not arrive in time.

Why this exists: on SIGTERM uvicorn stops accepting connections, waits up to its graceful-shutdown
timeout for open ones, then cancels their tasks, and only after that runs the app's lifespan
shutdown (which stops the engine). A stream still running at the deadline was cancelled mid-body:
the client saw the connection end with no error event and no ``[DONE]``, and the log got a
traceback; and uvicorn re-raises the signal at the end, so the process died with 143. Here the
shutdown drains first: the app's ``Admission`` turns to ``draining`` at once (``/health`` 503
``{"status": "draining"}``, every new request, on a new or a kept-alive connection, a 503 with
``Retry-After``: ``tidespec.server.guard``), requests in flight get ``grace_s`` to finish, then the
engine loop stops, which fails the rest with ``EngineStoppedError``: each open stream sends an
OpenAI error event (code ``server_shutting_down``) and ``[DONE]`` and ends normally, a
non-streaming request gets a 503 with that code; only then does uvicorn close the listening
socket and the connections, and the process exits 0 (a drain is the expected end, not a crash).

uvicorn has no timeout for reading a request's headers: a client that opens connections and sends
a header byte now and then (slowloris) holds each one forever. ``HeaderTimeoutH11Protocol`` (the
h11 protocol with one timer, as nginx's ``client_header_timeout``) closes the connection, with a
408 and an OpenAI error body when a request was begun, when a request's line and headers are not
complete ``header_timeout_s`` after the connection opened or after its first byte arrived.

Worked example::

    server = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=8000), grace_s=10.0)
    server.run()            # SIGTERM: admit nothing new, wait <= 10 s for requests in flight,
                            # end the rest cleanly, return (exit code 0)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Generator
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tidespec.config import ConfigError
from tidespec.server.api_errors import error_body
from tidespec.server.async_engine import AsyncEngine
from tidespec.server.guard import Admission

log = logging.getLogger("tidespec.server")

HEADER_TIMEOUT_S = 15.0


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's line and headers.

    The timer starts when the connection opens, and on a kept-alive connection when the first byte
    of the next request arrives (until then uvicorn's keep-alive timeout governs the idle
    connection); it is cancelled as soon as h11 has parsed a request's headers (uvicorn then starts
    a new request cycle). When it fires, a partly sent request gets a 408 with an OpenAI error body,
    a connection that sent nothing is closed silently. The body is not under this timer (the app
    reads it within its own size and time bounds, ``guard.RequestGuard``).

    A request answered before its body was read (a 401, a 413) leaves the rest of the body to come:
    h11 reads and discards it, and the connection is closed if it has not all arrived
    ``header_timeout_s`` after the answer (a lingering close, as nginx's ``lingering_timeout``: the
    client that is still writing can read the answer, one that trickles bytes holds nothing for long).
    """

    header_timeout_s: float = HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None
    _partial_request: bool = False  # bytes of a request whose headers are not complete yet
    _linger_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_linger_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY:
            self._cancel_linger_timer()
            self._linger_timer = self.loop.call_later(self.header_timeout_s, self._linger_over)

    def _linger_over(self) -> None:
        self._linger_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY:
            self.transport.close()

    def _cancel_linger_timer(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        between_requests = cycle is None or cycle.response_complete
        super().data_received(data)
        if self.cycle is not cycle:  # a request's headers were parsed: its cycle runs
            self._cancel_header_timer()
            self._partial_request = False
        elif between_requests and data:  # part of the next request line or headers
            self._partial_request = True
            if self._header_timer is None:
                self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        """408 written directly on the transport: h11 cannot answer a request it has not parsed."""
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._partial_request:
            body = json.dumps(error_body(408, f"the request headers did not arrive within {self.header_timeout_s:g} s",
                                         code="request_timeout")).encode()
            head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
            self.transport.write(head + body)
        self.transport.close()


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` that drains, then ends, the app's in-flight requests before closing."""

    def __init__(self, config: uvicorn.Config, grace_s: float = 10.0, poll_s: float = 0.05,
                 header_timeout_s: float = HEADER_TIMEOUT_S) -> None:
        if not header_timeout_s > 0:
            raise ConfigError(f"header_timeout_s must be > 0, got {header_timeout_s}")
        # the protocol class is built per server so two servers in one process keep their timeouts
        config.http = type("HeaderTimeoutH11", (HeaderTimeoutH11Protocol,), {"header_timeout_s": header_timeout_s})
        super().__init__(config)
        self.grace_s = grace_s
        self.poll_s = poll_s

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's signal capture without re-raising the captured SIGTERM/SIGINT at the end: the
        drain is the expected end of a server, so ``run`` returns and the process exits 0."""
        with super().capture_signals():
            try:
                yield
            finally:
                if self._captured_signals:
                    log.info("drained after signal %s; exiting normally", self._captured_signals[-1])
                self._captured_signals.clear()

    async def shutdown(self, sockets: Any = None) -> None:
        state = getattr(self.config.app, "state", None)
        admission: Admission | None = getattr(state, "admission", None) if state is not None else None
        aengine: AsyncEngine | None = getattr(state, "async_engine", None) if state is not None else None
        if admission is not None:
            admission.phase = "draining"  # from now on: /health 503, new requests 503 + Retry-After

        def busy() -> int:
            return max(aengine.num_in_flight if aengine is not None else 0,
                       admission.active if admission is not None else 0)

        if aengine is not None and aengine.running:
            if busy():
                log.info("draining: admitting no new requests; %d in flight get up to %.1f s", busy(), self.grace_s)
            deadline = time.monotonic() + self.grace_s
            while busy() and time.monotonic() < deadline:
                await asyncio.sleep(self.poll_s)
            if aengine.num_in_flight:
                log.warning("shutting down: ending %d request(s) still in flight after %.1f s",
                            aengine.num_in_flight, self.grace_s)
            await aengine.shutdown()  # the rest fail with EngineStoppedError: error event + [DONE]
        await super().shutdown(sockets)
