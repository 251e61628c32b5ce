"""``tidespec train-drafter``: the decoupled draft-trainer process of TIDE (Sec. 3.3, Algorithm 1).

Why this exists: training must never stall serving, so it runs in its own process (or on another
machine sharing the directories, or on another device, or on several ranks with DDP). It watches
the signal store the engine writes, trains an EAGLE-3 head from the captured target hidden states
when enough new signals arrived, and publishes the new head atomically only when it beats the
current one on held-out signals. The serving engine polls the publish root and swaps it in
(``tidespec.online.online.DrafterUpdater``).

One round::

    new shards since the last consumed shard id  (>= min_signals rows, else wait poll_s)
      -> rows grouped per sequence into runs of consecutive positions, cut to max_segment_len
      -> split by sequence: ~heldout_frac of the sequences held out (positions split if only one)
      -> plus up to replay_rows rows of earlier rounds' shards (newest first), training only, so a
         round on a new domain does not erase the old one
      -> candidate = current head (or, from a fresh head with a smaller draft vocab, a fresh head
         whose draft vocabulary is the most frequent tokens of the training rows)
      -> training-time-test AdamW steps (DDP over ranks: each rank takes its slice of every batch)
      -> simulated mean acceptance length of greedy gamma-chains on the held-out split, candidate
         vs current; publish(root, candidate) iff candidate > current + min_gain (rank 0 only)
      -> trainer_state.json: consumed shard id, and the round (alpha_train = current's acceptance
         rate, alpha_eval = candidate's) which the engine relays to its selective collector

Worked example: 3 sequences of 40 captured positions, heldout_frac 0.34 -> 1 sequence held out;
current (fresh) head scores 1.02, candidate 1.61 at gamma 4 -> published as v1, round
{"alpha_train": 0.005, "alpha_eval": 0.15, "published_version": 1}.

Distributed: launched by ``torchrun`` (``WORLD_SIZE`` > 1) it joins a process group (gloo on CPU,
nccl on CUDA); rank 0 lists shards and decides, the others follow its broadcasts.
"""

from __future__ import annotations

import copy
import ctypes
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from tidespec.config import opt
from tidespec.errors import ConfigError
from tidespec.models.eagle3_checkpoint import (
    PublishedDrafter,
    export_eagle3,
    fresh_head,
    head_from_published,
    import_eagle3,
    load_latest_valid,
    load_version,
    publish,
    validate_eagle3_dir,
)
from tidespec.models.eagle3_head import Eagle3Config, Eagle3Head
from tidespec.models.llama import LlamaConfig, LlamaModel
from tidespec.online.capture import CaptureBuffer
from tidespec.online.collection import CollectionConfig, SelectiveCollector
from tidespec.online.eagle3_train import (
    SignalSegment,
    evaluate,
    segments_from_rows,
    select_draft_vocab,
    ttt_loss,
)
from tidespec.online.online import (
    TRAINER_STATE_NAME,
    OnlineConfig,
    SignalCollector,
    TapCaptureDrafter,
)
from tidespec.online.store import ShardGone, ShardInfo, SignalShard, SignalStore

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class TrainerConfigError(ConfigError):
    """A trainer setting is invalid; the message is one line."""


