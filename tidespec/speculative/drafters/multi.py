"""Several drafters loaded at once (``MultiDrafter``), and cheap shadow scoring of the model-free ones.

Why this exists: no drafter wins everywhere — a suffix drafter is nearly free and excellent on
repetitive text, EAGLE-3 costs a head forward per token and wins on free text, and both lose to
plain decoding at large batches (TIDE §4.1, the field guide's operational traps). The
controller (``speculative.policy.analytic``) chooses per step which drafter drafts for which
sequence; this wrapper makes several drafters look like one to the engine: ``propose`` routes each
``DraftInput`` to the member its ``drafter`` field names, ``observe`` and ``release`` reach every
member (stateful ones must follow every sequence even while another drafter runs).

Shadow estimates. A model-free member (n-gram, suffix: no weights, no per-token forward) can draft
on the side for free, so the controller knows its acceptance without ever running it: after each
``observe`` the wrapper asks it for a draft of the sequence's next tokens (one pending draft per
member and sequence, never for the member that drafts the sequence this step) and scores that draft
against the tokens the target then produced. For greedy requests this is exactly what verification
would have accepted (verification keeps the longest prefix that matches the target's argmax); for
sampled ones a point-mass draft token is accepted with probability p(token), which is also the
probability that the target's own draw equals it, so the score has the right distribution.

One draft per step. Per-sequence drafting asks the model-free members for their drafts before
planning (``offers``), the winner drafts the sequence in the step, and the shadow drafts the same
context after the step: up to three proposals of one context. A model-free member's draft is
deterministic in the context, the gamma and the tree flag, so the wrapper keeps the last one per
member and sequence (``_Kept``) and hands it out again: the shadow drafted after step k is step
k + 1's offer, and the offer is the routed draft (a gamma at least its length; a sequence whose
context grew, or a draft longer than the gamma asked, is drafted anew).

Worked example (suffix shadowing eagle3, gamma 3): context ... t9 observed, the shadow drafts
[a, b, c] for positions 10..12; the target then emits t10 = a, t11 = x: the draft is scored
(gamma 3, depth 3, accepted 1) — the same outcome the engine would have counted had the suffix
drafter run — and the next shadow draft starts from t11.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidespec.sampling import SamplingParams
from tidespec.speculative.api import Drafter, DraftInput, DraftProposal, Observation, SeqDraft

if TYPE_CHECKING:
    from tidespec.speculative.vocab.dynamic import DynamicVocab

log = logging.getLogger(__name__)


@dataclass
class _Shadow:
    """A draft a model-free member proposed on the side, waiting for the target's tokens."""

    start: int  # context length when it was proposed: the draft guesses token_ids[start:]
    gamma: int
    tokens: list[int]


@dataclass
class _Kept:
    """A model-free member's last draft of a sequence, and what it was drafted from."""

    length: int  # context length (len(token_ids)): a sequence's context only grows by verified tokens
    last: int  # its last token (-1: empty)
    gamma: int
    tree: bool
    draft: SeqDraft

    def fits(self, inp: DraftInput) -> bool:
        """Whether it answers ``inp``: the same context and tree flag, a gamma at least as long as the draft
        and no longer than the gamma it was drafted at (a longer ask might have drafted more)."""
        return (self.length == len(inp.token_ids) and self.last == _last(inp.token_ids) and self.tree == inp.tree
                and self.draft.num_tokens <= inp.num_speculative_tokens <= self.gamma)


def _last(token_ids: Sequence[int]) -> int:
    return token_ids[-1] if token_ids else -1


def score_shadow(shadow: _Shadow, token_ids: Sequence[int]) -> tuple[int, int, int] | None:
    """(gamma, depth, accepted) once the target's tokens decide the draft, else None.

    Example: draft [5, 6, 7] from start 10; tokens[10:] = [5, 9] -> (3, 3, 1) (decided by the
    mismatch); tokens[10:] = [5] -> None (position 11 not produced yet); [5, 6, 7] -> (3, 3, 3).
    """
    actual = token_ids[shadow.start:shadow.start + len(shadow.tokens)]
    accepted = 0
    for drafted, real in zip(shadow.tokens, actual):
        if drafted != real:
            return shadow.gamma, len(shadow.tokens), accepted
        accepted += 1
    if accepted == len(shadow.tokens):
        return shadow.gamma, len(shadow.tokens), accepted
    return None


