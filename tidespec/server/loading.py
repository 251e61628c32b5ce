"""The app ``tidespec serve`` binds before the model is loaded: 503 "loading" until it is ready.

Why this exists: loading a checkpoint (and compiling, capturing graphs, timing kernels) takes
seconds to minutes. A server that binds its port only afterwards looks dead to a load balancer
and to an orchestrator's probe: connection refused, indistinguishable from a crash. Here the port
is bound at once; ``/health`` answers 503 ``{"status": "loading"}`` and every other route a 503
with ``Retry-After`` (``guard.Admission``) while a daemon thread builds the real app; then the real
app's lifespan starts (the engine loop) and requests pass through to it. A load that fails stops
the server, and ``tidespec serve`` reports the error as it did before binding. A SIGTERM during
the load ends the server without waiting for it.

Worked example::

    admission = Admission("loading")
    app = DeferredApp(lambda: create_app(build_engine(config), admission=admission), admission,
                      on_failure=lambda exc: setattr(server, "should_exit", True))
    GracefulServer(uvicorn.Config(app, port=8000)).run()   # /health: 503 loading ... 200 ok
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI

from tidespec.server.guard import Admission, Receive, Scope, Send

log = logging.getLogger("tidespec.server")


class DeferredApp:
    """ASGI app answering for ``admission`` until ``load()`` (run on a daemon thread) returns the
    real app; ``state`` carries ``admission`` and, once loaded, ``async_engine`` (the drain reads both)."""

    def __init__(self, load: Callable[[], FastAPI], admission: Admission,
                 on_failure: Callable[[BaseException], None]) -> None:
        self.load = load
        self.admission = admission
        self.on_failure = on_failure
        self.state = SimpleNamespace(admission=admission, async_engine=None)
        self.app: FastAPI | None = None
        self.error: BaseException | None = None
        self._stack = contextlib.AsyncExitStack()
        self._task: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # a websocket: nothing is served on one
            return
        refusal = self.admission.refusal(str(scope.get("path", "")))
        assert refusal is not None  # the phase turns to "serving" only once self.app is set
        await refusal(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._task = asyncio.get_running_loop().create_task(self._load())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._task is not None and not self._task.done():
                    self._task.cancel()  # the thread goes on loading; the process exits without it
                await self._stack.aclose()  # the real app's shutdown: engine loop, trainer child
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _load(self) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[FastAPI] = loop.create_future()

        def run() -> None:
            try:
                app = self.load()
            except BaseException as exc:  # noqa: BLE001 - reported to the server, which stops and re-raises it
                loop.call_soon_threadsafe(_settle, done, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, done, app, None)

        t0 = time.monotonic()
        # a daemon thread, not the loop's executor: a SIGTERM during a long load must not wait for it
        threading.Thread(target=run, name="tidespec-load", daemon=True).start()
        try:
            app = await done
            await self._stack.enter_async_context(app.router.lifespan_context(app))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the load's error, handed to the server
            self.error = exc
            self.on_failure(exc)
            return
        self.app = app
        self.state.async_engine = app.state.async_engine
        if self.admission.phase == "loading":
            self.admission.phase = "serving"
        log.info("model loaded in %.1f s; serving", time.monotonic() - t0)


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
