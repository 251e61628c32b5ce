"""A uvicorn server whose shutdown ends every open stream with an error event, never a cut.

Why this exists: on SIGTERM uvicorn stops accepting connections, waits up to its graceful-shutdown
timeout for open ones, then cancels their tasks, and only after that runs the app's lifespan
shutdown (which stops the engine). A stream still running at the deadline was cancelled mid-body:
the client saw the connection end with no error event and no ``[DONE]``, and the log got a
traceback. Here the shutdown first gives in-flight requests ``grace_s`` to finish, then stops the
engine loop, which fails the rest with ``EngineStoppedError``: each open stream sends an OpenAI
error event and ``[DONE]`` and ends normally (a non-streaming request gets a 500 error body), and
only then does uvicorn close the connections.

Worked example::

    server = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=8000), grace_s=10.0)
    server.run()            # SIGTERM: wait <= 10 s for requests in flight, then end the rest cleanly
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import uvicorn

from tidespec.server.async_engine import AsyncEngine

log = logging.getLogger("tidespec.server")


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` that drains, then ends, the app's in-flight requests before closing."""

    def __init__(self, config: uvicorn.Config, grace_s: float = 10.0, poll_s: float = 0.05) -> None:
        super().__init__(config)
        self.grace_s = grace_s
        self.poll_s = poll_s

    async def shutdown(self, sockets: Any = None) -> None:
        state = getattr(self.config.app, "state", None)
        aengine: AsyncEngine | None = getattr(state, "async_engine", None) if state is not None else None
        if aengine is not None and aengine.running:
            deadline = time.monotonic() + self.grace_s
            while aengine.num_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(self.poll_s)
            if aengine.num_in_flight:
                log.warning("shutting down: ending %d request(s) still in flight after %.1f s",
                            aengine.num_in_flight, self.grace_s)
            await aengine.shutdown()  # the rest fail with EngineStoppedError: error event + [DONE]
        await super().shutdown(sockets)
