"""A draft vocabulary that follows the traffic: a static frequency core plus an ARC-managed buffer
filled by retrieval in a background thread (EvoSpec Sec. 3.3, Algorithm 1 path A).

Why this exists: a drafter whose output layer covers a fixed set of tokens cannot propose any
other token, so a static vocabulary chosen on one domain collapses acceptance on another, while
the full vocabulary makes the output projection the drafter's largest cost. Here the output layer
runs over V_t = core ∪ buffer. When a verified token is outside V_t (an OOV event) the engine's
step only *records* it (token id + the target's final hidden state that produced it); a worker
thread then recalls candidates — the token itself, its nearest LM-head rows by inner product with
that hidden state (``index.MipsIndex``), and their likely successors (``graph.CooccurrenceGraph``,
also learning from every served token) — admits them through ARC (``arc.ArcBuffer``), gathers the
output rows of the new V_t and publishes a new immutable ``VocabSnapshot``. The drafter reads the
current snapshot once per ``propose`` (between steps), so a swap never happens inside a step and
the step never waits on retrieval. Lossless by construction: the drafter's probabilities are its
softmax over V_t, zero elsewhere, and verification is unchanged. Steps without an OOV event (their
buffer hits and graph streams) reach the worker in batches of ``batch_steps``: on 2 cores a worker
woken every step took the GIL and the cores from the step often enough to show in the draft time.

Worked example (core {0, 1}, buffer of 2, a recorded OOV token 7 whose successor is 8)::

    vocab = DynamicVocab(DynamicVocabConfig(core_size=2, buffer=ArcConfig(capacity=2, min_residency=0)),
                         core=[0, 1], rows_for=lambda ids: table[ids], graph=g)   # g: 7 -> 8 seen often
    vocab.snapshot.ids          # tensor([0, 1])
    vocab.record(produced=[(7, hidden)], streams=[])
    vocab.drain()               # (tests) wait for the worker
    vocab.snapshot.ids          # tensor([0, 1, 7, 8])
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import nn

from tidespec.errors import ConfigError, check_at_least
from tidespec.speculative.api import Observation
from tidespec.speculative.vocab.arc import ArcBuffer, ArcConfig
from tidespec.speculative.vocab.graph import CooccurrenceGraph, GraphConfig
from tidespec.speculative.vocab.index import MipsIndex
from tidespec.threads import start_helper

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DynamicVocabConfig:
    core_size: int = 4096  # static frequency core
    buffer: ArcConfig = field(default_factory=ArcConfig)  # the dynamic buffer (capacity 0 via dynamic=False)
    graph: GraphConfig = field(default_factory=GraphConfig)
    dynamic: bool = True  # False: the core alone (a static frequency vocabulary, FR-Spec)
    semantic_k: int = 10  # HNSW neighbours per OOV event (EvoSpec: 10)
    successor_k: int = 8  # graph successors per seed (EvoSpec: 8)
    max_pending: int = 256  # recorded steps waiting for the worker; beyond, the oldest are dropped (counted)
    # steps whose buffer hits and graph streams go to the worker as one record (an OOV event goes at
    # once, with them): the worker wakes, and takes the GIL from the step, once per batch, not per step
    batch_steps: int = 16

    def __post_init__(self) -> None:
        check_at_least(1, vocab_core_size=self.core_size, vocab_max_pending=self.max_pending,
                       vocab_batch_steps=self.batch_steps)
        check_at_least(0, vocab_semantic_k=self.semantic_k, vocab_successor_k=self.successor_k)


@dataclass(frozen=True)
class VocabSnapshot:
    """One published V_t: read-only, replaced as a whole."""

    version: int
    ids: torch.Tensor  # [n] int64 target ids: the core, then the buffer
    blocks: tuple[torch.Tensor, ...]  # [n_i, H] each: the drafter's output rows for those ids, in order
    members: frozenset[int]  # the same ids, for the per-token OOV test
    output: nn.Module | None = None  # [T, H] -> [T, n] over ``rows`` in the drafter's weight format (int8), or None

    @cached_property
    def rows(self) -> torch.Tensor:
        """[n, H] the output rows stacked: built when first read (a drafter with an ``output``
        layer never reads them, so a publish does not copy ~8k float rows for nothing)."""
        return self.blocks[0] if len(self.blocks) == 1 else torch.cat(self.blocks)

    @property
    def weights(self) -> torch.Tensor | nn.Module:
        """What the drafter's logits multiply by: ``output`` if built, else the float ``rows``."""
        return self.output if self.output is not None else self.rows

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])


