"""Multi-turn chats for ``tidespec bench serve --turns N``: the history a client resends, turn by turn.

Why this exists: a chat client sends, with every new question, the whole conversation so far (the
system message, each earlier question and the answer it got). That resent history is what a prefix
cache is for, and a benchmark of one-turn requests never shows it. A conversation here is the
client's side only: it keeps the messages, appends each answer as it arrives and the next record's
question, and stops when a turn fails (a later turn without its answer would be another request).

Worked example::

    chat = Conversation(WorkloadRecord("a", "chat", "chat", "What is 2+2?", system="Be brief."))
    chat.messages        # [{"role": "system", ...}, {"role": "user", "content": "What is 2+2?"}]
    chat.answer("4.")
    chat.ask(WorkloadRecord("b", "chat", "chat", "And 3+3?"))       # True
    [m["role"] for m in chat.messages]   # ['system', 'user', 'assistant', 'user']
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, Protocol

from tidespec.config import ConfigError
from tidespec.workloads.loader import WorkloadRecord


class TurnRecord(Protocol):
    """What ``summarize_turns`` reads of a request (``bench.serve.run.RequestRecord``)."""

    turn: int
    ok: bool
    ttft_s: float | None
    prompt_tokens: int
    cached_tokens: int


class Conversation:
    """One client's chat: the messages it sends next."""

    def __init__(self, first: WorkloadRecord) -> None:
        self.messages: list[dict[str, str]] = first.messages()
        self.failed = False

    def answer(self, text: str | None) -> None:
        """The last turn's answer (None: it failed, so the conversation ends)."""
        if text is None:
            self.failed = True
        else:
            self.messages = [*self.messages, {"role": "assistant", "content": text}]

    def ask(self, record: WorkloadRecord) -> bool:
        """Append ``record``'s question as the next user turn; False once a turn has failed."""
        if self.failed:
            return False
        self.messages = [*self.messages, {"role": "user", "content": record.prompt}]
        return True


def chat_records(items: list[WorkloadRecord], workload: str) -> list[WorkloadRecord]:
    """The chat records of a workload (conversations are chats); ConfigError if it has none."""
    chats = [r for r in items if r.kind == "chat"]
    if not chats:
        raise ConfigError(f"--turns > 1 needs chat records; workload {workload!r} has only completions")
    return chats


def summarize_turns(records: Sequence[TurnRecord]) -> dict[int, dict[str, Any]]:
    """Per turn (only when some request is a later turn): requests answered, median TTFT, prompt
    tokens and how many of them the server reported as reused from its cache.

    Example: turns 1 and 2 with prompts of 40 and 90 tokens, 0 and 60 cached ->
    ``{1: {..., "prompt_tokens": 40, "cached_prompt_tokens": 0}, 2: {..., 90, 60}}``.
    """
    if not any(r.turn > 1 for r in records):
        return {}
    out: dict[int, dict[str, Any]] = {}
    for turn in sorted({r.turn for r in records}):
        ok = [r for r in records if r.turn == turn and r.ok]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        out[turn] = {"requests": len(ok),
                     "ttft_p50_s": float(statistics.median(ttfts)) if ttfts else None,
                     "prompt_tokens": sum(r.prompt_tokens for r in ok),
                     "cached_prompt_tokens": sum(r.cached_tokens for r in ok)}
    return out
