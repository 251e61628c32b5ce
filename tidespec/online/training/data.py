"""A round's data: per-sequence segments, the held-out split, fresh heads, simulated acceptance.

Why this exists: these steps are pure functions of signal shards and heads (no store, process or
group), shared by ``trainer.rounds.DraftTrainer`` and by the benchmarks that replay a round offline
(``tidespec bench learn`` / ``bench shift``), so both cut, split and score signals the same way.

Signal rows are cut into runs of consecutive positions per sequence, split by sequence into
training and held-out segments; a fresh head takes its draft vocabulary from the training rows,
and the simulated acceptance on the held-out split decides whether a candidate is published.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from tidespec.models.eagle3.checkpoint import fresh_head
from tidespec.models.eagle3.head import Eagle3Head
from tidespec.models.target import TargetConfig
from tidespec.online.store import SignalShard
from tidespec.online.training.eagle3_train import (
    Eagle3TrainError,
    SignalSegment,
    acceptance_stats,
    segments_from_rows,
    select_draft_vocab,
)


def cut_segment(seg: SignalSegment, max_len: int) -> list[SignalSegment]:
    """Split a run into pieces of at most ``max_len`` positions (rope positions kept).

    Example: 5 positions from 10, max_len 2 -> (10, 11), (12, 13), (14).
    """
    return [seg.slice(a, min(a + max_len, seg.num_positions)) for a in range(0, seg.num_positions, max_len)]


def segments_by_sequence(shards: Sequence[SignalShard], max_len: int) -> dict[int, list[SignalSegment]]:
    """Rows of all shards -> per store seq id, runs of consecutive positions cut to ``max_len``.

    Duplicate (seq, position) rows keep the first one. The target's top-k rows come along when
    every shard has them with one K (a teacher-pass store, ``trainer.distill``); else none do.
    """
    if not shards:
        return {}
    taps = torch.cat([s.taps for s in shards])  # [R, 3H]
    tokens = torch.cat([s.token_ids for s in shards])  # [R]
    nexts = torch.cat([s.next_token_ids for s in shards])  # [R]
    seqs = torch.cat([s.seq_ids for s in shards])  # [R]
    pos = torch.cat([s.positions for s in shards])  # [R]
    ks = {int(s.topk_ids.shape[1]) if s.topk_ids is not None else 0 for s in shards}
    top_ids = torch.cat([s.topk_ids for s in shards]) if 0 not in ks and len(ks) == 1 else None  # [R, K]
    top_logits = torch.cat([s.topk_logits for s in shards]) if top_ids is not None else None  # [R, K]
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
        top = (top_ids[k], top_logits[k]) if top_ids is not None and top_logits is not None else (None, None)
        segs = segments_from_rows(taps[k], tokens[k], nexts[k], seqs[k], pos[k], *top)
        out[int(sid)] = [piece for seg in segs for piece in cut_segment(seg, max_len)]
    return out


def heldout_keys(keys: Sequence[int], frac: float, min_keys: int = 1) -> set[int]:
    """The held-out sequences of ``split_heldout``: every ``round(1/frac)``-th of the sorted keys
    (at least the last one) or, when that is fewer than ``min_keys``, ``min_keys`` of them evenly
    spread (never more than half of the keys).

    Example: keys [3, 8, 9, 12, 20], frac 0.34 -> {9} (every 3rd); frac 0.1 -> {20}; frac 0.1
    and min_keys 2 -> {8, 20}; min_keys 4 -> {8, 20} too (half of five keys).
    """
    keys = sorted(keys)
    k = max(2, round(1 / frac))
    held = {keys[i] for i in range(len(keys)) if (i + 1) % k == 0} or ({keys[-1]} if keys else set())
    want = min(min_keys, len(keys) // 2)
    if len(held) >= want:
        return held
    return {keys[(j + 1) * len(keys) // want - 1] for j in range(want)}


def split_heldout(by_seq: dict[int, list[SignalSegment]], frac: float, min_sequences: int = 1
                  ) -> tuple[list[SignalSegment], list[SignalSegment]]:
    """(train, heldout): every ``round(1/frac)``-th sequence (at least one, and at least
    ``min_sequences`` up to half of them: ``heldout_keys``) is held out; with a single sequence, the
    last ``frac`` of each of its runs is.

    Example: sequences [3, 8, 9, 12], frac 0.5 -> held out 8, 12.
    """
    keys = sorted(by_seq)
    if len(keys) >= 2:
        held = heldout_keys(keys, frac, min_sequences)
        train = [s for key in keys if key not in held for s in by_seq[key]]
        heldout = [s for key in keys if key in held for s in by_seq[key]]
        return train, heldout
    train, heldout = [], []
    for seg in (by_seq[keys[0]] if keys else []):
        cut = round(seg.num_positions * (1 - frac))
        if cut < 2 or seg.num_positions - cut < 2:
            train.append(seg)
            continue
        train.append(seg.slice(0, cut))
        heldout.append(seg.slice(cut, seg.num_positions))
    return train, heldout


def fresh_head_for(target_cfg: TargetConfig, draft_vocab: int, train: Sequence[SignalSegment], dtype: torch.dtype,
                   device: torch.device | str, seed: int, num_layers: int = 1, fusion: str = "concat") -> Eagle3Head:
    """A fresh head of ``num_layers`` layers and ``fusion`` whose draft vocabulary is the
    ``draft_vocab`` most frequent tokens of ``train`` (the whole target vocabulary when
    ``draft_vocab`` is 0 or not smaller)."""
    vocab = target_cfg.vocab_size
    if not draft_vocab or draft_vocab >= vocab:
        return fresh_head(target_cfg, None, dtype, device, seed=seed, num_layers=num_layers, fusion=fusion)
    d2t, t2d = select_draft_vocab(token_counts(train, vocab), draft_vocab)
    head = fresh_head(target_cfg, draft_vocab, dtype, device, seed=seed, num_layers=num_layers, fusion=fusion)
    head.set_vocab_map(d2t.to(device), t2d.to(device))
    return head


def token_counts(segments: Sequence[SignalSegment], vocab: int) -> torch.Tensor:
    """[vocab] int64: how often each target id is a row's token over ``segments``."""
    counts = torch.zeros(vocab, dtype=torch.int64)
    for seg in segments:
        counts += torch.bincount(seg.token_ids, minlength=vocab)
    return counts


