"""Strict request models: no type coercion, no NaN, unknown fields kept aside and named, and the
OpenAI features tidespec does not serve accepted only at their "not used" values.

Why a module of its own: every request model of the server derives from ``StrictModel`` (the shared
sampling fields in ``protocol``, the structured-output fields in ``formats``, each route's own), and
``protocol`` builds on ``formats``; the base both need sits below them.

Example: ``first_invalid_text({"messages": [{"content": "\\ud800"}]})`` -> ``"messages[0].content"``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

# OpenAI request fields tidespec does not implement, with the values that mean "not used" (accepted,
# since clients send them by default); any other value is refused with a 400 naming the field.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
    "parallel_tool_calls": (),
    "modalities": (["text"],), "audio": (), "top_logprobs": (0,),
    "service_tier": ("auto", "default"),
}


def first_invalid_text(value: Any, where: str = "") -> str | None:
    """Where in a parsed JSON body the first string is not valid Unicode text (a lone UTF-16
    surrogate such as ``"\\ud800"``, which JSON allows and no tokenizer can encode), else None.

    Example: ``first_invalid_text({"messages": [{"content": "\\ud800"}]})`` -> ``"messages[0].content"``.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
        return None
    items: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        items = [(f"{where}.{k}" if where else str(k), v) for k, v in value.items()]
        items = [(where or "body", k) for k in value] + items
    elif isinstance(value, list):
        items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    for at, v in items:
        hit = first_invalid_text(v, at)
        if hit is not None:
            return hit
    return None


class StrictModel(BaseModel):
    """Strict types (no ``"1"`` -> 1 coercion), no NaN/inf. Unknown fields are kept aside
    (``extra="allow"``) and ignored, as vLLM and OpenAI's server do for forward compatibility;
    ``unknown_fields`` names them so that the server can say so (or refuse them)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    def unknown_fields(self, where: str = "") -> list[str]:
        """Dotted paths of the fields this model and the models inside it do not know, except the
        OpenAI features screened by ``UNSUPPORTED_FIELDS`` (known, accepted at "not used").

        Example: ``ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi",
        "x": 1}], "min_tokens": 2}).unknown_fields()`` -> ``["min_tokens", "messages[0].x"]``."""
        found = [f"{where}{k}" for k in (self.model_extra or {}) if not (not where and k in UNSUPPORTED_FIELDS)]
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
            for i, item in items:
                if isinstance(item, StrictModel):
                    found += item.unknown_fields(f"{where}{name}{'' if i is None else f'[{i}]'}.")
        return found
