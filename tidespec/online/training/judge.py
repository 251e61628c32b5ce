"""A paired judgement of two EAGLE-3 heads on the same rows, on the acceptance a server would walk.

Why this exists: the trainer decides twice whether a new head is better — on its round's held-out
sequences (publish or not) and on the rows served after it (keep or revert) — and both decisions
were taken on the per-row score (a greedy chain drafted from every row) and on a point estimate.
Measured on two domains the shipped head never saw (docs/benchmarks/learning.md, "What training
on a new domain's first requests buys"), both misled: on a head fine-tuned on a domain's first
requests, the per-row score of its later ones rose about twice as much as the walked acceptance
(what a greedy server meets: one chain per emitted run of tokens, ``eagle3_train.walk_chains``),
2-6 % against 1-3 %; and a round's held-out window (about 125 rows at the default 10 % of 512-row
rounds) is so small that a win of that size there is noise, so versions were published, swapped
in and judged "kept" while served acceptance stayed where the frozen head had it.

So a judgement here is

* on the walked metric: accepted tokens per drafting step of each head's own walk over the rows;
* paired: both heads walk the same rows, so how hard the traffic is cancels out;
* with its uncertainty: the rows are cut into blocks of ``block_rows`` (each walked from its first
  row, an independent sample of a server's steps), and the gain's ``confidence`` interval comes
  from a paired bootstrap over blocks (both heads' sums resampled with the same indices, the gain
  a difference of ratio estimates). ``confidence`` 0 gives the point estimate on both sides.

Decisions on a judgement (``rounds.DraftTrainer``): publish when ``low > min_gain``; revert a
served version when ``high < -margin * base``. Fewer than two blocks cannot show a spread: the
interval is then unbounded (nothing is published, nothing reverted) unless ``confidence`` is 0.

Worked example: blocks (steps, tokens) for the base head [(10, 18), (9, 17), (11, 19)] and the
candidate [(8, 18), (8, 17), (9, 19)] -> base 54/30 = 1.80, candidate 54/25 = 2.16, gain +0.36;
every resample of three blocks gains (the candidate needs fewer steps in each block), so the
interval lies above 0 and, with min_gain 0, the candidate is published.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tidespec.models.eagle3_head import Eagle3Head
from tidespec.online.training.eagle3_train import SignalSegment, acceptance_stats


@dataclass(frozen=True)
class PairedJudgement:
    """Two heads walked over the same rows (see the module docstring).

    ``base`` / ``cand``: walked acceptance length (tokens per step) of each; ``row_base`` /
    ``row_cand``: the per-row score beside it, for the record; ``low`` / ``high``: the
    ``confidence`` interval of ``cand - base``; ``blocks``: the samples it was resampled from.
    """

    rows: int
    blocks: int
    base: float
    cand: float
    row_base: float
    row_cand: float
    low: float
    high: float
    confidence: float

    @property
    def gain(self) -> float:
        return self.cand - self.base

    def better(self, min_gain: float) -> bool:
        """The candidate wins: its gain's lower bound is above ``min_gain`` (a NaN base — nothing
        the old head could be walked on — lets a finite candidate win)."""
        if not math.isfinite(self.cand):
            return False
        return not math.isfinite(self.base) or self.low > min_gain

    def worse(self, margin: float) -> bool:
        """The candidate loses by more than ``margin`` of the base: the gain's upper bound is below
        ``-margin * base`` (a NaN candidate against a finite base loses)."""
        if not math.isfinite(self.base):
            return False
        return not math.isfinite(self.cand) or self.high < -margin * self.base

    def to_json(self) -> dict[str, float | int | None]:
        """The figures for ``trainer_state.json`` (non-finite ones as None)."""
        def num(v: float) -> float | None:
            return v if math.isfinite(v) else None
        return {"judged_rows": self.rows, "judged_blocks": self.blocks, "walk_accept_len": num(self.cand),
                "walk_base_accept_len": num(self.base), "row_accept_len": num(self.row_cand),
                "row_base_accept_len": num(self.row_base), "gain_low": num(self.low), "gain_high": num(self.high),
                "confidence": self.confidence}


def paired_bootstrap(base: Sequence[tuple[int, int]], cand: Sequence[tuple[int, int]], confidence: float,
                     resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """The two-sided ``confidence`` interval of ``tokens/steps`` (cand) minus (base) from blocks of
    (steps, tokens) paired by index, by resampling blocks with replacement (seeded, so a judgement
    is reproducible). ``confidence`` 0: the point estimate twice; fewer than 2 blocks: (-inf, inf).

    Example: base [(10, 18), (9, 17), (11, 19)], cand [(8, 18), (8, 17), (9, 19)], 0.9 ->
    an interval inside (0.2, 0.5) around the gain 0.36.
    """
    if len(base) != len(cand):
        raise ValueError(f"paired blocks differ in number: {len(base)} vs {len(cand)}")
    b = torch.tensor(list(base), dtype=torch.float64).reshape(-1, 2)  # [K, 2] steps, tokens
    c = torch.tensor(list(cand), dtype=torch.float64).reshape(-1, 2)
    point = _ratio(c.sum(0)) - _ratio(b.sum(0))
    if confidence <= 0.0:
        return point, point
    if len(base) < 2:
        return -math.inf, math.inf
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(base), (resamples, len(base)), generator=gen)  # [R, K]
    bs, cs = b[idx].sum(1), c[idx].sum(1)  # [R, 2] each
    gains = cs[:, 1] / cs[:, 0].clamp(min=1) - bs[:, 1] / bs[:, 0].clamp(min=1)  # [R]
    tail = (1.0 - confidence) / 2.0
    low, high = torch.quantile(gains, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return low, high


def _ratio(sums: torch.Tensor) -> float:
    """tokens / steps of summed (steps, tokens); NaN with no steps."""
    steps, tokens = float(sums[0]), float(sums[1])
    return tokens / steps if steps else float("nan")


@dataclass(frozen=True)
class HeadWalk:
    """One head walked over a list of rows in blocks (``walk_head``): what ``compare`` pairs."""

    rows: int  # positions of the walked segments
    blocks: list[tuple[int, int]]  # (steps, tokens) per block, in the segments' order
    row_sum: int  # the per-row score's sum over the rows whose gamma labels are all known
    row_count: int

    @property
    def walk_mean(self) -> float:
        return _ratio(torch.tensor(self.blocks or [(0, 0)], dtype=torch.float64).sum(0))

    @property
    def row_mean(self) -> float:
        return self.row_sum / self.row_count if self.row_count else float("nan")


def walk_head(head: Eagle3Head, embed: nn.Embedding, segments: list[SignalSegment], gamma: int,
              block_rows: int = 32, batch: int = 32) -> HeadWalk:
    """``head``'s walks over every row of ``segments`` (those longer than ``gamma``) in blocks of
    ``block_rows``; ``batch`` segments share an unroll. Two walks over the same segments pair block by block."""
    usable = [s for s in segments if s.num_positions > gamma]
    blocks: list[tuple[int, int]] = []
    row_sum = row_count = 0
    for i in range(0, len(usable), batch):
        stats = acceptance_stats(head, embed, usable[i:i + batch], gamma, block_rows=block_rows)
        blocks += stats.blocks
        row_sum += stats.row_sum
        row_count += stats.rows
    return HeadWalk(sum(s.num_positions for s in usable), blocks, row_sum, row_count)


def compare(base: HeadWalk, cand: HeadWalk, confidence: float = 0.9, seed: int = 0) -> PairedJudgement:
    """The paired judgement of two walks over the same rows (module docstring)."""
    low, high = paired_bootstrap(base.blocks, cand.blocks, confidence, seed=seed)
    return PairedJudgement(rows=base.rows, blocks=len(base.blocks), base=base.walk_mean, cand=cand.walk_mean,
                           row_base=base.row_mean, row_cand=cand.row_mean, low=low, high=high,
                           confidence=confidence)


def judge_pair(base: Eagle3Head, cand: Eagle3Head, embed: nn.Embedding, segments: list[SignalSegment], gamma: int,
               block_rows: int = 32, confidence: float = 0.9, seed: int = 0) -> PairedJudgement:
    """Walk ``base`` and ``cand`` over every row of ``segments`` in blocks of ``block_rows`` and judge
    the walked gain with a paired bootstrap (``walk_head``, then ``compare``)."""
    return compare(walk_head(base, embed, segments, gamma, block_rows),
                   walk_head(cand, embed, segments, gamma, block_rows), confidence, seed)


def gain_interval(doc: Mapping[str, Any] | None) -> str:
    """A judgement's interval from its JSON (``PairedJudgement.to_json``, as ``trainer_state.json``
    records it) for a report: ``" (gain -0.04 .. +0.21 at 90 %)"``; empty for a record without one
    (a round or judgement written before judgements had intervals, or at confidence 0)."""
    if not doc or not doc.get("confidence"):
        return ""
    low, high = doc.get("gain_low"), doc.get("gain_high")  # None: unbounded (fewer than two blocks)
    lo = "-inf" if low is None else f"{low:+.2f}"
    hi = "+inf" if high is None else f"{high:+.2f}"
    return f" (gain {lo} .. {hi} at {100 * doc['confidence']:.0f} %)"
