"""``POST /v1/completions``: a text or token-id prompt, answered whole or streamed; its request and
response models (OpenAI's, with tidespec's extensions of ``SamplingRequest``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from tidespec.engine.output import RequestOutput
from tidespec.server.api_errors import ApiError
from tidespec.server.async_engine import RequestStream
from tidespec.server.protocol import Choice, ErrorResponse, ResponseBase, SamplingRequest, Usage
from tidespec.server.sse import sse, usage_of

if TYPE_CHECKING:
    from tidespec.server.app import Server


class CompletionRequest(SamplingRequest):
    # a string, a one-element list of strings (n=1 batches only), or token ids
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | Annotated[
        list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    suffix: Literal[""] | None = None

    def prompt_input(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            return p
        if isinstance(p[0], str):
            return p[0]  # type: ignore[return-value]
        return list(p)  # type: ignore[arg-type]


class CompletionChoice(Choice):
    text: str


class CompletionResponse(ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


def router(server: Server) -> APIRouter:
    """The completions route of ``server``."""
    routes = APIRouter()

    @routes.post("/v1/completions", response_model=CompletionResponse,
                 responses={400: {"model": ErrorResponse}, 429: {"model": ErrorResponse}})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await complete(server, body, request)

    return routes


async def complete(server: Server, body: CompletionRequest, request: Request) -> Response:
    """One completion request: checked, submitted, then answered whole or as an event stream."""
    server.check_model(body.model)
    label = server.route_label(request)
    prompt = body.prompt_input()
    if isinstance(prompt, list) and max(prompt) >= server.vocab_size:
        raise ApiError(400, f"prompt token ids must be < vocab size {server.vocab_size}", param="prompt")
    headers = server.ignored_fields(body, "completion")
    params = server.params(lambda: body.sampling_params(server.config.default_completion_max_tokens), body)
    stream = await server.submit(prompt, params, body, label, "cmpl")
    model = server.config.served_model_name

    def whole(out: RequestOutput) -> CompletionResponse:
        return CompletionResponse(id=stream.request_id, created=int(time.time()), model=model,
                                  choices=[CompletionChoice(text=out.text, finish_reason=out.finish_reason)],
                                  usage=usage_of(out), drafter_version=server.drafter_version)

    return await server.respond(body, stream, request, headers,
                                lambda: _stream(server, stream, model, body.include_usage), whole)


def _stream(server: Server, stream: RequestStream, model: str, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(text: str, finish: str | None, usage: Usage | None = None, choices: bool = True) -> str:
        return sse(CompletionResponse(
            id=stream.request_id, created=created, model=model,
            choices=[CompletionChoice(text=text, finish_reason=finish)] if choices else [], usage=usage,
            drafter_version=server.drafter_version))

    def render(out: RequestOutput) -> list[str]:
        chunks = []
        if out.delta_text or out.finished:
            chunks.append(chunk(out.delta_text, out.finish_reason if out.finished else None))
        if out.finished and include_usage:
            chunks.append(chunk("", None, usage_of(out), choices=False))
        return chunks

    return server.sse_events(stream, [], render)
