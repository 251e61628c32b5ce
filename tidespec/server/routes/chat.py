"""``POST /v1/chat/completions``: messages through the model's chat template, answered whole or
streamed; its request and response models (OpenAI's, with tidespec's extensions of ``SamplingRequest``)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError

from tidespec.engine.output import RequestOutput
from tidespec.sampling import MAX_LOGPROBS, SamplingParams
from tidespec.server.api_errors import ApiError
from tidespec.server.async_engine import RequestStream
from tidespec.server.logprobs import ChatLogprobs
from tidespec.server.protocol import Choice, ErrorResponse, ResponseBase, SamplingRequest, StrictModel, Usage
from tidespec.server.sse import sse, usage_of
from tidespec.server.tools.protocol import (
    DeltaToolCall,
    ToolCall,
    ToolCallOut,
    ToolChoice,
    ToolList,
    ToolPlan,
    ToolRequestError,
    call_id,
    calls_out,
    plan_tools,
    template_message_calls,
)
from tidespec.server.tools.stream import ToolStream

if TYPE_CHECKING:
    from tidespec.server.app import Server


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (the history a tool loop sends back)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


# apply_chat_template's own arguments and the variables the server sets: not a request's to override
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "bos_token", "eos_token", "pad_token", "unk_token", "raise_exception", "reasoning_effort"})


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: ToolList | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # vLLM's and SGLang's extension: variables for the chat template (Qwen3's and SmolLM3's
    # enable_thinking, Llama 3's date_string), passed to it beside the messages
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's field: how much a reasoning model thinks; the chat template reads it (gpt-oss's harmony
    # template puts it in the system turn), as vLLM passes it
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("top_logprobs", "top_logprobs needs logprobs: true", {"param": "top_logprobs"})
        return self

    @model_validator(mode="after")
    def _template_kwargs_are_variables(self) -> ChatCompletionRequest:
        taken = sorted(set(self.chat_template_kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise PydanticCustomError(
                "chat_template_kwargs", "chat_template_kwargs cannot set {name}: the request's own fields decide it",
                {"param": "chat_template_kwargs", "name": taken[0]})
        return self

    def _logprobs(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

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

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the tokenizer's chat template expects them (``developer`` -> ``system``; an
        assistant's calls with their arguments as objects; a tool result with the call it answers)."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                msg["tool_calls"] = template_message_calls(m.tool_calls)
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Choice):
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None


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


def chat_prompt(server: Server, body: ChatCompletionRequest, plan: ToolPlan) -> str:
    """``body``'s messages (and its tools) rendered by the chat template, or a 400 naming ``messages``
    (or ``tools``, when the template ignores the tools a request needs it to show)."""
    tokenizer = server.engine.tokenizer
    extra: dict[str, Any] = {**(body.chat_template_kwargs or {})}
    if body.reasoning_effort is not None:
        extra["reasoning_effort"] = body.reasoning_effort
    if server.chat_template:
        extra["chat_template"] = server.chat_template
    messages = body.template_messages()
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                 tools=plan.template_tools, **extra)
        if plan.parser is not None and rendered == tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **extra):
            raise ApiError(400, "this model's chat template does not render tools; serve it with --chat-template FILE "
                                "(one that does) and --tool-call-parser NAME", param="tools")
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as exc:
        raise ApiError(400, f"cannot apply the chat template: {str(exc).splitlines()[0] if str(exc) else exc!r}",
                       param="messages") from exc
    if not isinstance(rendered, str):
        raise ApiError(400, "the chat template did not render to text", param="messages")
    return rendered


def tool_plan(server: Server, body: ChatCompletionRequest, params: SamplingParams) -> tuple[ToolPlan, SamplingParams]:
    """The request's tool plan and its sampling parameters with the plan's grammar, or a 400 naming the field."""
    try:
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, server.tool_parser,
                          server.engine.grammars.json_options, server.tool_special_token)
    except ToolRequestError as exc:
        raise ApiError(400, str(exc), param=exc.param) from exc
    if plan.constraint is None:
        return plan, params
    if params.structured is not None:
        what = body.tool_choice if isinstance(body.tool_choice, str) else "naming a function"
        raise ApiError(400, f"tool_choice {what} makes the output a tool call; it cannot also follow "
                            f"{params.structured.field}", param="tool_choice")
    return plan, dataclasses.replace(params, structured=plan.constraint)


def _answer(out: RequestOutput, plan: ToolPlan) -> tuple[AssistantMessage, str | None]:
    """The assistant message of a finished output: its calls read back when the request offered tools."""
    if plan.parser is not None:
        parsed = plan.parser.parse(out.text)
        if parsed.calls:
            finish = "tool_calls" if out.finish_reason == "stop" else out.finish_reason
            return AssistantMessage(content=parsed.content, tool_calls=calls_out(parsed)), finish
    return AssistantMessage(content=out.text), out.finish_reason


async def chat(server: Server, body: ChatCompletionRequest, request: Request) -> Response:
    """One chat request: checked, its prompt rendered, its choices submitted, then answered whole or as an
    event stream."""
    server.check_model(body.model)
    label = server.route_label(request)
    headers = server.ignored_fields(body, "chat completion")
    plan, params = tool_plan(server, body, server.params(lambda: body.sampling_params(1), body))
    prompt = await server.aengine.prepare(lambda b: chat_prompt(server, b, plan), body)  # a template can be slow
    streams = await server.submit_choices([prompt], params, body, label, "chatcmpl")
    model = server.config.served_model_name
    texts = server.logprob_text if body.logprobs else None

    def whole(outs: list[RequestOutput]) -> ChatCompletionResponse:
        choices = []
        for i, out in enumerate(outs):
            message, finish = _answer(out, plan)
            choices.append(ChatChoice(index=i, message=message, finish_reason=finish,
                                      logprobs=texts.chat(out.logprobs or []) if texts is not None else None))
        return ChatCompletionResponse(id=streams[0].request_id, created=int(time.time()), model=model,
                                      choices=choices, usage=usage_of(outs, body.n),
                                      drafter_version=server.drafter_version)

    return await server.respond(body, streams, request, headers,
                                lambda: _stream(server, streams, model, body, plan), whole)


def _stream(server: Server, streams: list[RequestStream], model: str, body: ChatCompletionRequest,
            plan: ToolPlan) -> AsyncIterator[str]:
    created = int(time.time())
    calls = [ToolStream(plan.parser) if plan.parser is not None else None for _ in streams]
    texts = server.logprob_text if body.logprobs else None

    def chunk(i: int, delta: DeltaMessage | None, finish: str | None, usage: Usage | None = None,
              logprobs: ChatLogprobs | None = None) -> str:
        choices = [ChatChunkChoice(index=i, delta=delta, finish_reason=finish, logprobs=logprobs)] \
            if delta is not None else []
        return sse(ChatCompletionChunk(id=streams[0].request_id, created=created, model=model, choices=choices,
                                       usage=usage, drafter_version=server.drafter_version))

    def render(i: int, out: RequestOutput) -> list[str]:
        lp = texts.chat(out.delta_logprobs) if texts is not None and out.delta_logprobs else None
        tool_calls = calls[i]
        if tool_calls is not None:  # the step's log-probabilities ride on its first chunk
            pending = [lp]

            def first_with_logprobs(delta: DeltaMessage | None, finish: str | None) -> str:
                return chunk(i, delta, finish, logprobs=pending.pop() if pending else None)

            chunks = _tool_chunks(tool_calls, out, first_with_logprobs)
            if pending and lp is not None:  # text held back (it may become a call): the numbers go out anyway
                chunks.append(chunk(i, DeltaMessage(), None, logprobs=lp))
            return chunks
        if out.delta_text or out.finished or lp is not None:
            delta = DeltaMessage(content=out.delta_text) if out.delta_text else DeltaMessage()
            return [chunk(i, delta, out.finish_reason if out.finished else None, logprobs=lp)]
        return []

    def last(outs: list[RequestOutput]) -> list[str]:
        return [chunk(0, None, None, usage_of(outs, body.n))] if body.include_usage else []

    first = [chunk(i, DeltaMessage(role="assistant", content=""), None) for i in range(len(streams))]
    return server.sse_events(streams, first, render, last)


def _tool_chunks(calls: ToolStream, out: RequestOutput,
                 chunk: Callable[[DeltaMessage | None, str | None], str]) -> list[str]:
    """The chunks of one output of a request that offered tools: the text that cannot be a call yet;
    at the end the rest, or each call as OpenAI streams it (its name, then its arguments), and the
    finish reason."""
    chunks = []
    text = calls.feed(out.delta_text)
    if not out.finished:
        return [chunk(DeltaMessage(content=text), None)] if text else []
    rest, parsed = calls.finish()
    if text + rest:
        chunks.append(chunk(DeltaMessage(content=text + rest), None))
    for i, c in enumerate(parsed.calls):
        chunks.append(chunk(DeltaMessage(tool_calls=[DeltaToolCall(index=i, id=call_id(), type="function",
                                                                   function={"name": c.name, "arguments": ""})]), None))
        chunks.append(chunk(DeltaMessage(tool_calls=[DeltaToolCall(index=i, function={"arguments": c.arguments})]),
                            None))
    finish = "tool_calls" if parsed.calls and out.finish_reason == "stop" else out.finish_reason
    chunks.append(chunk(DeltaMessage(), finish))
    return chunks
