"""Log-probabilities on the wire: OpenAI's chat form (``logprobs.content``) and its completions form
(``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``), from the engine's
``TokenLogprob`` values.

Why this exists: both routes, whole and streamed, report the same numbers in two shapes; a token's
text is decoded once per id (a cache per server), and a log-probability that JSON cannot carry
(``-inf``: a token a grammar forbids, listed among a row's top tokens) is clamped as vLLM does.

Example: ``LogprobText(tok).chat([TokenLogprob(42, -0.1, ((42, -0.1),))])`` ->
``ChatLogprobs(content=[ChatTokenLogprob(token="a", logprob=-0.1, bytes=[97], top_logprobs=[...])])``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from tidespec.engine.logits import TokenLogprob

MIN_LOGPROB = -9999.0  # what -inf is reported as (vLLM's value): JSON has no infinity


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


def _finite(x: float) -> float:
    return max(x, MIN_LOGPROB)


class LogprobText:
    """Token texts for log-probabilities (each id decoded alone, as vLLM reports them), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        got = self._text.get(token_id)
        if got is None:
            got = self._text[token_id] = self.tokenizer.decode([token_id])
        return got

    def top(self, token_id: int, logprob: float) -> TopLogprob:
        t = self.text(token_id)
        return TopLogprob(token=t, logprob=_finite(logprob), bytes=list(t.encode("utf-8")))

    def chat(self, entries: list[TokenLogprob]) -> ChatLogprobs:
        """The chat form of the log-probabilities of ``entries`` (generated tokens)."""
        content = []
        for e in entries:
            t = self.text(e.token_id)
            content.append(ChatTokenLogprob(token=t, logprob=_finite(e.logprob), bytes=list(t.encode("utf-8")),
                                            top_logprobs=[self.top(i, v) for i, v in e.top]))
        return ChatLogprobs(content=content)

    def completion(self, entries: list[TokenLogprob | None], token_ids: list[int], offset: int) -> CompletionLogprobs:
        """The completions form for ``token_ids`` (prompt tokens with ``echo``, then generated ones) with
        their ``entries`` (None where there is none: the prompt's first token); ``text_offset`` counts
        from ``offset``, the characters of the choice's text before the first of them."""
        out = CompletionLogprobs()
        for token_id, e in zip(token_ids, entries):
            t = self.text(token_id)
            out.tokens.append(t)
            out.text_offset.append(offset)
            offset += len(t)
            out.token_logprobs.append(None if e is None else _finite(e.logprob))
            # the chosen token's beside the top ones, as OpenAI and vLLM list it (up to logprobs + 1 entries)
            out.top_logprobs.append(None if e is None else {**{self.text(i): _finite(v) for i, v in e.top},
                                                             t: _finite(e.logprob)})
        return out
