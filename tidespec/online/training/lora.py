"""Online LoRA alignment between full training rounds: EvoSpec's path B in the TIDE trainer.

Why this exists: a full round (``rounds``) waits for ``min_signals`` new rows (16k by default)
before it retrains the head; after a topic shift that is many requests of poor drafting.
EvoSpec (Sec. 3.4, Algorithm 1 path B, Table 5) closes the gap with small, frequent updates of
rank-32 LoRA adapters on the draft layer's query and value projections (``--lora-targets`` adds
the layer's other linears: ``eagle3_lora.ALL_TARGETS``), from a replay buffer of
verification events the drafter could have got right (its token was in the draft vocabulary)
but did not (the draft was rejected) or only barely (a large draft/target divergence), with a
confidence-aware curriculum on a top-k KL loss. This module is that path, run by the trainer
process (never the engine) on the same signal store and publish root as the full rounds:

    new shards since the aligner's own cursor (>= min_rows rows; the full rounds keep theirs)
      -> the target's top-k logits at every row, recovered from the captured final hidden state
         (logits = hidden @ LM-head^T; the engine stores hidden, never logits)
      -> an update waiting to be judged is judged first on these rows (below)
      -> eligible rows (Algorithm 1 line 24): label in the draft vocabulary and (greedy draft !=
         label or KL(p || q) > kl_threshold), judged with the adapters as they are now; the draft
         vocabulary is the head's own plus, with ``extra_vocab`` N, the newest N distinct tokens
         outside it that the target emitted, through calibrated rows (``extra_vocab``: what a
         dynamic V_t lets the engine draft; the adapters then learn to propose them)
      -> replay buffer, with ``anchor`` times as many of the rows the head already drafts well
         beside them (0 = EvoSpec's buffer; see ``anchor_rows``); once it holds ``buffer_rows``
         eligible rows and no update waits: ``steps`` AdamW steps on the curriculum loss (each on
         one chunk of <= 8 segments, in turn, topped up from a window of earlier buffers of
         ``replay_rows`` eligible rows), buffer moved into that window
      -> the update waits for ``judge_rows`` rows served after it, from at least
         ``judge_min_sequences`` requests; on them, the adapted head and the bare base head are each
         walked against the head served now (base, or base + the newest adapter), paired (``judge``:
         walked acceptance, a bootstrap interval over those requests); publish the adapter
         (``lora/v{base}/a{N}``) iff it wins beyond the interval and the base head is not better,
         or a zero adapter (the base head) iff the base head wins so (``_judge``); the engine merges
         it in between steps

Judging on the rows that arrive next (test, then train: every row first scores the pending update,
then joins the replay buffer) rather than on a held-out share: after a shift a held-out window
still holds the old domain, so an adapter fitted to the new one is judged on the traffic it left
(docs/benchmarks/learning.md: every adapter but the first refused), and on a few requests per phase a
held-out share is a handful of sequences taken from training. Rows that arrive after an update are
unseen by it and are the traffic the adapter would serve. Example: buffer full at shard 3 -> update;
shard 4 (>= judge_rows rows) -> judged, published or not, then buffered -> next update.

Curriculum (EvoSpec eq. 4-5): for an eligible row with step-1 cross-entropy L_base against the
verified token, step j of the training-time-test unroll weighs w_j = exp(-beta * L_base * (j-1)),
and the loss is sum_j w_j * T^2 * KL(p_j || q_j) over the target's top-k support (p renormalised
there, q the drafter's whole softmax read there: ``topk_kl``; temperature T). Worked example:
L_base 2.0, beta 0.3 -> w = [1, 0.55, 0.30, 0.17] for j = 1..4; a confident row (L_base 0.1) keeps
w = [1, 0.97, 0.94, 0.91].

A new full-round version resets the adapters (they are relative to their base version).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tidespec.models.eagle3.head import Eagle3Head
from tidespec.models.eagle3.lora import (
    AdapterError,
    adapter_dir,
    list_adapters,
    load_adapter,
    lora_parameters,
    merged_state,
    save_adapter,
    with_lora,
)
from tidespec.online.store import ShardGone, ShardInfo, SignalShard, SignalStore
from tidespec.online.training.config import LoraAlignConfig
from tidespec.online.training.data import segments_by_sequence
from tidespec.online.training.eagle3_train import SignalBatch, SignalSegment, unroll
from tidespec.online.training.judge import HeadWalk, compare, count_sequences, walk_head

logger = logging.getLogger(__name__)

SEGMENTS_PER_BATCH = 8  # segments per forward of the gate and per optimizer step
MAX_READ_ROWS = 4096  # newest rows of a backlog the aligner reads at once


@dataclass
class AdapterResult:
    """One adapter update: what it trained on, how it scored on the rows served after it, whether it
    was published. ``baseline_accept_len`` is the head served while it was judged (base, or base +
    the newest adapter)."""

    base_version: int
    eligible_rows: int
    seen_rows: int
    loss_before: float
    loss_after: float
    judged_rows: int
    baseline_accept_len: float
    adapted_accept_len: float
    base_accept_len: float  # the bare base head (= baseline_accept_len while no adapter is served)
    reset: bool  # the base head won: a zero adapter (the base) published, training goes on
    update_ms: float
    adapter: int | None  # the published number, None if it did not beat the served head


@dataclass
class _Pending:
    """An update waiting for ``judge_rows`` rows served after it (``judge``) to be judged on."""

    eligible_rows: int
    seen_rows: int
    loss_before: float
    loss_after: float
    update_ms: float
    judge: list[SignalSegment]


def with_target_topk(shard: SignalShard, out_rows: torch.Tensor, k: int, chunk: int = 256) -> SignalShard:
    """``shard`` with the target's top-k logits at every row recovered from its final hidden
    states (``hidden`` [N, H] @ ``out_rows`` [V, H]^T); a shard without ``hidden`` (or with top-k
    already) is returned as it is."""
    if shard.hidden is None or shard.topk_ids is not None:
        return shard
    ids, vals = [], []
    w = out_rows.float()
    for i in range(0, shard.num_signals, chunk):
        logits = shard.hidden[i:i + chunk].float() @ w.T  # [c, V]
        top = logits.topk(min(k, w.shape[0]), dim=-1)
        ids.append(top.indices)
        vals.append(top.values)
    return dataclasses.replace(shard, topk_ids=torch.cat(ids), topk_logits=torch.cat(vals))


def topk_kl(logits: torch.Tensor, top_ids: torch.Tensor, top_logits: torch.Tensor, t2d: torch.Tensor,
            temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(p || q) per row over the target's top-k support inside the draft vocabulary.

    logits [B, N, Vd] (draft), top_ids / top_logits [B, N, K] (target) -> (kl [B, N], keep [B, N]);
    p is the softmax of the target's top-k logits / temperature renormalised on the support, q the
    drafter's softmax of logits / temperature over its whole vocabulary, read on the support: the
    mass q puts off the support counts as error (sum p log(p/q) >= -log q(support) >= 0). A q
    renormalised on the support would leave the logits off it untouched, and pulling the support's
    top-1 down towards a flatter p then lets a token off the support overtake it
    (docs/benchmarks/learning.md: updates that lowered their loss lowered held-out acceptance). A row whose support has
    no draft-vocabulary token is not kept.

    Example: p = (0.7, 0.3) on tokens (a, b), q(a) = 0.7, q(b) = 0.3 -> 0; the same q(a), q(b) halved
    (half of q's mass elsewhere) -> log 2."""
    draft_ids = t2d[top_ids]  # [B, N, K], -1 = outside the draft vocabulary
    inside = draft_ids >= 0
    logp = torch.log_softmax((top_logits.float() / temperature).masked_fill(~inside, float("-inf")), dim=-1)
    logq = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, draft_ids.clamp(min=0))  # [B, N, K]
    p = logp.exp().nan_to_num(0.0)
    kl = (p * (logp - logq).masked_fill(~inside, 0.0).nan_to_num(0.0)).sum(-1)  # [B, N]
    return kl, inside.any(-1)


