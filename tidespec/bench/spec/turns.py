"""``tidespec bench spec --turns N``: chats whose later turns resend the history, offline.

Why this exists: a chat client sends, with every new question, the whole conversation so far, and
that resent history is what the prefix cache serves; a speculative engine must then draft and
verify on top of cached blocks it did not compute in this request. ``bench serve --turns`` measures
that through the server; here it runs inside ``bench spec``'s interleaved grid, so every drafter's
outputs on prefix hits are compared token for token with plain decoding of the same prompts (the
exactness promise), beside its speed.

Protocol: conversation c takes the chat records c*N .. c*N+N-1 of the workload (cycled when it has
fewer). Turn 1 asks record c*N's question (its system message first). Every configuration runs
the turn's prompts (waves of the batch size, round-robin, as ``bench spec`` does); then plain
decoding's answer is appended to each conversation as the assistant's message, followed by the
next record's question, so every configuration sees the same prompts in the next turn (greedy
speculation is lossless: a configuration whose answer differed is counted as a mismatch, and its
next prompt is still plain's). Each engine keeps its own prefix cache across the turns.

Worked example::

    chats = conversations(load_workload("chat"), limit=4, turns=3)     # 4 conversations of 3 records
    prompts = turn_prompts(chats, [None] * 4, 0, tokenizer)          # turn 1: one prompt per chat
    # ... run every configuration on them, then with plain's answers:
    prompts = turn_prompts(chats, answers, 1, tokenizer)             # turn 2: history + next question
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from tidespec.bench.serve.turns import Conversation, chat_records
from tidespec.workloads.loader import Prompt, WorkloadRecord

# tokens the chat template adds around an answer it carries (role markers, end of turn), beyond the
# answer's own: a generous bound for sizing the engines' KV before the answers exist
TEMPLATE_SLACK = 16


class Chat:
    """One conversation: its records (one per turn) and the client's messages so far."""

    def __init__(self, records: list[WorkloadRecord]) -> None:
        self.records = records
        self.conversation = Conversation(records[0])


def conversations(items: list[WorkloadRecord], workload: str, limit: int, turns: int) -> list[Chat]:
    """``limit`` chats of ``turns`` chat records each, in file order, cycled when the workload has
    fewer than ``limit * turns``. Example: 5 chat records, limit 2, turns 3 -> records 0-2 and 3, 4, 0."""
    chats = chat_records(items, workload)
    return [Chat([chats[(c * turns + k) % len(chats)] for k in range(turns)]) for c in range(limit)]


def turn_prompts(chats: Sequence[Chat], answers: Sequence[str | None], turn: int,
                 tokenizer: PreTrainedTokenizerBase) -> list[Prompt]:
    """The prompts of 0-based ``turn``: for turn 0 each chat's first question; later, each chat's
    last answer (``answers``, plain decoding's text) and then its next question appended first."""
    out = []
    for chat, answer in zip(chats, answers):
        if turn:
            chat.conversation.answer(answer)
            chat.conversation.ask(chat.records[turn])
        out.append(Prompt(record=chat.records[turn], token_ids=_template(chat.conversation.messages, tokenizer)))
    return out


def longest_prompt(chats: Sequence[Chat], max_tokens: int, tokenizer: PreTrainedTokenizerBase) -> int:
    """An upper bound of the last turn's prompt, before any answer exists: every question of a chat
    with empty answers between them, plus ``max_tokens`` + ``TEMPLATE_SLACK`` per answer."""
    longest = 0
    for chat in chats:
        messages = chat.records[0].messages()
        for record in chat.records[1:]:
            messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": record.prompt}]
        answers = len(chat.records) - 1
        longest = max(longest, len(_template(messages, tokenizer)) + answers * (max_tokens + TEMPLATE_SLACK))
    return longest


def _template(messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(i) for i in ids]


def by_turn(turn_of: Sequence[int], records: Sequence[Any], plain: Sequence[Any]) -> list[dict[str, Any]]:
    """Per 1-based turn, one configuration's requests (``RequestRecord`` s, in prompt order, beside
    plain's): prompt tokens, how many the prefix cache served, median TTFT, and outputs differing
    from plain's. ``turn_of[i]``: the turn of prompt i.

    Example: prompts of turns [1, 1, 2, 2], 40 and 90 prompt tokens a turn, 0 and 60 cached ->
    ``[{"turn": 1, "prompt_tokens": 80, "cached_tokens": 0, ...}, {"turn": 2, ..., 180, 120, ...}]``.
    """
    out = []
    for turn in sorted(set(turn_of)):
        pairs = [(r, p) for r, p in zip(records, plain) if turn_of[r.prompt_index] == turn]
        ttfts = [r.ttft for r, _ in pairs]
        out.append({"turn": turn, "requests": len(pairs), "prompt_tokens": sum(r.prompt_tokens for r, _ in pairs),
                    "cached_tokens": sum(r.cached_tokens for r, _ in pairs),
                    "ttft_p50_ms": 1e3 * statistics.median(ttfts) if ttfts else float("nan"),
                    "mismatches": sum(1 for r, p in pairs if r.token_ids != p.token_ids)})
    return out
