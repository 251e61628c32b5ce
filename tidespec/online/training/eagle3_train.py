"""Training an EAGLE-3 head from captured target signals: training-time-test loss, AdamW, evaluation.

Why this exists: TIDE (Sec. 3.3) fine-tunes the drafter from hidden states the serving engine
already produced, without re-running the target. A signal segment is one run of consecutive
positions of one sequence: the target's taps there, the tokens, and (optionally) the target's own
next-token choices, which are the labels.

Training-time test (EAGLE-3): the head is unrolled ``ttt_steps`` times over every position of a
segment at once. Step 1 reads ``fc(taps)``; step s >= 2 reads the head's own pre-norm output of
step s-1 at the same row, with the token one further along, at rope position ``row + s - 1``.
Attention of step s at row j: causal over step 1's keys (rows <= j, the real context) plus the
row's own keys of steps 2..s (the speculative chain) — the keys the inference drafter sees when
it drafts s tokens after position j (``ttt_step``). Inputs are ground-truth tokens
(teacher forcing); gradients flow through the unroll (every layer of a deeper head takes the
same mask). The loss of step s is cross-entropy over the draft vocabulary, weighted
``step_weight_decay ** (s - 1)``, against the token that followed, or, when the segments carry
the target's top-k logits (a teacher pass, ``trainer.distill``), against the target's top-k
distribution renormalised over the draft vocabulary (EAGLE-3 trains on the target's distribution)
or its top-1; labels outside the draft vocabulary are ignored.

Indexing for a segment of N positions (``token_ids`` [N+1], ``token_ids[i]`` at position i):
step s at row j inputs token ``token_ids[j+s]`` and predicts ``token_ids[j+s+1]`` (or
``target_next_ids[j+s]``). Example N=4, s=2: rows 0..2 input tokens 2..4; labels exist for
rows 0..1 (tokens 3, 4) from ``token_ids`` alone, or rows 0..2 with ``target_next_ids``.

Evaluation (``evaluate``) simulates greedy chain drafting of ``gamma`` tokens from every row
whose labels are all known and counts how many match the target's actual continuation:
acceptance length = accepted + 1 (the bonus token). With top-k rows, a row counts only where the
continuation is the target's greedy one (sampled continuations are training contexts, not labels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tidespec.errors import UserError
from tidespec.models.eagle3.head import Eagle3Head
from tidespec.models.families.rope import rotate_half


@dataclass
class TTTCache:
    """K/V of earlier training-time-test steps: ``k[layer][s]`` holds step s's ``[B, N, n_kv, hd]``."""

    k: list[list[torch.Tensor]] = field(default_factory=list)
    v: list[list[torch.Tensor]] = field(default_factory=list)


def ttt_step(head: Eagle3Head, fused: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
             cache: TTTCache) -> tuple[torch.Tensor, torch.Tensor]:
    """One training-time-test step over B padded segments of N rows, differentiable, no KV slots.

    fused, embeds: [B, N, H]; positions: [B, N] rope positions of this step (row start + j + s).
    Step s (0-based, the number of steps already in ``cache``) at row j stands for drafting step
    s+1 started after real position j: in every layer of the head the query attends causally to
    step 0's keys at rows <= j and to its own row's keys of steps 1..s (the speculative chain),
    exactly the keys the inference path sees when drafting from position j. Padding rows must come
    last in each segment (causality keeps real rows from seeing them). Returns (pre-norm
    [B, N, H], logits [B, N, draft_vocab]).

    Example mask for N=3, step s=2 (columns: step-0 rows 0..2, then steps 1, 2 diagonal)::

        row 0: [1 0 0 | 1 | 1]
        row 1: [1 1 0 | 1 | 1]
        row 2: [1 1 1 | 1 | 1]
    """
    if not cache.k:
        cache.k = [[] for _ in range(head.cfg.num_layers)]
        cache.v = [[] for _ in range(head.cfg.num_layers)]
    layer = head.midlayer
    cos, sin = head.rope(positions, fused.dtype)  # [B, N, hd]
    rope = (cos.unsqueeze(-2), sin.unsqueeze(-2))  # [B, N, 1, hd] each
    x, residual = layer.attn_input(fused, embeds)  # [B, N, 2H] or [B, N, H]; [B, N, H]
    h = layer.finish(residual, _ttt_attention(layer.self_attn, x, rope, cache.k[0], cache.v[0]))
    for i, block in enumerate(head.blocks, start=1):
        h = h + _ttt_attention(block.self_attn, block.input_layernorm(h), rope, cache.k[i], cache.v[i])
        h = h + block.mlp(block.post_attention_layernorm(h))
    return h, head.logits(h)