@contextmanager
def extra_vocab(head: Eagle3Head, ids: torch.Tensor, rows: torch.Tensor) -> Iterator[Eagle3Head]:
    """Within the block ``head`` drafts over its own vocabulary plus the target ids ``ids`` [n] (none
    of them its own), whose output rows are ``rows`` [n, H]; its LM head, vocabulary map and config
    are restored on exit. Nothing trainable changes: the LoRA adapters live in the draft layers, the
    widened LM head is frozen, so an adapter trained inside the block serves the narrow head.

    Why: with a dynamic draft vocabulary the engine drafts over V_t, which holds tokens outside the
    head's trained vocabulary through calibrated rows (``Eagle3Head.output_rows``). EvoSpec's path B
    aligns on every verification event whose token was in V_t; judged on the head's own vocabulary
    only, a head after a shift could never learn to propose the new domain's tokens that retrieval
    put within its reach (docs/benchmarks/learning.md: coverage 94.6 %, acceptance unchanged).

    Example: own vocabulary {5, 9} (d2t [5, 8]), ids [2], rows [[..]] -> inside the block draft ids
    0, 1, 2 stand for target ids 5, 9, 2 and the logits have 3 columns."""
    if ids.numel() == 0:
        yield head
        return
    saved = (head.cfg, head.lm_head, head.d2t, head.t2d)
    own = head.draft_to_target(torch.arange(head.cfg.draft_vocab_size, device=head.d2t.device))  # [Vd]
    every = torch.cat([own, ids.to(own.device)])  # [Vd + n]
    n = every.numel()
    w = head.lm_head.weight
    lm_head = nn.Linear(w.shape[1], n, bias=False, device=w.device, dtype=w.dtype).requires_grad_(False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.cat([w.detach(), rows.to(device=w.device, dtype=w.dtype)]))
    t2d = torch.zeros_like(head.t2d)
    t2d[every] = True
    head.cfg = dataclasses.replace(head.cfg, draft_vocab_size=n)
    head.lm_head = lm_head
    head.d2t = every - torch.arange(n, device=every.device)
    head.t2d = t2d
    try:
        yield head
    finally:
        head.cfg, head.lm_head, head.d2t, head.t2d = saved