@dataclass(frozen=True)
class _Part:
    """Output rows of some ids and the drafting layer over them, built from one rows source."""

    rows: torch.Tensor  # [n, H]
    output: nn.Module | None  # [T, H] -> [T, n], or None


@dataclass
class VocabStats:
    """Counters read by metrics and benchmarks (ints written by one thread each)."""

    verified: int = 0  # generated tokens verified while a snapshot was in use
    covered: int = 0  # ... of which inside V_t
    oov_events: int = 0
    dropped: int = 0  # recorded steps dropped because the worker fell behind
    published: int = 0  # snapshots published after the first
    retrievals: int = 0
    retrieval_s: float = 0.0  # worker time in HNSW + graph per OOV event, summed
    errors: int = 0  # worker exceptions (logged; the vocabulary keeps its last snapshot)
    build_s: float = 0.0  # worker time building published snapshots, summed

    @property
    def coverage(self) -> float:
        return self.covered / self.verified if self.verified else float("nan")

    @property
    def mean_retrieval_ms(self) -> float:
        return 1e3 * self.retrieval_s / self.retrievals if self.retrievals else float("nan")

    @property
    def mean_build_ms(self) -> float:
        return 1e3 * self.build_s / self.published if self.published else float("nan")


@dataclass
class _Record:
    step: int
    produced: list[tuple[int, torch.Tensor | None]]  # OOV tokens and the hidden that produced them
    hits: list[int]  # buffer tokens verified this step
    streams: list[tuple[int | None, list[int]]]  # (token before, newly final tokens) per sequence


