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
* with its uncertainty: the rows are walked in blocks of ``block_rows`` (each walk starting at its
  block's first row), and the gain's ``confidence`` interval comes from a paired percentile
  bootstrap (both heads' sums resampled with the same indices, the gain a difference of ratio
  estimates), once over the blocks and once over whole sequences (each sequence's blocks summed);
  the interval spans both. ``confidence`` 0 gives the point estimate on both sides.

Why both: blocks of one request share its topic and wording, so they need not be independent
samples of what the next request meets; but a bootstrap over the two or four requests of a small
held-out window has too few samples to be trusted either. Measured on 74 held-out requests
(``bench learn --judge-windows``; docs/benchmarks/learning.md, "Can a judgement on a few requests
be trusted"), against the gain over all of them, on random windows of 2 / 4 / 8 requests at 90 %:
for a head that had lost 0.023 the blocks' interval held the loss in 74 / 83 / 84 % of the
windows and the sequences' in 54 / 75 / 86 %, the span of both in 76 / 84 / 88 %, and it
published the loser in 5 / 4 / 1 % (the 5 % a 90 % interval allows); for a head that had gained
0.097 the span held the gain in 94 / 95 / 100 % and published it in 38 / 74 / 98 %. One request
alone gives no interval: its blocks' interval held the loss in 65 % of the windows.

Decisions on a judgement (``rounds.DraftTrainer``): publish when ``low > min_gain``; revert a
served version when ``high < -margin * base``. Fewer than ``min_sequences`` sequences (at least
two) give an unbounded interval: nothing is published, nothing reverted, unless ``confidence`` is
0. A segment without a ``seq_id`` counts as a sequence of its own.

Worked example: blocks (steps, tokens) for the base head [(10, 18), (9, 17), (11, 19)] and the
candidate [(8, 18), (8, 17), (9, 19)], each block a sequence of its own -> base 54/30 = 1.80,
candidate 54/25 = 2.16, gain +0.36; every resample gains (the candidate needs fewer steps in each
block), so the interval lies above 0 and, with min_gain 0, the candidate is published. Had the
three blocks been one sequence, there would be one sample and no interval.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tidespec.models.eagle3.head import Eagle3Head
from tidespec.online.training.eagle3_train import SignalSegment, acceptance_stats


@dataclass(frozen=True)
class PairedJudgement:
    """Two heads walked over the same rows (see the module docstring).

    ``base`` / ``cand``: walked acceptance length (tokens per step) of each; ``row_base`` /
    ``row_cand``: the per-row score beside it, for the record; ``low`` / ``high``: the
    ``confidence`` interval of ``cand - base``; ``blocks``: the walked blocks; ``sequences``: the
    sequences they belong to (both resampled for the interval).
    """

    rows: int
    blocks: int
    sequences: int
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
        return {"judged_rows": self.rows, "judged_blocks": self.blocks, "judged_sequences": self.sequences,
                "walk_accept_len": num(self.cand),
                "walk_base_accept_len": num(self.base), "row_accept_len": num(self.row_cand),
                "row_base_accept_len": num(self.row_base), "gain_low": num(self.low), "gain_high": num(self.high),
                "confidence": self.confidence}


def paired_bootstrap(base: Sequence[tuple[int, int]], cand: Sequence[tuple[int, int]], confidence: float,
                     resamples: int = 1000, seed: int = 0, groups: Sequence[int] | None = None,
                     min_groups: int = 2) -> tuple[float, float]:
    """The two-sided ``confidence`` interval of ``tokens/steps`` (cand) minus (base) from blocks of
    (steps, tokens) paired by index, by resampling the blocks with replacement (seeded, so a
    judgement is reproducible). With ``groups`` (a group number per block: its sequence), the
    groups' summed blocks are resampled as well and the interval spans both: it must hold whether
    the blocks of a sequence are independent samples or only the sequences are; fewer than
    ``min_groups`` (at least 2) groups give (-inf, inf). ``confidence`` 0: the point estimate twice.

    Example: base [(10, 18), (9, 17), (11, 19)], cand [(8, 18), (8, 17), (9, 19)], 0.9 ->
    an interval inside (0.2, 0.5) around the gain 0.36; with groups [0, 0, 0]: (-inf, inf).
    """
    if len(base) != len(cand) or (groups is not None and len(groups) != len(base)):
        raise ValueError(f"paired blocks differ in number: {len(base)} vs {len(cand)}"
                         + (f" ({len(groups)} groups)" if groups is not None else ""))
    b = torch.tensor(list(base), dtype=torch.float64).reshape(-1, 2)  # [K, 2] steps, tokens
    c = torch.tensor(list(cand), dtype=torch.float64).reshape(-1, 2)
    if confidence <= 0.0:
        point = _ratio(c.sum(0)) - _ratio(b.sum(0))
        return point, point
    low, high = bootstrap_interval(b, c, confidence, resamples, seed)
    if groups is None:
        return low, high
    gb, gc = group_sums(b, c, groups)
    if len(gb) < max(2, min_groups):
        return -math.inf, math.inf
    g_low, g_high = bootstrap_interval(gb, gc, confidence, resamples, seed)
    return min(low, g_low), max(high, g_high)


def group_sums(base: torch.Tensor, cand: torch.Tensor, groups: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Paired blocks ``[K, 2]`` (steps, tokens) summed per group -> ``[G, 2]`` each, groups in
    ascending order of their numbers. Example: groups [5, 5, 9] -> rows (block 0 + block 1, block 2)."""
    g = torch.unique(torch.tensor(list(groups), dtype=torch.int64), return_inverse=True)[1]  # [K] 0..G-1
    num = int(g.max()) + 1 if len(g) else 0
    gb = torch.zeros(num, 2, dtype=torch.float64).index_add_(0, g, base)  # [G, 2]
    return gb, torch.zeros_like(gb).index_add_(0, g, cand)


def bootstrap_interval(base: torch.Tensor, cand: torch.Tensor, confidence: float, resamples: int = 1000,
                       seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of the paired gain over samples ``base`` / ``cand`` [K, 2]
    (steps, tokens), resampled with one seeded set of indices for both; (-inf, inf) below 2 samples."""
    if len(base) < 2:
        return -math.inf, math.inf
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(base), (resamples, len(base)), generator=gen)  # [R, K]
    bs, cs = base[idx].sum(1), cand[idx].sum(1)  # [R, 2] each
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
    groups: list[int]  # per block, the number (0, 1, ...) of the sequence it belongs to
    row_sum: int  # the per-row score's sum over the rows whose gamma labels are all known
    row_count: int

    @property
    def sequences(self) -> int:
        return len(set(self.groups))

    @property
    def walk_mean(self) -> float:
        return _ratio(torch.tensor(self.blocks or [(0, 0)], dtype=torch.float64).sum(0))

    @property
    def row_mean(self) -> float:
        return self.row_sum / self.row_count if self.row_count else float("nan")


def walk_head(head: Eagle3Head, embed: nn.Embedding, segments: list[SignalSegment], gamma: int,
              block_rows: int = 32, batch: int = 32) -> HeadWalk:
    """``head``'s walks over every row of ``segments`` (those longer than ``gamma``) in blocks of
    ``block_rows``, each block numbered by its segment's sequence; ``batch`` segments share an
    unroll. Two walks over the same segments pair block by block."""
    usable = [s for s in segments if s.num_positions > gamma]
    blocks: list[tuple[int, int]] = []
    row_sum = row_count = 0
    for i in range(0, len(usable), batch):
        stats = acceptance_stats(head, embed, usable[i:i + batch], gamma, block_rows=block_rows)
        blocks += stats.blocks
        row_sum += stats.row_sum
        row_count += stats.rows
    numbers: dict[tuple[str, int], int] = {}
    groups: list[int] = []
    for i, seg in enumerate(usable):
        groups += [numbers.setdefault(_sequence_key(i, seg), len(numbers))] * math.ceil(seg.num_positions / block_rows)
    assert len(groups) == len(blocks), (len(groups), len(blocks))
    return HeadWalk(sum(s.num_positions for s in usable), blocks, groups, row_sum, row_count)


def count_sequences(segments: Sequence[SignalSegment]) -> int:
    """How many independent samples ``segments`` give a judgement: their distinct sequences (a
    segment without a ``seq_id`` counts as one of its own)."""
    return len({_sequence_key(i, s) for i, s in enumerate(segments)})


def _sequence_key(index: int, seg: SignalSegment) -> tuple[str, int]:
    """The sequence a segment belongs to: its ``seq_id``, or (without one) the segment itself."""
    return ("seq", seg.seq_id) if seg.seq_id is not None else ("segment", index)


def compare(base: HeadWalk, cand: HeadWalk, confidence: float = 0.9, seed: int = 0,
            min_sequences: int = 2) -> PairedJudgement:
    """The paired judgement of two walks over the same rows, its interval spanning the bootstrap over
    blocks and over sequences (unbounded below ``min_sequences`` of them; module docstring)."""
    low, high = paired_bootstrap(base.blocks, cand.blocks, confidence, seed=seed, groups=base.groups,
                                 min_groups=min_sequences)
    return PairedJudgement(rows=base.rows, blocks=len(base.blocks), sequences=base.sequences, base=base.walk_mean,
                           cand=cand.walk_mean, row_base=base.row_mean, row_cand=cand.row_mean, low=low, high=high,
                           confidence=confidence)


def judge_pair(base: Eagle3Head, cand: Eagle3Head, embed: nn.Embedding, segments: list[SignalSegment], gamma: int,
               block_rows: int = 32, confidence: float = 0.9, seed: int = 0, min_sequences: int = 2) -> PairedJudgement:
    """Walk ``base`` and ``cand`` over every row of ``segments`` in blocks of ``block_rows`` and judge
    the walked gain with a paired bootstrap over blocks and sequences (``walk_head``, then ``compare``)."""
    return compare(walk_head(base, embed, segments, gamma, block_rows),
                   walk_head(cand, embed, segments, gamma, block_rows), confidence, seed, min_sequences)


def gain_interval(doc: Mapping[str, Any] | None) -> str:
    """A judgement's interval from its JSON (``PairedJudgement.to_json``, as ``trainer_state.json``
    records it) for a report: ``" (gain -0.04 .. +0.21 at 90 % over 6 sequences)"``; empty for a
    record without one (a round or judgement written before judgements had intervals, or at
    confidence 0); a record from before intervals were resampled over sequences has no "over"."""
    if not doc or not doc.get("confidence"):
        return ""
    low, high = doc.get("gain_low"), doc.get("gain_high")  # None: unbounded (too few sequences)
    lo = "-inf" if low is None else f"{low:+.2f}"
    hi = "+inf" if high is None else f"{high:+.2f}"
    seqs = doc.get("judged_sequences")
    over = f" over {seqs} sequence{'s' if seqs != 1 else ''}" if seqs is not None else ""
    return f" (gain {lo} .. {hi} at {100 * doc['confidence']:.0f} %{over})"