@dataclass
class TrainerConfig:
    """Flags of ``tidespec train-drafter`` (one field = one ``--flag``)."""

    signal_dir: str = opt("", "signal store directory to watch (written by the engine or --from-workload)")
    publish_root: str = opt("", "drafter publish root (v1/, v2/, LATEST); the engine's --eagle3-dir")
    model: str | None = opt(None, "target checkpoint (HF dir or GGUF); default: embedded SmolLM2-135M-Instruct")
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = opt("float32", "target weights dtype")
    device: str = opt("cpu", "torch device for the target embedding and training (cpu, cuda, cuda:1)")
    threads: int = opt(0, "torch intra-op threads (0 = torch default)")
    draft_vocab: int = opt(0, "draft vocabulary of a fresh head, most frequent captured tokens (0 = full vocab)")
    init_from: str | None = opt(None, "exported EAGLE-3 checkpoint to start from when nothing is published")
    min_signals: int = opt(16384, "new signal rows (positions) that trigger a training round")
    heldout_frac: float = opt(0.1, "fraction of sequences held out to compare candidate and current drafter")
    epochs: float = opt(2.0, "passes over the round's training segments")
    max_steps: int = opt(0, "optimizer steps per round (0 = from --epochs)")
    batch_segments: int = opt(8, "segments per optimizer step (per rank)")
    max_segment_len: int = opt(256, "positions per training segment (longer runs are cut)")
    replay_rows: int = opt(4096, "also train on up to this many rows of earlier rounds (newest first), so a round "
                                "on a new domain does not erase the old one; 0 = new rows only")
    lr: float = opt(1e-3, "AdamW learning rate")
    ttt_steps: int = opt(3, "training-time-test unroll steps")
    gamma: int = opt(4, "draft length of the simulated-acceptance evaluation")
    min_gain: float = opt(0.0, "publish only if the mean acceptance length improves by more than this")
    poll_s: float = opt(10.0, "seconds between checks of the signal store")
    max_rounds: int = opt(0, "stop after this many training rounds (0 = run until interrupted)")
    once: bool = opt(False, "run one round on the signals available now (at least one row) and exit")
    from_workload: str | None = opt(None, "bootstrap: generate greedily from this JSONL workload, capture, train")
    workload_limit: int = opt(0, "bootstrap: first N workload records (0 = all)")
    max_tokens: int = opt(128, "bootstrap: tokens generated per prompt")
    budget_mb: int = opt(2048, "signal store byte budget in MiB (bootstrap writes; readers ignore it)")
    seed: int = opt(0, "seed of shuffling and of a fresh head's draft-vocabulary head")
    export_dir: str | None = opt(None, "at the end, write the newest published drafter to this directory as one "
                                      "EAGLE-3 checkpoint (the vLLM/SGLang layout; --bootstrap/--eagle3-dir take it)")
    export_dtype: Literal["float32", "bfloat16", "float16"] = opt("float32", "dtype of the --export-dir weights")
    backend: Literal["auto", "gloo", "nccl"] = opt("auto", "torch.distributed backend under torchrun")
    progress: bool = opt(True, "show progress bars (rank 0)")

    def __post_init__(self) -> None:
        if not self.signal_dir:
            raise TrainerConfigError("--signal-dir is required")
        if not self.publish_root:
            raise TrainerConfigError("--publish-root is required")
        for name in ("threads", "draft_vocab", "max_steps", "max_rounds", "workload_limit", "replay_rows"):
            if getattr(self, name) < 0:
                raise TrainerConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("min_signals", "batch_segments", "ttt_steps", "gamma", "max_tokens", "budget_mb"):
            if getattr(self, name) < 1:
                raise TrainerConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_segment_len < 2:
            raise TrainerConfigError(f"max_segment_len must be >= 2, got {self.max_segment_len}")
        if not 0.0 < self.heldout_frac < 1.0:
            raise TrainerConfigError(f"heldout_frac must be in (0, 1), got {self.heldout_frac}")
        if self.epochs <= 0 or self.lr <= 0 or self.poll_s <= 0:
            raise TrainerConfigError("epochs, lr and poll_s must be > 0")
        if self.min_gain < 0:
            raise TrainerConfigError(f"min_gain must be >= 0, got {self.min_gain}")


# ----------------------------------------------------------------------------------------------
# distributed context
# ----------------------------------------------------------------------------------------------


@dataclass
class DistContext:
    """This process's place in a torch.distributed group (world size 1 = no group)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @staticmethod
    def from_env(backend: str, device: str) -> DistContext:
        """Join the group ``torchrun`` describes in the environment, if any."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return DistContext()
        if backend == "auto":
            backend = "nccl" if device.startswith("cuda") else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend=backend)
        return DistContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------


def cut_segment(seg: SignalSegment, max_len: int) -> list[SignalSegment]:
    """Split a run into pieces of at most ``max_len`` positions (rope positions kept).

    Example: 5 positions from 10, max_len 2 -> (10, 11), (12, 13), (14).
    """
    out: list[SignalSegment] = []
    for a in range(0, seg.num_positions, max_len):
        b = min(a + max_len, seg.num_positions)
        out.append(SignalSegment(seg.taps[a:b], seg.token_ids[a:b + 1], None, seg.start_position + a))
    return out


