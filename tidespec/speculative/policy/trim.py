"""Draft trimming (``DraftTrim``): which drafted tokens of a whole batch are worth verifying.

Why this exists: a drafter sizes each sequence's draft on its own (the suffix drafter up to gamma
tokens while its path probability stays above ``min_prob``), but what a drafted token costs is a
row of the batch's verification forward, and what a row is worth depends on the batch. On the
compiled w4a8 path at batch 4 a verified row costs ~1 ms against a 10-13 ms step, so a token the
target accepts one time in five costs more than it returns: suffix alone ran at 0.93x plain on
chat there, the controller too (docs/benchmarks/policies.md, 2026-12-05). Choosing per *token*
across the batch, as TETRIS does for batched speculation ("Optimal Draft Token Selection for Batch
Speculative Decoding", Wu et al., ACL 2025), keeps the sure tokens of every draft and drops the
unsure tails, so speculation at a batch size where rows are dear degrades towards plain decoding
rather than below it.

The rule. Each draft token k carries its drafter's probability ``p_k`` that verification accepts
the path up to and including it (``SeqDraft.token_probs``; the suffix drafter's path probability).
Drafters' probabilities are not calibrated (suffix's counts are over-confident on a long draft seen
once), so ``q_k = calibrated(p_k)``: per drafter, greedy or sampled, and tenth of [0, 1], the share
of verified tokens of that band that verification accepted (an EMA that starts at the band's
middle: the drafter is trusted until measured). A child is never worth more than its parent
(``q_k = min(q_k, q_parent)``), so the tokens sorted by q (parents first among equals) form
valid subtrees at every cut. The step's value with the m best tokens kept is
``(B + sum of their q) / T(B, 1 + (F + m) / B)``: expected tokens emitted over the start-up
profile's forward time, with B decode sequences and F rows of drafts without probabilities (kept
as they are). The m with the highest value wins (ties: fewer tokens); everything else is cut. Cuts
are lossless: verification checks whatever is left, and a shorter draft is still a draft.

Exploration: a band whose tokens are always cut is never measured again, and a drafter whose
probabilities are pessimistic would stay cut for good (the decision deadlock the analytic policy's
probes answer). So every ``explore_every``-th step with something to cut verifies every draft
whole.

Worked example (B = 4, the profile's T(4, 1 + n / 4) = 10 ms + 1 ms per drafted row n; one suffix
chain [a, b, c] with p = 0.9, 0.5, 0.1, calibration the identity; three sequences without drafts):
m = 0 is worth 4 / 10 = 0.400 tokens per ms, m = 1 4.9 / 11 = 0.445, m = 2 5.4 / 12 = 0.450, m = 3
5.5 / 13 = 0.423. So [a, b] is verified and c is cut: its 0.1 expected tokens are worth less than the
1 ms its row costs at 0.45 tokens per ms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidespec.speculative.api import SeqDraft
from tidespec.speculative.policy.speedup import Profile

BANDS = 10  # calibration bands over [0, 1]: tenths of the drafter's probability


@dataclass
class _Band:
    """Share of one band's verified tokens that verification accepted."""

    mean: float
    n: int = 0


def _band(p: float) -> int:
    """Band of probability ``p``: 0.05 -> 0, 0.5 -> 5, 1.0 -> 9."""
    return min(BANDS - 1, max(0, int(p * BANDS)))


