"""OpenAI wire format shared by the routes: the sampling fields of ``/v1/completions`` and
``/v1/chat/completions``, usage, errors, models (each route's own request and response models are
beside it, in ``tidespec.server.routes``).

Why this exists: the HTTP layer must reject malformed input *before* it reaches the engine, with a
message a client can act on, and must answer in exactly the shape the official ``openai`` client
parses. Pydantic models in strict mode give both: a wrong type (``"n": "1"``, ``"stream": 1``) or
an out-of-range value (``"temperature": 7``) fails validation and becomes an OpenAI-style 400
(see ``tidespec.server.app``); everything that validates maps one-to-one onto ``SamplingParams``.

Extensions beyond OpenAI (all optional):

* ``top_k`` (as vLLM; ``-1`` and ``0`` mean off),
* ``tidespec: {"enabled": bool, "num_speculative_tokens": int}`` — per-request speculation
  (``enabled: false`` -> 0 draft tokens; no ``num_speculative_tokens`` -> the engine's default),
* vLLM's ``repetition_penalty`` and ``min_tokens``,
* ``usage.draft_tokens`` / ``usage.accepted_tokens`` in every response,
* ``drafter_version`` on responses when the engine's drafter exposes a ``version``.

Worked example::

    # CompletionRequest (tidespec.server.routes.completions) is a SamplingRequest
    req = CompletionRequest.model_validate({"model": "m", "prompt": "Hi", "max_tokens": 8,
                                            "stop": "\\n", "tidespec": {"enabled": False}})
    req.sampling_params(default_max_tokens=16)   # SamplingParams(max_tokens=8, stop=["\\n"], ...)
    req.spec_tokens()                             # 0
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tidespec.sampling import GREEDY_TEMPERATURE, MAX_LOGIT_BIAS, SamplingParams, StructuredOutputs
from tidespec.server.formats import GUIDED_FIELDS, ResponseFormat, StructuredOutputsRequest, constraint
from tidespec.server.strict import UNSUPPORTED_FIELDS, StrictModel, first_invalid_text

MAX_STOP_STRINGS = 16
MAX_CHOICES = 64  # sequences one request may ask for: n, times the prompts of a batched completion
MAX_STOP_LEN = 256
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
# temperatures below this are greedy (as vLLM's _SAMPLING_EPS): logits / 1e-163 overflow to inf


class StreamOptions(StrictModel):
    include_usage: bool = False


class PredictionPart(StrictModel):
    type: Literal["text"]
    text: str


class Prediction(StrictModel):
    """OpenAI's Predicted Outputs: the output the client expects (a file before an edit), drafted where
    the output follows it; it never changes what is generated."""

    type: Literal["content"]
    content: str | Annotated[list[PredictionPart], Field(min_length=1)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class TidespecOptions(StrictModel):
    """Per-request speculation control (a tidespec extension)."""

    enabled: bool = True
    num_speculative_tokens: Annotated[int, Field(ge=0, le=64)] | None = None


class SamplingRequest(StrictModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    stop: str | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]],
                          Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    ignore_eos: bool = False  # vLLM extension
    tidespec: TidespecOptions | None = None
    # best_of > 1 is not served (as in vLLM v1): n choices, each sampled, are
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None  # vLLM extension
    min_tokens: Annotated[int, Field(ge=0)] | None = None  # vLLM extension
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = None
    prediction: Prediction | None = None  # OpenAI's Predicted Outputs
    # structured outputs (tidespec.server.formats): OpenAI's, vLLM's current object and its legacy fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Annotated[str, Field(min_length=1)] | None = None
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    guided_grammar: Annotated[str, Field(min_length=1)] | None = None
    _constraint: StructuredOutputs | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        """Before any field: text that is not valid Unicode, and OpenAI features tidespec does not
        implement (``UNSUPPORTED_FIELDS``) set to anything but "not used" (the error's ``param``
        names the field)."""
        where = first_invalid_text(data)
        if where is not None:
            raise PydanticCustomError("invalid_text", "{where} is not valid Unicode text (a lone surrogate)",
                                      {"where": where, "param": where})
        if isinstance(data, dict):
            for name, neutral in UNSUPPORTED_FIELDS.items():
                if name in cls.model_fields:  # served by this route (chat: tools)
                    continue
                if data.get(name) is not None and data[name] not in neutral:
                    raise PydanticCustomError("unsupported", "not supported by this server",
                                              {"param": name})
        return data

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingRequest:
        """At most one output constraint (``formats.constraint`` refuses two, naming them)."""
        self._constraint = constraint(self.response_format, self.structured_outputs,
                                      {n: getattr(self, n) for n in GUIDED_FIELDS if getattr(self, n) is not None})
        return self

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, str) and not 1 <= len(v) <= MAX_STOP_LEN:
            raise ValueError(f"a stop string must have 1 to {MAX_STOP_LEN} characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        bad = next((k for k in v or {} if not k.isdigit()), None)
        if bad is not None:
            raise ValueError(f"logit_bias keys must be token ids (decimal integers), got {bad!r}")
        return v

    def _logprobs(self) -> tuple[int | None, int | None]:
        """(top log-probabilities per generated token, per prompt token): None where not asked."""
        return None, None

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's ``SamplingParams``; raises ``SamplingParamsError`` on an invalid combination."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self._max_tokens()
        temperature = 1.0 if self.temperature is None else float(self.temperature)
        logprobs, prompt_logprobs = self._logprobs()
        return SamplingParams(
            temperature=0.0 if temperature < GREEDY_TEMPERATURE else temperature,
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=max(0, self.top_k or 0),
            seed=self.seed,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            stop=stop,
            ignore_eos=self.ignore_eos,
            structured=self._constraint,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_tokens=self.min_tokens or 0,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def api_param(self, name: str | None) -> str | None:
        """The request field an engine-side parameter name stands for (``prompt`` is the prompt
        the server built, from ``messages`` in a chat request)."""
        if name == "num_speculative_tokens":
            return "tidespec.num_speculative_tokens"
        return name

    def spec_tokens(self) -> int | None:
        """Per-request speculation length: None = the engine decides, 0 = no speculation."""
        if self.tidespec is None:
            return None
        if not self.tidespec.enabled:
            return 0
        return self.tidespec.num_speculative_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def fills_context(self) -> bool:
        """Whether the engine sets ``max_tokens`` to what the context leaves (a chat request without one)."""
        return False


# ----------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache


class CompletionTokensDetails(BaseModel):
    """Of a Predicted Output's tokens (``prediction``): drafted and kept, drafted and refused."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    completion_tokens_details: CompletionTokensDetails | None = None
    draft_tokens: int = 0  # tidespec: draft tokens proposed for this request
    accepted_tokens: int = 0  # tidespec: of those, accepted by the target


class Choice(BaseModel):
    index: int = 0
    finish_reason: str | None = None


class ResponseBase(BaseModel):
    """Fields every completion, chat completion and chat chunk response carries (after ``object``
    and ``choices``, which each subclass declares)."""

    id: str
    created: int
    model: str
    usage: Usage | None = None
    system_fingerprint: str | None = None
    drafter_version: str | None = None  # tidespec: the drafter version that served the request


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tidespec"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
