"""``DraftTrainer``, the rounds of TIDE's decoupled draft trainer, with ``TrainerState`` and ``RoundResult``.

Why this exists: the serving engine swaps in only a head that beat the current one on held-out
signals, and relays each round's acceptance rates to its selective collector; a round (TIDE Sec.
3.3, Algorithm 1) is where an EAGLE-3 head is trained from the captured target hidden states once
enough new signals arrived, compared with the current one, published atomically or not, and
recorded in ``trainer_state.json``. The process around it is ``trainer.process``.

One round::

    new shards since the last consumed shard id  (>= min_signals rows, else wait poll_s)
      -> shards captured with the target's final hidden states (--online-lora) get its top-k logits,
         so the round distils from the target's distribution rather than imitating its tokens
      -> rows grouped per sequence into runs of consecutive positions, cut to max_segment_len
      -> split by sequence: ~heldout_frac of the sequences held out (positions split if only one)
      -> plus up to replay_rows rows of earlier rounds' shards (newest first), training only, so a
         round on a new domain does not erase the old one
      -> candidate = current head (or, from a fresh head with a smaller draft vocab, a fresh head
         whose draft vocabulary is the most frequent tokens of the training rows)
      -> training-time-test AdamW steps at --finetune-lr when the versions descend from a trained
         head (published as v1, or --init-from), else at --lr (a lineage started from a fresh head);
         DDP over ranks: each rank takes its slice of every batch
      -> both heads walked over the held-out split as a greedy server would (``judge``: accepted
         tokens per drafting step, paired, a bootstrap interval over blocks of rows); publish(root,
         candidate) iff the interval's lower end of the gain is above min_gain (rank 0 only)
      -> trainer_state.json: consumed shard id, and the round (alpha_train = current's acceptance
         rate, alpha_eval = candidate's) which the engine relays to its selective collector
      -> served judgement (``judge_served``), before any further round: on the first
         served_judge_rows rows captured after the round, the published head and the one it
         replaced are both walked (paired: the same rows, so how hard the traffic is cancels out);
         a loser by more than served_margin (at the interval's upper end) is reverted by
         publishing the replaced head again

The held-out split judges a candidate on the round's own window of traffic; the served judgement
judges it on the traffic that came after, which the candidate never saw. Both compare two heads on
the same rows. (Comparing one version's served acceptance on its requests with another's on
earlier ones would mistake easier requests for a better head.)

Worked example: 3 sequences of 40 captured positions, heldout_frac 0.34 -> 1 sequence held out,
2 blocks of 32 rows; the current (fresh) head walks 1.02 tokens per step, the candidate 1.61 at
gamma 4, the gain's interval (0.4, 0.8) -> published as v1, round {"alpha_train": 0.005,
"alpha_eval": 0.15, "published_version": 1}.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from tidespec.models.eagle3.checkpoint import (
    PublishedDrafter,
    fresh_head,
    head_from_published,
    import_eagle3,
    load_latest_valid,
    load_version,
    publish,
    validate_eagle3_dir,
)
from tidespec.models.eagle3.head import Eagle3Head, init_from_target
from tidespec.models.target import TargetConfig
from tidespec.online.signals import TRAINER_STATE_NAME
from tidespec.online.store import ShardGone, ShardInfo, SignalShard, SignalStore
from tidespec.online.training.config import TrainerConfig, TrainerConfigError
from tidespec.online.training.data import fresh_head_for, segments_by_sequence, split_heldout, token_counts, widen_head
from tidespec.online.training.dist import DistContext, check_replicas_in_sync
from tidespec.online.training.eagle3_train import SignalSegment, ttt_loss
from tidespec.online.training.judge import PairedJudgement, count_sequences, gain_interval, judge_pair
from tidespec.online.training.lora import LoraAligner, with_target_topk

logger = logging.getLogger(__name__)

WIDEN_MIN_COUNT = 2  # a token seen once in a round's rows does not enter the draft vocabulary


class _TTTObjective(nn.Module):
    """The head plus its training-time-test loss as one module, so DDP can wrap it. The target's
    embedding is held outside the module tree (frozen, not broadcast, not synchronized)."""

    def __init__(self, head: Eagle3Head, embed: nn.Embedding, ttt_steps: int, step_weight_decay: float = 0.8,
                 distill: str = "soft", autocast: str = "none") -> None:
        super().__init__()
        self.head = head
        self._embed = (embed,)
        self.ttt_steps = ttt_steps
        self.step_weight_decay = step_weight_decay
        self.distill = distill
        self.autocast = autocast

    def forward(self, segments: list[SignalSegment]) -> tuple[torch.Tensor, list[float]]:
        # bfloat16 autocast: the matmuls run in bf16 (AMX on recent Xeons, tensor cores on GPUs),
        # weights, optimizer state and the loss's softmax stay float32
        with torch.autocast(self.head.device.type, dtype=torch.bfloat16, enabled=self.autocast == "bf16"):
            loss, acc = ttt_loss(self.head, self._embed[0], segments, self.ttt_steps, self.step_weight_decay,
                                 self.distill)
        # every parameter in the graph (zero-weighted) so each rank's backward reaches every DDP hook
        anchor = sum(p.sum() for p in self.head.parameters()) * 0.0
        return loss + anchor, acc


def _batches(n: int, per_step: int, seed: int) -> Iterator[list[int]]:
    """Endless ``per_step``-sized index batches over successive seeded permutations of range(n)."""
    gen = torch.Generator().manual_seed(seed)
    buf: list[int] = []
    while True:
        while len(buf) < per_step:
            buf.extend(torch.randperm(n, generator=gen).tolist())
        yield buf[:per_step]
        buf = buf[per_step:]


@dataclass
class TrainerState:
    """What the trainer persists in ``publish_root/trainer_state.json``."""

    last_shard_id: str | None = None
    rounds: list[dict[str, Any]] = field(default_factory=list)
    judgements: list[dict[str, Any]] = field(default_factory=list)  # served judgements of published versions
    fresh_start: bool = False  # the first round trained a fresh head: every round keeps --lr (no --finetune-lr)

    @staticmethod
    def load(root: Path) -> TrainerState:
        try:
            doc = json.loads((root / TRAINER_STATE_NAME).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return TrainerState()
        except (OSError, json.JSONDecodeError) as exc:
            logger.warning("ignoring unreadable %s: %s", root / TRAINER_STATE_NAME, exc)
            return TrainerState()
        return TrainerState(doc.get("last_shard_id"), list(doc.get("rounds") or []), list(doc.get("judgements") or []),
                            bool(doc.get("fresh_start", False)))

    def save(self, root: Path) -> None:
        """Atomic replace (temp file, fsync, rename): the engine may read it at any time."""
        tmp = root / f".tmp-{TRAINER_STATE_NAME}-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(asdict(self), f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, root / TRAINER_STATE_NAME)
        finally:
            tmp.unlink(missing_ok=True)


@dataclass
class RoundResult:
    round: int
    num_train_rows: int
    num_heldout_rows: int
    baseline_accept_len: float
    candidate_accept_len: float
    train_loss: float
    train_time_s: float
    published_version: int | None
    parent_version: int


Head = TypeVar("Head", bound=nn.Module)  # what a trainer's rounds train: an EAGLE-3 head, Medusa heads


@dataclass
class Awaiting(Generic[Head]):
    """A published version waiting for its served judgement: the head it replaced, and the rows
    captured after the round's last shard (neither head trained on them), read so far."""

    version: int
    parent: Head
    parent_version: int
    after: str
    shards: list[SignalShard] = field(default_factory=list)
    read: set[str] = field(default_factory=set)


