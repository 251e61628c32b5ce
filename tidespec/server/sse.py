"""Server-sent events and usage of the OpenAI routes: the streamed response that aborts its request
however it ends, one event's encoding, a finished request's ``usage``.

Why this exists: every generating route (``routes.completions``, ``routes.chat``) streams the same
way and counts usage the same way; it lives apart from ``app.Server`` so that the routes import it
without importing the app that assembles them.

Example: ``sse({"a": 1}) == 'data: {"a":1}\\n\\n'``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from tidespec.engine.output import RequestOutput
from tidespec.server.protocol import PromptTokensDetails, Usage


class EventStream(StreamingResponse):
    """SSE response that runs ``on_close`` however it ends (done, client gone, cancelled)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self._on_close = on_close

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(obj: BaseModel | dict[str, Any]) -> str:
    data = obj.model_dump(exclude_none=False) if isinstance(obj, BaseModel) else obj
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def usage_of(out: RequestOutput) -> Usage:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c, draft_tokens=out.stats.num_draft_tokens,
                 accepted_tokens=out.stats.num_accepted_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=out.stats.num_cached_tokens))
