"""The dynamic buffer of a draft vocabulary, managed by an Adaptive Replacement Cache (ARC).

Why this exists: EvoSpec (Sec. 3.3, App. A.3) keeps the draft vocabulary's dynamic part within a
fixed budget with ARC (Megiddo & Modha, FAST 2003): tokens admitted once sit in ``T1`` (recent),
tokens seen again move to ``T2`` (frequent), and the ghost lists ``B1``/``B2`` remember what was
evicted from each, so a ghost hit tells ARC which side deserved more room (the target size ``p``
of ``T1``). On top of textbook ARC, EvoSpec's safeguards: at most ``max_insert`` new tokens per
event, a token stays at least ``min_residency`` steps once admitted, and ``p`` is held fixed for
the first ``warmup_events`` events. No library ships an ARC with these knobs over a bounded
resident set we can read from another thread, so this is a small hand-written one (ordered dicts
as the four LRU lists).

Worked example (capacity 2, p starts at 1, no residency guard, no warm-up)::

    arc = ArcBuffer(ArcConfig(capacity=2, min_residency=0, warmup_events=0, initial_p=1))
    arc.admit([10, 11], step=0)   # T1 = [10, 11]
    arc.touch([10], step=1)       # T1 = [11], T2 = [10]
    arc.admit([12], step=2)       # full, |T1| = 1 is not above p = 1: evict T2's LRU 10 (ghost B2)
    arc.admit([10], step=3)       # B2 ghost hit: p shrinks to 0, evict T1's LRU 11, 10 returns to T2
    arc.resident()                # [12, 10]
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tidespec.errors import ConfigError, check_at_least


@dataclass(frozen=True)
class ArcConfig:
    capacity: int = 256  # resident tokens at most (EvoSpec: 256)
    max_insert: int = 32  # new tokens admitted per event at most
    min_residency: int = 8  # steps a token stays before it may be evicted
    warmup_events: int = 50  # events during which p stays at its initial value
    initial_p: int = -1  # target size of T1; -1 = capacity // 2

    def __post_init__(self) -> None:
        check_at_least(1, arc_capacity=self.capacity, arc_max_insert=self.max_insert)
        check_at_least(0, arc_min_residency=self.min_residency, arc_warmup_events=self.warmup_events)
        if self.initial_p > self.capacity:
            raise ConfigError(f"initial_p must be <= capacity ({self.capacity}), got {self.initial_p}")


@dataclass
class ArcStats:
    admitted: int = 0  # tokens that became resident
    evicted: int = 0  # tokens that left the resident set
    ghost_hits: int = 0  # admissions of a token ARC remembered in B1/B2
    blocked: int = 0  # admissions refused because every resident token was too young to evict


class ArcBuffer:
    """ARC over token ids: ``admit`` new candidates, ``touch`` tokens seen again, read ``resident()``."""

    def __init__(self, cfg: ArcConfig | None = None) -> None:
        self.cfg = cfg or ArcConfig()
        self.p = self.cfg.initial_p if self.cfg.initial_p >= 0 else self.cfg.capacity // 2
        self.t1: OrderedDict[int, int] = OrderedDict()  # token -> step admitted (LRU first)
        self.t2: OrderedDict[int, int] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()  # ghosts of T1 evictions
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.events = 0
        self.stats = ArcStats()

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, token: int) -> bool:
        return token in self.t1 or token in self.t2

    def resident(self) -> list[int]:
        """The buffer's tokens: T1 then T2, each least recently used first."""
        return [*self.t1, *self.t2]

    def touch(self, tokens: list[int], step: int) -> None:
        """Tokens of the buffer that were used again (e.g. verified): T1 -> T2, T2 -> its MRU end."""
        for tok in tokens:
            if tok in self.t1:
                self.t2[tok] = self.t1.pop(tok)
            elif tok in self.t2:
                self.t2.move_to_end(tok)

    def admit(self, candidates: list[int], step: int) -> list[int]:
        """One event's candidates (deduplicated in order, at most ``max_insert`` new ones); returns
        the tokens that became resident. A resident candidate counts as a hit (``touch``)."""
        self.events += 1
        admitted: list[int] = []
        seen: set[int] = set()
        for tok in candidates:
            if tok in seen:
                continue
            seen.add(tok)
            if tok in self:
                self.touch([tok], step)
                continue
            if len(admitted) >= self.cfg.max_insert:
                break
            if not self._admit_one(tok, step):
                break  # every resident token is too young: later candidates could not enter either
            admitted.append(tok)
        return admitted

    def _adapt(self, grow: bool) -> None:
        if self.events <= self.cfg.warmup_events:
            return
        if grow:  # a B1 ghost: recency deserved more room
            self.p = min(self.cfg.capacity, self.p + max(1, len(self.b2) // max(1, len(self.b1))))
        else:
            self.p = max(0, self.p - max(1, len(self.b1) // max(1, len(self.b2))))

    def _admit_one(self, tok: int, step: int) -> bool:
        ghost = tok in self.b1 or tok in self.b2
        if ghost:
            self.stats.ghost_hits += 1
            self._adapt(grow=tok in self.b1)
        if len(self) >= self.cfg.capacity and not self._replace(step, in_b2=tok in self.b2):
            self.stats.blocked += 1
            return False
        self.b1.pop(tok, None)
        self.b2.pop(tok, None)
        (self.t2 if ghost else self.t1)[tok] = step  # a remembered token was wanted twice: frequent
        self.stats.admitted += 1
        return True

    def _old_enough(self, admitted_at: int, step: int) -> bool:
        return step - admitted_at >= self.cfg.min_residency

    def _evict_from(self, lru: OrderedDict[int, int], ghosts: OrderedDict[int, None], step: int) -> bool:
        for tok, at in lru.items():  # least recently used first; skip tokens still within their residency
            if self._old_enough(at, step):
                del lru[tok]
                ghosts[tok] = None
                while len(ghosts) > self.cfg.capacity:
                    ghosts.popitem(last=False)
                self.stats.evicted += 1
                return True
        return False

    def _replace(self, step: int, in_b2: bool) -> bool:
        """ARC's REPLACE: evict from T1 when it exceeds its target p, else from T2 (the other side
        when the preferred one has nothing old enough). False if nothing may be evicted."""
        prefer_t1 = bool(self.t1) and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p))
        recent, frequent = (self.t1, self.b1), (self.t2, self.b2)
        first, second = (recent, frequent) if prefer_t1 else (frequent, recent)
        return self._evict_from(*first, step) or self._evict_from(*second, step)
