"""Online rounds for Medusa heads: the trainer child's rounds when the served drafter is ``--drafter medusa``.

Why this exists: Medusa heads learn from the same captured signals as the EAGLE-3 head, by
the same decoupled loop (``rounds.DraftTrainer``, TIDE Sec. 3.3): new rows arrive in the signal store, a
candidate is fine-tuned from the published heads, both are walked over held-out sequences as a greedy
server would draft with them, and the candidate is published only when the paired judgement
(``judge.compare``, a bootstrap over blocks and sequences) says it drafts more tokens per step; the
serving engine swaps it in between steps (``online/serving/medusa_updates.py``). Before the next round, a
published version is judged again on the rows served after it, against the heads it replaced, and
reverted if it lost there (``judge_served``, as EAGLE-3's rounds do). A Medusa head needs no
taps: each row's final hidden state (what the engine hands the drafter while serving) and the tokens
after it are its training example, so the rounds read shards captured with ``hidden``.

Rows. A shard row of sequence s at position p holds the target's final hidden state h_p, whose logits
gave the token at p + 1 (``next_token_ids[p]``). Head k (1-based) drafts, from h_p, the token at
p + 1 + k: ``next_token_ids`` of position p + k of the same run of consecutive positions (unknown past
the run's end: -1, never matched). A round trains every head on those labels (``medusa.fit_heads``).

Walk (a greedy server with chains of ``gamma`` tokens): at row p the heads draft d_1..d_gamma; the
target accepts the leading d_k equal to the labels, a tokens, and emits a + 1 (its own token after
them); the next draft starts from the row that produced the last emitted token, p + a + 1. Blocks of
``judge_block_rows`` rows are walked apart, each from its first row, and paired between two sets of
heads (``judge.HeadWalk``).

Worked example: a run of 6 rows, gamma 2; the heads' drafts match the labels for 2, 0, 1, 2, 0, 0
leading tokens at rows 0..5 -> the walk visits row 0 (2 accepted, 3 tokens), row 3 (2 accepted, 3
tokens), then row 6 is past the run: 2 steps, 6 tokens, 3.0 tokens per step.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tidespec.files import latest_version
from tidespec.models.medusa.heads import MedusaConfig, MedusaHeads, latest_published, publish_heads
from tidespec.models.target import TargetModel, output_matrix
from tidespec.online.store import ShardGone, ShardInfo, SignalShard, SignalStore
from tidespec.online.training.config import TrainerConfig
from tidespec.online.training.data import heldout_keys
from tidespec.online.training.judge import HeadWalk, PairedJudgement, compare, gain_interval
from tidespec.online.training.medusa import IGNORE, draft_vocabulary, fit_heads
from tidespec.online.training.rounds import (
    WIDEN_MIN_COUNT,
    Awaiting,
    RoundResult,
    TrainerState,
    chain_alpha,
    finite_or_none,
    replay_infos,
    run_rounds,
)

logger = logging.getLogger(__name__)
ROWS_PER_STEP = 512  # rows per optimizer step, as ``tidespec train-medusa``'s default


@dataclass
class MedusaRun:
    """One sequence's rows at consecutive positions: hidden states and each head's label."""

    seq_id: int
    hidden: torch.Tensor  # [n, H] the target's final hidden state at each position
    labels: torch.Tensor  # [n, K] int64: head k's token from row i (-1: past the run)

    @property
    def num_rows(self) -> int:
        return self.hidden.shape[0]


def medusa_runs(shards: list[SignalShard], num_heads: int, max_len: int = 0) -> dict[int, list[MedusaRun]]:
    """Per sequence, its runs of consecutive positions over the shards that carry hidden states (duplicate
    positions keep the first row), labelled for ``num_heads`` heads, cut into pieces of ``max_len`` rows
    (0: whole) after labelling, so a piece's last rows keep the labels past it.

    Example: positions 4, 5, 6, 9 of one sequence with next tokens a, b, c, d and 2 heads -> runs
    [4, 5, 6] with labels [[b, c], [c, -1], [-1, -1]] and [9] with [[-1, -1]]."""
    usable = [s for s in shards if s.hidden is not None and s.hidden.shape[0]]
    if not usable:
        return {}
    hidden = torch.cat([s.hidden for s in usable])  # type: ignore[misc]  # [R, H]
    nexts = torch.cat([s.next_token_ids for s in usable])  # [R]
    seqs = torch.cat([s.seq_ids for s in usable])  # [R]
    pos = torch.cat([s.positions for s in usable])  # [R]
    out: dict[int, list[MedusaRun]] = {}
    for sid in torch.unique(seqs).tolist():
        idx = (seqs == sid).nonzero().squeeze(1)  # [r]
        first: dict[int, int] = {}
        for i, p in zip(idx.tolist(), pos[idx].tolist()):
            first.setdefault(p, i)
        order = sorted(first)
        start = 0
        for j in range(1, len(order) + 1):
            if j < len(order) and order[j] == order[j - 1] + 1:
                continue
            rows = torch.tensor([first[p] for p in order[start:j]])  # [n] one run's rows
            run_next = torch.cat([nexts[rows], torch.full((num_heads,), -1, dtype=nexts.dtype)])  # [n + K]
            n = rows.shape[0]
            labels = torch.stack([run_next[k:k + n] for k in range(1, num_heads + 1)], dim=1)  # [n, K]
            step = max_len or n
            out.setdefault(int(sid), []).extend(
                MedusaRun(int(sid), hidden[rows[a:a + step]], labels[a:a + step]) for a in range(0, n, step))
            start = j
    return out


def accepted_per_row(heads: MedusaHeads, rows: torch.Tensor, ids: torch.Tensor, run: MedusaRun,
                     gamma: int) -> torch.Tensor:
    """[n] int64: how many of a greedy chain of ``gamma`` drafts from each row the target accepts (the
    leading drafts equal to the labels); ``rows`` [N, H] the draft vocabulary's output rows, ``ids`` [N]
    their token ids."""
    with torch.no_grad():
        states = heads(run.hidden.to(heads.dtype), gamma)  # [g, n, H]
        drafts = ids[(states @ rows.T).argmax(-1)].T  # [n, g] token ids
    match = (drafts == run.labels[:, :gamma]).long()  # [n, g]
    return match.cumprod(dim=1).sum(dim=1)


def walk_medusa(heads: MedusaHeads, rows: torch.Tensor, ids: torch.Tensor, runs: list[MedusaRun], gamma: int,
                block_rows: int = 32) -> HeadWalk:
    """``heads`` walked over ``runs`` in blocks of ``block_rows`` (module docstring), each block numbered by
    its sequence: what ``judge.compare`` pairs. The per-row score beside it counts rows whose ``gamma``
    labels are all known."""
    blocks: list[tuple[int, int]] = []
    groups: list[int] = []
    numbers: dict[int, int] = {}
    row_sum = row_count = total = 0
    for run in runs:
        acc = accepted_per_row(heads, rows, ids, run, gamma).tolist()
        known = (run.labels[:, :gamma] >= 0).all(dim=1).tolist()
        row_sum += sum(a + 1 for a, k in zip(acc, known) if k)
        row_count += sum(known)
        total += run.num_rows
        walked = walk_blocks(acc, block_rows)
        blocks += walked
        groups += [numbers.setdefault(run.seq_id, len(numbers))] * len(walked)
    return HeadWalk(total, blocks, groups, row_sum, row_count)


def walk_blocks(accepted: list[int], block_rows: int) -> list[tuple[int, int]]:
    """(steps, tokens) of a greedy server's walk over each block of ``block_rows`` rows, from its first row:
    at row p it emits ``accepted[p] + 1`` tokens and drafts next from row p + accepted[p] + 1.

    Example: accepted [2, 0, 1, 2, 0, 0], one block -> rows 0 and 3: [(2, 6)]; blocks of 3 -> [(1, 3), (1, 3)]."""
    out: list[tuple[int, int]] = []
    for lo in range(0, len(accepted), block_rows):
        hi, p, steps, tokens = min(lo + block_rows, len(accepted)), lo, 0, 0
        while p < hi:
            steps += 1
            tokens += accepted[p] + 1
            p += accepted[p] + 1
        out.append((steps, tokens))
    return out


class MedusaTrainer:
    """Watches a signal store and publishes better Medusa heads under ``cfg.publish_root`` (module
    docstring). ``target``: the served target (its LM-head rows are the heads' output layer). The
    heads train in float32 (float64 for a float64 target, as in the tests) on the CPU."""

    def __init__(self, cfg: TrainerConfig, target: TargetModel) -> None:
        self.cfg = cfg
        self.target = target
        self.dtype = torch.float64 if target.dtype == torch.float64 else torch.float32
        self.root = Path(cfg.publish_root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.store = SignalStore(cfg.signal_dir, cfg.budget_mb << 20)
        self.state = TrainerState.load(self.root)
        self.lm = output_matrix(target).detach().to(device="cpu", dtype=self.dtype)  # [V, H]
        self.current_version = -1
        self.current: MedusaHeads | None = None
        self.carry: MedusaHeads | None = None  # an unpublished candidate the next round trains on from
        self.awaiting: Awaiting[MedusaHeads] | None = None  # a published version before its served judgement
        self._refresh_current()

    def _refresh_current(self) -> MedusaHeads | None:
        """The newest valid published heads, if the version changed (None while nothing is published)."""
        if latest_version(self.root) == self.current_version:
            return self.current
        found = latest_published(self.root, self.target.cfg.hidden_size, self.target.cfg.vocab_size, self.dtype)
        if found is not None:
            self.current_version, self.current = found
            self.carry = None  # it descends from heads that are no longer current
        return self.current

    def _read(self, infos: list[ShardInfo]) -> list[SignalShard]:
        shards: list[SignalShard] = []
        for info in infos:
            try:
                shards.append(self.store.read(info.shard_id))
            except ShardGone:
                logger.info("shard %s was evicted before it was read", info.shard_id)
        return shards

    def _rows(self, heads: MedusaHeads) -> tuple[torch.Tensor, torch.Tensor]:
        """(``rows`` [N, H], ``ids`` [N]): the output rows of ``heads``' draft vocabulary, and its ids."""
        ids = torch.tensor(heads.cfg.vocab_ids, dtype=torch.int64)
        return self.lm[ids].to(heads.dtype), ids

    def _fresh(self, train: list[MedusaRun], num_heads: int) -> MedusaHeads:
        """Zero heads (each repeats the target's next token) over the training rows' most frequent tokens."""
        vocab = draft_vocabulary([(r.labels[:, 0][r.labels[:, 0] >= 0].tolist(), 0) for r in train], 8192)
        cfg = self.target.cfg
        return MedusaHeads(MedusaConfig(cfg.hidden_size, num_heads, vocab or [0], cfg.vocab_size)).to(self.dtype)

    def _widened(self, heads: MedusaHeads, fresh: list[MedusaRun]) -> MedusaHeads:
        """New heads: ``heads`` over a draft vocabulary widened by up to ``--widen-vocab`` tokens of this round's
        rows that it lacks (seen at least ``WIDEN_MIN_COUNT`` times, most frequent first; never past
        ``--max-draft-vocab``), or ``heads`` itself when nothing widens it. Why: a head never drafts a token
        outside its vocabulary (on Arabic the shipped heads' walk stayed at 1.00 tokens a step), and a Medusa
        head's output rows are the target's own LM-head rows, so a wider vocabulary needs no new weights, only
        more rows in each proposal's product. Example: 8,192 ids, 300 new tokens of which 120 occur twice or
        more -> 8,312 ids, the blocks unchanged."""
        have = set(heads.cfg.vocab_ids)
        room = min(self.cfg.widen_vocab, self.cfg.max_draft_vocab - len(have))
        if room <= 0:
            return heads
        counts = Counter(t for r in fresh for t in r.labels[:, 0].tolist() if t >= 0 and t not in have)
        new = [t for t, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if c >= WIDEN_MIN_COUNT][:room]
        if not new:
            return heads
        logger.info("Medusa draft vocabulary widened %d -> %d tokens by this round's rows", len(have), len(have) + len(new))
        wide = MedusaHeads(dataclasses.replace(heads.cfg, vocab_ids=heads.cfg.vocab_ids + new)).to(self.dtype)
        wide.load_state_dict({k: v.to(self.dtype) for k, v in heads.state_dict().items()})
        return wide

    def _judge(self, base: MedusaHeads, cand: MedusaHeads, runs: list[MedusaRun]) -> PairedJudgement:
        cfg = self.cfg
        gamma = min(cfg.gamma, base.cfg.num_heads, cand.cfg.num_heads)
        walks = [walk_medusa(h, *self._rows(h), runs, gamma, cfg.judge_block_rows) for h in (base, cand)]
        return compare(walks[0], walks[1], cfg.judge_confidence, cfg.seed)

    def run_round(self, min_signals: int | None = None) -> RoundResult | None:
        """Train and maybe publish once, if at least ``min_signals`` (default ``cfg.min_signals``) new rows
        with hidden states arrived; None otherwise (nothing consumed)."""
        cfg = self.cfg
        need = cfg.min_signals if min_signals is None else min_signals
        if self.awaiting is not None:
            self.judge_served()
            if self.awaiting is not None:
                return None  # test, then train: the rows after a new version judge it before any round uses them
        infos = self.store.list_shards(since=self.state.last_shard_id)
        if not infos or sum(i.num_signals for i in infos) < max(1, need):
            return None
        shards, old = self._read(infos), self._read(replay_infos(self.store, infos, cfg.replay_rows))
        self.state.last_shard_id = infos[-1].shard_id
        parent = self._refresh_current()
        num_heads = parent.cfg.num_heads if parent is not None else 4
        by_seq = medusa_runs(shards, num_heads, cfg.max_segment_len)
        held = heldout_keys(list(by_seq), cfg.heldout_frac, cfg.judge_min_sequences) if len(by_seq) >= 2 else set()
        train = [r for sid, runs in by_seq.items() if sid not in held for r in runs]
        heldout = [r for sid, runs in by_seq.items() if sid in held for r in runs]
        fresh = list(train)  # this round's own training rows: the draft vocabulary widens by them
        # earlier rounds' rows train too (never judge: the held-out split measures the traffic of now)
        train += [r for sid, runs in medusa_runs(old, num_heads, cfg.max_segment_len).items() if sid not in held
                  for r in runs]
        round_no = len(self.state.rounds) + 1
        if not train or not heldout:
            logger.warning("round %d: %d shards hold too few sequences with hidden states to train and judge on",
                           round_no, len(infos))
            self.state.save(self.root)
            return None
        base = parent if parent is not None else self._fresh(train, num_heads)
        # from the last unpublished candidate that gained on average (--carry-unpublished), as EAGLE-3's rounds
        start = self.carry if self.carry is not None else base
        candidate = self._widened(start, fresh)
        candidate = copy.deepcopy(start).to(self.dtype) if candidate is start else candidate
        rows, ids = self._rows(candidate)
        index = torch.full((self.target.cfg.vocab_size,), IGNORE, dtype=torch.int64)
        index[ids] = torch.arange(ids.shape[0])
        x = torch.cat([r.hidden for r in train]).to(self.dtype)  # [R, H]
        labels = torch.cat([r.labels for r in train])  # [R, K]
        y = torch.where(labels >= 0, index[labels.clamp(min=0)], IGNORE)  # [R, K] draft-vocabulary indices
        torch.manual_seed(cfg.seed + round_no)
        t0 = time.perf_counter()
        per_step = max(1, min(ROWS_PER_STEP, x.shape[0] // 8))  # a small round still takes 8 steps a pass
        epochs = max(cfg.epochs, cfg.min_steps / math.ceil(x.shape[0] / per_step))  # and --min-steps in all
        loss = fit_heads(candidate, rows, x, y, epochs, cfg.medusa_lr, per_step, progress=logger.debug)
        train_time = time.perf_counter() - t0
        judged = self._judge(base, candidate, heldout)
        num_train, num_held = x.shape[0], sum(r.num_rows for r in heldout)
        version, parent_version = None, max(self.current_version, 0)
        if judged.better(cfg.min_gain):
            version = publish_heads(self.root, candidate, {
                "round": round_no, "parent_version": parent_version, "train_loss": loss,
                "heldout_accept_len": judged.cand, "baseline_accept_len": judged.base, "num_train_rows": num_train,
                "num_heldout_rows": num_held, "train_time_s": train_time, "drafter": "medusa"})
            if cfg.served_judge_rows and parent is not None:
                self.awaiting = Awaiting(version, parent, parent_version, infos[-1].shard_id)
            self.current, self.current_version = candidate.eval(), version
        self.carry = candidate if cfg.carry_unpublished and version is None and judged.cand > judged.base else None
        logger.info("medusa round %d: %d train / %d held-out rows, loss %.3f, walked accept len %.3f -> %.3f, "
                    "gain %+.3f%s, %s", round_no, num_train, num_held, loss, judged.base, judged.cand,
                    judged.cand - judged.base, gain_interval(judged_json := judged.to_json()),
                    f"published v{version}" if version else "not published")
        gamma = min(cfg.gamma, candidate.cfg.num_heads)
        self.state.rounds.append({
            "round": round_no, "time": time.time(), "published_version": version, "drafter": "medusa",
            "baseline_accept_len": finite_or_none(judged.base), "candidate_accept_len": finite_or_none(judged.cand),
            "alpha_train": chain_alpha(judged.base, gamma), "alpha_eval": chain_alpha(judged.cand, gamma), "train_loss": loss,
            "num_train_rows": num_train, "num_heldout_rows": num_held, "judgement": judged_json})
        self.state.save(self.root)
        return RoundResult(round_no, num_train, num_held, judged.base, judged.cand, loss, train_time, version,
                           parent_version)

    def judge_served(self) -> dict[str, Any] | None:
        """Judge the version awaiting its served judgement once ``--served-judge-rows`` rows of at least
        ``--judge-min-sequences`` requests were captured after its round: both heads walked on the same rows
        (``judge.compare``); a version below the one it replaced by more than ``--served-margin`` (at the
        upper end of the gain's interval) is reverted by publishing the replaced heads again as the newest
        version, which servers swap in like any other. Returns the judgement (also in
        ``trainer_state.json``), or None while rows are missing. As ``rounds.DraftTrainer.judge_served``."""
        a, cfg = self.awaiting, self.cfg
        assert a is not None and self.current is not None
        for info in self.store.list_shards(since=a.after):
            if info.shard_id not in a.read:
                a.read.add(info.shard_id)
                a.shards += self._read([info])
        runs = [r for runs in medusa_runs(a.shards, a.parent.cfg.num_heads, cfg.max_segment_len).values()
                for r in runs]
        n = sum(r.num_rows for r in runs)
        if n < cfg.served_judge_rows or len({r.seq_id for r in runs}) < cfg.judge_min_sequences:
            return None
        judged = self._judge(a.parent, self.current, runs)
        judgement: dict[str, Any] = {**judged.to_json(), "time": time.time(), "version": a.version,
                                     "replaced_version": a.parent_version, "judged_rows": n, "drafter": "medusa",
                                     "reverted_as": None}
        if judged.worse(cfg.served_margin):
            version = publish_heads(self.root, a.parent, {"reverts": a.version, "restores": a.parent_version,
                                                          "accept_len": judged.base, "reverted_accept_len": judged.cand,
                                                          "judged_rows": n, "drafter": "medusa"})
            self.current, self.current_version = a.parent, version
            judgement["reverted_as"] = version
        logger.info("Medusa heads v%d judged on %d rows captured after them: walked accept len %.3f, v%d's %.3f%s: %s",
                    a.version, n, judged.cand, a.parent_version, judged.base, gain_interval(judgement),
                    f"reverted (v{a.parent_version} published again as v{judgement['reverted_as']})"
                    if judgement["reverted_as"] else "kept")
        self.awaiting = None
        self.state.judgements.append(judgement)
        self.state.save(self.root)
        return judgement

    def run(self, max_rounds: int | None = None, once: bool | None = None) -> list[RoundResult]:
        """Rounds until ``max_rounds`` trained rounds (0 = forever) or, with ``once``, one attempt."""
        return run_rounds(self.run_round, self.cfg, max_rounds, once)