def segments_by_sequence(shards: Sequence[SignalShard], max_len: int) -> dict[int, list[SignalSegment]]:
    """Rows of all shards -> per store seq id, runs of consecutive positions cut to ``max_len``.

    Duplicate (seq, position) rows keep the first one.
    """
    if not shards:
        return {}
    taps = torch.cat([s.taps for s in shards])  # [R, 3H]
    tokens = torch.cat([s.token_ids for s in shards])  # [R]
    nexts = torch.cat([s.next_token_ids for s in shards])  # [R]
    seqs = torch.cat([s.seq_ids for s in shards])  # [R]
    pos = torch.cat([s.positions for s in shards])  # [R]
    out: dict[int, list[SignalSegment]] = {}
    for sid in torch.unique(seqs).tolist():
        idx = (seqs == sid).nonzero().squeeze(1)  # [r]
        seen: set[int] = set()
        keep: list[int] = []
        for i, p in zip(idx.tolist(), pos[idx].tolist()):
            if p not in seen:
                seen.add(p)
                keep.append(i)
        k = torch.tensor(keep)
        segs = segments_from_rows(taps[k], tokens[k], nexts[k], seqs[k], pos[k])
        out[int(sid)] = [piece for seg in segs for piece in cut_segment(seg, max_len)]
    return out


def heldout_keys(keys: Sequence[int], frac: float) -> set[int]:
    """The held-out sequences of ``split_heldout``: every ``round(1/frac)``-th of the sorted keys
    (at least the last one).

    Example: keys [3, 8, 9, 12, 20], frac 0.34 -> {9} (every 3rd); frac 0.1 -> {20}.
    """
    keys = sorted(keys)
    k = max(2, round(1 / frac))
    return {keys[i] for i in range(len(keys)) if (i + 1) % k == 0} or ({keys[-1]} if keys else set())


def split_heldout(by_seq: dict[int, list[SignalSegment]], frac: float
                  ) -> tuple[list[SignalSegment], list[SignalSegment]]:
    """(train, heldout): every ``round(1/frac)``-th sequence (at least one) is held out; with a
    single sequence, the last ``frac`` of each of its runs is.

    Example: sequences [3, 8, 9, 12], frac 0.5 -> held out 8, 12.
    """
    keys = sorted(by_seq)
    if len(keys) >= 2:
        held = heldout_keys(keys, frac)
        train = [s for key in keys if key not in held for s in by_seq[key]]
        heldout = [s for key in keys if key in held for s in by_seq[key]]
        return train, heldout
    train, heldout = [], []
    for seg in (by_seq[keys[0]] if keys else []):
        cut = round(seg.num_positions * (1 - frac))
        if cut < 2 or seg.num_positions - cut < 2:
            train.append(seg)
            continue
        train.append(SignalSegment(seg.taps[:cut], seg.token_ids[:cut + 1], None, seg.start_position))
        heldout.append(SignalSegment(seg.taps[cut:], seg.token_ids[cut:], None, seg.start_position + cut))
    return train, heldout


def fresh_head_for(target_cfg: LlamaConfig, draft_vocab: int, train: Sequence[SignalSegment], dtype: torch.dtype,
                   device: torch.device | str, seed: int) -> Eagle3Head:
    """A fresh head whose draft vocabulary is the ``draft_vocab`` most frequent tokens of ``train``
    (the whole target vocabulary when ``draft_vocab`` is 0 or not smaller)."""
    vocab = target_cfg.vocab_size
    if not draft_vocab or draft_vocab >= vocab:
        return fresh_head(target_cfg, None, dtype, device, seed=seed)
    counts = torch.zeros(vocab, dtype=torch.int64)
    for seg in train:
        counts += torch.bincount(seg.token_ids, minlength=vocab)
    d2t, t2d = select_draft_vocab(counts, draft_vocab)
    head = fresh_head(target_cfg, draft_vocab, dtype, device, seed=seed)
    head.set_vocab_map(d2t.to(device), t2d.to(device))
    return head