def _padded(masks: list[torch.Tensor], n: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(masks), n, dtype=torch.bool, device=device)  # [B, N]
    for b, m in enumerate(masks):
        out[b, :m.numel()] = m.to(device)
    return out


def curriculum_loss(head: Eagle3Head, embed: nn.Embedding, segments: list[SignalSegment], masks: list[torch.Tensor],
                    steps: int, beta: float, temperature: float) -> tuple[torch.Tensor, int]:
    """EvoSpec eq. 5 over the rows ``masks`` marks (each [N_b] bool) -> (mean row loss, rows)."""
    batch = SignalBatch.collate(segments, head)
    rows = _padded(masks, batch.num_rows, head.device)  # [B, N]
    t2d = head.target_to_draft()  # [V]
    step_logits = unroll(head, embed, batch, steps)
    labels, valid = batch.labels(1)
    draft_labels = t2d[labels]  # [B, N]
    rows = rows & valid & (draft_labels >= 0)
    base = F.cross_entropy(step_logits[0].float().flatten(0, 1), draft_labels.clamp(min=0).flatten(),
                           reduction="none").view_as(draft_labels).detach()  # [B, N] L_base
    total = torch.zeros((), dtype=torch.float32, device=head.device)
    for j, logits in enumerate(step_logits, start=1):
        top_ids, top_logits, ok = batch.soft_labels(j)
        kl, keep = topk_kl(logits, top_ids, top_logits, t2d, temperature)
        weight = torch.exp(-beta * base * (j - 1))  # [B, N]
        sel = rows & ok & keep
        total = total + (weight * temperature ** 2 * kl)[sel].sum()
    n = int(rows.sum())
    return total / max(1, n), n


