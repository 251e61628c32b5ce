"""Structured-output request fields: OpenAI's ``response_format`` and vLLM's ``structured_outputs``
and legacy ``guided_*`` fields, read into the engine's one ``StructuredOutputs``.

Why this exists: clients come with three spellings of the same constraint (the openai SDK's
``response_format``, vLLM's current ``structured_outputs`` object, and the ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields older vLLM clients still send);
the engine should see one, and a request that names two gets a 400 naming both.

Worked example::

    body = {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True}}}
    constraint(ResponseFormat.model_validate(body["response_format"]), None, {})
    # StructuredOutputs(json={"type": "object"}, field="response_format")

``strict``: the output is always constrained to the schema (as vLLM does), whatever ``strict`` says;
a schema the grammar library cannot enforce is a 400 naming ``response_format`` (the engine's
``GrammarCompiler``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field
from pydantic_core import PydanticCustomError

from tidespec.sampling import SamplingParamsError, StructuredOutputs
from tidespec.server.strict import StrictModel

MAX_CHOICES = 1024


class JsonSchemaFormat(StrictModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow", populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's ``response_format``: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(StrictModel):
    """vLLM's ``structured_outputs``: exactly one of its constraints."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: Annotated[str, Field(min_length=1)] | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)] | None \
        = None
    grammar: Annotated[str, Field(min_length=1)] | None = None
    json_object: bool | None = None


# vLLM's legacy per-kind fields, with the ``StructuredOutputs`` argument each sets
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _refuse(message: str, param: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_structured_output", message, {"param": param})


def _make(**kwargs: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(**kwargs)
    except SamplingParamsError as exc:  # the 400's message names the field already: not twice
        param = exc.param or "structured_outputs"
        raise _refuse(str(exc).removeprefix(f"{param}: "), param) from None


def constraint(response_format: ResponseFormat | None, structured: StructuredOutputsRequest | None,
               guided: dict[str, Any]) -> StructuredOutputs | None:
    """The request's one constraint, or None; raises a ``PydanticCustomError`` (a 400 naming the field)
    when it names more than one or a ``json_schema`` format without its schema. ``guided``: the
    ``guided_*`` fields that were set."""
    found: list[tuple[str, StructuredOutputs]] = []
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            found.append(("response_format", _make(json_object=True, field="response_format")))
        else:
            js = response_format.json_schema
            if js is None or js.schema_ is None:
                raise _refuse("response_format of type json_schema needs json_schema.schema",
                              "response_format.json_schema")
            found.append(("response_format", _make(json=js.schema_, field="response_format")))
    if structured is not None:
        kinds = {"json": structured.json_, "regex": structured.regex, "grammar": structured.grammar,
                 "choice": tuple(structured.choice) if structured.choice is not None else None}
        given = {k: v for k, v in kinds.items() if v is not None}
        if structured.json_object:
            given["json_object"] = True
        if len(given) != 1:
            raise _refuse(f"structured_outputs must name exactly one of json, json_object, regex, choice, grammar; "
                          f"got {', '.join(given) or 'none'}", "structured_outputs")
        (kind, value), = given.items()
        found.append(("structured_outputs", _make(**{kind: value}, field=f"structured_outputs.{kind}")))
    for name, value in guided.items():
        kind = GUIDED_FIELDS[name]
        found.append((name, _make(**{kind: tuple(value) if kind == "choice" else value}, field=name)))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise _refuse(f"a request takes one output constraint; got {names}", found[1][0])
    return found[0][1] if found else None