@dataclass
class DraftTrim:
    """Cuts each step's drafts to the tokens whose expected value pays for their rows (module docstring)."""

    profile: Profile
    ema: float = 0.05  # the bands' EMA rate once measured (before: a running mean weighted with the prior)
    prior_weight: int = 4  # the band's middle counts as this many measured tokens
    explore_every: int = 16  # every n-th step with something to cut verifies every draft whole (0: never)
    num_cut: int = 0  # tokens cut so far
    num_steps: int = 0  # steps with something to cut (explored ones included)
    _bands: dict[tuple[str, bool, int], _Band] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"ema must be in (0, 1], got {self.ema}")
        if self.prior_weight < 0 or self.explore_every < 0:
            raise ValueError(f"prior_weight and explore_every must be >= 0, got {self.prior_weight}, "
                             f"{self.explore_every}")

    def calibrated(self, drafter: str, sampled: bool, p: float) -> float:
        """The share of ``drafter``'s tokens at probability ``p`` that verification accepts (so far)."""
        band = self._bands.get((drafter, sampled, _band(p)))
        return band.mean if band is not None else (_band(p) + 0.5) / BANDS

    def learn(self, drafter: str, sampled: bool, draft: SeqDraft, accepted: list[int]) -> None:
        """One verified draft: ``accepted`` are the indices of its tokens on the accepted path."""
        if draft.token_probs is None:
            return
        kept = set(accepted)
        for k, p in enumerate(draft.token_probs):
            key = (drafter, sampled, _band(p))
            band = self._bands.get(key)
            if band is None:
                band = self._bands[key] = _Band((_band(p) + 0.5) / BANDS)
            band.n += 1
            rate = max(self.ema, 1.0 / (band.n + self.prior_weight))
            band.mean += rate * (float(k in kept) - band.mean)

    def cut(self, drafts: dict[int, SeqDraft], drafters: dict[int, str], sampled: set[int], batch_size: int) -> int:
        """Replace the drafts in ``drafts`` (sequence -> draft) by their kept tokens; ``drafters``: sequence
        -> the drafter that drafted it, ``sampled``: the sequences sampled rather than greedy,
        ``batch_size``: the step's decode sequences. Returns the number of tokens cut."""
        fixed = 0  # rows of drafts without probabilities: kept as they are
        cands: list[tuple[float, int, int]] = []  # (-q, index in its draft, seq) for every token that may be cut
        for sid, draft in drafts.items():
            if draft.token_probs is None or not draft.num_tokens:
                fixed += draft.num_tokens
                continue
            name, smp = drafters.get(sid, ""), sid in sampled
            qs: list[float] = []
            for k, p in enumerate(draft.token_probs):
                parent = draft.parent_indices[k] if draft.parent_indices is not None else k - 1
                q = self.calibrated(name, smp, p)
                qs.append(min(q, qs[parent]) if parent >= 0 else q)
                cands.append((-qs[-1], k, sid))
        if not cands:
            return 0
        self.num_steps += 1
        if self.explore_every and self.num_steps % self.explore_every == 0:
            return 0
        cands.sort()
        keep = best_count([-c[0] for c in cands], batch_size, fixed, self.profile)
        if keep == len(cands):
            return 0
        kept: dict[int, list[int]] = {sid: [] for _, _, sid in cands[keep:]}  # the sequences that lose tokens
        for _, k, sid in cands[:keep]:
            if sid in kept:
                kept[sid].append(k)
        for sid, ks in kept.items():
            drafts[sid] = keep_tokens(drafts[sid], sorted(ks))
        cut = len(cands) - keep
        self.num_cut += cut
        return cut


def best_count(qs: list[float], batch_size: int, fixed: int, profile: Profile) -> int:
    """How many of the tokens (their q, best first) to keep: the m maximising (B + sum of the first m q) /
    T(B, 1 + (fixed + m) / B), ties to the smaller m. Example: the module docstring's."""
    best_m, best_v, tokens = 0, 0.0, float(batch_size)
    for m in range(len(qs) + 1):
        if m:
            tokens += qs[m - 1]
        value = tokens / profile.verify(batch_size, 1.0 + (fixed + m) / batch_size)
        if value > best_v * (1.0 + 1e-9):
            best_m, best_v = m, value
    return best_m


def keep_tokens(draft: SeqDraft, keep: list[int]) -> SeqDraft:
    """The tokens of ``draft`` at indices ``keep`` (ascending, every kept token's parent kept too) as a draft
    of their own, parents renumbered. Example: tokens [a, b, c, d], parents [-1, -1, 0, 1], keep [0, 2]
    -> [a, c], parents [-1, 0] (a chain)."""
    if len(keep) == draft.num_tokens:
        return draft
    at = {k: i for i, k in enumerate(keep)}
    parents = None
    if draft.parent_indices is not None:
        parents = [at[draft.parent_indices[k]] if draft.parent_indices[k] >= 0 else -1 for k in keep]
        if all(p == i - 1 for i, p in enumerate(parents)):
            parents = None  # a chain
    probs = draft.draft_probs[keep] if draft.draft_probs is not None and keep else None
    token_probs = [draft.token_probs[k] for k in keep] if draft.token_probs is not None else None
    return SeqDraft([draft.token_ids[k] for k in keep], parents, probs, score=sum(token_probs or ()),
                    token_probs=token_probs)