def simulated_acceptance(head: Eagle3Head, embed: nn.Embedding, segments: list[SignalSegment], gamma: int,
                         batch: int = 32) -> float:
    """``evaluate`` over all segments in batches, weighted by each batch's qualifying rows
    (a segment of n positions has ``max(0, n - gamma)`` rows with all gamma labels). NaN if none."""
    total, weight = 0.0, 0
    usable = [s for s in segments if s.num_positions > gamma]
    for i in range(0, len(usable), batch):
        chunk = usable[i:i + batch]
        w = sum(s.num_positions - gamma for s in chunk)
        total += evaluate(head, embed, chunk, gamma) * w
        weight += w
    return total / weight if weight else float("nan")


class _TTTObjective(nn.Module):
    """The head plus its training-time-test loss as one module, so DDP can wrap it. The target's
    embedding is held outside the module tree (frozen, not broadcast, not synchronized)."""

    def __init__(self, head: Eagle3Head, embed: nn.Embedding, ttt_steps: int, step_weight_decay: float = 0.8) -> None:
        super().__init__()
        self.head = head
        self._embed = (embed,)
        self.ttt_steps = ttt_steps
        self.step_weight_decay = step_weight_decay

    def forward(self, segments: list[SignalSegment]) -> tuple[torch.Tensor, list[float]]:
        loss, acc = ttt_loss(self.head, self._embed[0], segments, self.ttt_steps, self.step_weight_decay)
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


# ----------------------------------------------------------------------------------------------
# the trainer
# ----------------------------------------------------------------------------------------------