@torch.no_grad()
def eligible_rows(head: Eagle3Head, embed: nn.Embedding, segments: list[SignalSegment], kl_threshold: float,
                  temperature: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Algorithm 1 line 22-24 per segment -> (eligible, usable), each [N] bool per segment: usable =
    labelled, label in the draft vocabulary, target top-k known; eligible = usable and (greedy draft
    != label or KL(p || q) > kl_threshold) at unroll step 1."""
    batch = SignalBatch.collate(segments, head)
    t2d = head.target_to_draft()
    logits = unroll(head, embed, batch, 1)[0]  # [B, N, Vd]
    labels, valid = batch.labels(1)
    draft_labels = t2d[labels]
    top_ids, top_logits, top_ok = batch.soft_labels(1)
    kl, keep = topk_kl(logits, top_ids, top_logits, t2d, temperature)
    miss = logits.argmax(-1) != draft_labels
    usable = valid & top_ok & keep & (draft_labels >= 0)
    ok = usable & (miss | (kl > kl_threshold))
    return ([ok[b, :s.num_positions].cpu() for b, s in enumerate(segments)],
            [usable[b, :s.num_positions].cpu() for b, s in enumerate(segments)])


def anchor_rows(eligible: list[torch.Tensor], usable: list[torch.Tensor], ratio: float,
                gen: torch.Generator) -> list[torch.Tensor]:
    """``eligible`` plus about ``ratio`` times as many of the other usable rows, drawn uniformly.

    Why: the replay buffer holds, by construction, the rows the head got wrong; a few steps on those
    alone move the head towards them and away from the rows it got right (docs/benchmarks/learning.md: the
    buffer loss fell while held-out acceptance fell). Rows it already drafts well, replayed beside
    the misses, anchor the update to the traffic as a whole. ``ratio`` 0 is EvoSpec's buffer.
    Example: 10 eligible of 100 usable rows, ratio 1.0 -> each of the other 90 kept with p = 10/90:
    about 20 rows in all."""
    others = [u & ~e for e, u in zip(eligible, usable)]
    n_elig, n_other = sum(int(e.sum()) for e in eligible), sum(int(o.sum()) for o in others)
    p = min(1.0, ratio * n_elig / n_other) if n_other else 0.0
    return [e | (o & (torch.rand(o.shape, generator=gen) < p)) for e, o in zip(eligible, others)]


class LoraAligner:
    """Path B state of one trainer: adapters on the current base version, replay buffer, cursor.

    ``out_rows`` [V, H]: the target's LM-head rows (the top-k of a captured hidden state).
    ``min_gain``: an adapter is published only if its walked acceptance on the rows served after it
    beats the served head's by more, at the lower end of a ``judge_confidence`` interval
    resampled over the sequences of those rows (walked in blocks of ``judge_block_rows``;
    ``judge.judge_pair``), which number at least ``judge_min_sequences``.
    """

    def __init__(self, cfg: LoraAlignConfig, store: SignalStore, root: Path | str, embed: nn.Embedding,
                 out_rows: torch.Tensor, *, gamma: int, ttt_steps: int, max_segment_len: int,
                 min_gain: float = 0.0, judge_confidence: float = 0.9, judge_block_rows: int = 32,
                 judge_min_sequences: int = 2) -> None:
        self.cfg = cfg
        self.judge_confidence = judge_confidence
        self.judge_block_rows = judge_block_rows
        self.judge_min_sequences = judge_min_sequences
        self.store = store
        self.root = Path(root)
        self.embed = embed
        self.out_rows = out_rows
        self.gamma = gamma
        self.ttt_steps = ttt_steps
        self.max_segment_len = max_segment_len
        self.min_gain = min_gain
        self.cursor: str | None = None  # newest shard id read (the full rounds keep their own)
        self.base_version = -1
        self.head: Eagle3Head | None = None  # the base head with adapters (training copy)
        self.base: Eagle3Head | None = None  # the version's head, no adapters
        self.served: Eagle3Head | None = None  # what the engine serves: the base head, or a copy at the last publish
        self.optimizer: torch.optim.Optimizer | None = None
        # (segment, replayed rows [N], how many of them are eligible: anchors do not fill the buffer)
        self.buffer: list[tuple[SignalSegment, torch.Tensor, int]] = []
        self.window: list[tuple[SignalSegment, torch.Tensor, int]] = []  # earlier updates' buffers, newest last
        self.seen = 0  # training rows read since the last update
        self.pending: _Pending | None = None
        self.gen = torch.Generator().manual_seed(0)  # anchor draws
        self.results: list[AdapterResult] = []
        # ``cfg.extra_vocab`` newest distinct emitted tokens outside the base head's vocabulary (oldest
        # first) and their calibrated output rows [H], computed once per base version
        self.recent: OrderedDict[int, None] = OrderedDict()
        self.extra_rows: dict[int, torch.Tensor] = {}
        self.num_uncovered_rows = 0  # rows read but left to the full rounds (``_covered``)
        self._uncovered = False  # whether the last read was (logged once per change)

    def start_cursor(self, shard_id: str | None) -> None:
        """Read only shards after ``shard_id`` (the trainer starts where its full rounds stand)."""
        self.cursor = shard_id

    def _rebase(self, base: Eagle3Head, version: int) -> None:
        self.head = with_lora(copy.deepcopy(base), self.cfg.rank, self.cfg.alpha, self.cfg.target_modules).eval()
        self.base = base
        self.served = self._served_head(base, version)
        self.optimizer = torch.optim.AdamW(lora_parameters(self.head), lr=self.cfg.lr, betas=(0.9, 0.95))
        self.base_version = version
        self.buffer.clear()
        self.window.clear()
        self.seen = 0
        self.pending = None
        self.extra_rows.clear()
        logger.info("lora: adapters (rank %d on %s) reset on drafter version %d", self.cfg.rank, self.cfg.targets,
                    version)

    def _served_head(self, base: Eagle3Head, version: int) -> Eagle3Head:
        """What the engine serves for ``version``: ``online.adapters`` merges the newest adapter only,
        and an engine that refuses it serves the base head. A restarted trainer must beat that."""
        numbers = list_adapters(self.root, version)
        if not numbers:
            return base
        try:
            adapter = load_adapter(adapter_dir(self.root, version, numbers[-1]), base.cfg)
        except AdapterError:
            return base  # the engine refuses it too
        served = copy.deepcopy(base)
        served.load_state_dict(merged_state(base.state_dict(), adapter, base.cfg))
        return served

    def _read_new(self) -> list[SignalShard]:
        """The shards since the cursor once they hold ``min_rows`` rows; of a larger backlog (a trainer
        that starts late) only the newest ``MAX_READ_ROWS``: alignment follows the traffic of now."""
        infos = self.store.list_shards(since=self.cursor)
        if not infos or sum(i.num_signals for i in infos) < self.cfg.min_rows:
            return []
        self.cursor = infos[-1].shard_id
        newest: list[ShardInfo] = []
        for info in reversed(infos):
            if newest and sum(i.num_signals for i in newest) + info.num_signals > MAX_READ_ROWS:
                break
            newest.insert(0, info)
        shards = []
        for info in newest:
            try:
                shard = self.store.read(info.shard_id)
            except ShardGone:
                continue
            if shard.hidden is not None or shard.topk_ids is not None:  # served (hidden) or teacher-pass rows
                shards.append(with_target_topk(shard, self.out_rows, self.cfg.topk))
        return shards

    def step(self, base: Eagle3Head, version: int) -> AdapterResult | None:
        """Read the new signals: judge the waiting update on them once there are ``judge_rows`` of at
        least ``judge_min_sequences`` sequences, then
        grow the replay buffer and update once it is full (and no update waits). Returns the judged
        update, if one was."""
        if self.head is None or version != self.base_version:
            self._rebase(base, version)
        assert self.head is not None and self.optimizer is not None
        shards = self._read_new()
        if not shards:
            return None
        segments = [s for segs in segments_by_sequence(shards, self.max_segment_len).values() for s in segs
                    if s.topk_ids is not None]
        self._note_tokens(segments)
        result = None
        if self.pending is not None:
            self.pending.judge.extend(segments)
            judge = self.pending.judge
            if (sum(s.num_positions for s in judge) >= self.cfg.judge_rows
                    and count_sequences(judge) >= self.judge_min_sequences):
                result = self._judge(self.pending)
                self.pending = None
        train = [s for s in segments if s.num_positions >= 2]
        if not self._covered(train):
            self.num_uncovered_rows += sum(s.num_positions for s in train)
            return result
        self.seen += sum(s.num_positions for s in train)
        for i in range(0, len(train), SEGMENTS_PER_BATCH):  # bounded memory: logits are [B, N, draft vocab]
            chunk = train[i:i + SEGMENTS_PER_BATCH]
            with self._wide(self.head) as head:
                eligible, usable = eligible_rows(head, self.embed, chunk, self.cfg.kl_threshold, self.cfg.temperature)
            for seg, elig, mask in zip(chunk, eligible, anchor_rows(eligible, usable, self.cfg.anchor, self.gen)):
                if bool(mask.any()):
                    self.buffer.append((seg, mask, int(elig.sum())))
        buffered = sum(n for _, _, n in self.buffer)
        if self.pending is None and buffered >= self.cfg.buffer_rows:
            self.pending = self._update(buffered)
        return result

    def _covered(self, segments: list[SignalSegment]) -> bool:
        """Whether at least ``cfg.min_coverage`` of ``segments``' next tokens lie inside the base head's
        vocabulary or among the remembered extra tokens. Below it the traffic needs tokens the head cannot
        draft, which adapters on its attention cannot give it and a full round's widening can (measured on a
        new script: LoRA adapters trained on Chinese and Russian rows were never published, 1.118 -> 1.118
        and 1.068 -> 1.070, while full rounds reached 1.15-1.30x the frozen head). An update's eligibility
        pass and its optimizer steps then go to the next round instead: the trainer shares the CPU's idle
        time between them.

        Example: own vocabulary {0..23}, min_coverage 0.7, a segment whose next tokens are
        [5, 30, 7, 40] -> 2 of 4 inside: not covered, its rows left to the rounds."""
        if not self.cfg.min_coverage or not segments:
            return True
        assert self.base is not None
        inside = self.base.t2d.cpu().clone()  # [V] bool
        if self.recent:
            inside[torch.tensor(list(self.recent))] = True
        labels = torch.cat([s.token_ids[1:] for s in segments])  # [rows]
        share = float(inside[labels].float().mean())
        uncovered = share < self.cfg.min_coverage
        if uncovered != self._uncovered:
            logger.info("lora: %.0f %% of the new rows' tokens inside the head's vocabulary: %s", 100 * share,
                        "left to the full rounds (they widen it)" if uncovered else "aligning again")
            self._uncovered = uncovered
        return not uncovered

    def _note_tokens(self, segments: list[SignalSegment]) -> None:
        """Remember the newest ``cfg.extra_vocab`` distinct tokens outside the base head's vocabulary
        that the target emitted in ``segments`` (a dynamic V_t admits each at its first sighting)."""
        if not self.cfg.extra_vocab or not segments:
            return
        assert self.base is not None
        own = self.base.t2d.cpu()  # [V] bool
        for seg in segments:
            for t in seg.token_ids.tolist():
                if not own[t]:
                    self.recent[t] = None
                    self.recent.move_to_end(t)
        while len(self.recent) > self.cfg.extra_vocab:
            self.recent.popitem(last=False)

    @contextmanager
    def _wide(self, head: Eagle3Head) -> Iterator[Eagle3Head]:
        """``head`` over its own vocabulary plus the remembered tokens (``extra_vocab``), whose rows are
        the base head's calibrated rows (the LM head is never adapted, so one row serves every head)."""
        assert self.base is not None
        own = self.base.t2d.cpu()  # [V] bool; a new base version may own tokens remembered under the last
        ids = [t for t in self.recent if not own[t]]
        if not ids:
            yield head
            return
        new = [t for t in ids if t not in self.extra_rows]
        if new:
            with torch.no_grad():
                rows = self.base.output_rows(torch.tensor(new), self.out_rows)  # [n_new, H]
            self.extra_rows.update(zip(new, rows))
        with extra_vocab(head, torch.tensor(ids), torch.stack([self.extra_rows[t] for t in ids])) as wide:
            yield wide

    def _buffer_loss(self, chunk: list[tuple[SignalSegment, torch.Tensor, int]]) -> float:
        """The curriculum loss over one chunk of the replay buffer (mean per replay row)."""
        assert self.head is not None
        with torch.no_grad(), self._wide(self.head) as head:
            loss, _ = curriculum_loss(head, self.embed, [s for s, _, _ in chunk], [m for _, m, _ in chunk],
                                      self.ttt_steps, self.cfg.beta, self.cfg.temperature)
        return float(loss)

    def _update(self, buffered: int) -> _Pending:
        """``steps`` optimizer steps over the buffer's chunks in turn, each chunk topped up to
        ``SEGMENTS_PER_BATCH`` segments drawn from the replay window (``replay_rows``); the buffer then
        joins the window (the oldest leave it) and is cleared. The loss before and after is read on
        the first chunk only (a diagnostic: the trainer runs on a fraction of two cores, and a pass
        over the whole buffer costs as much as the steps)."""
        assert self.head is not None and self.optimizer is not None
        chunks = [self.buffer[i:i + SEGMENTS_PER_BATCH] for i in range(0, len(self.buffer), SEGMENTS_PER_BATCH)]
        t0 = time.perf_counter()
        loss_before = self._buffer_loss(chunks[0])
        self.head.train()
        for k in range(self.cfg.steps):  # each step one chunk of the buffer, in turn
            chunk = chunks[k % len(chunks)]
            room = SEGMENTS_PER_BATCH - len(chunk)
            if room and self.window:
                pick = torch.randperm(len(self.window), generator=self.gen)[:room].tolist()
                chunk = chunk + [self.window[i] for i in pick]
            with self._wide(self.head) as head:
                loss, _ = curriculum_loss(head, self.embed, [s for s, _, _ in chunk], [m for _, m, _ in chunk],
                                          self.ttt_steps, self.cfg.beta, self.cfg.temperature)
            self.optimizer.zero_grad(set_to_none=True)
            if loss.requires_grad:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(lora_parameters(self.head), 1.0)
                self.optimizer.step()
        self.head.eval()
        update_ms = (time.perf_counter() - t0) * 1e3
        pending = _Pending(buffered, self.seen, loss_before, self._buffer_loss(chunks[0]), update_ms, [])
        if self.cfg.replay_rows:
            self.window.extend(self.buffer)
            while sum(n for _, _, n in self.window) > self.cfg.replay_rows:
                self.window.pop(0)
        self.buffer.clear()
        self.seen = 0
        logger.info("lora: %d eligible rows of %d, loss %.3f -> %.3f in %.0f ms; judged on the next %d rows",
                    buffered, pending.seen_rows, pending.loss_before, pending.loss_after, update_ms,
                    self.cfg.judge_rows)
        return pending

    def _judge(self, pending: _Pending) -> AdapterResult:
        """Walked acceptance on the rows served after the update of the served head, the adapted one
        and (when an adapter is served) the bare base head, each paired with the served one
        (``judge.judge_pair``); the best, when it beats the served one by more than ``min_gain`` at
        the lower end of its interval, is published and served from now on. The base head winning means the traffic went
        back to where the adapters do not help (docs/benchmarks/learning.md: prose and math adapters cost
        code 0.17 of acceptance when code returned): a zero adapter, equal to the base head, is
        published, and training goes on from the adapters as they are (restarting them from zero
        threw away a domain's progress on a noisy judgement in the same measurements).

        Example: served a3 1.90, adapted 1.95, base 2.10 -> a4 = zero adapter (the base) published;
        the next update must beat 2.x of the base head on its own rows."""
        assert self.head is not None and self.served is not None and self.base is not None
        def walk(head: Eagle3Head) -> HeadWalk:
            with self._wide(head) as wide:
                return walk_head(wide, self.embed, pending.judge, self.gamma, self.judge_block_rows)

        served = walk(self.served)  # walked once, paired with each of the others
        up = compare(served, walk(self.head), self.judge_confidence)
        back = None if self.served is self.base else compare(served, walk(self.base), self.judge_confidence)
        before, after = up.base, up.cand
        bare = before if back is None else back.cand
        reset = back is not None and back.better(self.min_gain) and not after > bare
        publish = reset or (up.better(self.min_gain) and not bare > after)
        judged = sum(s.num_positions for s in pending.judge)
        metrics: dict[str, Any] = {"eligible_rows": pending.eligible_rows, "seen_rows": pending.seen_rows,
                                   "update_ms": round(pending.update_ms, 1), "judged_rows": judged,
                                   "adapted_accept_len": after, "baseline_accept_len": before,
                                   "base_accept_len": bare, "reset": reset, "gain_low": up.low,
                                   "gain_high": up.high, "confidence": up.confidence,
                                   "loss_before": pending.loss_before, "loss_after": pending.loss_after}
        number = None
        if publish:
            number = save_adapter(self.root, zero_adapters(self.head) if reset else self.head, self.base_version,
                                  {k: v for k, v in metrics.items()
                                   if isinstance(v, (int, float)) and math.isfinite(v)})
            self.served = self.base if reset else copy.deepcopy(self.head)
        result = AdapterResult(self.base_version, pending.eligible_rows, pending.seen_rows, pending.loss_before,
                               pending.loss_after, judged, before, after, bare, reset, pending.update_ms, number)
        self.results.append(result)
        logger.info("lora: judged on %d rows served after it: accept len %.3f (served) -> %.3f (adapted), %.3f "
                    "(base), %s", judged, before, after, bare,
                    (f"base head published as v{self.base_version}/a{number}" if reset else
                     f"published v{self.base_version}/a{number}" if number else "not published"))
        return result


def zero_adapters(head: Eagle3Head) -> Eagle3Head:
    """A copy of a ``with_lora`` head with every adapter's B zero: the base head's function, in the
    adapter format (what the engine merges to serve the base head again)."""
    out = copy.deepcopy(head)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if "lora_B" in name:
                p.zero_()
    return out
