"""``POST /v1/completions``: a text or token-id prompt, answered whole or streamed; its request and
response models (OpenAI's, with tidespec's extensions of ``SamplingRequest``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from tidespec.engine.logits import TokenLogprob
from tidespec.engine.output import RequestOutput
from tidespec.sampling import MAX_LOGPROBS
from tidespec.server.api_errors import ApiError
from tidespec.server.async_engine import RequestStream
from tidespec.server.logprobs import CompletionLogprobs, LogprobText
from tidespec.server.protocol import MAX_CHOICES, Choice, ErrorResponse, ResponseBase, SamplingRequest, Usage
from tidespec.server.sse import sse, usage_of

if TYPE_CHECKING:
    from tidespec.server.app import Server


class CompletionRequest(SamplingRequest):
    # a string, a list of strings, token ids or a list of token-id lists (a batch: n choices each)
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | Annotated[
        list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | Annotated[
        list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]], Field(min_length=1,
                                                                                     max_length=MAX_CHOICES)]
    suffix: Literal[""] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False

    @model_validator(mode="after")
    def _choices(self) -> CompletionRequest:
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise PydanticCustomError("too_many_choices", "{count} prompts times n={n} exceeds {limit} choices",
                                      {"count": len(self.prompts()), "n": self.n, "limit": MAX_CHOICES, "param": "n"})
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return [q if isinstance(q, str) else list(q) for q in p]  # type: ignore[union-attr]

    def _logprobs(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None


class CompletionChoice(Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


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


class _Echo:
    """What ``echo`` puts before a choice's text: the prompt's text and, with ``logprobs``, its tokens'."""

    def __init__(self, server: Server, body: CompletionRequest, logprobs: LogprobText) -> None:
        self.server, self.body, self.texts = server, body, logprobs

    def text(self, out: RequestOutput) -> str:
        if not self.body.echo:
            return ""
        return self.server.engine.tokenizer.decode(out.prompt_token_ids)

    def logprobs(self, out: RequestOutput) -> CompletionLogprobs | None:
        """A finished choice's log-probabilities: the prompt's first (with ``echo``), then the generated tokens'."""
        if self.body.logprobs is None:
            return None
        entries: list[TokenLogprob | None] = list(out.logprobs or [])
        ids = list(out.token_ids)
        if self.body.echo:
            entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + entries
            ids = list(out.prompt_token_ids) + ids
        return self.texts.completion(entries, ids, 0)


async def complete(server: Server, body: CompletionRequest, request: Request) -> Response:
    """One completion request: checked, its choices submitted, then answered whole or as an event stream."""
    server.check_model(body.model)
    label = server.route_label(request)
    prompts = body.prompts()
    for prompt in prompts:
        if isinstance(prompt, list) and max(prompt) >= server.vocab_size:
            raise ApiError(400, f"prompt token ids must be < vocab size {server.vocab_size}", param="prompt")
    headers = server.ignored_fields(body, "completion")
    params = server.params(lambda: body.sampling_params(server.config.default_completion_max_tokens), body)
    streams = await server.submit_choices(prompts, params, body, label, "cmpl")
    model = server.config.served_model_name
    echo = _Echo(server, body, server.logprob_text)

    def whole(outs: list[RequestOutput]) -> CompletionResponse:
        choices = [CompletionChoice(index=i, text=echo.text(out) + out.text, finish_reason=out.finish_reason,
                                    logprobs=echo.logprobs(out)) for i, out in enumerate(outs)]
        return CompletionResponse(id=streams[0].request_id, created=int(time.time()), model=model, choices=choices,
                                  usage=usage_of(outs, body.n), drafter_version=server.drafter_version)

    return await server.respond(body, streams, request, headers,
                                lambda: _stream(server, streams, model, body, echo), whole)


def _stream(server: Server, streams: list[RequestStream], model: str, body: CompletionRequest,
            echo: _Echo) -> AsyncIterator[str]:
    created = int(time.time())
    started: set[int] = set()  # choices whose first chunk (with the echoed prompt) went out
    sent = [0] * len(streams)  # characters of each choice's text sent so far (its logprobs' text_offset)

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse(CompletionResponse(id=streams[0].request_id, created=created, model=model, choices=choices,
                                      usage=usage, drafter_version=server.drafter_version))

    def render(i: int, out: RequestOutput) -> list[str]:
        text, lp = out.delta_text, None
        if body.logprobs is not None:
            entries: list[TokenLogprob | None] = list(out.delta_logprobs or [])
            ids = list(out.delta_token_ids)
            offset = sent[i]
            if i not in started and body.echo:
                entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + entries
                ids = list(out.prompt_token_ids) + ids
                offset = 0
            lp = server.logprob_text.completion(entries, ids, offset) if ids else None
        if i not in started:
            text = echo.text(out) + text
            started.add(i)
        sent[i] += len(text)
        if not (text or out.finished or lp is not None):
            return []
        return [chunk([CompletionChoice(index=i, text=text, finish_reason=out.finish_reason if out.finished else None,
                                        logprobs=lp)])]

    def last(outs: list[RequestOutput]) -> list[str]:
        return [chunk([], usage_of(outs, body.n))] if body.include_usage else []

    return server.sse_events(streams, [], render, last)