@torch.no_grad()
def widen_head(head: Eagle3Head, draft_vocab: int, train: Sequence[SignalSegment],
               target_lm_head: torch.Tensor) -> Eagle3Head:
    """A copy of a trained ``head`` whose draft vocabulary grows to ``draft_vocab``: its own tokens
    plus the most frequent others of ``train``. Layers, norm and the old rows are kept; a new
    token's row is ``head.output_rows`` of it (the target's LM-head row [V, H] carried into the
    head's output space by the fitted row map), so training starts from calibrated rows rather
    than random ones. Why: a pruned head can never propose a token outside its vocabulary (11-14 %
    of chat answer tokens for the shipped 8,192-token head, docs/benchmarks/drafters.md), and
    retraining a wider head from scratch costs the whole recipe again.

    Example: own tokens {3, 7}, counts of train [0, 9, 0, 1, 0, 5, 0, 0], draft_vocab 3 -> vocabulary
    {1, 3, 7} (1 is the most frequent id not yet in it); rows of 3 and 7 unchanged.
    """
    n, v = draft_vocab, head.cfg.target_vocab_size
    if not head.cfg.draft_vocab_size <= n <= v:
        raise Eagle3TrainError(f"a head of {head.cfg.draft_vocab_size} draft tokens cannot be widened to {n} "
                               f"(target vocabulary {v})")
    own = head.t2d.to("cpu")  # [V] bool
    score = token_counts(train, v).double()
    score[own] = float("inf")  # keep every own token first; then by count, ties to the lower id
    d2t, t2d = select_draft_vocab(score, n)
    ids = d2t + torch.arange(n)  # [n] ascending target ids
    w = head.lm_head.weight
    wide = Eagle3Head(dataclasses.replace(head.cfg, draft_vocab_size=n)).to(device=w.device, dtype=w.dtype)
    state = {k: t for k, t in head.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    wide.load_state_dict(state, strict=False)
    wide.set_vocab_map(d2t.to(w.device), t2d.to(w.device))
    wide.lm_head.weight.copy_(head.output_rows(ids, target_lm_head.detach().to(w.device, torch.float32)).to(w.dtype))
    return wide.train(head.training)


@torch.no_grad()
def deepen_head(head: Eagle3Head, num_layers: int, target_layers: Sequence[nn.Module]) -> Eagle3Head:
    """A copy of a trained ``head`` with ``num_layers`` decoder layers that computes exactly what
    ``head`` computes: its layers are kept, each new block is one of the target's last layers
    (``target_layers``, the target's ``DecoderLayer`` list) with its attention output and MLP down
    projections zeroed, so the block adds nothing to its residual until training moves them (the
    zero-initialised residual of ReZero / LoRA's B). Why: a deeper head accepts more (docs/benchmarks/drafters.md:
    depth 4 served 1.86 against 1.79 on code) but retraining one from scratch costs the whole recipe.

    Example: a 1-layer head deepened to 2 -> blocks.0 = the target's last layer with o_proj and
    down_proj all zero; every output of the new head equals the old head's at the start.
    """
    if not head.cfg.num_layers < num_layers <= len(target_layers):
        raise Eagle3TrainError(f"a head of {head.cfg.num_layers} layer(s) cannot be deepened to {num_layers} "
                               f"(the target has {len(target_layers)})")
    w = head.lm_head.weight
    deep = Eagle3Head(dataclasses.replace(head.cfg, num_layers=num_layers)).to(device=w.device, dtype=w.dtype)
    deep.load_state_dict(head.state_dict(), strict=False)  # blocks past the old depth stay to be filled
    new = list(deep.blocks)[head.cfg.num_layers - 1:]
    for block, source in zip(new, list(target_layers)[-len(new):]):
        block.load_state_dict({k: t.to(w) for k, t in source.state_dict().items()})
        block.self_attn.o_proj.weight.zero_()
        block.mlp.down_proj.weight.zero_()
    return deep.train(head.training)


def simulated_acceptance(head: Eagle3Head, embed: nn.Embedding, segments: list[SignalSegment], gamma: int,
                         batch: int = 32) -> float:
    """``evaluate`` over all segments in batches, weighted by each batch's qualifying rows
    (a segment of n positions has ``max(0, n - gamma)`` rows with all gamma labels). NaN if none."""
    return heldout_acceptance(head, embed, segments, gamma, batch)[0]


def heldout_acceptance(head: Eagle3Head, embed: nn.Embedding, segments: list[SignalSegment], gamma: int,
                       batch: int = 32) -> tuple[float, float]:
    """(``simulated_acceptance``, the served estimate: walked tokens per step, ``acceptance_stats``, over every
    segment) from one unroll per batch of segments. NaN where nothing qualifies."""
    total, weight = 0.0, 0
    steps = tokens = 0
    usable = [s for s in segments if s.num_positions > gamma]
    for i in range(0, len(usable), batch):
        chunk = usable[i:i + batch]
        w = sum(s.num_positions - gamma for s in chunk)
        stats = acceptance_stats(head, embed, chunk, gamma)
        total += stats.row_mean * w
        weight += w
        steps += stats.walk_steps
        tokens += stats.walk_tokens
    return (total / weight if weight else float("nan")), (tokens / steps if steps else float("nan"))
