"""Non-blocking capture of training signals on the engine's hot path.

Why this exists: TIDE (Sec. 3.2) keeps signal extraction off the critical path: the tapped hidden
states of accepted tokens are copied into a *pre-allocated host buffer* while the next
verification step computes, and a background thread flushes full buffers to shared storage.
``CaptureBuffer.push`` is the only call the engine makes per step; it never waits on I/O or on
the GPU:

* it copies the rows into a ring buffer of ``capacity_rows`` rows (taps stored in the on-disk
  dtype, pinned host memory when the source is on CUDA);
* if the ring has no room the whole push is dropped and counted (``num_dropped`` rows) -
  losing a few training rows is harmless, stalling the engine is not;
* CUDA sources are copied with ``non_blocking=True`` on a side stream that first waits for the
  compute stream; a CUDA event recorded after the copy is what the flusher thread waits on before
  it reads those rows, so the engine thread never synchronises;
* the flusher cuts shards of ``flush_rows`` rows (or fewer, once the oldest row has waited
  ``max_shard_age_s`` or on ``flush``/``close``) and hands them to the sink (a ``SignalStore``);
  a shard never mixes drafter versions. Ring rows are released as soon as the flusher has copied
  them out, *before* the (slow) write, so a slow store delays shards, not the engine.

Worked example (ring of 8 rows, flush_rows 4, sink busy for a long time)::

    buf = CaptureBuffer(store, capacity_rows=8, flush_rows=4)
    buf.push(7, [0, 1, 2], [5, 9, 2], [9, 2, 4], taps)   # -> True  (3 rows buffered)
    buf.push(7, [3, 4], [4, 1], [1, 8], taps2)           # -> True  (5 >= 4: flusher takes 4 rows)
    ...                                                  # pushes that do not fit -> False, counted
    buf.close()                                          # flushes what is left, joins the thread
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tidespec.online.store import ShardSink, SignalShard
from tidespec.threads import start_helper

logger = logging.getLogger(__name__)

IntRows = torch.Tensor | Sequence[int]


@dataclass(frozen=True)
class _Push:
    """Per-push metadata, kept off the ring (constant over the push's n rows)."""

    start: int  # first ring row (monotonic index)
    n: int
    seq_id: int
    domain: int  # index into the buffer's domain names
    drafter_version: int
    alpha: float | None
    wall_time: float


class CaptureBuffer:
    """Bounded, drop-when-full host buffer of training signals with a background flusher.

    ``store``: where shards go; ``None`` keeps flushed shards in memory (at most ``capacity_rows``
    rows, oldest shards discarded first) for ``drain()`` - useful for in-process consumers.
    ``taps_dtype``: host-buffer dtype of the taps; default the store's ``taps_dtype`` if it has
    one, else bfloat16. ``topk``: K of the optional target top-k rows (0 = none captured).
    ``hidden_dim``: H of the optional rows of the target's final hidden state (0 = none captured;
    stored in ``taps_dtype``).
    ``taps_dim``: k*H (0: no taps, rows of hidden states only, what Medusa heads train on); given, the
    ring is allocated now, else at the first push (a one-off allocation on the hot path).
    ``pin_memory``: page-lock the ring (needed for truly asynchronous device-to-host copies); None =
    when CUDA is available (``taps_dim`` given) or the first pushed taps are on CUDA.
    """

    def __init__(self, store: ShardSink | None, capacity_rows: int, flush_rows: int, *,
                 taps_dtype: torch.dtype | None = None, topk: int = 0, hidden_dim: int = 0,
                 taps_dim: int | None = None,
                 max_shard_age_s: float = 5.0, drafter_version: int = 0, pin_memory: bool | None = None) -> None:
        if capacity_rows < 1:
            raise ValueError(f"capacity_rows must be >= 1, got {capacity_rows}")
        if not 1 <= flush_rows <= capacity_rows:
            raise ValueError(f"flush_rows must be in [1, capacity_rows={capacity_rows}], got {flush_rows}")
        if topk < 0 or hidden_dim < 0:
            raise ValueError(f"topk and hidden_dim must be >= 0, got {topk}, {hidden_dim}")
        if max_shard_age_s <= 0:
            raise ValueError(f"max_shard_age_s must be > 0, got {max_shard_age_s}")
        if taps_dim is not None and taps_dim < 0:
            raise ValueError(f"taps_dim must be >= 0, got {taps_dim}")
        self._sink = store
        self.capacity_rows = capacity_rows
        self.flush_rows = flush_rows
        self.topk = topk
        self.hidden_dim = hidden_dim
        self.max_shard_age_s = max_shard_age_s
        self.drafter_version = drafter_version
        store_dtype = getattr(store, "taps_dtype", None)
        self.taps_dtype: torch.dtype = taps_dtype or (store_dtype if isinstance(store_dtype, torch.dtype)
                                                      else torch.bfloat16)
        self._lock = threading.Lock()  # guards the counters below; never held during copies or I/O
        self._wake = threading.Event()
        self._done_cond = threading.Condition(threading.Lock())
        self._head = 0  # rows ever published (monotonic); ring row = index % capacity_rows
        self._tail = 0  # rows ever released by the flusher
        self._done = 0  # rows whose sink write finished (success or failure)
        self._flush_upto = 0  # rows below this are flushed without waiting for a full shard
        self._closing = False
        self._events: deque[tuple[int, int, Any]] = deque()  # (first_row, end_row, torch.cuda.Event)
        self._copy_streams: dict[int, Any] = {}  # cuda device index -> side stream
        self._domain_names: list[str] = []
        self._domain_index: dict[str, int] = {}
        self._memory: deque[SignalShard] = deque()
        self._memory_rows = 0
        self._counters = {"num_pushes": 0, "num_captured": 0, "num_dropped": 0, "num_dropped_pushes": 0,
                          "num_flushed": 0, "num_shards": 0, "num_flush_errors": 0, "num_lost": 0,
                          "num_discarded": 0}
        self._taps: torch.Tensor | None = None  # [C, k*H] taps_dtype
        self._ids: torch.Tensor | None = None  # [C, 3] int64: positions, token_ids, next_token_ids
        self._pushes: deque[_Push] = deque()  # per-push metadata of unreleased rows, oldest first
        self._topk_ids: torch.Tensor | None = None  # [C, K] int64
        self._topk_logits: torch.Tensor | None = None  # [C, K] float32
        self._hidden: torch.Tensor | None = None  # [C, H] taps_dtype
        self._pin_memory = pin_memory
        if taps_dim is not None:
            self._allocate(taps_dim, pin=torch.cuda.is_available() if pin_memory is None else pin_memory)
        self._thread = start_helper(self._run, "tidespec-capture-flusher")

    # ----------------------------------------------------------------------------- hot path
    def push(self, seq_id: int, positions: IntRows, token_ids: IntRows, next_token_ids: IntRows,
             taps: torch.Tensor, domain: str = "", alpha: float | None = None,
             topk_ids: torch.Tensor | None = None, topk_logits: torch.Tensor | None = None,
             hidden: torch.Tensor | None = None) -> bool:
        """Buffer n rows of one sequence; returns False (and counts the rows) if they were dropped.

        ``taps``: [n, k*H] on any device; ``positions``/``token_ids``/``next_token_ids``: [n];
        ``alpha``: acceptance rate of the request, if known; ``topk_*``: [n, K] when ``topk > 0``;
        ``hidden``: [n, H] when ``hidden_dim > 0``.
        """
        n = int(taps.shape[0])
        if taps.dim() != 2:
            raise ValueError(f"taps must be [n, k*H], got shape {tuple(taps.shape)}")
        if (topk_ids is None) != (self.topk == 0) or (topk_logits is None) != (self.topk == 0):
            raise ValueError(f"topk_ids/topk_logits must be given exactly when topk > 0 (topk={self.topk})")
        if (hidden is None) != (self.hidden_dim == 0) or (hidden is not None and hidden.shape[-1] != self.hidden_dim):
            raise ValueError(f"hidden [n, {self.hidden_dim}] must be given exactly when hidden_dim > 0")
        self._counters["num_pushes"] += 1
        if n == 0:
            return True
        with self._lock:
            free = self.capacity_rows - (self._head - self._tail)
            closing = self._closing
        if closing or n > free:
            self._counters["num_dropped"] += n
            self._counters["num_dropped_pushes"] += 1
            return False
        if self._taps is None:
            self._allocate(int(taps.shape[1]), pin=taps.is_cuda if self._pin_memory is None else self._pin_memory)
        assert self._taps is not None and self._ids is not None
        if taps.shape[1] != self._taps.shape[1]:
            raise ValueError(f"taps width {taps.shape[1]} != buffer width {self._taps.shape[1]}")
        start = self._head
        dom = self._domain_index.get(domain)
        if dom is None:
            dom = len(self._domain_names)
            self._domain_names.append(domain)
            self._domain_index[domain] = dom
        id_srcs = (positions, token_ids, next_token_ids)
        id_device = next((t.device for t in id_srcs if isinstance(t, torch.Tensor) and t.is_cuda), None)
        id_parts = [torch.as_tensor(t, dtype=torch.int64, device=id_device) for t in id_srcs]  # 3 x [n]
        if any(tuple(t.shape) != (n,) for t in id_parts):
            raise ValueError(f"positions/token_ids/next_token_ids must each have shape ({n},)")
        ids = torch.stack(id_parts, dim=1)  # [n, 3]
        cuda_srcs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ring, source) pairs copied on the GPU stream
        for ring, src in ((self._ids, ids), (self._taps, taps), (self._topk_ids, topk_ids),
                          (self._topk_logits, topk_logits), (self._hidden, hidden)):
            if ring is None or src is None:
                continue
            if src.shape[0] != n:
                raise ValueError(f"taps/topk rows must match ({n}), got {src.shape[0]}")
            if src.is_cuda:
                cuda_srcs.append((ring, src))
            else:
                self._write(ring, start, src)
        if cuda_srcs:
            self._write_cuda(cuda_srcs, start, n)
        self._pushes.append(_Push(start, n, seq_id, dom, self.drafter_version, alpha, time.time()))
        with self._lock:
            self._head += n
            avail = self._head - self._tail
        self._counters["num_captured"] += n
        if avail >= self.flush_rows:
            self._wake.set()
        return True

    def _write(self, ring: torch.Tensor, start: int, src: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy ``src`` ([n, ...]) into ring rows start..start+n, wrapping around the end."""
        idx = start % self.capacity_rows
        n = src.shape[0]
        first = min(n, self.capacity_rows - idx)
        ring[idx:idx + first].copy_(src[:first], non_blocking=non_blocking)
        if first < n:
            ring[:n - first].copy_(src[first:], non_blocking=non_blocking)

    def _write_cuda(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], start: int, n: int) -> None:
        """Device-to-pinned-host copies on a side stream; the flusher waits on the recorded event."""
        device = pairs[0][1].device
        key = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._copy_streams.get(key)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            self._copy_streams[key] = stream
        stream.wait_stream(torch.cuda.current_stream(device))  # the taps must be computed first
        with torch.cuda.stream(stream):
            for ring, src in pairs:
                src.record_stream(stream)  # the caching allocator must not reuse src before the copy
                rows = src.to(ring.dtype).reshape((n, *ring.shape[1:]))  # [n, ...] converted on the GPU
                self._write(ring, start, rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._events.append((start, start + n, event))

    def _allocate(self, taps_dim: int, pin: bool) -> None:
        pin = pin and torch.cuda.is_available()
        c = self.capacity_rows
        self._taps = torch.empty(c, taps_dim, dtype=self.taps_dtype, pin_memory=pin)  # [C, k*H]
        self._ids = torch.zeros(c, 3, dtype=torch.int64, pin_memory=pin)  # [C, 3]
        if self.topk:
            self._topk_ids = torch.zeros(c, self.topk, dtype=torch.int64, pin_memory=pin)  # [C, K]
            self._topk_logits = torch.zeros(c, self.topk, dtype=torch.float32, pin_memory=pin)  # [C, K]
        if self.hidden_dim:
            self._hidden = torch.empty(c, self.hidden_dim, dtype=self.taps_dtype, pin_memory=pin)  # [C, H]

    def set_drafter_version(self, version: int) -> None:
        """Rows pushed from now on are tagged with ``version`` (a shard never mixes versions)."""
        self.drafter_version = version

    # ----------------------------------------------------------------------------- flusher
    def _take(self, ring: torch.Tensor, start: int, m: int) -> torch.Tensor:
        """Copy ring rows start..start+m out (unwrapping)."""
        idx = start % self.capacity_rows
        first = min(m, self.capacity_rows - idx)
        if first == m:
            return ring[idx:idx + m].clone()
        return torch.cat([ring[idx:], ring[:m - first]])

    def _run(self) -> None:
        while True:
            with self._lock:
                start, avail = self._tail, self._head - self._tail
                closing, urgent = self._closing, self._flush_upto > self._tail
            if avail == 0:
                if closing:
                    return
                self._wake.wait(timeout=self.max_shard_age_s)
                self._wake.clear()
                continue
            age = time.time() - self._pushes[0].wall_time
            if avail < self.flush_rows and not closing and not urgent and age < self.max_shard_age_s:
                self._wake.wait(timeout=self.max_shard_age_s - age)
                self._wake.clear()
                continue
            shard = self._cut(start, min(avail, self.flush_rows))
            with self._lock:
                self._tail += shard.num_signals  # ring rows are free again; the write below may be slow
            self._deliver(shard)
            with self._done_cond:
                self._done += shard.num_signals
                self._done_cond.notify_all()

    def _cut(self, start: int, m: int) -> SignalShard:
        while self._events and self._events[0][0] < start + m:
            first_row, end_row, event = self._events[0]
            event.synchronize()
            if end_row <= start + m:
                self._events.popleft()
            else:
                break
        assert self._taps is not None and self._ids is not None
        version = self._pushes[0].drafter_version
        seq_ids: list[int] = []
        doms: list[int] = []
        alphas: list[float] = []
        counts: list[int] = []
        for i in range(len(self._pushes)):  # indexing, not iterating: the engine thread may append
            rec = self._pushes[i]
            if rec.start >= start + m or rec.drafter_version != version:
                break
            counts.append(min(rec.start + rec.n, start + m) - max(rec.start, start))
            seq_ids.append(rec.seq_id)
            doms.append(rec.domain)
            alphas.append(float("nan") if rec.alpha is None else rec.alpha)
        m = sum(counts)
        while self._pushes and self._pushes[0].start + self._pushes[0].n <= start + m:
            self._pushes.popleft()
        reps = torch.tensor(counts)  # [P] rows per push record
        ids = self._take(self._ids, start, m)  # [m, 3]
        row_alphas = torch.tensor(alphas, dtype=torch.float32).repeat_interleave(reps)  # [m]
        known = row_alphas[~row_alphas.isnan()]  # [m'] rows whose request alpha is known
        acceptance = {"mean_alpha": float(known.mean()), "num_rows_with_alpha": float(known.numel())} \
            if known.numel() else {}
        uniq, local = torch.unique(torch.tensor(doms).repeat_interleave(reps), return_inverse=True)
        return SignalShard(
            taps=self._take(self._taps, start, m), token_ids=ids[:, 1].clone(), next_token_ids=ids[:, 2].clone(),
            seq_ids=torch.tensor(seq_ids).repeat_interleave(reps), positions=ids[:, 0].clone(), domain_ids=local,
            alphas=row_alphas,
            topk_ids=self._take(self._topk_ids, start, m) if self._topk_ids is not None else None,
            topk_logits=self._take(self._topk_logits, start, m) if self._topk_logits is not None else None,
            hidden=self._take(self._hidden, start, m) if self._hidden is not None else None,
            domains=[self._domain_names[i] for i in uniq.tolist()], wall_time=time.time(),
            drafter_version=version, acceptance=acceptance)

    def _deliver(self, shard: SignalShard) -> None:
        if self._sink is None:
            with self._lock:
                self._memory.append(shard)
                self._memory_rows += shard.num_signals
                while self._memory_rows > self.capacity_rows and len(self._memory) > 1:
                    old = self._memory.popleft()
                    self._memory_rows -= old.num_signals
                    self._counters["num_discarded"] += old.num_signals
        else:
            try:
                self._sink.append(shard)
            except Exception:  # noqa: BLE001 - the flusher must survive any store failure and keep draining
                logger.exception("capture: writing a shard of %d rows failed", shard.num_signals)
                self._counters["num_flush_errors"] += 1
                self._counters["num_lost"] += shard.num_signals
                return
        self._counters["num_flushed"] += shard.num_signals
        self._counters["num_shards"] += 1

    # ----------------------------------------------------------------------------- control
    def flush(self, timeout: float | None = None) -> bool:
        """Block until every row pushed so far reached the sink. Not for the hot path.
        Returns False on timeout."""
        with self._lock:
            target = self._head
            self._flush_upto = max(self._flush_upto, target)
        self._wake.set()
        with self._done_cond:
            return self._done_cond.wait_for(lambda: self._done >= target, timeout=timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush everything buffered, stop the flusher and join it. Later pushes are dropped."""
        with self._lock:
            self._closing = True
        self._wake.set()
        self._thread.join(timeout)

    def drain(self) -> list[SignalShard]:
        """Flushed shards kept in memory (only when constructed with ``store=None``)."""
        with self._lock:
            out = list(self._memory)
            self._memory.clear()
            self._memory_rows = 0
        return out

    def stats(self) -> dict[str, int]:
        """Counters, in rows unless named ``*_pushes``/``*_shards``/``*_errors``."""
        with self._lock:
            buffered = self._head - self._tail
        return {**self._counters, "buffered": buffered, "capacity_rows": self.capacity_rows}

    @property
    def num_captured(self) -> int:
        return self._counters["num_captured"]

    @property
    def num_dropped(self) -> int:
        return self._counters["num_dropped"]

    def __enter__(self) -> CaptureBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