class MultiDrafter:
    """Several drafters behind the one ``Drafter`` contract (name ``"a+b"``); at most one of them may
    read the target's taps. ``shadow_gamma`` > 0 turns on shadow scoring of the model-free members
    (the draft length they are scored at: the engine's largest gamma)."""

    model_free = False  # a member drafts: some of them may run a model

    def __init__(self, drafters: Sequence[Drafter], shadow_gamma: int = 0) -> None:
        if len(drafters) < 2:
            raise ValueError("MultiDrafter needs at least two drafters")
        names = [d.name for d in drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"drafter names must differ, got {names}")
        tapped = [d for d in drafters if d.tap_layers]
        if len(tapped) > 1:
            raise ValueError(f"at most one drafter may read the target's taps, got {[d.name for d in tapped]}")
        if shadow_gamma < 0:
            raise ValueError(f"shadow_gamma must be >= 0, got {shadow_gamma}")
        self._members: dict[str, Drafter] = {d.name: d for d in drafters}
        self.default = names[0]
        self.name = "+".join(names)
        self.tap_layers: tuple[int, ...] = tapped[0].tap_layers if tapped else ()
        self.tapped: str | None = tapped[0].name if tapped else None
        self.shadow_gamma = shadow_gamma
        self.shadowed = (frozenset(d.name for d in drafters if d.model_free and getattr(d, "side_scored", True))
                         if shadow_gamma else frozenset())
        self._pending: dict[str, dict[int, _Shadow]] = {n: {} for n in self.shadowed}
        self._running: dict[int, str] = {}  # seq_id -> the member that drafted it in the last propose
        self._kept: dict[str, dict[int, _Kept]] = {d.name: {} for d in drafters if d.model_free}
        self._scored: dict[str, list[tuple[int, int, int]]] = {}

    @property
    def members(self) -> Mapping[str, Drafter]:
        return self._members

    @property
    def stateful(self) -> bool:
        return any(d.stateful for d in self._members.values())

    @property
    def versioned(self) -> bool:
        return any(d.versioned for d in self._members.values())

    @property
    def version(self) -> int:
        """The newest version among the members (an online-trained EAGLE-3 head's; others are 0)."""
        return max(d.version for d in self._members.values())

    @property
    def wants_hidden(self) -> bool:
        """Whether a member asks for the target's final hidden states (a dynamic draft vocabulary)."""
        return any(d.wants_hidden for d in self._members.values())

    @property
    def drafts_from_hidden(self) -> bool:
        """False: the profiler times each member on its own, never the group."""
        return False

    @property
    def vocab(self) -> DynamicVocab | None:
        """The draft vocabulary of the member that has one."""
        return next((d.vocab for d in self._members.values() if d.vocab is not None), None)

    def warm_up(self, max_gamma: int) -> float:
        return sum(d.warm_up(max_gamma) for d in self._members.values())

    def cost_signature(self) -> str:
        """Each member's own (the profiler keys a profile by every member's)."""
        return " ".join(f"{n}={s}" for n, d in self._members.items() if (s := d.cost_signature()))

    def member_of(self, inp: DraftInput) -> str:
        name = inp.drafter or self.default
        if name not in self._members:
            raise ValueError(f"no drafter {name!r} loaded (have {', '.join(self._members)})")
        return name

    def propose(self, inputs: list[DraftInput]) -> DraftProposal:
        groups: dict[str, list[DraftInput]] = {}
        for inp in inputs:
            groups.setdefault(self.member_of(inp), []).append(inp)
        self._running = {inp.seq_id: name for name, group in groups.items() for inp in group}
        out = DraftProposal()
        for name, group in groups.items():
            hits, fresh = self._split(name, group, exact=False)
            out.drafts.update(hits)
            if fresh:
                part = self._members[name].propose(fresh)
                out.drafts.update(part.drafts)
                out.cold |= part.cold
        return out

    def offers(self, inputs: list[DraftInput]) -> dict[int, dict[str, tuple[float, int]]]:
        """Each model-free member's draft of each sequence (kept for the step, or the one kept since the
        last shadow), as (its expected accepted tokens, its length): ``model_free_offers``."""
        out: dict[int, dict[str, tuple[float, int]]] = {}
        for name in self._kept:
            try:
                drafts = self._drafts(name, inputs)
            except Exception:  # an offer is optional: the step is planned without it
                log.exception("drafter %s failed to offer drafts", name)
                continue
            for sid, d in drafts.items():
                if d.num_tokens:
                    out.setdefault(sid, {})[name] = (d.score if d.score is not None else float(d.num_tokens),
                                                     d.num_tokens)
        return out

    def _split(self, name: str, inputs: list[DraftInput], exact: bool) -> tuple[dict[int, SeqDraft], list[DraftInput]]:
        """Member ``name``'s kept drafts that answer ``inputs`` (``exact``: only one drafted at the very gamma
        asked, as an offer must be), and the inputs left to propose (every one for a member that keeps none)."""
        kept = self._kept.get(name, {})
        hits: dict[int, SeqDraft] = {}
        fresh: list[DraftInput] = []
        for inp in inputs:
            k = kept.get(inp.seq_id)
            if k is not None and k.fits(inp) and (not exact or k.gamma == inp.num_speculative_tokens):
                hits[inp.seq_id] = k.draft
            else:
                fresh.append(inp)
        return hits, fresh

    def _drafts(self, name: str, inputs: list[DraftInput]) -> dict[int, SeqDraft]:
        """Member ``name``'s drafts of ``inputs``: the kept ones that fit, the others proposed (and kept)."""
        kept = self._kept[name]
        out, fresh = self._split(name, inputs, exact=True)
        if fresh:
            drafts = self._members[name].propose(fresh).drafts
            for inp in fresh:
                d = drafts.get(inp.seq_id)
                if d is not None:
                    out[inp.seq_id] = d
                    kept[inp.seq_id] = _Kept(len(inp.token_ids), _last(inp.token_ids), inp.num_speculative_tokens,
                                             inp.tree, d)
        return out

    def observe(self, observations: list[Observation]) -> None:
        untapped = observations  # what the members that never read taps get: no reference to them
        if self.tapped is not None and any(o.taps is not None for o in observations):
            untapped = [Observation(o.seq_id, o.token_ids, o.num_new_cached, None, o.start) for o in observations]
        for name, member in self._members.items():
            member.observe(observations if name == self.tapped else untapped)
        if self.shadowed:
            self._shadow(observations)

    def release(self, seq_id: int) -> None:
        for member in self._members.values():
            member.release(seq_id)
        for pending in self._pending.values():
            pending.pop(seq_id, None)
        for kept in self._kept.values():
            kept.pop(seq_id, None)
        self._running.pop(seq_id, None)

    def drain_shadow(self) -> dict[str, list[tuple[int, int, int]]]:
        """Shadow outcomes scored since the last call, per member name (then forgotten)."""
        out, self._scored = self._scored, {}
        return out

    def _shadow(self, observations: list[Observation]) -> None:
        """Score the pending shadow drafts against the new tokens; draft anew where none is pending."""
        for name in self.shadowed:
            pending = self._pending[name]
            fresh: list[DraftInput] = []
            for obs in observations:
                shadow = pending.get(obs.seq_id)
                if shadow is not None:
                    outcome = score_shadow(shadow, obs.token_ids)
                    if outcome is None:
                        continue
                    self._scored.setdefault(name, []).append(outcome)
                    del pending[obs.seq_id]
                if self._running.get(obs.seq_id) == name:
                    continue  # it drafts this sequence for real: the engine counts its outcomes
                if obs.start >= 0 and obs.start + obs.num_new_cached >= len(obs.token_ids):
                    continue  # a prompt chunk before the prompt's end: nothing generated yet
                fresh.append(DraftInput(obs.seq_id, obs.token_ids, self.shadow_gamma, SamplingParams()))
            if fresh:
                drafts = self._drafts(name, fresh)
                for inp in fresh:
                    d = drafts.get(inp.seq_id)
                    tokens = list(d.token_ids) if d is not None and not d.is_tree else []
                    if d is not None and d.is_tree:  # shadows are scored as chains: the first path
                        tokens = _first_path(d.token_ids, d.parent_indices or [])
                    if not tokens:
                        self._scored.setdefault(name, []).append((self.shadow_gamma, 0, 0))
                        continue
                    pending[inp.seq_id] = _Shadow(len(inp.token_ids), self.shadow_gamma, tokens)


