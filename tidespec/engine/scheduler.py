"""Continuous-batching scheduler with chunked prefill, admission by free KV blocks and preemption.

Why this exists: requests join and leave between steps; a long prompt must not stall the
sequences that are decoding. Each step the scheduler (1) admits waiting requests FIFO while a
KV slot is free and, over a paged cache (``models/kv/paged.py``), while the free blocks hold the
request's prompt beyond a watermark (``admit``; the blocks of a cached prefix it will share and
that sequences already hold cost nothing), then — once the policy has chosen each decoding
sequence's gamma — (2) reserves ``1 + gamma`` tokens of budget and KV blocks for every decoding
sequence, oldest first, and (3) hands the rest of the budget to prefill chunks, as far as blocks
allow (``schedule``).

When a decoding sequence's blocks cannot be had, its draft is dropped first (gamma 0, one
position); if even that does not fit, the newest running sequence is preempted: its blocks go
back to the pool, it returns to the head of the waiting queue, and when readmitted it is
prefilled again over its tokens so far (recompute, as vLLM does; row invariance makes that K/V
bit-identical) and decodes on. The oldest sequence is never preempted for a newer one, so it
always finishes: a request is only accepted if its prompt + max_tokens fits the whole pool.

Worked example: budget 64, three decoding sequences with gammas 4, 4, 0 (5 + 5 + 1 = 11
reserved) and a 100-token prompt waiting -> this step prefills prompt tokens 0..52, the next
step the rest, while the three keep decoding.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tidespec.engine.sequence import SeqStatus, Sequence
from tidespec.errors import UserError
from tidespec.models.kv.cache import KVCache
from tidespec.models.kv.paged import PagedKVCache


class QueueFullError(UserError, RuntimeError):
    """The bounded waiting queue is full (the server maps it to HTTP 429)."""


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int  # first prompt position in this chunk
    num_tokens: int

    @property
    def is_last(self) -> bool:
        """Whether this chunk completes the prefill (``Sequence.prefill_len``)."""
        return self.start + self.num_tokens == self.seq.prefill_len

    @property
    def samples(self) -> bool:
        """Whether its last row's logits give the first output token (a recomputed prefill's do not:
        its next token is already known)."""
        return self.is_last and not self.seq.output_ids


@dataclass
class ScheduledBatch:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # back in the waiting queue, cache dropped

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, kv: KVCache, max_num_batched_tokens: int, max_waiting: int = 0,
                 on_preempt: Callable[[Sequence], None] | None = None,
                 reused_blocks: Callable[[Sequence], list[int]] | None = None) -> None:
        """``on_preempt(seq)``: called before a preempted sequence's slot is freed (its K/V still there);
        ``reused_blocks(seq)``: the paged cache's blocks a waiting sequence will share (a cached
        prefix, ``engine/prefix_cache.py``), for admission."""
        self.kv = kv
        self.on_preempt = on_preempt
        self.reused_blocks = reused_blocks
        self.num_preemptions = 0  # sequences preempted since start
        self.budget = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. ``max_waiting`` bounds the sequences that must wait for a KV slot:
        those that a free slot will take at the next admission do not count (a burst arriving
        between two steps is not refused while slots are free)."""
        if self.max_waiting and len(self.waiting) >= self.max_waiting + self.kv.num_free_slots:
            raise QueueFullError(f"waiting queue is full ({self.max_waiting} requests)")
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of either queue and free its slot (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None:
            self.kv.free(seq.slot)
            seq.slot = None
        seq.status = SeqStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Sequence]:
        """Move waiting requests into free KV slots, FIFO, while the free blocks of a paged cache hold
        each one's prefill and a watermark (1 %% of the pool) stays free for the running ones to
        grow, counting the blocks that prompts admitted earlier and still in prefill will take (else a
        burst is admitted whole while the first prompts are still in their first chunks, and then
        preempted as they fill); returns those admitted. A block of a cached prefix that a running sequence holds
        already is not counted (shared, it costs nothing more); one only the prefix cache holds is,
        once (it is counted free). Nothing waits behind an empty cache: the first request is
        admitted whenever nothing runs.

        Example (blocks of 16): a 1,100-token prompt whose first 1,024 tokens are cached and in
        use by running sequences needs 5 blocks, not 69."""
        admitted = []
        paged = self.kv if isinstance(self.kv, PagedKVCache) else None
        free = 0  # the free blocks, less what prompts admitted before (and here) will still take
        if paged is not None and self.waiting:
            free = paged.num_free_blocks - sum(max(0, paged.blocks_for(s.prefill_len + 1) - len(paged.blocks[s.slot]))
                                               for s in self.running if s.in_prefill and s.slot is not None)
        taken: set[int] = set()  # reused blocks that admissions here make busy
        while self.waiting and self.kv.num_free_slots:
            seq = self.waiting[0]
            if paged is not None and self.running:
                need = paged.blocks_for(seq.prefill_len + 1)
                if self.reused_blocks is not None:
                    reused = self.reused_blocks(seq)
                    need -= sum(1 for b in reused if b in taken or paged.refs(b) > 1)
                    taken.update(reused)
                if free - need < max(1, paged.num_blocks // 100):
                    break
                free -= need
            self.waiting.popleft()
            seq.slot = self.kv.allocate()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def decoding(self) -> list[Sequence]:
        """Running sequences past their prompt: each decodes (and maybe speculates) this step."""
        return [seq for seq in self.running if not seq.in_prefill]

    def schedule(self, gammas: dict[int, int]) -> ScheduledBatch:
        """The step's batch: every decoding sequence with ``1 + gammas[seq_id]`` tokens reserved
        (a sequence missing from ``gammas`` decodes plainly), prefill chunks in what is left. Over a
        paged cache the blocks are reserved too: a gamma that does not fit is set to 0 in
        ``gammas``, a sequence that does not fit at all preempts the newest (module docstring)."""
        batch = ScheduledBatch()
        left = self.budget
        paged = self.kv if isinstance(self.kv, PagedKVCache) else None
        for seq in [s for s in self.running if not s.in_prefill]:
            if seq.status is not SeqStatus.RUNNING:  # preempted for an older one in this loop
                continue
            if paged is not None and not self._reserve_decode(paged, seq, gammas, batch):
                continue
            batch.decode.append(seq)
            left -= 1 + gammas.get(seq.seq_id, 0)
        for seq in list(self.running):
            if not seq.in_prefill or left <= 0 or seq.status is not SeqStatus.RUNNING:
                continue
            n = min(seq.prefill_len - seq.num_cached, left)
            if paged is not None:
                n = min(n, paged.room(seq.slot) - seq.num_cached)  # type: ignore[arg-type]
                if n <= 0:  # not one position free: an older prompt waits for blocks, a newer one gives its own up
                    if seq is self.running[-1] and len(self.running) > 1:
                        self._preempt(seq, batch)
                    continue
                paged.reserve(seq.slot, seq.num_cached + n)  # type: ignore[arg-type]
            batch.prefill.append(PrefillChunk(seq, seq.num_cached, n))
            left -= n
        return batch

    def _reserve_decode(self, kv: PagedKVCache, seq: Sequence, gammas: dict[int, int],
                        batch: ScheduledBatch) -> bool:
        """Blocks for a decoding sequence's 1 + gamma rows; its draft dropped, then newer sequences
        preempted, until they fit. False when it was preempted itself."""
        slot = seq.slot
        assert slot is not None
        if kv.reserve(slot, seq.num_cached + 1 + gammas.get(seq.seq_id, 0)):
            return True
        if gammas.get(seq.seq_id, 0):
            gammas[seq.seq_id] = 0
        while not kv.reserve(slot, seq.num_cached + 1):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Give a running sequence's blocks back; it waits at the head of the queue to be prefilled again."""
        self.running.remove(seq)
        if seq in batch.decode:
            batch.decode.remove(seq)
        if self.on_preempt is not None:
            self.on_preempt(seq)
        if seq.slot is not None:
            self.kv.free(seq.slot)
            seq.slot = None
        seq.num_cached = 0
        seq.status = SeqStatus.WAITING
        seq.stats.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
