"""``POST /v1/chat/completions``: messages through the model's chat template, answered whole or
streamed; its request and response models (OpenAI's, with tidespec's extensions of ``SamplingRequest``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Literal

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from tidespec.engine.output import RequestOutput
from tidespec.server.api_errors import ApiError
from tidespec.server.async_engine import RequestStream
from tidespec.server.protocol import Choice, ErrorResponse, ResponseBase, SamplingRequest, StrictModel, Usage
from tidespec.server.sse import sse, usage_of

if TYPE_CHECKING:
    from tidespec.server.app import Server


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def fills_context(self) -> bool:
        return self._max_tokens() is None

    def api_param(self, name: str | None) -> str | None:
        if name == "prompt":
            return "messages"
        if name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if name == "max_tokens" and self.max_tokens is None:  # the server filled it to the end of the context
            return "messages"
        return super().api_param(name)

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the tokenizer's chat template expects them (``developer`` -> ``system``)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(Choice):
    message: AssistantMessage


class ChatCompletionResponse(ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(Choice):
    delta: DeltaMessage


class ChatCompletionChunk(ResponseBase):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


def router(server: Server) -> APIRouter:
    """The chat completions route of ``server``."""
    routes = APIRouter()

    @routes.post("/v1/chat/completions", response_model=ChatCompletionResponse,
                 responses={400: {"model": ErrorResponse}, 429: {"model": ErrorResponse}})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat(server, body, request)

    return routes


def chat_prompt(server: Server, body: ChatCompletionRequest) -> str:
    """``body``'s messages rendered by the model's chat template, or a 400 naming ``messages``."""
    try:
        rendered = server.engine.tokenizer.apply_chat_template(body.template_messages(), add_generation_prompt=True,
                                                               tokenize=False)
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as exc:
        raise ApiError(400, f"cannot apply the chat template: {str(exc).splitlines()[0] if str(exc) else exc!r}",
                       param="messages") from exc
    if not isinstance(rendered, str):
        raise ApiError(400, "the chat template did not render to text", param="messages")
    return rendered


async def chat(server: Server, body: ChatCompletionRequest, request: Request) -> Response:
    """One chat request: checked, its prompt rendered, submitted, then answered whole or as an event stream."""
    server.check_model(body.model)
    label = server.route_label(request)
    headers = server.ignored_fields(body, "chat completion")
    params = server.params(lambda: body.sampling_params(1), body)
    prompt = await server.aengine.prepare(lambda b: chat_prompt(server, b), body)  # a template can be slow: off the loop
    stream = await server.submit(prompt, params, body, label, "chatcmpl")
    model = server.config.served_model_name

    def whole(out: RequestOutput) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=stream.request_id, created=int(time.time()), model=model,
            choices=[ChatChoice(message=AssistantMessage(content=out.text), finish_reason=out.finish_reason)],
            usage=usage_of(out), drafter_version=server.drafter_version)

    return await server.respond(body, stream, request, headers,
                                lambda: _stream(server, stream, model, body.include_usage), whole)


def _stream(server: Server, stream: RequestStream, model: str, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(delta: DeltaMessage | None, finish: str | None, usage: Usage | None = None) -> str:
        choices = [ChatChunkChoice(delta=delta, finish_reason=finish)] if delta is not None else []
        return sse(ChatCompletionChunk(id=stream.request_id, created=created, model=model, choices=choices,
                                       usage=usage, drafter_version=server.drafter_version))

    def render(out: RequestOutput) -> list[str]:
        chunks = []
        if out.delta_text or out.finished:
            delta = DeltaMessage(content=out.delta_text) if out.delta_text else DeltaMessage()
            chunks.append(chunk(delta, out.finish_reason if out.finished else None))
        if out.finished and include_usage:
            chunks.append(chunk(None, None, usage_of(out)))
        return chunks

    return server.sse_events(stream, [chunk(DeltaMessage(role="assistant", content=""), None)], render)