def model_free_offers(drafter: Drafter, inputs: list[DraftInput]) -> dict[int, dict[str, tuple[float, int]]]:
    """Each model-free member's draft of each sequence, as (its expected accepted tokens, its length):
    what per-sequence drafting prices (``speculative/policy/routing.py``, ``SeqState.offers``). A few
    array operations per sequence, and none for a draft the wrapper kept (``MultiDrafter.offers``); the
    member that wins drafts the step with the same draft. A member that fails offers nothing (logged);
    a single drafter offers nothing (there is nothing to route between).

    Example: suffix drafts [5, 6] with path probabilities 1.0 and 0.5 for sequence 3 and nothing for
    sequence 4 -> {3: {"suffix": (1.5, 2)}}."""
    if not inputs or not isinstance(drafter, MultiDrafter):
        return {}
    return drafter.offers(inputs)


def find_member(drafter: Drafter | None, name: str) -> Drafter | None:
    """The drafter named ``name``: ``drafter`` itself or one of a ``MultiDrafter``'s members."""
    return drafter.members.get(name) if drafter is not None else None


def _first_path(tokens: list[int], parents: list[int]) -> list[int]:
    """The path that always follows a node's first child: parents [-1, -1, 0, 2] -> tokens 0, 2, 3."""
    path: list[int] = []
    node = -1
    for j, p in enumerate(parents):
        if p == node:
            path.append(tokens[j])
            node = j
    return path