class DraftTrainer:
    """Watches a signal store and publishes better EAGLE-3 heads (see the module docstring).

    ``embed`` is the target's token embedding (read-only). The head trains in float32 (float64
    for a float64 target, as in the tests) on ``cfg.device``. ``target`` (the ``TargetModel``) is
    needed only when ``cfg.init_from_target`` starts fresh heads from its weights.
    """

    def __init__(self, cfg: TrainerConfig, target_cfg: TargetConfig, embed: nn.Embedding,
                 ctx: DistContext | None = None, target: nn.Module | None = None) -> None:
        if cfg.init_from_target != "none" and target is None:
            raise TrainerConfigError(f"--init-from-target {cfg.init_from_target} needs the target model")
        self.target = target
        self.cfg = cfg
        self.target_cfg = target_cfg
        self.embed = embed
        self.ctx = ctx or DistContext()
        self.device = torch.device(cfg.device)
        self.dtype = torch.float64 if embed.weight.dtype == torch.float64 else torch.float32
        self.root = Path(cfg.publish_root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.store = SignalStore(cfg.signal_dir, cfg.budget_mb << 20)
        self.state = self.ctx.broadcast(TrainerState.load(self.root) if self.ctx.is_main else None)
        self.current_version = -1
        self.current = self._refresh_current()
        self._out_rows: torch.Tensor | None = None  # the target's LM-head rows, once a shard has hidden states
        self.aligner = self._aligner(target) if cfg.lora.enabled else None
        self.awaiting: Awaiting[Eagle3Head] | None = None  # a published version before its served judgement
        self.carry: Eagle3Head | None = None  # an unpublished candidate the next round trains on from

    # -- the current drafter ---------------------------------------------------------------------

    def _refresh_current(self) -> Eagle3Head:
        """Load the newest valid published version if it changed (rank 0 decides which)."""
        version = self.ctx.broadcast(self._newest_valid() if self.ctx.is_main else None)
        if version == self.current_version:
            return self.current
        self.carry = None  # it descends from the head that is no longer current
        if version > 0:
            head = head_from_published(load_version(self.root, version, self.target_cfg), self.dtype, self.device)
        elif self.cfg.init_from:
            validate_eagle3_dir(self.cfg.init_from, self.target_cfg)
            config, sd = import_eagle3(self.cfg.init_from, self.target_cfg)
            head = head_from_published(PublishedDrafter(0, config, sd, {}), self.dtype, self.device)
        else:
            head = fresh_head(self.target_cfg, self.cfg.draft_vocab or None, self.dtype, self.device)
        self.current_version, self.current = version, head
        return head

    def _aligner(self, target: nn.Module | None) -> LoraAligner:
        """EvoSpec's path B between the rounds (``trainer.lora``), reading from where the rounds stand."""
        if target is None or self.ctx.enabled:
            raise TrainerConfigError("--lora needs the target model and a single trainer process")
        cfg = self.cfg
        aligner = LoraAligner(cfg.lora, self.store, self.root, self.embed, self._target_rows(target),
                              gamma=cfg.gamma, ttt_steps=cfg.ttt_steps, max_segment_len=cfg.max_segment_len,
                              min_gain=cfg.min_gain, judge_confidence=cfg.judge_confidence,
                              judge_block_rows=cfg.judge_block_rows, judge_min_sequences=cfg.judge_min_sequences)
        aligner.start_cursor(self.state.last_shard_id)
        return aligner

    def _with_target_topk(self, shards: list[SignalShard]) -> list[SignalShard]:
        """Shards that carry the target's final hidden states (``--online-lora`` capture) get its top-k
        logits (``--topk``, else ``--lora-topk``), so the round distils from the target's
        distribution (``--distill``) instead of imitating its tokens; other shards as they are."""
        if self.target is None or not any(s.hidden is not None and s.topk_ids is None for s in shards):
            return shards
        rows, k = self._target_rows(self.target), self.cfg.topk or self.cfg.lora.topk
        return [with_target_topk(s, rows, k) for s in shards]

    def _target_rows(self, target: nn.Module) -> torch.Tensor:
        """[V, H] the target's LM-head rows (a target's logits = its final hidden state times these)."""
        if self._out_rows is None:
            from tidespec.models.target import output_matrix

            self._out_rows = output_matrix(target).to(self.device)
        return self._out_rows

    def _newest_valid(self) -> int:
        pub = load_latest_valid(self.root, self.target_cfg)
        return pub.version if pub is not None else 0

    def _candidate(self, train: list[SignalSegment], fresh: list[SignalSegment]) -> Eagle3Head:
        """A copy of the current head (or of the carried candidate of an unpublished round that gained
        on average: ``carry_unpublished``), its draft vocabulary widened by ``fresh`` rows' tokens it
        lacks (``_widened``); from a fresh head, a fresh head of ``head_layers`` layers and ``fusion``
        (with a reduced draft vocabulary: the most frequent tokens of the training rows) started from
        the target's weights as ``init_from_target`` says."""
        if self.current_version > 0 or self.cfg.init_from:
            start = self.carry if self.carry is not None else self.current
            wide = self._widened(start, fresh)  # a new head, or ``start`` itself
            return wide if wide is not start else copy.deepcopy(start)
        head = fresh_head_for(self.target_cfg, self.current.cfg.draft_vocab_size, train, self.dtype, self.device,
                              self.cfg.seed, self.cfg.head_layers, self.cfg.fusion)
        return init_from_target(head, self.target, self.cfg.init_from_target) if self.target is not None else head

    def _widened(self, head: Eagle3Head, fresh: list[SignalSegment]) -> Eagle3Head:
        """A new head: ``head`` with up to ``widen_vocab`` more draft tokens (never past ``max_draft_vocab``): the
        tokens of this round's rows that its vocabulary lacks and that occur at least
        ``WIDEN_MIN_COUNT`` times, most frequent first, each with a calibrated row
        (``data.widen_head``); training then moves them like the others. Why: a head can never
        propose a token outside its vocabulary, so on a new script (39 % of a Chinese answer's tokens
        were in the shipped head's 8,192) no training of its weights alone brings acceptance back.

        Example: an 8,192-token head, widen_vocab 512, the new rows hold 300 outside tokens of
        which 120 occur twice or more -> a head of 8,312 tokens; its old rows are unchanged. ``head``
        itself, unchanged, when nothing widens it."""
        cfg = self.cfg
        size = head.cfg.draft_vocab_size
        room = min(cfg.widen_vocab, cfg.max_draft_vocab - size, head.cfg.target_vocab_size - size)
        if room <= 0 or self.target is None:
            return head
        counts = token_counts(fresh, head.cfg.target_vocab_size)  # [V]
        counts[head.t2d.to("cpu")] = 0
        k = min(room, int((counts >= WIDEN_MIN_COUNT).sum()))
        if k == 0:
            return head
        logger.info("draft vocabulary widened %d -> %d tokens by this round's rows", size, size + k)
        return widen_head(head, size + k, fresh, self._target_rows(self.target))

    # -- rounds ----------------------------------------------------------------------------------

    def pending_signals(self) -> list[ShardInfo]:
        """Shards appended since the last consumed one (rank 0's listing on every rank)."""
        infos = self.store.list_shards(since=self.state.last_shard_id) if self.ctx.is_main else None
        return self.ctx.broadcast(infos)

    def replay_signals(self, pending: list[ShardInfo]) -> list[ShardInfo]:
        """Already-consumed shards still in the store, newest first, up to ``replay_rows`` rows
        (rank 0's choice on every rank).

        Example: consumed shards of 300, 500 and 400 rows (oldest first), replay_rows 800 ->
        the 400- and 500-row shards (the 300-row one would exceed the budget)."""
        chosen = replay_infos(self.store, pending, self.cfg.replay_rows) if self.ctx.is_main else None
        return self.ctx.broadcast(chosen)

    def run_round(self, min_signals: int | None = None) -> RoundResult | None:
        """Train and maybe publish once, if at least ``min_signals`` (default ``cfg.min_signals``)
        new rows arrived; None otherwise (nothing consumed)."""
        need = self.cfg.min_signals if min_signals is None else min_signals
        if self.awaiting is not None:
            self.judge_served()
            if self.awaiting is not None:
                return None  # test, then train: the rows after a new version judge it before any round uses them
        infos = self.pending_signals()
        if not infos or sum(i.num_signals for i in infos) < max(1, need):
            return None
        replay = self.replay_signals(infos) if self.cfg.replay_rows else []
        read: dict[str, SignalShard] = {}
        for info in infos + replay:
            try:
                read[info.shard_id] = self.store.read(info.shard_id)
            except ShardGone:
                logger.info("shard %s was evicted before it was read", info.shard_id)
        common = set(read).intersection(*self.ctx.all_gather(set(read)))  # every rank trains on the same rows
        shards = self._with_target_topk([read[i.shard_id] for i in infos if i.shard_id in common])
        old = self._with_target_topk([read[i.shard_id] for i in replay if i.shard_id in common])
        self.state.last_shard_id = infos[-1].shard_id
        train, heldout = split_heldout(segments_by_sequence(shards, self.cfg.max_segment_len), self.cfg.heldout_frac,
                                       self.cfg.judge_min_sequences)
        fresh = list(train)  # this round's own training rows: the draft vocabulary widens by them
        # replayed rows only train (the held-out split measures the traffic of now)
        train += [seg for segs in segments_by_sequence(old, self.cfg.max_segment_len).values() for seg in segs]
        train = [s for s in train if s.num_positions >= 2]  # one position has no label at step 1
        parent = self._refresh_current()
        parent_version = self.current_version
        round_no = len(self.state.rounds) + 1
        if not train:
            logger.warning("round %d: no trainable segments in %d shards", round_no, len(infos))
            self._save_state()
            return None
        candidate = self._candidate(train, fresh)
        # fine-tuning: the lineage started from a trained head (the shipped one, published as v1 by the
        # server, or --init-from); a lineage this trainer started from a fresh head keeps --lr
        self.state.fresh_start |= self.current_version <= 0 and not self.cfg.init_from
        tuning = not self.state.fresh_start
        t0 = time.perf_counter()
        loss = self.train_head(candidate, train, seed=self.cfg.seed + round_no,
                               lr=self.cfg.finetune_lr if tuning else self.cfg.lr)
        train_time = time.perf_counter() - t0
        version: int | None = None
        base = cand = float("nan")
        verdict: dict[str, Any] = {}
        if self.ctx.is_main:
            g = self.cfg.gamma
            judged = self._judge(parent, candidate, heldout)
            base, cand, verdict = judged.base, judged.cand, judged.to_json()
            better = judged.better(self.cfg.min_gain)
            metrics = {"heldout_accept_len": cand, "baseline_accept_len": base, "gamma": g, "train_loss": loss,
                       "heldout_row_accept_len": judged.row_cand, "gain_low": judged.low,
                       "round": round_no, "parent_version": parent_version,
                       "num_train_rows": sum(s.num_positions for s in train),
                       "num_heldout_rows": sum(s.num_positions for s in heldout),
                       "world_size": self.ctx.world_size, "train_time_s": train_time}
            if better:
                version = publish(self.root, candidate, {k: v for k, v in metrics.items() if _json_number(v)})
            logger.info("round %d: %d train / %d held-out rows, loss %.3f, walked accept len %.3f -> %.3f at gamma "
                        "%d, gain %+.3f%s, %s", round_no, metrics["num_train_rows"], metrics["num_heldout_rows"], loss,
                        base, cand, g, judged.gain, gain_interval(verdict),
                        f"published v{version}" if version else "not published")
        version, base, cand, verdict = self.ctx.broadcast((version, base, cand, verdict))
        # Why carry: an unpublished round's gain (its interval reaching below 0 on a few held-out
        # requests) and its widened vocabulary were thrown away, and the next round started again
        # from the published head (docs/benchmarks/learning.md); every publication is still judged
        # against the served head
        self.carry = candidate.eval() if self.cfg.carry_unpublished and version is None and cand > base else None
        if version is not None:
            if self.cfg.served_judge_rows:
                self.awaiting = Awaiting(version, parent, parent_version, infos[-1].shard_id)
            self.current, self.current_version = candidate.eval(), version
        result = RoundResult(round_no, sum(s.num_positions for s in train), sum(s.num_positions for s in heldout),
                             base, cand, loss, train_time, version, parent_version)
        g = self.cfg.gamma
        self.state.rounds.append({
            "round": round_no, "time": time.time(), "published_version": version,
            "baseline_accept_len": finite_or_none(base), "candidate_accept_len": finite_or_none(cand),
            "alpha_train": chain_alpha(base, g), "alpha_eval": chain_alpha(cand, g), "train_loss": loss,
            "num_train_rows": result.num_train_rows, "num_heldout_rows": result.num_heldout_rows,
            "judgement": verdict,
        })
        self._save_state()
        return result

    def judge_served(self) -> dict[str, Any] | None:
        """Judge the version awaiting its served judgement, once ``served_judge_rows`` rows of at least
        ``judge_min_sequences`` sequences were captured after its round: the walked acceptance of the
        new head and of the head it replaced on the same rows (paired, so the traffic's difficulty
        cancels: ``judge``; its interval resampled over those sequences). The new one is kept unless
        it is below the replaced one by more than ``served_margin`` at the upper end of the gain's
        interval; a loser is reverted by publishing the replaced head again as the newest version.
        Returns the judgement (also in ``trainer_state.json``), or None while rows are missing.

        Example: v2 published; the next 300 captured rows give v2 1.41 and v1 1.52 at gamma 4 with
        the gain's interval [-0.17, -0.05] -> -0.05 < -0.02 x 1.52, so v1's weights are published as
        v3 (``{"reverts": 2, "restores": 1}``).
        """
        a = self.awaiting
        assert a is not None
        found = None
        if self.ctx.is_main:
            for info in self.store.list_shards(since=a.after):
                if info.shard_id not in a.read:
                    a.read.add(info.shard_id)
                    try:
                        a.shards.append(self.store.read(info.shard_id))
                    except ShardGone:
                        logger.info("shard %s was evicted before it was judged on", info.shard_id)
            rows = [s for segs in segments_by_sequence(a.shards, self.cfg.max_segment_len).values() for s in segs]
            n = sum(s.num_positions for s in rows)
            if n >= self.cfg.served_judge_rows and count_sequences(rows) >= self.cfg.judge_min_sequences:
                judged = self._judge(a.parent, self.current, rows)
                found = (n, judged.cand, judged.base, judged.worse(self.cfg.served_margin), judged.to_json())
        found = self.ctx.broadcast(found)
        if found is None:
            return None
        n, new, old, lost, verdict = found
        judgement: dict[str, Any] = {**verdict, "time": time.time(), "version": a.version,
                                     "replaced_version": a.parent_version, "judged_rows": n, "gamma": self.cfg.gamma,
                                     "accept_len": finite_or_none(new), "replaced_accept_len": finite_or_none(old),
                                     "reverted_as": None}
        if lost:
            version = None
            if self.ctx.is_main:
                version = publish(self.root, a.parent, {"reverts": a.version, "restores": a.parent_version,
                                                        "accept_len": old, "reverted_accept_len": new,
                                                        "judged_rows": n, "gamma": self.cfg.gamma})
            version = self.ctx.broadcast(version)
            self.current, self.current_version = a.parent, version
            judgement["reverted_as"] = version
        logger.info("version %d judged on %d rows captured after it: walked accept len %.3f, v%d's %.3f%s: %s",
                    a.version, n, new, a.parent_version, old, gain_interval(verdict),
                    f"reverted (v{a.parent_version} published again as v{judgement['reverted_as']})" if lost else "kept")
        self.awaiting = None
        self.state.judgements.append(judgement)
        self._save_state()
        return judgement

    def _judge(self, base: Eagle3Head, cand: Eagle3Head, rows: list[SignalSegment]) -> PairedJudgement:
        """Both heads walked over ``rows``, paired (``judge.judge_pair`` with this trainer's settings)."""
        cfg = self.cfg
        return judge_pair(base, cand, self.embed, rows, cfg.gamma, cfg.judge_block_rows, cfg.judge_confidence,
                          seed=cfg.seed)

    def _save_state(self) -> None:
        if self.ctx.is_main:
            self.state.save(self.root)

    def train_head(self, head: Eagle3Head, train: list[SignalSegment], seed: int,
                   on_step: Callable[[int, float], None] | None = None, lr: float | None = None) -> float:
        """Train ``head`` in place: AdamW training-time-test steps (``max_steps``, else ``epochs``
        passes over ``train`` but at least ``min_steps``) at peak ``lr`` (default ``cfg.lr``); under
        DDP each rank takes its slice of every global batch. Returns
        the mean loss of the last quarter of the steps. ``on_step(step, loss)`` (1-based) is called
        after every optimizer step (``bench learn`` evaluates there; it must leave the head in
        train mode)."""
        cfg, ctx = self.cfg, self.ctx
        objective = _TTTObjective(head, self.embed, cfg.ttt_steps, distill=cfg.distill, autocast=cfg.autocast)
        model: nn.Module = (DistributedDataParallel(objective, broadcast_buffers=False) if ctx.enabled
                            else objective)
        optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr if lr is None else lr, betas=(0.9, 0.95),
                                      weight_decay=cfg.weight_decay)
        per_step = cfg.batch_segments * ctx.world_size
        # rank 0's count on every rank: a shard evicted between two ranks' reads must not desync DDP
        steps = ctx.broadcast(cfg.max_steps or max(1, cfg.min_steps, math.ceil(cfg.epochs * len(train) / per_step)))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda i: lr_factor(i, steps, cfg.warmup_steps, cfg.lr_schedule))
        batches = _batches(len(train), per_step, seed)
        head.train()
        losses: list[float] = []
        bar = tqdm(range(steps), desc="train-drafter", unit="step", disable=not (cfg.progress and ctx.is_main),
                   leave=False)
        for step in bar:
            idx = next(batches)[ctx.rank * cfg.batch_segments:(ctx.rank + 1) * cfg.batch_segments]
            loss, acc = model([train[i] for i in idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{losses[-1]:.3f}", acc1=f"{acc[0]:.2f}" if acc and math.isfinite(acc[0]) else "-")
            if on_step is not None:
                on_step(step + 1, losses[-1])
        head.eval()
        if ctx.enabled:
            check_replicas_in_sync(head, ctx)
        tail = losses[-max(1, len(losses) // 4):]
        return sum(tail) / len(tail)

    def run(self, max_rounds: int | None = None, once: bool | None = None) -> list[RoundResult]:
        """Rounds until ``max_rounds`` trained rounds (0 = forever) or, with ``once``, one attempt."""
        return run_rounds(self.run_round, self.cfg, max_rounds, once, self.align)

    def align(self) -> bool:
        """One step of the LoRA path on the current head, if it is on; True if it read new signals.
        Not on a fresh random head (nothing published, no ``--init-from``): rank-r adapters on its
        attention cannot make it draft, so the first full round trains it and the adapters start
        on that version (from the newest rows: ``LoraAligner`` reads a backlog's tail only)."""
        if self.aligner is None:
            return False
        head = self._refresh_current()
        if self.current_version <= 0 and not self.cfg.init_from:
            return False
        before = self.aligner.cursor
        self.aligner.step(head, self.current_version)
        return self.aligner.cursor != before


def replay_infos(store: SignalStore, pending: list[ShardInfo], replay_rows: int) -> list[ShardInfo]:
    """Already-consumed shards still in ``store`` (not in ``pending``), newest first, up to ``replay_rows`` rows
    (``DraftTrainer.replay_signals``' example); what a round trains on beside its new rows."""
    new = {i.shard_id for i in pending}
    chosen: list[ShardInfo] = []
    rows = 0
    for info in reversed(store.list_shards()):
        if info.shard_id in new:
            continue
        if rows + info.num_signals > replay_rows:
            break
        chosen.append(info)
        rows += info.num_signals
    return chosen


def run_rounds(run_round: Callable[[int | None], RoundResult | None], cfg: TrainerConfig, max_rounds: int | None,
               once: bool | None, idle: Callable[[], bool] = lambda: False) -> list[RoundResult]:
    """A trainer's loop (EAGLE-3's, Medusa's): ``run_round`` until ``max_rounds`` trained rounds (default
    ``cfg.max_rounds``, 0 = forever) or, with ``once`` (default ``cfg.once``), one attempt on whatever
    arrived; between rounds ``idle()`` (True: it used the wait) or a ``cfg.poll_s`` sleep."""
    max_rounds = cfg.max_rounds if max_rounds is None else max_rounds
    once = cfg.once if once is None else once
    results: list[RoundResult] = []
    while True:
        result = run_round(1 if once else None)
        if result is not None:
            results.append(result)
        if once or (max_rounds and len(results) >= max_rounds):
            return results
        if result is None and not idle():
            time.sleep(cfg.poll_s)


def lr_factor(step: int, steps: int, warmup: int, schedule: str, floor: float = 0.1) -> float:
    """Multiplier of the peak learning rate at 0-based optimizer step ``step`` of ``steps``: linear
    warm-up over ``warmup`` steps, then constant or cosine decay down to ``floor``.

    Example: steps 10, warmup 2, cosine -> 0.5, 1.0, then 1.0 ... 0.1 (0.1 at step 9).
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule != "cosine":
        return 1.0
    span = max(1, steps - 1 - warmup)
    t = min(1.0, (step - warmup) / span)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def _json_number(v: Any) -> bool:
    return not isinstance(v, float) or math.isfinite(v)


def finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None


def chain_alpha(accept_len: float, gamma: int) -> float | None:
    """Acceptance rate of a gamma-chain with mean acceptance length L: (L - 1) / gamma."""
    return min(1.0, max(0.0, (accept_len - 1.0) / gamma)) if math.isfinite(accept_len) else None
