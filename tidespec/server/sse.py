"""Server-sent events and usage of the OpenAI routes: the streamed response that aborts its request
however it ends, one event's encoding, a finished request's ``usage``.

Why this exists: every generating route (``routes.completions``, ``routes.chat``) streams the same
way and counts usage the same way; it lives apart from ``app.Server`` so that the routes import it
without importing the app that assembles them.

Example: ``sse({"a": 1}) == 'data: {"a":1}\\n\\n'``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from tidespec.engine.output import RequestOutput
from tidespec.server.async_engine import RequestStream
from tidespec.server.protocol import CompletionTokensDetails, PromptTokensDetails, Usage


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


def usage_of(outs: list[RequestOutput], n: int = 1) -> Usage:
    """The usage of a request's choices (``n`` per prompt, prompt-major): each prompt counted once, as
    its first choice computed it (the others share its blocks), and every choice's generated tokens.

    Example: 2 choices of a 5-token prompt, 3 and 4 tokens generated -> prompt 5, completion 7."""
    prompts = outs[::n]
    p = sum(len(o.prompt_token_ids) for o in prompts)
    c = sum(len(o.token_ids) for o in outs)
    details = None
    if any(o.stats.num_accepted_prediction_tokens or o.stats.num_rejected_prediction_tokens for o in outs):
        details = CompletionTokensDetails(
            accepted_prediction_tokens=sum(o.stats.num_accepted_prediction_tokens for o in outs),
            rejected_prediction_tokens=sum(o.stats.num_rejected_prediction_tokens for o in outs))
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c, completion_tokens_details=details,
                 draft_tokens=sum(o.stats.num_draft_tokens for o in outs),
                 accepted_tokens=sum(o.stats.num_accepted_tokens for o in outs),
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(o.stats.num_cached_tokens
                                                                             for o in prompts)))


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) of several request streams as they come; ends when all have ended; a
    stream's failure is raised (the caller aborts the others)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, exc))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
