"""Tool-call formats of the model families, one parser each: read calls back out of the model's
text, and write the grammar that makes it call (``tool_choice`` required or a named function).

Why this exists: a model calls tools in the format its chat template taught it, not in OpenAI's
``tool_calls`` objects; the server turns one into the other (vLLM's ``--tool-call-parser``), and
``bench spec --structured`` forces calls with the same grammars (so it sits with the constraints,
below both). Each
parser knows its format both ways, so a call the grammar forces is one the parser reads back. A
parser is chosen by name (``--tool-call-parser``) or from the chat template (``detect``).

Formats (``REGISTRY``):

* ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per
  call (Qwen2.5, Qwen3, Hermes, and the embedded SmolLM2's template); a block holding a list of
  calls (SmolLM2's model card) is read too.
* ``llama3_json``: Llama 3.1+ answers a call as bare JSON ``{"name": ..., "parameters": {...}}``
  (after ``<|python_tag|>`` sometimes), several joined by ``; ``.
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``; ``[TOOL_CALLS]`` is a
  special token in Mistral's tokenizers, which the grammar writes as that token.

Worked example (hermes)::

    HermesParser().parse('Sure.<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    # Parsed(content="Sure.", calls=[ParsedCall(name="f", arguments='{"x": 1}')])
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from tidespec.errors import UserError


class ToolParserError(UserError, ValueError):
    """No such parser, or none fits the chat template; one line."""


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text (OpenAI's ``function.arguments``)


@dataclass
class Parsed:
    content: str | None  # the text that is not a call (None when there is none)
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolSpec:
    """One function a request offers: its name and its arguments' JSON schema."""

    name: str
    parameters: dict[str, Any]


def call_schema(tool: ToolSpec, arguments_key: str, json_options: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call of ``tool``: ``{"name": <its name>, <arguments_key>: <its parameters>}``,
    keys in that order; ``json_options`` (llguidance's ``x-guidance``: whitespace, separators) applied."""
    return {"type": "object", "properties": {"name": {"const": tool.name}, arguments_key: tool.parameters},
            "required": ["name", arguments_key], "additionalProperties": False, "x-guidance": json_options}


def _one_of(tools: list[ToolSpec], arguments_key: str, json_options: dict[str, Any]) -> str:
    """A Lark rule body: any call of any of ``tools`` (``%json``, llguidance's inline JSON schema)."""
    return " | ".join(f"%json {json.dumps(call_schema(t, arguments_key, json_options))}" for t in tools)


def _call_of(obj: Any, arguments_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in arguments_keys:
        if key in obj:
            args = obj[key]
            return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args))
    return ParsedCall(obj["name"], "{}")


class ToolCallParser(ABC):
    """A family's tool-call format. ``markers``: texts that start a call in the output (the server
    holds streamed text back while it could be one); ``at_start``: a call only counts at the start
    of the output."""

    name = ""
    markers: tuple[str, ...] = ()
    at_start = False

    @abstractmethod
    def detects(self, template: str) -> bool:
        """Whether a chat template writes this format."""

    @abstractmethod
    def parse(self, text: str) -> Parsed:
        """The calls in a model's answer, and the text that is not a call."""

    @abstractmethod
    def grammar(self, tools: list[ToolSpec], parallel: bool, json_options: dict[str, Any],
                special_token: int | None = None) -> str:
        """A Lark grammar (llguidance) of one call of any of ``tools`` (several when ``parallel``)."""


class HermesParser(ToolCallParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", re.DOTALL)

    def detects(self, template: str) -> bool:
        return "<tool_call>" in template

    def parse(self, text: str) -> Parsed:
        start = text.find("<tool_call>")
        if start < 0:
            return Parsed(text)
        calls: list[ParsedCall] = []
        for body, closed in self._block.findall(text[start:]):
            try:
                obj = json.loads(body)
            except ValueError:
                if not closed and calls:  # a last call cut short (max_tokens): the complete ones stand
                    break
                return Parsed(text)  # not a call after all: the text as it is
            for item in obj if isinstance(obj, list) else [obj]:
                call = _call_of(item, ("arguments", "parameters"))
                if call is None:
                    return Parsed(text)
                calls.append(call)
        return Parsed(text[:start].strip() or None, calls)

    def grammar(self, tools: list[ToolSpec], parallel: bool, json_options: dict[str, Any],
                special_token: int | None = None) -> str:
        more = ' ("\\n" block)*' if parallel else ""
        return (f"start: block{more}\n"
                f'block: "<tool_call>\\n" call "\\n</tool_call>"\n'
                f"call: {_one_of(tools, 'arguments', json_options)}\n")


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    at_start = True

    def detects(self, template: str) -> bool:
        return "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template)

    def parse(self, text: str) -> Parsed:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return Parsed(text)
        calls: list[ParsedCall] = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return Parsed(text)
            call = _call_of(obj, ("parameters", "arguments"))
            if call is None:
                return Parsed(text)
            calls.append(call)
            pos = end
            rest = body[pos:].lstrip()
            if not rest:
                break
            if not rest.startswith(";"):
                return Parsed(text)
            pos = len(body) - len(rest) + 1
            while pos < len(body) and body[pos].isspace():
                pos += 1
        return Parsed(None, calls)

    def grammar(self, tools: list[ToolSpec], parallel: bool, json_options: dict[str, Any],
                special_token: int | None = None) -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\ncall: {_one_of(tools, 'parameters', json_options)}\n"


class MistralParser(ToolCallParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def detects(self, template: str) -> bool:
        return "[TOOL_CALLS]" in template

    def parse(self, text: str) -> Parsed:
        start = text.find("[TOOL_CALLS]")
        body = text[start + len("[TOOL_CALLS]"):] if start >= 0 else text.lstrip()
        if start < 0 and not body.startswith("[{"):  # the special token may be left out of the text
            return Parsed(text)
        try:
            obj, _ = json.JSONDecoder().raw_decode(body.lstrip())
        except ValueError:
            return Parsed(text)
        calls = [_call_of(item, ("arguments", "parameters")) for item in (obj if isinstance(obj, list) else [obj])]
        if not calls or any(c is None for c in calls):
            return Parsed(text)
        content = text[:start].strip() if start >= 0 else ""
        return Parsed(content or None, [c for c in calls if c is not None])

    def grammar(self, tools: list[ToolSpec], parallel: bool, json_options: dict[str, Any],
                special_token: int | None = None) -> str:
        items = {"anyOf": [call_schema(t, "arguments", json_options) for t in tools]}
        array = {"type": "array", "items": items, "minItems": 1, "x-guidance": json_options}
        if not parallel:
            array["maxItems"] = 1
        marker = f"<[{special_token}]>" if special_token is not None else '"[TOOL_CALLS]"'
        return f"start: {marker} %json {json.dumps(array)}\n"


REGISTRY: dict[str, ToolCallParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser())}


def parser_for(name: str, template: str | None) -> ToolCallParser | None:
    """The parser named ``name``, or with ``"auto"`` the one whose format the chat template writes
    (None when none does: tools cannot be served then); raises ``ToolParserError`` for an unknown name."""
    if name != "auto":
        if name not in REGISTRY:
            raise ToolParserError(f"unknown tool-call parser {name!r}; one of auto, {', '.join(REGISTRY)}")
        return REGISTRY[name]
    if not template:
        return None
    return next((p for p in REGISTRY.values() if p.detects(template)), None)
