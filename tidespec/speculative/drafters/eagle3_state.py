"""Per-sequence state of the EAGLE-3 drafter: its tap rows, its head-KV position, where its chain starts;
and how a chain's confidence decides its length (``drawn_prob``, ``confident_prefix``).

Why this exists: ``drafters/eagle3.py`` owns the drafting logic; the bookkeeping it keeps per
sequence (see that module's docstring for the positions' meaning) lives here so each module stays
readable on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tidespec.speculative.api import SeqDraft


@dataclass(frozen=True)
class DraftVocab:
    """The vocabulary one ``propose`` drafts over: the head's own (``rows`` None) or a dynamic V_t."""

    version: int  # -1: the head's own draft vocabulary
    ids: torch.Tensor  # [n] target id of each logit
    rows: torch.Tensor | nn.Module | None  # [n, H] output rows or their int8 layer; None = the head's LM head


class TapStore:
    """Tap rows of one sequence kept as appended chunks; rows before ``start`` may be dropped."""

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []  # each [n_i, 3H]
        self.start = 0  # position of the first row still held
        self.end = 0  # one past the last position appended

    def append(self, rows: torch.Tensor) -> None:
        if rows.shape[0]:
            self.chunks.append(rows)
            self.end += rows.shape[0]

    def rows(self, a: int, b: int) -> torch.Tensor:
        """[b - a, 3H] rows for positions a..b-1 (must be held)."""
        if a < self.start or b > self.end:
            raise IndexError(f"tap rows {a}..{b} not held ({self.start}..{self.end})")
        out: list[torch.Tensor] = []
        end = self.end
        for c in reversed(self.chunks):  # from the newest: a catch-up reads the last few rows
            pos = end - c.shape[0]
            lo, hi = max(a, pos), min(b, end)
            if lo < hi:
                out.append(c[lo - pos:hi - pos])
            if pos <= a:
                break
            end = pos
        out.reverse()
        return torch.cat(out) if len(out) > 1 else out[0]

    def drop_before(self, a: int) -> None:
        """Forget rows before position a (chunk granularity is refined by slicing)."""
        if a <= self.start:
            return
        keep = self.rows(a, self.end) if a < self.end else None
        self.chunks = [keep] if keep is not None else []
        self.start = a


@dataclass
class SeqState:
    slot: int
    generator: torch.Generator
    taps: TapStore = field(default_factory=TapStore)
    tokens: list[int] = field(default_factory=list)  # context token ids known to the drafter
    base: int = 0  # context position of head position 0 (> 0 after a hole in the taps)
    kv_len: int = 0  # head positions with final K/V: pairs (tap_{base+j}, token_{base+j+1}) for j < kv_len
    last_hidden: torch.Tensor | None = None  # [H] pre-norm output at position kv_len - 1
    last_logits: torch.Tensor | None = None  # [n] logits at position kv_len - 1 over the vocabulary below
    logits_vocab: int = -1  # version of the draft vocabulary ``last_logits`` is over (-1: the head's own)
    stale: bool = False  # head weights changed since kv was computed: rebuild from taps
    hole: bool = False  # a step without taps since the last taps
    lost: bool = False  # taps resumed at an unknown position (``Observation.start`` -1): never drafted again
    seeded: bool = False  # generator seeded from the request seed already

    def restart(self, position: int) -> None:
        """Start the head context afresh at context ``position`` (after a hole); the caller empties its K/V."""
        self.base, self.taps = position, TapStore()
        self.kv_len, self.last_hidden, self.last_logits, self.stale = 0, None, None, False

    def root_output(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-norm hidden [H], logits [Vd]) at the last final position: where drafting starts."""
        if self.last_hidden is None or self.last_logits is None:
            raise RuntimeError("no observed position to draft from")
        return self.last_hidden, self.last_logits


@dataclass
class CatchUp:
    state: SeqState
    start: int  # first head position to compute
    end: int  # one past the last


def drawn_prob(top: float, probs: torch.Tensor | None, token: int) -> float:
    """A draft's probability under the head: greedy (``probs`` None) the top one, sampled the drawn
    token's in ``probs`` [V] (the distribution it was drawn from)."""
    return top if probs is None else float(probs[token])


def confident_prefix(ids: list[int], tops: list[float], floor: float) -> SeqDraft:
    """The drafts a chain keeps under the confidence ``floor`` (``min_draft_prob``) given the head's
    probability of each: the ``k``-th draft is kept while the product of the probabilities before it is
    >= the floor (as the eager loop decides), with those products as its path probabilities (``token_probs``).
    Example: floor 0.3, tops 0.9, 0.5, 0.6, 0.8 -> 3 drafts, path probabilities 0.9, 0.45, 0.27."""
    path = [tops[0]]
    while len(path) < len(ids) and path[-1] >= floor:
        path.append(path[-1] * tops[len(path)])
    return SeqDraft(ids[:len(path)], None, None, token_probs=path)
