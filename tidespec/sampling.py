"""Sampling parameters and the one logits -> probabilities transform shared by sampler and verifier.

Why this exists: speculative sampling is lossless only if the verifier compares the draft
against *exactly* the distribution plain sampling would draw from. Both call
``target_probs`` below, so temperature / top-k / top-p can never drift apart.

Seeded requests draw every token by an *exponential race* keyed by (seed, output position)
(``seeded_draw``): the token at position t is ``argmax_i p_i / E_i`` with ``E ~ Exp(1)`` from a
generator seeded by the pair. The draw depends on nothing but the seed, the position and the
target's distribution there: not on how many random numbers drafts or verification consumed before,
which is what makes seeded sampling reproducible with any drafter (``verify_seeded``).

Worked example (top-p)::

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    # softmax = [.644, .237, .087, .032]; the smallest prefix reaching 0.8 is the first two
    # tokens -> p == [[.731, .269, 0, 0]]; top_p=1e-300 keeps the first token alone -> [[1, 0, 0, 0]]
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from tidespec.errors import UserError

GREEDY_TEMPERATURE = 1e-5


class SamplingParamsError(UserError, ValueError):
    """A sampling parameter is out of range; the message is one line, fit for an HTTP 400.
    ``param``: the parameter's name."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputs:
    """What a constrained request's output must match: exactly one of a JSON schema (``json``, a
    dict or its text), any JSON object (``json_object``), a regular expression, a list of choices,
    or a grammar (Lark, or llama.cpp's GBNF), as vLLM's ``StructuredOutputsParams``. ``field``: the
    request field it came from (``response_format``, ``structured_outputs.json``, ``guided_regex``,
    ...), which an error names. Compiled by ``tidespec.structured`` (llguidance).

    Example: ``StructuredOutputs(choice=("yes", "no")).source == ("choice", '["yes", "no"]')``.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise SamplingParamsError(f"{self.field} must name exactly one of json, json_object, regex, choice, "
                                      f"grammar; got {', '.join(given) or 'none'}", param=self.field)
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as exc:
                raise SamplingParamsError(f"{self.field}: the JSON schema is not valid JSON ({exc})",
                                          param=self.field) from None
            object.__setattr__(self, "json", schema)
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise SamplingParamsError(f"{self.field}: a JSON schema must be an object", param=self.field)
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise SamplingParamsError(f"{self.field}: choice must be a non-empty list of non-empty strings",
                                          param=self.field)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(f"{self.field}: {name} must be a non-empty string", param=self.field)

    @property
    def source(self) -> tuple[str, str]:
        """(llguidance's format name, the grammar's text): what compiles, and the cache key."""
        if self.json_object:
            return "json_schema", '{"type": "object"}'
        if self.json is not None:
            return "json_schema", json.dumps(self.json)  # key order kept: properties are emitted in it
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        if self.regex is not None:
            return "regex", self.regex
        assert self.grammar is not None
        return "grammar", self.grammar

    def __hash__(self) -> int:
        return hash(self.source)


MAX_LOGPROBS = 20  # top log-probabilities a request may ask for per position (OpenAI's limit)
MAX_LOGIT_BIAS = 100.0  # |bias| OpenAI accepts


@dataclass
class SamplingParams:
    """Per-request decoding parameters (OpenAI/vLLM names); ``structured``: the output's constraint.

    Penalties and bias change the target's logits before a token is chosen, in plain decoding and in
    verification alike (``tidespec.engine.logits``), as vLLM applies them: ``logit_bias`` (token id ->
    added value) and ``min_tokens`` (the stop tokens masked until that many tokens were generated),
    then ``repetition_penalty`` (prompt and output tokens: positive logits divided, others
    multiplied), ``frequency_penalty`` (times each token's count in the output) and
    ``presence_penalty`` (once per token present in the output), subtracted. ``logprobs``: how many
    of the most likely tokens to report beside each generated one (0: the generated token's
    alone; None: no log-probabilities); ``prompt_logprobs`` the same for the prompt's tokens.
    ``prediction``: the output a client expects (OpenAI's Predicted Outputs), drafted where the output
    follows it (``speculative/prediction.py``); it never changes what is generated.
    """

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # (0, 1]
    seed: int | None = None
    max_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    structured: StructuredOutputs | None = None
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # [0, MAX_LOGPROBS]
    prompt_logprobs: int | None = None  # [0, MAX_LOGPROBS]
    prediction: list[int] | None = None  # token ids of the output the client expects (Predicted Outputs)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.temperature, (int, float)) or self.temperature != self.temperature:
            raise SamplingParamsError(f"temperature must be a number, got {self.temperature!r}", param="temperature")
        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}", param="temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < 0:
            raise SamplingParamsError(f"top_k must be >= 0, got {self.top_k}", param="top_k")
        if self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("stop strings must be non-empty strings", param="stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {getattr(self, name)}", param=name)
        if not self.repetition_penalty > 0 or self.repetition_penalty == float("inf"):
            raise SamplingParamsError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}",
                                      param="repetition_penalty")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                                      f"{self.min_tokens}", param="min_tokens")
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        bad = next(((t, b) for t, b in self.logit_bias.items() if t < 0 or not abs(b) <= MAX_LOGIT_BIAS), None)
        if bad is not None:
            raise SamplingParamsError(f"logit_bias: token {bad[0]} -> {bad[1]}: ids must be >= 0 and biases in "
                                      f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", param="logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise SamplingParamsError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", param=name)

    @property
    def processes_logits(self) -> bool:
        """Whether a penalty, a bias or ``min_tokens`` changes the target's logits (``engine.logits``)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias)

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy (as in vLLM): dividing logits by them overflows."""
        return self.temperature < GREEDY_TEMPERATURE


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...]: the index of each row's largest value, the first one among ties, a NaN counting as
    the largest, exactly as ``torch.argmax(x, -1)``. It is ``torch.max(x, -1).indices``: on a CPU
    ``torch.argmax`` takes 2-3x as long for the same answer (torch 2.13, 2 threads, float32 rows of
    SmolLM2's 49,152 logits: 69 vs 36 us for one row, 214 vs 81 us for 5, 753 vs 273 us for 20), and every
    decode step takes the argmax of every row it verifies (``engine/runner.py``), so speculation paid it
    per drafted token.

    Example: ``row_argmax(torch.tensor([[1.0, 3.0, 3.0], [0.0, nan, 5.0]]))`` -> ``tensor([1, 1])``."""
    return torch.max(x, dim=-1).indices


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] float probabilities after temperature, top-k, top-p.

    Greedy params give a one-hot at the argmax (ties -> lowest id, like ``argmax``).
    Computed in float64 when the logits are float64, else float32.
    """
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(dt)
    if params.greedy:
        return torch.nn.functional.one_hot(row_argmax(x), x.shape[-1]).to(dt)
    x = x / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = (cum - sorted_p) >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        # ... and always the most likely token: a top_p that underflows in float32 (1e-300 -> 0)
        # would otherwise drop every token and leave no distribution to sample from
        drop[..., 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a [V] probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1


def _fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finalizer: a bijection on 64-bit integers that spreads every input bit."""
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _MASK64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _MASK64
    return x ^ (x >> 33)


def _fmix32(x: int) -> int:
    """MurmurHash3's 32-bit finalizer, a bijection on 32-bit integers."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _MASK32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of output position ``position`` of a request seeded ``seed``.

    PyTorch's CPU generator (mt19937) keeps only the low 32 bits of a seed, so the key is built
    in 32 bits and is injective in the position: two positions of one request never share noise.
    Example: ``position_seed(7, 0) != position_seed(7, 1)``; the same pair always gives the same seed.
    """
    base = _fmix64(seed & _MASK64) & _MASK32
    return _fmix32((base + position) & _MASK32)


def race_noise(seed: int, position: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[vocab] float64 Exp(1) variates of one (seed, output position): ``E_i = -log(U_i)``.

    Always drawn by the CPU generator (then moved to ``device``): a CUDA generator gives other
    numbers for the same seed, and a drafter on one device must see the noise the target sees on
    another. ``U_i = 0`` (probability 2**-53) gives ``E_i = inf``: that token cannot win the race.
    """
    g = torch.Generator()
    g.manual_seed(position_seed(seed, position))
    u = torch.rand(vocab, dtype=torch.float64, generator=g)  # [V] in [0, 1)
    return (-torch.log(u)).to(device)


def seeded_draw(probs: torch.Tensor, seed: int, position: int, ids: torch.Tensor | None = None,
                vocab: int = 0) -> int:
    """Draw from ``probs`` [n] by the exponential race of (seed, position); returns an index into ``probs``.

    ``argmax_i p_i / E_i`` with independent ``E_i ~ Exp(1)`` is token i with probability ``p_i``
    (``E_i / p_i`` is exponential with rate ``p_i``; the smallest of independent exponentials is
    the one of rate ``p_i`` with probability ``p_i / sum(p)``), so the draw is exact. ``ids`` [n]:
    the token id of each entry when ``probs`` covers a subset of the ``vocab`` tokens (a drafter's
    small vocabulary): the noise of the whole vocabulary is drawn and read at those ids, so a
    draft drawn with the target's noise agrees with the target's own draw whenever both
    distributions favour the same token.

    Worked example: p = [.5, .3, .2], E = [1.2, .2, .9] -> p / E = [.42, 1.5, .22] -> index 1.
    """
    if ids is None:
        noise = race_noise(seed, position, probs.shape[-1], probs.device)  # [n]
    else:
        if vocab <= 0:
            raise ValueError("seeded_draw over a subset needs the full vocabulary size")
        noise = race_noise(seed, position, vocab, probs.device)[ids]  # [vocab] -> [n]
    return int((probs.to(torch.float64) / noise).argmax().item())


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request for ``n`` choices seeded ``seed``: choice 0 is the
    request's own seed (``n=1`` gives the same text), the others keyed by (seed, index).

    Example: ``choice_seed(7, 0) == 7``; ``choice_seed(7, 1) != choice_seed(7, 2)``, both fixed by (7, i).
    """
    return seed if index == 0 else _fmix64((seed + index * 0x9E3779B97F4A7C15) & _MASK64)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is not None:
        g.manual_seed(seed)
    else:
        g.seed()
    return g