class DynamicVocab:
    """V_t = core ∪ ARC buffer, maintained by a worker thread; ``snapshot`` is the current one.

    ``rows_for(ids [n]) -> [n, H]`` gives the drafter's output rows (called on the worker);
    ``output_for(rows)``, if given, builds the layer that drafts over them in the drafter's own
    weight format (an int8 ``Int8Linear`` for a head drafting in int8; on the worker too), and
    ``output_join(layers)`` the layer over their rows stacked (``Int8Linear.concat``);
    ``index_rows`` [V, H] are the rows HNSW searches (the target's LM head), built on the worker
    (or pass a prebuilt ``index``); ``graph`` is the co-occurrence graph (its unigram counts
    chose ``core`` in ``from_graph``). ``start=False`` keeps everything on the caller's thread
    (``process_pending``), for tests.

    The worker's CPU time is taken from the step on a small host (on 2 cores the draft time per
    token rose about as much as the worker worked: docs/benchmarks/learning.md), so a publish
    does as little as it can: the core's rows and layer are kept from the first build, and each
    buffer token's row from when it was admitted, until ``refresh`` says the rows source changed;
    only newly admitted tokens' rows are computed, the buffer's layer is rebuilt (<= ``capacity``
    rows) and joined to the core's; and the records that queued while the worker was busy are
    absorbed together before one publish.
    """

    def __init__(self, cfg: DynamicVocabConfig, core: list[int], rows_for: Callable[[torch.Tensor], torch.Tensor],
                 graph: CooccurrenceGraph | None = None, index_rows: torch.Tensor | None = None,
                 index: MipsIndex | None = None, start: bool = True,
                 output_for: Callable[[torch.Tensor], nn.Module] | None = None,
                 output_join: Callable[[list[nn.Module]], nn.Module] | None = None) -> None:
        if not core:
            raise ConfigError("a draft vocabulary needs a non-empty core")
        self.cfg = cfg
        self.core = list(dict.fromkeys(int(t) for t in core))
        self._core_set = frozenset(self.core)
        self.rows_for = rows_for
        self.output_for = output_for  # rows [n, H] -> the drafting output layer (e.g. int8), built on the worker
        self.output_join = output_join  # layers over row blocks -> the layer over the blocks stacked
        self.graph = graph if graph is not None else CooccurrenceGraph(cfg.graph)
        self.arc = ArcBuffer(cfg.buffer)
        self.stats = VocabStats()
        self._index = index
        self._index_rows = index_rows
        self._pending: queue.Queue[_Record | None] = queue.Queue()
        self._lock = threading.Lock()  # guards the rows source, its generation and the core's cached part
        self._rows_gen = 0  # bumped by ``refresh``: a core part built from an older source is not kept
        self._core_part: _Part | None = None
        self._extra_rows: dict[int, torch.Tensor] = {}  # buffer token -> its output row [H] (worker only)
        self._extra_gen = 0  # the rows source generation ``_extra_rows`` came from
        self._steps = 0
        self._held_hits: list[int] = []  # buffer hits and streams of steps not yet sent to the worker
        self._held_streams: list[tuple[int | None, list[int]]] = []
        self._held_steps = 0
        self.snapshot = self._build(0)
        self._thread: threading.Thread | None = None
        if start:
            self._thread = start_helper(self._run, "tidespec-vocab")

    # -- engine side (hot path: no retrieval, no waiting) ------------------------------------------

    def record(self, produced: list[tuple[int, torch.Tensor | None]],
               streams: list[tuple[int | None, list[int]]]) -> None:
        """One engine step's generated tokens, each with the target hidden state [H] that produced
        it (or None), and each sequence's newly final tokens for the graph. Counts coverage
        against the current snapshot and queues the OOV events; returns at once."""
        self._steps += 1
        snap = self.snapshot
        oov: list[tuple[int, torch.Tensor | None]] = []
        hits: list[int] = []
        for tok, hidden in produced:
            self.stats.verified += 1
            if tok in snap.members:
                self.stats.covered += 1
                if tok not in self._core_set:
                    hits.append(tok)
            else:
                self.stats.oov_events += 1
                oov.append((tok, hidden.detach().clone() if hidden is not None else None))
        if not (self.cfg.dynamic and (oov or hits or streams)):
            return
        self._held_hits += hits
        self._held_streams += streams
        self._held_steps += 1
        if oov or self._held_steps >= self.cfg.batch_steps:
            self._send(oov)

    def _send(self, oov: list[tuple[int, torch.Tensor | None]]) -> None:
        """Queue one record: ``oov`` and the held hits and streams (engine thread)."""
        rec = _Record(self._steps, oov, self._held_hits, self._held_streams)
        self._held_hits, self._held_streams, self._held_steps = [], [], 0
        if self._pending.qsize() >= self.cfg.max_pending:
            self.stats.dropped += 1
            return
        self._pending.put(rec)

    def observe(self, observations: list[Observation]) -> None:
        """``record`` the generated tokens of a step's observations: row j of an observation
        produced ``token_ids[start + j + 1]``; prompt positions are not generated (not counted)."""
        produced: list[tuple[int, torch.Tensor | None]] = []
        streams: list[tuple[int | None, list[int]]] = []
        for obs in observations:
            if obs.start < 0:
                continue
            lo = max(obs.start + 1, obs.num_prompt_tokens)
            hi = min(obs.start + obs.num_new_cached + 1, len(obs.token_ids))
            if lo >= hi:
                continue
            for pos in range(lo, hi):
                hidden = obs.hidden[pos - obs.start - 1] if obs.hidden is not None else None
                produced.append((obs.token_ids[pos], hidden))
            streams.append((obs.token_ids[lo - 1] if lo > 0 else None, obs.token_ids[lo:hi]))
        if produced:
            self.record(produced, streams)

    def refresh(self, rows_for: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """The drafter's output rows changed (new weights): republish V_t with fresh rows (on the
        worker; until then the old snapshot, still lossless, is used)."""
        with self._lock:
            if rows_for is not None:
                self.rows_for = rows_for
            self._rows_gen += 1
            self._core_part = None
        self._pending.put(_Record(self._steps, [], [], []))

    # -- worker ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch = [self._pending.get()]
            while True:  # what queued meanwhile is absorbed with it: one publish for all
                try:
                    batch.append(self._pending.get_nowait())
                except queue.Empty:
                    break
            stop = any(rec is None for rec in batch)
            try:
                self._process([rec for rec in batch if rec is not None])
            except Exception:  # a failure here must not take the engine down: keep the last snapshot
                self.stats.errors += 1
                log.exception("draft vocabulary update failed")
            finally:
                for _ in batch:
                    self._pending.task_done()
            if stop:
                return

    def process_pending(self) -> None:
        """Run the queued records, and the held steps, on this thread (``start=False``)."""
        if self._held_steps:
            self._send([])
        batch: list[_Record] = []
        while not self._pending.empty():
            rec = self._pending.get_nowait()
            if rec is not None:
                batch.append(rec)
        try:
            if batch:
                self._process(batch)
        finally:
            for _ in batch:
                self._pending.task_done()

    def drain(self) -> None:
        """Wait until every recorded step has been processed (tests, benchmarks; the engine thread)."""
        if self._held_steps:
            self._send([])
        if self._thread is None:
            self.process_pending()
        else:
            self._pending.join()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._pending.put(None)
            self._thread.join(timeout=5)

    def prepare(self) -> None:
        """Build (or read from its cache) the HNSW index now rather than at the first OOV event."""
        if self.cfg.dynamic and self.cfg.semantic_k:
            self._ensure_index()

    def _ensure_index(self) -> MipsIndex | None:
        if self._index is None and self._index_rows is not None:
            self._index = MipsIndex.cached(self._index_rows)
            self._index_rows = None
        return self._index

    def candidates(self, token: int, hidden: torch.Tensor | None) -> list[int]:
        """The OOV token, its semantic neighbours, and every seed's likely successors (in order)."""
        seeds = [token]
        index = self._ensure_index() if hidden is not None and self.cfg.semantic_k else None
        if index is not None and hidden is not None:
            seeds += index.query(hidden, self.cfg.semantic_k)
        out = list(seeds)
        for s in seeds:
            out += self.graph.successors(s, self.cfg.successor_k)
        return [t for t in dict.fromkeys(out) if t not in self._core_set]

    def _process(self, records: list[_Record]) -> None:
        """Absorb ``records`` in order, then publish once if V_t changed or one of them asked to
        (an empty record: ``refresh``)."""
        before = self.arc.resident()
        asked = False
        for rec in records:
            for prev, toks in rec.streams:
                self.graph.add(toks, previous=prev)
            self.arc.touch(rec.hits, rec.step)
            for tok, hidden in rec.produced:
                t0 = time.perf_counter()
                cands = self.candidates(tok, hidden)
                self.stats.retrieval_s += time.perf_counter() - t0
                self.stats.retrievals += 1
                self.arc.admit(cands, rec.step)
            asked |= not (rec.produced or rec.hits or rec.streams)
        if self.arc.resident() != before or asked:
            t0 = time.perf_counter()
            self.snapshot = self._build(self.snapshot.version + 1)
            self.stats.build_s += time.perf_counter() - t0
            self.stats.published += 1

    def _build(self, version: int) -> VocabSnapshot:
        """V_t = the core's part (kept while the rows source is unchanged) + the buffer's, built now."""
        extra = [t for t in self.arc.resident() if t not in self._core_set]
        with self._lock:
            rows_for, gen, core = self.rows_for, self._rows_gen, self._core_part
        if core is None:
            core = self._part(rows_for(torch.tensor(self.core, dtype=torch.int64)))
            with self._lock:
                if self._rows_gen == gen:  # else a refresh came meanwhile: its own record rebuilds
                    self._core_part = core
        ids = torch.tensor(self.core + extra, dtype=torch.int64, device=core.rows.device)  # [n]
        members = self._core_set.union(extra)
        if not extra:
            return VocabSnapshot(version, ids, (core.rows,), members, core.output)
        buf = self._extra_part(rows_for, gen, extra)
        output = self._joined(core, buf)
        # without a layer the drafter multiplies by the float rows: stacked here, not on its thread
        blocks = (core.rows, buf.rows) if output is not None else (torch.cat([core.rows, buf.rows]),)
        return VocabSnapshot(version, ids, blocks, members, output)

    def _part(self, rows: torch.Tensor) -> _Part:
        """``rows`` [n, H] and the drafting layer over them (if the drafter has its own format)."""
        return _Part(rows, self.output_for(rows) if self.output_for is not None else None)

    def _extra_part(self, rows_for: Callable[[torch.Tensor], torch.Tensor], gen: int, extra: list[int]) -> _Part:
        """The buffer's part: rows kept per token since its admission (computed for new tokens only),
        its layer built afresh (a few hundred rows); rows of tokens that left the buffer are dropped."""
        if self._extra_gen != gen:
            self._extra_rows, self._extra_gen = {}, gen
        missing = [t for t in extra if t not in self._extra_rows]
        if missing:
            for t, row in zip(missing, rows_for(torch.tensor(missing, dtype=torch.int64))):
                self._extra_rows[t] = row
        self._extra_rows = {t: self._extra_rows[t] for t in extra}
        return self._part(torch.stack([self._extra_rows[t] for t in extra]))  # rows [n_extra, H]

    def _joined(self, core: _Part, buf: _Part) -> nn.Module | None:
        """The drafting layer over [core; buffer]: the two parts' layers joined, or, with no
        ``output_join``, built from the stacked rows afresh."""
        if self.output_for is None or core.output is None or buf.output is None:
            return None
        if self.output_join is None:
            return self.output_for(torch.cat([core.rows, buf.rows]))
        return self.output_join([core.output, buf.output])

    @classmethod
    def from_graph(cls, cfg: DynamicVocabConfig, graph: CooccurrenceGraph, vocab_size: int,
                   rows_for: Callable[[torch.Tensor], torch.Tensor], index_rows: torch.Tensor | None = None,
                   own: list[int] | None = None, start: bool = True,
                   output_for: Callable[[torch.Tensor], nn.Module] | None = None,
                   output_join: Callable[[list[nn.Module]], nn.Module] | None = None) -> "DynamicVocab":
        """Core = the ``core_size`` first of: the drafter's ``own`` tokens (those with trained
        output rows, e.g. a pruned EAGLE-3 head's draft vocabulary; None = every token has one),
        most frequent in the graph first; then the graph's other tokens by frequency; then the
        lowest ids. A pruned head's own vocabulary is itself a frequency vocabulary, chosen on its
        (broad) training signals, and its rows beat calibrated target rows: it goes first.

        Example: own [4, 7, 9], graph counts {7: 5, 2: 9, 4: 1}, core_size 4 -> core [7, 4, 9, 2].
        """
        size = min(cfg.core_size, vocab_size)
        ranked = graph.most_frequent(len(graph.unigrams))
        if own is not None:
            mine = set(own)
            ranked = [t for t in ranked if t in mine] + [t for t in own if t not in graph.unigrams] + \
                [t for t in ranked if t not in mine]
        core = ranked[:size]  # no repeats: graph tokens once each, own tokens (distinct) not in the graph once
        if len(core) < size:
            seen = set(core)
            core += [t for t in range(vocab_size) if t not in seen][:size - len(core)]
        return cls(cfg, core, rows_for, graph=graph, index_rows=index_rows, start=start, output_for=output_for,
                   output_join=output_join)