@dataclass
class TrainerState:
    """What the trainer persists in ``publish_root/trainer_state.json``."""

    last_shard_id: str | None = None
    rounds: list[dict[str, Any]] = field(default_factory=list)

    @staticmethod
    def load(root: Path) -> TrainerState:
        try:
            doc = json.loads((root / TRAINER_STATE_NAME).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return TrainerState()
        except (OSError, json.JSONDecodeError) as exc:
            logger.warning("ignoring unreadable %s: %s", root / TRAINER_STATE_NAME, exc)
            return TrainerState()
        return TrainerState(doc.get("last_shard_id"), list(doc.get("rounds") or []))

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


class DraftTrainer:
    """Watches a signal store and publishes better EAGLE-3 heads (see the module docstring).

    ``embed`` is the target's token embedding (read-only). The head trains in float32 (float64
    for a float64 target, as in the tests) on ``cfg.device``.
    """

    def __init__(self, cfg: TrainerConfig, target_cfg: LlamaConfig, embed: nn.Embedding,
                 ctx: DistContext | None = None) -> None:
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

    # -- the current drafter ---------------------------------------------------------------------

    def _refresh_current(self) -> Eagle3Head:
        """Load the newest valid published version if it changed (rank 0 decides which)."""
        version = self.ctx.broadcast(self._newest_valid() if self.ctx.is_main else None)
        if version == self.current_version:
            return self.current
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

    def _newest_valid(self) -> int:
        pub = load_latest_valid(self.root, self.target_cfg)
        return pub.version if pub is not None else 0

    def _candidate(self, train: list[SignalSegment]) -> Eagle3Head:
        """A copy of the current head; from a fresh head with a reduced draft vocabulary, a fresh
        head whose vocabulary is the most frequent tokens of the training rows."""
        cfg = self.current.cfg
        if self.current_version > 0 or self.cfg.init_from or cfg.draft_vocab_size == cfg.target_vocab_size:
            return copy.deepcopy(self.current)
        return fresh_head_for(self.target_cfg, cfg.draft_vocab_size, train, self.dtype, self.device, self.cfg.seed)

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
        chosen: list[ShardInfo] | None = None
        if self.ctx.is_main:
            new = {i.shard_id for i in pending}
            chosen, rows = [], 0
            for info in reversed(self.store.list_shards()):
                if info.shard_id in new:
                    continue
                if rows + info.num_signals > self.cfg.replay_rows:
                    break
                chosen.append(info)
                rows += info.num_signals
        return self.ctx.broadcast(chosen)

    def run_round(self, min_signals: int | None = None) -> RoundResult | None:
        """Train and maybe publish once, if at least ``min_signals`` (default ``cfg.min_signals``)
        new rows arrived; None otherwise (nothing consumed)."""
        need = self.cfg.min_signals if min_signals is None else min_signals
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
        shards = [read[i.shard_id] for i in infos if i.shard_id in common]
        old = [read[i.shard_id] for i in replay if i.shard_id in common]
        self.state.last_shard_id = infos[-1].shard_id
        train, heldout = split_heldout(segments_by_sequence(shards, self.cfg.max_segment_len), self.cfg.heldout_frac)
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
        candidate = self._candidate(train)
        t0 = time.perf_counter()
        loss = self.train_head(candidate, train, seed=self.cfg.seed + round_no)
        train_time = time.perf_counter() - t0
        version: int | None = None
        base = cand = float("nan")
        if self.ctx.is_main:
            g = self.cfg.gamma
            base = simulated_acceptance(parent, self.embed, heldout, g)
            cand = simulated_acceptance(candidate, self.embed, heldout, g)
            better = math.isfinite(cand) and (not math.isfinite(base) or cand > base + self.cfg.min_gain)
            metrics = {"heldout_accept_len": cand, "baseline_accept_len": base, "gamma": g, "train_loss": loss,
                       "round": round_no, "parent_version": parent_version,
                       "num_train_rows": sum(s.num_positions for s in train),
                       "num_heldout_rows": sum(s.num_positions for s in heldout),
                       "world_size": self.ctx.world_size, "train_time_s": train_time}
            if better:
                version = publish(self.root, candidate, {k: v for k, v in metrics.items() if _json_number(v)})
            logger.info("round %d: %d train / %d held-out rows, loss %.3f, accept len %.3f -> %.3f at gamma %d, %s",
                        round_no, metrics["num_train_rows"], metrics["num_heldout_rows"], loss, base, cand, g,
                        f"published v{version}" if version else "not published")
        version, base, cand = self.ctx.broadcast((version, base, cand))
        if version is not None:
            self.current, self.current_version = candidate.eval(), version
        result = RoundResult(round_no, sum(s.num_positions for s in train), sum(s.num_positions for s in heldout),
                             base, cand, loss, train_time, version, parent_version)
        g = self.cfg.gamma
        self.state.rounds.append({
            "round": round_no, "time": time.time(), "published_version": version,
            "baseline_accept_len": _finite_or_none(base), "candidate_accept_len": _finite_or_none(cand),
            "alpha_train": _alpha(base, g), "alpha_eval": _alpha(cand, g), "train_loss": loss,
            "num_train_rows": result.num_train_rows, "num_heldout_rows": result.num_heldout_rows,
        })
        self._save_state()
        return result

    def _save_state(self) -> None:
        if self.ctx.is_main:
            self.state.save(self.root)

    def train_head(self, head: Eagle3Head, train: list[SignalSegment], seed: int,
                   on_step: Callable[[int, float], None] | None = None) -> float:
        """Train ``head`` in place: AdamW training-time-test steps (``max_steps``, else ``epochs``
        passes over ``train``); under DDP each rank takes its slice of every global batch. Returns
        the mean loss of the last quarter of the steps. ``on_step(step, loss)`` (1-based) is called
        after every optimizer step (``bench learn`` evaluates there; it must leave the head in
        train mode)."""
        cfg, ctx = self.cfg, self.ctx
        objective = _TTTObjective(head, self.embed, cfg.ttt_steps)
        model: nn.Module = (DistributedDataParallel(objective, broadcast_buffers=False) if ctx.enabled
                            else objective)
        optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        per_step = cfg.batch_segments * ctx.world_size
        # rank 0's count on every rank: a shard evicted between two ranks' reads must not desync DDP
        steps = ctx.broadcast(cfg.max_steps or max(1, math.ceil(cfg.epochs * len(train) / per_step)))
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
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{losses[-1]:.3f}", acc1=f"{acc[0]:.2f}" if acc and math.isfinite(acc[0]) else "-")
            if on_step is not None:
                on_step(step + 1, losses[-1])
        head.eval()
        if ctx.enabled:
            _check_replicas_in_sync(head, ctx)
        tail = losses[-max(1, len(losses) // 4):]
        return sum(tail) / len(tail)

    def run(self, max_rounds: int | None = None, once: bool | None = None) -> list[RoundResult]:
        """Rounds until ``max_rounds`` trained rounds (0 = forever) or, with ``once``, one attempt."""
        max_rounds = self.cfg.max_rounds if max_rounds is None else max_rounds
        once = self.cfg.once if once is None else once
        results: list[RoundResult] = []
        while True:
            result = self.run_round(min_signals=1 if once else None)
            if result is not None:
                results.append(result)
            if once or (max_rounds and len(results) >= max_rounds):
                return results
            if result is None:
                time.sleep(self.cfg.poll_s)


def _check_replicas_in_sync(head: Eagle3Head, ctx: DistContext) -> None:
    """DDP keeps every rank's weights identical; a mismatch means ranks trained apart (a bug)."""
    local = torch.stack([p.detach().double().sum() for p in head.parameters()])  # [P] on the head's device
    gathered = [torch.zeros_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, local)
    if any(not torch.allclose(g, gathered[0], rtol=1e-6, atol=1e-9) for g in gathered[1:]):
        raise RuntimeError("DDP replicas diverged: rank weights differ after training")


def _json_number(v: Any) -> bool:
    return not isinstance(v, float) or math.isfinite(v)


def _finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _alpha(accept_len: float, gamma: int) -> float | None:
    """Acceptance rate of a gamma-chain with mean acceptance length L: (L - 1) / gamma."""
    return min(1.0, max(0.0, (accept_len - 1.0) / gamma)) if math.isfinite(accept_len) else None


# ----------------------------------------------------------------------------------------------
# offline bootstrap
# ----------------------------------------------------------------------------------------------


def capture_from_workload(model: LlamaModel, tokenizer: Any, workload: str, signal_dir: str | Path, *,
                          max_tokens: int = 128, limit: int = 0, budget_bytes: int = 2 << 30,
                          max_num_seqs: int = 8, progress: bool = True) -> dict[str, int]:
    """Greedy-generate every workload prompt with the target, capturing the taps of every final
    position into the store at ``signal_dir``. Returns the capture counters."""
    from tidespec.config import CacheConfig, EngineConfig, SpecConfig
    from tidespec.engine.engine import LLMEngine, RequestError
    from tidespec.sampling import SamplingParams
    from tidespec.workloads.loader import load_prompts

    prompts = load_prompts(workload, tokenizer, limit or None)
    taps = Eagle3Config.for_target(model.cfg).tap_layers
    longest = max(len(p.token_ids) for p in prompts) + max_tokens + 1
    max_len = max(8, min(model.cfg.max_position_embeddings, longest))
    config = EngineConfig(cache=CacheConfig(max_model_len=max_len, max_num_seqs=max_num_seqs),
                          spec=SpecConfig(num_speculative_tokens=0))
    engine = LLMEngine(model, tokenizer, config, drafter=TapCaptureDrafter(taps))
    store = SignalStore(signal_dir, budget_bytes)
    capacity = max(4096, 4 * max_num_seqs * max_len)
    capture = CaptureBuffer(store, capacity, min(2048, capacity), taps_dim=len(taps) * model.cfg.hidden_size)
    collector = SignalCollector(engine, capture, SelectiveCollector(CollectionConfig(force=True)))
    engine.observation_consumers.append(collector)
    params = SamplingParams(max_tokens=max_tokens)
    added = 0
    for p in prompts:
        try:
            engine.add_request(p.token_ids, params, label=p.record.domain)
            added += 1
        except RequestError as exc:
            logger.warning("skipping workload record %s: %s", p.record.id, exc)
    with tqdm(total=added, desc="bootstrap generate", unit="req", disable=not progress, leave=False) as bar:
        while engine.has_unfinished_requests():
            bar.update(sum(1 for o in engine.step() if o.finished))
    capture.close()
    stats = capture.stats()
    logger.info("bootstrap: %d prompts, %d rows captured, %d dropped", added, stats["num_captured"],
                stats["num_dropped"])
    return stats


# ----------------------------------------------------------------------------------------------
# entry points
# ----------------------------------------------------------------------------------------------


def train_drafter(cfg: TrainerConfig) -> list[RoundResult]:
    """``tidespec train-drafter``: join torchrun's group if any, load the target, (bootstrap,) train."""
    from tidespec.models.loader import load_model

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ctx = DistContext.from_env(cfg.backend, cfg.device)
    try:
        device = cfg.device
        if ctx.enabled and device == "cuda":
            device = f"cuda:{ctx.local_rank}"
        loaded = load_model(cfg.model, dtype=DTYPES[cfg.dtype], device=device)
        if cfg.from_workload:
            if ctx.is_main:
                capture_from_workload(loaded.model, loaded.tokenizer, cfg.from_workload, cfg.signal_dir,
                                      max_tokens=cfg.max_tokens, limit=cfg.workload_limit,
                                      budget_bytes=cfg.budget_mb << 20, progress=cfg.progress)
            ctx.barrier()
        run_cfg = TrainerConfig(**{**asdict(cfg), "device": device})
        trainer = DraftTrainer(run_cfg, loaded.config, loaded.model.embed_tokens, ctx)
        if cfg.from_workload:  # the bootstrap signals form one round now, whatever their count
            first = trainer.run_round(min_signals=1)
            results = [first] if first is not None else []
            if not (cfg.once or (cfg.max_rounds and len(results) >= cfg.max_rounds)):
                results += trainer.run(max_rounds=cfg.max_rounds - len(results) if cfg.max_rounds else 0)
        else:
            results = trainer.run()
        if cfg.export_dir and ctx.is_main:
            export_latest(cfg.publish_root, cfg.export_dir, loaded.config, DTYPES[cfg.export_dtype])
        return results
    finally:
        ctx.close()


def export_latest(root: str | Path, directory: str | Path, target_cfg: LlamaConfig, dtype: torch.dtype) -> int:
    """Write the newest valid published version under ``root`` as one exported checkpoint in
    ``dtype`` (a bfloat16 copy halves the size; the engine casts to the target's dtype on load).
    Returns the version exported; ``TrainerConfigError`` when nothing valid is published."""
    pub = load_latest_valid(root, target_cfg)
    if pub is None:
        raise TrainerConfigError(f"nothing valid is published under {root}; nothing to export")
    export_eagle3(head_from_published(pub, dtype, "cpu"), directory)
    logger.info("exported drafter version %d from %s to %s (%s)", pub.version, root, directory, dtype)
    return pub.version


def start_trainer_process(online: OnlineConfig, model: str | None, dtype: str = "float32", device: str = "cpu",
                          draft_vocab: int = 0, extra_args: Sequence[str] = (),
                          log_path: Path | str | None = None, nice: int = 0) -> subprocess.Popen[bytes]:
    """Start ``train-drafter`` as a child process watching ``online``'s store and publish root.

    ``device``: where it trains (another GPU keeps training off the serving device). ``nice``:
    added to the child's niceness, so on a CPU shared with serving the scheduler runs the
    engine's threads first and training takes what serving leaves (0 keeps the parent's; Linux's
    scheduler weighs a nice-10 thread at about a tenth of a nice-0 one).
    ``draft_vocab`` must equal the engine's fresh-head draft vocabulary. Output goes to
    ``log_path`` (default: ``<publish_root>/trainer.log``). Stop it with ``terminate()``.
    """
    cmd = [sys.executable, "-m", "tidespec.online.cli", "train-drafter",
           "--signal-dir", online.signal_dir, "--publish-root", online.publish_root,
           "--min-signals", str(online.collection.n_threshold), "--dtype", dtype, "--device", device,
           "--draft-vocab", str(draft_vocab), "--budget-mb", str(max(1, online.signal_budget_bytes >> 20)),
           "--no-progress"]
    if model:
        cmd += ["--model", model]
    cmd += list(extra_args)
    log = Path(log_path) if log_path is not None else Path(online.publish_root) / "trainer.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_child_setup(nice))


def _child_setup(nice: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` for the trainer child: raise its niceness by ``nice`` and, on Linux, ask
    the kernel to SIGTERM it when its parent dies, so a serving process that is killed (SIGKILL,
    a crash) never leaves its trainer running. ``prctl`` has no wrapper in the standard library;
    libc's is looked up here, before the fork, so the child only makes the one foreign call."""
    if nice < 0:
        raise TrainerConfigError(f"nice must be >= 0 (an unprivileged process cannot lower it), got {nice}")
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
    if prctl is None and nice == 0:
        return None

    def setup() -> None:
        if nice:
            os.nice(nice)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return setup
