"""Online LoRA alignment between full training rounds: EvoSpec's path B in the TIDE trainer.

Why this exists: a full round (``rounds``) waits for ``min_signals`` new rows (16k by default)
before it retrains the head; after a topic shift that is many requests of poor drafting.
EvoSpec (Sec. 3.4, Algorithm 1 path B, Table 5) closes the gap with small, frequent updates of
rank-32 LoRA adapters on the draft layer's query and value projections, from a replay buffer of
verification events the drafter could have got right (its token was in the draft vocabulary)
but did not (the draft was rejected) or only barely (a large draft/target divergence), with a
confidence-aware curriculum on a top-k KL loss. This module is that path, run by the trainer
process (never the engine) on the same signal store and publish root as the full rounds:

    new shards since the aligner's own cursor (>= min_rows rows; the full rounds keep theirs)
      -> the target's top-k logits at every row, recovered from the captured final hidden state
         (logits = hidden @ LM-head^T; the engine stores hidden, never logits)
      -> sequences split: ~heldout_frac held out (kept, newest ``heldout_rows``, to judge adapters)
      -> eligible rows (Algorithm 1 line 24): label in the head's vocabulary and (greedy draft !=
         label or KL(p || q) > kl_threshold), judged with the adapters as they are now
      -> replay buffer, with ``anchor`` times as many of the rows the head already drafts well
         beside them (0 = EvoSpec's buffer; see ``anchor_rows``); once it holds ``buffer_rows``
         eligible rows: ``steps`` AdamW steps on the curriculum loss (each on one chunk of <= 8
         segments, in turn), buffer cleared
      -> simulated acceptance on the held-out rows, adapted vs base head; publish the adapter
         (``lora/v{base}/a{N}``) iff it is better; the engine merges it in between steps

Curriculum (EvoSpec eq. 4-5): for an eligible row with step-1 cross-entropy L_base against the
verified token, step j of the training-time-test unroll weighs w_j = exp(-beta * L_base * (j-1)),
and the loss is sum_j w_j * T^2 * KL(p_j || q_j) over the target's top-k support (both
distributions renormalised there, temperature T). Worked example: L_base 2.0, beta 0.3 ->
w = [1, 0.55, 0.30, 0.17] for j = 1..4; a confident row (L_base 0.1) keeps w = [1, 0.97, 0.94, 0.91].

A new full-round version resets the adapters (they are relative to their base version).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tidespec.models.eagle3_head import Eagle3Head
from tidespec.models.eagle3_lora import lora_parameters, save_adapter, with_lora
from tidespec.online.eagle3_train import SignalBatch, SignalSegment, unroll
from tidespec.online.store import ShardGone, ShardInfo, SignalShard, SignalStore
from tidespec.online.trainer.config import LoraAlignConfig
from tidespec.online.trainer.data import segments_by_sequence, simulated_acceptance, split_heldout

logger = logging.getLogger(__name__)

SEGMENTS_PER_BATCH = 8  # segments per forward of the gate and per optimizer step
MAX_READ_ROWS = 4096  # newest rows of a backlog the aligner reads at once


@dataclass
class AdapterResult:
    """One adapter update: what it trained on, how it scored, whether it was published."""

    base_version: int
    eligible_rows: int
    seen_rows: int
    loss_before: float
    loss_after: float
    baseline_accept_len: float
    adapted_accept_len: float
    update_ms: float
    adapter: int | None  # the published number, None if it did not beat the base head


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
    top-1 down towards a flatter p then lets a token off the support overtake it (benchmarks sections
    15 and 19: updates that lowered their loss lowered held-out acceptance). A row whose support has
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
    alone move the head towards them and away from the rows it got right (benchmarks section 15: the
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
    ``min_gain``: an adapter is published only if its held-out acceptance beats the base head's by more.
    """

    def __init__(self, cfg: LoraAlignConfig, store: SignalStore, root: Path | str, embed: nn.Embedding,
                 out_rows: torch.Tensor, *, gamma: int, ttt_steps: int, heldout_frac: float, max_segment_len: int,
                 min_gain: float = 0.0) -> None:
        self.cfg = cfg
        self.store = store
        self.root = Path(root)
        self.embed = embed
        self.out_rows = out_rows
        self.gamma = gamma
        self.ttt_steps = ttt_steps
        self.heldout_frac = heldout_frac
        self.max_segment_len = max_segment_len
        self.min_gain = min_gain
        self.cursor: str | None = None  # newest shard id read (the full rounds keep their own)
        self.base_version = -1
        self.head: Eagle3Head | None = None  # the base head with adapters (training copy)
        self.optimizer: torch.optim.Optimizer | None = None
        # (segment, replayed rows [N], how many of them are eligible: anchors do not fill the buffer)
        self.buffer: list[tuple[SignalSegment, torch.Tensor, int]] = []
        self.gen = torch.Generator().manual_seed(0)  # anchor draws
        self.heldout: deque[SignalSegment] = deque()
        self.results: list[AdapterResult] = []

    def start_cursor(self, shard_id: str | None) -> None:
        """Read only shards after ``shard_id`` (the trainer starts where its full rounds stand)."""
        self.cursor = shard_id

    def _rebase(self, base: Eagle3Head, version: int) -> None:
        self.head = with_lora(copy.deepcopy(base), self.cfg.rank, self.cfg.alpha).eval()
        self.optimizer = torch.optim.AdamW(lora_parameters(self.head), lr=self.cfg.lr, betas=(0.9, 0.95))
        self.base_version = version
        self.buffer.clear()
        logger.info("lora: adapters (rank %d) reset on drafter version %d", self.cfg.rank, version)

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

    def _keep_heldout(self, segments: list[SignalSegment]) -> None:
        self.heldout.extend(segments)
        while sum(s.num_positions for s in self.heldout) > self.cfg.heldout_rows and len(self.heldout) > 1:
            self.heldout.popleft()

    def step(self, base: Eagle3Head, version: int) -> AdapterResult | None:
        """Read the new signals, grow the replay buffer, update and maybe publish once it is full."""
        if self.head is None or version != self.base_version:
            self._rebase(base, version)
        assert self.head is not None and self.optimizer is not None
        shards = self._read_new()
        if not shards:
            return None
        train, held = split_heldout(segments_by_sequence(shards, self.max_segment_len), self.heldout_frac)
        self._keep_heldout([s for s in held if s.topk_ids is not None])
        train = [s for s in train if s.num_positions >= 2 and s.topk_ids is not None]
        seen = sum(s.num_positions for s in train)
        for i in range(0, len(train), SEGMENTS_PER_BATCH):  # bounded memory: logits are [B, N, draft vocab]
            chunk = train[i:i + SEGMENTS_PER_BATCH]
            eligible, usable = eligible_rows(self.head, self.embed, chunk, self.cfg.kl_threshold,
                                             self.cfg.temperature)
            for seg, elig, mask in zip(chunk, eligible, anchor_rows(eligible, usable, self.cfg.anchor, self.gen)):
                if bool(mask.any()):
                    self.buffer.append((seg, mask, int(elig.sum())))
        buffered = sum(n for _, _, n in self.buffer)
        if buffered < self.cfg.buffer_rows:
            return None
        return self._update(base, buffered, seen)

    @torch.no_grad()
    def _buffer_loss(self, chunks: list[list[tuple[SignalSegment, torch.Tensor, int]]]) -> float:
        """The curriculum loss over the whole replay buffer (mean per replay row)."""
        assert self.head is not None
        total, rows = 0.0, 0
        for chunk in chunks:
            loss, n = curriculum_loss(self.head, self.embed, [s for s, _, _ in chunk], [m for _, m, _ in chunk],
                                      self.ttt_steps, self.cfg.beta, self.cfg.temperature)
            total += float(loss) * n
            rows += n
        return total / max(1, rows)

    def _update(self, base: Eagle3Head, buffered: int, seen: int) -> AdapterResult:
        assert self.head is not None and self.optimizer is not None
        chunks = [self.buffer[i:i + SEGMENTS_PER_BATCH] for i in range(0, len(self.buffer), SEGMENTS_PER_BATCH)]
        t0 = time.perf_counter()
        loss_before = self._buffer_loss(chunks)
        self.head.train()
        for k in range(self.cfg.steps):  # each step one chunk of the buffer, in turn
            chunk = chunks[k % len(chunks)]
            loss, _ = curriculum_loss(self.head, self.embed, [s for s, _, _ in chunk], [m for _, m, _ in chunk],
                                      self.ttt_steps, self.cfg.beta, self.cfg.temperature)
            self.optimizer.zero_grad(set_to_none=True)
            if loss.requires_grad:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(lora_parameters(self.head), 1.0)
                self.optimizer.step()
        self.head.eval()
        update_ms = (time.perf_counter() - t0) * 1e3
        losses = [loss_before, self._buffer_loss(chunks)]
        self.buffer.clear()
        held = list(self.heldout)
        before = simulated_acceptance(base, self.embed, held, self.gamma)
        after = simulated_acceptance(self.head, self.embed, held, self.gamma)
        better = math.isfinite(after) and (not math.isfinite(before) or after > before + self.min_gain)
        metrics: dict[str, Any] = {"eligible_rows": buffered, "seen_rows": seen, "update_ms": round(update_ms, 1),
                                   "heldout_accept_len": after, "baseline_accept_len": before,
                                   "loss_before": losses[0], "loss_after": losses[-1]}
        number = (save_adapter(self.root, self.head, self.base_version,
                               {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)})
                  if better else None)
        result = AdapterResult(self.base_version, buffered, seen, losses[0], losses[-1], before, after, update_ms,
                               number)
        self.results.append(result)
        logger.info("lora: %d eligible rows, loss %.3f -> %.3f in %.0f ms, held-out accept len %.3f -> %.3f, %s",
                    buffered, losses[0], losses[-1], update_ms, before, after,
                    f"published v{self.base_version}/a{number}" if number else "not published")
        return result
