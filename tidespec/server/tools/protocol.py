"""The tool-calling fields of a chat request and response (OpenAI's), and the plan a request's
tools make: what the chat template gets, which parser reads the output, which grammar forces a call.

Why this exists: ``tool_choice`` decides three things at once — whether the template shows the
tools, whether the output is read for calls, and whether a grammar makes the model call (``required``:
any of the tools; a named function: that one, its arguments matching its JSON schema) — and each bad
combination is a 400 naming its field, decided before anything reaches the engine.

Worked example::

    plan = plan_tools(tools=[Tool(type="function", function=FunctionDef(name="f", parameters=schema))],
                      choice="required", parallel=True, parser=HermesParser(), json_options={})
    plan.template_tools   # [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    plan.constraint       # StructuredOutputs(grammar=<hermes grammar of f's calls>, field="tool_choice")
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from tidespec.errors import UserError
from tidespec.sampling import StructuredOutputs
from tidespec.server.strict import StrictModel
from tidespec.structured.tool_calls import Parsed, ToolCallParser, ToolSpec

MAX_TOOLS = 128


class FunctionDef(StrictModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictModel):
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
ToolList = Annotated[list[Tool], Field(max_length=MAX_TOOLS)]


class CalledFunction(StrictModel):
    name: Annotated[str, Field(min_length=1)]
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    """A call in an assistant message the client sends back (its history)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: dict[str, str]  # {"name", "arguments"}


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str]  # {"name", "arguments"} in the first chunk of a call, {"arguments"} after


class ToolRequestError(UserError, ValueError):
    """A tool field the server cannot serve as given; ``param`` names it (a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ToolPlan:
    template_tools: list[dict[str, Any]] | None  # what the chat template gets (None: no tools)
    parser: ToolCallParser | None  # reads calls out of the output (None: the output is text)
    constraint: StructuredOutputs | None  # the grammar that makes the model call (required / named)


def plan_tools(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None,
               parser: ToolCallParser | None, json_options: dict[str, Any],
               special_token: int | None = None) -> ToolPlan:
    """What a chat request's tool fields ask for; raises ``ToolRequestError`` (a 400 naming the field)."""
    tools = tools or []
    choice = choice if choice is not None else ("auto" if tools else "none")
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if choice != "none" and not tools:
        raise ToolRequestError(f"tool_choice {choice if named is None else repr(named)} needs tools", "tool_choice")
    names = [t.function.name for t in tools]
    if named is not None and named not in names:
        raise ToolRequestError(f"tool_choice names function {named!r}, which is not among the tools "
                               f"({', '.join(names)})", "tool_choice")
    if not tools:
        return ToolPlan(None, None, None)
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none":
        return ToolPlan(template_tools, None, None)
    if parser is None:
        raise ToolRequestError("this model's chat template has no tool-call format tidespec knows; serve it with "
                               "--chat-template FILE (one that renders tools) and --tool-call-parser NAME", "tools")
    if choice == "auto":
        return ToolPlan(template_tools, parser, None)
    chosen = [t for t in tools if named is None or t.function.name == named]
    specs = [ToolSpec(t.function.name, t.function.parameters or {"type": "object"}) for t in chosen]
    grammar = parser.grammar(specs, parallel is not False and named is None, json_options, special_token)
    return ToolPlan(template_tools, parser, StructuredOutputs(grammar=grammar, field="tool_choice"))


def template_message_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """An assistant message's calls as chat templates read them: arguments as an object where they parse."""
    out = []
    for c in calls:
        try:
            args: Any = json.loads(c.function.arguments)
        except ValueError:
            args = c.function.arguments
        out.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
    return out


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def calls_out(parsed: Parsed) -> list[ToolCallOut]:
    return [ToolCallOut(id=call_id(), function={"name": c.name, "arguments": c.arguments}) for c in parsed.calls]