def _ttt_attention(attn: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """One layer's training-time-test attention (``ttt_step``'s mask); appends this step's K/V to
    ``ks`` / ``vs``. x: [B, N, in] -> o_proj output [B, N, H]."""
    b, n = x.shape[0], x.shape[1]
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(b, n, attn.n_h, attn.hd)
    k = k.view(b, n, attn.n_kv, attn.hd)
    v = v.view(b, n, attn.n_kv, attn.hd)
    c, s = rope
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    ks.append(k)
    vs.append(v)
    rep = attn.n_h // attn.n_kv
    kr = [t.repeat_interleave(rep, dim=2) for t in ks]  # each [B, N, n_h, hd]
    vr = [t.repeat_interleave(rep, dim=2) for t in vs]
    scale = 1.0 / math.sqrt(attn.hd)
    causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()  # [N, N]
    first = torch.einsum("bihd,bjhd->bhij", q, kr[0]) * scale  # [B, n_h, N, N]
    first = first.masked_fill(~causal, float("-inf"))
    diag = [torch.einsum("bihd,bihd->bhi", q, kk).unsqueeze(-1) * scale for kk in kr[1:]]  # [B, n_h, N, 1] each
    probs = torch.softmax(torch.cat([first, *diag], dim=-1), dim=-1)  # [B, n_h, N, N + s]
    out = torch.einsum("bhij,bjhd->bihd", probs[..., :n], vr[0])  # [B, N, n_h, hd]
    for m, vv in enumerate(vr[1:]):
        out = out + probs[..., n + m].transpose(1, 2).unsqueeze(-1) * vv
    return attn.o_proj(out.reshape(b, n, attn.q_size))


class Eagle3TrainError(UserError, ValueError):
    """Bad training input or configuration (one line)."""


@dataclass
class SignalSegment:
    """Consecutive positions ``start_position .. start_position+N-1`` of one sequence.

    With ``topk_ids`` / ``topk_logits`` (the target's top-k logits at each position, from a teacher
    pass: ``trainer.distill``) the head is distilled from the target's distribution, and evaluation
    counts a row only where the sequence continued with the target's greedy token.
    """

    taps: torch.Tensor  # [N, 3H] target taps at those positions
    token_ids: torch.Tensor  # [N+1] int64: token at each position, then the token that followed
    target_next_ids: torch.Tensor | None = None  # [N] int64 target's own next token at each position
    start_position: int = 0
    topk_ids: torch.Tensor | None = None  # [N, K] int64 target's top-k next-token ids at each position
    topk_logits: torch.Tensor | None = None  # [N, K] float32 their logits
    seq_id: int | None = None  # the store's sequence id (a judgement's samples are whole sequences: ``judge``)

    def __post_init__(self) -> None:
        n = self.taps.shape[0]
        if self.taps.dim() != 2 or n < 1:
            raise Eagle3TrainError(f"taps must be [N>=1, 3H], got {tuple(self.taps.shape)}")
        if tuple(self.token_ids.shape) != (n + 1,):
            raise Eagle3TrainError(f"token_ids must have shape ({n + 1},), got {tuple(self.token_ids.shape)}")
        if self.target_next_ids is not None and tuple(self.target_next_ids.shape) != (n,):
            raise Eagle3TrainError(f"target_next_ids must have shape ({n},), got {tuple(self.target_next_ids.shape)}")
        if self.start_position < 0:
            raise Eagle3TrainError(f"start_position must be >= 0, got {self.start_position}")
        if (self.topk_ids is None) != (self.topk_logits is None):
            raise Eagle3TrainError("topk_ids and topk_logits must be given together")
        if self.topk_ids is not None and self.topk_logits is not None:
            if self.topk_ids.dim() != 2 or self.topk_ids.shape[0] != n or self.topk_ids.shape != self.topk_logits.shape:
                raise Eagle3TrainError(f"topk_ids/topk_logits must both be [{n}, K]")

    @property
    def num_positions(self) -> int:
        return int(self.taps.shape[0])

    def slice(self, a: int, b: int) -> SignalSegment:
        """Positions ``a .. b-1`` as a segment of their own (rope positions kept)."""
        top = lambda t: t[a:b] if t is not None else None  # noqa: E731
        return SignalSegment(self.taps[a:b], self.token_ids[a:b + 1], top(self.target_next_ids),
                             self.start_position + a, top(self.topk_ids), top(self.topk_logits), self.seq_id)

    def labels(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Target-vocab labels [N] for unroll step ``step`` (1-based) and a validity mask [N].

        With top-k rows, a label is valid only where the token that followed is the target's
        greedy choice (``topk_ids[:, 0]``): a greedy chain drafted there is judged on the context
        greedy decoding would have produced.
        """
        n = self.num_positions
        rows = torch.arange(n)
        if self.target_next_ids is not None:
            idx = rows + step  # target's choice after the input token at position j + step
            valid = idx <= n - 1
            return self.target_next_ids[idx.clamp(max=n - 1)], valid
        idx = rows + step + 1
        valid = idx <= n
        labels = self.token_ids[idx.clamp(max=n)]
        if self.topk_ids is not None:
            valid = valid & (self.topk_ids[(idx - 1).clamp(max=n - 1), 0] == labels)
        return labels, valid

    def soft_labels(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The target's top-k at the position unroll step ``step`` predicts: ids [N, K], logits
        [N, K] and validity [N] (row j, step s -> position j + s)."""
        assert self.topk_ids is not None and self.topk_logits is not None
        n = self.num_positions
        idx = torch.arange(n) + step
        keep = idx.clamp(max=n - 1)
        return self.topk_ids[keep], self.topk_logits[keep], idx <= n - 1


def segments_from_rows(taps: torch.Tensor, token_ids: torch.Tensor, next_token_ids: torch.Tensor,
                       seq_ids: torch.Tensor, positions: torch.Tensor, topk_ids: torch.Tensor | None = None,
                       topk_logits: torch.Tensor | None = None) -> list[SignalSegment]:
    """Group signal-store rows (one per position) into per-sequence runs of consecutive positions
    (``topk_ids`` / ``topk_logits`` [R, K], when given, follow their rows).

    Example: seq_ids [7, 7, 7, 9], positions [3, 4, 6, 0] -> segments (7: 3..4), (7: 6), (9: 0).
    """
    order = sorted(range(len(seq_ids)), key=lambda i: (int(seq_ids[i]), int(positions[i])))
    segments: list[SignalSegment] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            idx = torch.tensor(run)
            toks = torch.cat([token_ids[idx], next_token_ids[idx[-1:]]])
            top = ((topk_ids[idx], topk_logits[idx]) if topk_ids is not None and topk_logits is not None
                   else (None, None))
            segments.append(SignalSegment(taps[idx], toks, None, int(positions[run[0]]), *top,
                                          seq_id=int(seq_ids[run[0]])))

    for i in order:
        if run and (int(seq_ids[i]) != int(seq_ids[run[-1]]) or int(positions[i]) != int(positions[run[-1]]) + 1):
            flush()
            run = []
        run.append(i)
    flush()
    return segments


def _as_trainable(t: torch.Tensor, head: Eagle3Head) -> torch.Tensor:
    """Inference tensors (from ``TargetModel.forward``) cannot be saved for backward: copy them."""
    t = t.to(dtype=head.dtype, device=head.device)
    return t.clone() if t.is_inference() else t


@dataclass
class SignalBatch:
    """Segments padded to a common length N (padding after each segment's rows)."""

    taps: torch.Tensor  # [B, N, 3H]
    token_ids: torch.Tensor  # [B, N+1] int64 (padding repeats the last token)
    positions: torch.Tensor  # [B, N] int64 rope position of each row
    segments: list[SignalSegment]

    @staticmethod
    def collate(segments: list[SignalSegment], head: Eagle3Head) -> "SignalBatch":
        if not segments:
            raise Eagle3TrainError("a batch needs at least one segment")
        n = max(s.num_positions for s in segments)
        taps = torch.zeros(len(segments), n, segments[0].taps.shape[1], dtype=head.dtype, device=head.device)
        tokens = torch.zeros(len(segments), n + 1, dtype=torch.int64, device=head.device)
        for b, seg in enumerate(segments):
            k = seg.num_positions
            taps[b, :k] = seg.taps.to(dtype=head.dtype, device=head.device)
            tokens[b, :k + 1] = seg.token_ids.to(head.device)
            tokens[b, k + 1:] = tokens[b, k]
        starts = torch.tensor([s.start_position for s in segments], dtype=torch.int64, device=head.device)
        positions = starts.unsqueeze(1) + torch.arange(n, device=head.device)  # [B, N]
        return SignalBatch(taps, tokens, positions, list(segments))

    @property
    def num_rows(self) -> int:
        return int(self.taps.shape[1])

    @property
    def distilled(self) -> bool:
        """Every segment carries the target's top-k (the loss distils; otherwise hard labels)."""
        return all(s.topk_ids is not None for s in self.segments)

    def soft_labels(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded top-k ids [B, N, K], logits [B, N, K] and validity [B, N] of unroll step ``step``."""
        k = min(int(s.topk_ids.shape[1]) for s in self.segments if s.topk_ids is not None)
        b, n, dev = len(self.segments), self.num_rows, self.taps.device
        ids = torch.zeros(b, n, k, dtype=torch.int64, device=dev)
        logits = torch.zeros(b, n, k, dtype=torch.float32, device=dev)
        valid = torch.zeros(b, n, dtype=torch.bool, device=dev)
        for i, seg in enumerate(self.segments):
            m = seg.num_positions
            top_ids, top_logits, ok = seg.soft_labels(step)
            ids[i, :m], logits[i, :m], valid[i, :m] = top_ids[:, :k], top_logits[:, :k], ok
        return ids, logits, valid

    def labels(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded target-vocab labels [B, N] of unroll step ``step`` (1-based) and validity [B, N]."""
        labels = torch.zeros(len(self.segments), self.num_rows, dtype=torch.int64, device=self.taps.device)
        valid = torch.zeros(len(self.segments), self.num_rows, dtype=torch.bool, device=self.taps.device)
        for b, seg in enumerate(self.segments):
            lab, ok = seg.labels(step)
            labels[b, :seg.num_positions] = lab.to(labels.device)
            valid[b, :seg.num_positions] = ok.to(valid.device)
        return labels, valid


def unroll(head: Eagle3Head, embed: nn.Embedding, batch: SignalBatch, num_steps: int,
           self_feed: bool = False) -> list[torch.Tensor]:
    """Training-time-test unroll over a padded batch -> per-step logits, each [B, N, draft_vocab].

    ``self_feed=False``: step s inputs the ground-truth token ``token_ids[j+s]`` (training).
    ``self_feed=True``: step s >= 2 inputs the head's own greedy token of step s-1 at that row,
    which is exactly greedy chain drafting from every row at once (evaluation).
    """
    n = batch.num_rows
    rows = torch.arange(n, device=head.device)
    fused = head.fuse(_as_trainable(batch.taps, head))  # [B, N, H]
    cache = TTTCache()
    out: list[torch.Tensor] = []
    for step in range(1, num_steps + 1):
        if step > 1 and self_feed:
            tokens = head.draft_to_target(out[-1].argmax(-1))  # [B, N]
        else:
            tokens = batch.token_ids[:, (rows + step).clamp(max=n)]  # [B, N]
        with torch.no_grad():
            embeds = embed(tokens.to(embed.weight.device)).to(dtype=head.dtype, device=head.device)  # [B, N, H]
        fused, logits = ttt_step(head, fused, embeds, batch.positions + step - 1, cache)
        out.append(logits)
    return out


def ttt_loss(head: Eagle3Head, embed: nn.Embedding, segments: list[SignalSegment], ttt_steps: int,
             step_weight_decay: float = 0.8, distill: str = "soft") -> tuple[torch.Tensor, list[float]]:
    """Weighted sum over steps of the mean per-row loss -> (loss, per-step top-1 accuracy).

    When every segment carries top-k rows, the per-row loss is the cross-entropy against the
    target's top-k distribution renormalised over the draft vocabulary (``distill="soft"``) or
    against the target's top-1 (``"top1"``); otherwise against the token that followed. Accuracy is
    measured against the target's top-1 / the token that followed.

    Example (distillation, K=2): target top-k logits [2.0, 1.0] -> p = [0.73, 0.27]; draft log-probs
    of those tokens [-0.5, -1.5] -> row loss 0.73 * 0.5 + 0.27 * 1.5 = 0.77.
    """
    batch = SignalBatch.collate(segments, head)
    t2d_index = head.target_to_draft()  # [V]
    loss = torch.zeros((), dtype=torch.float32, device=head.device)
    acc: list[float] = []
    distilled = batch.distilled
    for s, logits in enumerate(unroll(head, embed, batch, ttt_steps), start=1):
        if distilled and distill == "top1":
            top_ids, _, ok = batch.soft_labels(s)
            row_loss, top1, keep = _hard_loss(logits, top_ids[..., 0], ok, t2d_index)
        elif distilled:
            row_loss, top1, keep = _soft_loss(logits, *batch.soft_labels(s), t2d_index)
        else:
            row_loss, top1, keep = _hard_loss(logits, *batch.labels(s), t2d_index)
        if not bool(keep.any()):
            acc.append(float("nan"))
            continue
        loss = loss + (step_weight_decay ** (s - 1)) * row_loss[keep].mean()
        acc.append(float((logits[keep].argmax(-1) == top1[keep]).float().mean()))
    return loss, acc


def _hard_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, t2d_index: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, N, Vd], target-vocab labels [B, N] -> (row loss [B, N], draft label [B, N], keep [B, N])."""
    draft_labels = t2d_index[labels]  # [B, N], -1 = not in the draft vocab
    keep = valid & (draft_labels >= 0)
    safe = draft_labels.clamp(min=0)
    row = F.cross_entropy(logits.float().flatten(0, 1), safe.flatten(), reduction="none").view_as(safe)
    return row, safe, keep


def _soft_loss(logits: torch.Tensor, top_ids: torch.Tensor, top_logits: torch.Tensor, valid: torch.Tensor,
               t2d_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, N, Vd], target top-k ids/logits [B, N, K] -> (row loss [B, N], draft id of the
    target's top-1 [B, N], keep [B, N]). Top-k entries outside the draft vocabulary are dropped and
    the rest renormalised; a row with none left, or whose top-1 is outside, is not kept."""
    draft_ids = t2d_index[top_ids]  # [B, N, K], -1 = not in the draft vocab
    inside = draft_ids >= 0
    p = torch.softmax(top_logits.masked_fill(~inside, float("-inf")), dim=-1).nan_to_num(0.0)  # [B, N, K]
    logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, draft_ids.clamp(min=0))  # [B, N, K]
    row = -(p * logq.masked_fill(~inside, 0.0)).sum(-1)  # [B, N]
    keep = valid & inside[..., 0]
    return row, draft_ids[..., 0].clamp(min=0), keep


@dataclass
class Eagle3TrainConfig:
    ttt_steps: int = 3  # unrolled drafting steps (EAGLE-3 uses up to 7; TIDE drafts 3 tokens)
    step_weight_decay: float = 0.8  # loss weight of step s is decay ** (s - 1)
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max grad norm; 0 = off

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise Eagle3TrainError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
        if not 0.0 < self.step_weight_decay <= 1.0:
            raise Eagle3TrainError(f"step_weight_decay must be in (0, 1], got {self.step_weight_decay}")
        if self.lr <= 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise Eagle3TrainError("lr must be > 0; weight_decay and grad_clip must be >= 0")


class Eagle3Trainer:
    """AdamW on the head's parameters (the target's embedding stays frozen and outside)."""

    def __init__(self, head: Eagle3Head, embed: nn.Embedding, cfg: Eagle3TrainConfig | None = None) -> None:
        self.head = head
        self.embed = embed
        self.cfg = cfg if cfg is not None else Eagle3TrainConfig()
        self.optimizer = torch.optim.AdamW(head.parameters(), lr=self.cfg.lr, betas=self.cfg.betas,
                                           weight_decay=self.cfg.weight_decay)
        self.num_steps = 0

    def step(self, segments: list[SignalSegment]) -> tuple[float, list[float]]:
        """One optimizer step on a batch of segments -> (loss, per-step top-1 accuracy)."""
        if not segments:
            raise Eagle3TrainError("a training step needs at least one segment")
        self.head.train()
        loss, acc = ttt_loss(self.head, self.embed, segments, self.cfg.ttt_steps, self.cfg.step_weight_decay)
        self.optimizer.zero_grad(set_to_none=True)
        if loss.requires_grad:
            loss.backward()
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
        self.num_steps += 1
        self.head.eval()
        return float(loss.detach()), acc


@dataclass
class AcceptanceStats:
    """Simulated greedy chains over a batch of segments, counted two ways (``acceptance_stats``).

    Per row: every row whose ``gamma`` labels are all known drafts a chain; ``row_sum`` adds
    accepted + 1 over those ``rows``. Walk: what a greedy server would see — drafting at a row, then
    jumping past the tokens that step emitted (``walk_steps`` chains, ``walk_tokens`` tokens). A long
    easy stretch is drafted from once per step there but from every one of its rows in the per-row
    count, so the per-row mean is the higher one; the walk is what served acceptance measures
    (docs/benchmarks/drafters.md).
    """

    rows: int = 0
    row_sum: int = 0
    walk_steps: int = 0
    walk_tokens: int = 0
    blocks: list[tuple[int, int]] = field(default_factory=list)  # (steps, tokens) per block (block_rows > 0 only)

    @property
    def row_mean(self) -> float:
        return self.row_sum / self.rows if self.rows else float("nan")

    @property
    def walk_mean(self) -> float:
        return self.walk_tokens / self.walk_steps if self.walk_steps else float("nan")


def walk_chains(leading: list[int], judged: list[bool], start: int = 0, stop: int | None = None) -> tuple[int, int]:
    """A greedy server's walk over one segment's rows -> (steps, tokens emitted).

    ``leading[p]``: drafts of the chain drafted at row p that match the continuation; ``judged[p]``:
    that chain's outcome is known — its first label is the target's greedy token and no label off
    the greedy path (prompt text, a sampled token) cut it short before a draft missed (labels past
    the end of the text only end it, as max_tokens ends a served request). A step at a judged row p
    emits ``leading[p] + 1`` tokens (fewer where the text ends: rows predict the tokens two
    positions on) and the walk goes on ``leading[p] + 1`` rows later; an unjudged row is skipped.
    On a greedy continuation every row is judged and the walk is exactly a server's (a test serves
    one through the engine); on sampled ones it keeps the chains whose outcome the text tells.

    Example: leading [2, 0, 0, 1, 0, 0], rows 0-4 judged (the last row has nothing left to draft)
    -> a step at row 0 (3 tokens), one at row 3 (2 tokens) -> (2, 5). With row 3 not judged as
    well: rows 0 (3 tokens) and 4 (1 token: the text ends) -> (2, 4).

    ``start`` / ``stop``: a walk that begins at row ``start`` and drafts no chain at or past row
    ``stop`` (its last step's tokens may reach past it), so that blocks of rows can be walked
    one by one as independent samples (``acceptance_stats(block_rows=...)``). Example: the first
    leading list above, start 2, stop 4 -> steps at rows 2 and 3 -> (2, 3).
    """
    n = len(leading)
    end = n if stop is None else min(stop, n)
    steps = tokens = 0
    p = start
    while p < end:
        if not judged[p]:
            p += 1
            continue
        steps += 1
        tokens += min(leading[p] + 1, n - p - 1)  # the segment's text ends at row n's token: no bonus past it
        p += leading[p] + 1
    return steps, tokens


@torch.no_grad()
def acceptance_stats(head: Eagle3Head, embed: nn.Embedding, segments: list[SignalSegment], gamma: int,
                     block_rows: int = 0) -> AcceptanceStats:
    """Greedy chains of ``gamma`` drafts from every row of ``segments`` at once (one unroll),
    counted per row and as a server's walk (``AcceptanceStats``, ``walk_chains``). With
    ``block_rows``, each segment is also walked in blocks of that many rows, each block's walk
    starting at its first row (``AcceptanceStats.blocks``: the samples a paired judgement resamples)."""
    if gamma < 1:
        raise Eagle3TrainError(f"gamma must be >= 1, got {gamma}")
    batch = SignalBatch.collate(segments, head)
    step_logits = unroll(head, embed, batch, gamma, self_feed=True)
    b, n = len(segments), batch.num_rows
    rows = torch.arange(n, device=head.device)
    lengths = torch.tensor([seg.num_positions for seg in segments], device=head.device)  # [B]
    alive = torch.ones(b, n, dtype=torch.bool, device=head.device)  # [B, N] per row: every draft so far matched
    accepted = torch.zeros(b, n, dtype=torch.int64, device=head.device)
    rows_ok = alive.clone()  # per row: all gamma labels known
    running = alive.clone()  # walk: matched through labels on the greedy path
    judged = alive.clone()  # walk: the chain's outcome is known
    leading = torch.zeros_like(accepted)
    for s, logits in enumerate(step_logits, start=1):
        labels, valid = batch.labels(s)
        inside = rows[None, :] <= lengths[:, None] - s - 1  # [B, N] the label lies within the text
        match = head.draft_to_target(logits.argmax(-1)) == labels
        rows_ok &= valid
        alive &= match
        accepted += alive.long()
        judged &= ~(running & inside & ~valid)  # an off-path label cut the chain short: outcome unknown
        if s == 1:
            judged &= valid  # nothing to draft at the last row; off-path first labels are not drafted for
        running &= valid & match
        leading += running.long()
    stats = AcceptanceStats(rows=int(rows_ok.sum()), row_sum=int((accepted[rows_ok] + 1).sum()))
    lead, ok = leading.tolist(), judged.tolist()
    for i, seg in enumerate(segments):
        m = seg.num_positions
        lead_i, ok_i = lead[i][:m], ok[i][:m]
        steps, tokens = walk_chains(lead_i, ok_i)
        stats.walk_steps += steps
        stats.walk_tokens += tokens
        if block_rows:
            stats.blocks += [walk_chains(lead_i, ok_i, a, a + block_rows) for a in range(0, m, block_rows)]
    return stats


def evaluate(head: Eagle3Head, embed: nn.Embedding, segments: list[SignalSegment], gamma: int = 3) -> float:
    """Simulated mean acceptance length of greedy chains of ``gamma`` drafts against the target's
    actual continuation, over every row of every segment whose ``gamma`` labels are all known
    (``AcceptanceStats.row_mean``).

    Example: drafts [a, b, c] where the target continued [a, b, x] -> 2 accepted -> length 3.
    Returns NaN when no row qualifies.
    """
    return acceptance_stats(head, embed, segments, gamma).row_mean


def select_draft_vocab(token_counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``size`` most frequent target ids as the draft vocabulary -> (d2t [size] int64, t2d [V] bool).

    Draft ids follow ascending target id; ties in count go to the lower id.
    Example: counts [5, 0, 9, 1], size 2 -> kept target ids [0, 2] -> d2t [0, 1], t2d [T, F, T, F].
    """
    v = token_counts.shape[0]
    if not 1 <= size <= v:
        raise Eagle3TrainError(f"draft vocab size must be in [1, {v}], got {size}")
    order = torch.sort(-token_counts.double(), stable=True).indices  # most frequent first, ties by id
    kept = torch.sort(order[:size]).values.to(torch.int64)  # [size] ascending target ids
    d2t = kept - torch.arange(size, dtype=torch.int64)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d
