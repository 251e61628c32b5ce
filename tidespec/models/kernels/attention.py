"""Attention of a ragged batch over the KV slots in one call: no Python loop per sequence.

Why this exists: a decode step of B sequences, each verifying its own chain or tree of draft
tokens against its own context length, used to run one ``scaled_dot_product_attention`` per
sequence per layer — B x 30 small kernel calls plus their masks, rebuilt every layer. Here the
ragged batch is laid out once per forward as a padded ``[Sb, n_h, q_max, hd]`` query block over
the cache's own ``[Sb, n_kv, L, hd]`` slots, with one boolean mask ``[Sb, 1, q_max, L]`` that
encodes everything the per-sequence path encoded: each sequence's context length, causal or
tree order among its new tokens, the sliding window, and the padding. Every layer then runs one
SDPA call. The mask and the index maps are built once per forward (``AttentionPlan``) and
shared by all layers.

Which slots: when the batch's slots are packed closely (``hi - lo <= 2 B``; slots are handed
out lowest first, so this is the common case) the keys are a *view* of the cache
``k_cache[lo:hi, :, :L]`` — no copy — and slots in that range that are not in the batch get
fully padded query rows. Otherwise the batch's slots are gathered (``index_select``), which
copies ``B x L`` positions per layer.

Padded query rows attend to key 0 only (a fully masked row would give NaN in some kernels);
their outputs are never read. Keys past a sequence's length are masked, so what is in the
cache there (another request's old K/V) never reaches an output: a masked score's weight is
exactly 0. That needs the values there to be finite (0 x NaN is NaN), which is why the caller
makes the range readable first (``KVCache.make_readable``: zero-fill of never-written positions).

Two kernels run the plan. On the CPU, when the key cache is stored transposed (``KVCache(...,
transposed_keys=True)``, what the engine allocates for a row-invariant target), every new token
is attended on its own by ``tidespec::exact_attention`` (``models/kernels/csrc/row_invariant.cpp``): its
output has the same bits whatever else the call holds, which is what makes a verification row
equal its decode row and a batched row equal the row run alone. The plan then carries one mask row
per token (``row_mask``) and its slot (``row_slots``) and pads nothing. Elsewhere (a GPU, a cache
in the usual layout) the padded block goes to one ``scaled_dot_product_attention`` call, whose
output for a row depends on the rest of the call in the last bits.

Worked example: sequences A (slot 0, ctx 3, a 2-token chain) and B (slot 1, ctx 1, 1 token)::

    plan = AttentionPlan.build(q_lens=[2, 1], ctx_lens=[3, 1], slots=[0, 1], tree_masks=[None, None],
                               window=None, device="cpu")
    plan.lo, plan.hi, plan.q_max, plan.kv_len   # 0, 2, 2, 5
    plan.q_index                                # tensor([0, 1, 2]): A's rows 0, 1; B's row 0 at 1*2+0
    plan.mask[0, 0]  # A: [[1,1,1,1,0], [1,1,1,1,1]]
    plan.mask[1, 0]  # B: [[1,1,0,0,0], [1,0,0,0,0]]   (row 1 is padding: key 0 only)
    exact = AttentionPlan.build(..., exact=True)   # the same layout for the row-invariant kernel
    exact.row_slots, exact.row_mask[2]             # tensor([0, 0, 1]); B's row: [1, 1, 0, 0, 0]
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tidespec.models.kernels.ops import exact_attention_op

# On CUDA, SDPA may pick cuDNN's attention, which builds an execution plan for every new shape: an
# eager forward's key length changes every step, and the EAGLE-3 head's attention then took 9 ms a
# call on an H100 (torch 2.11). Eager CUDA attention (also what a graph of the eager forward
# captures) uses the other kernels; inductor-compiled code keeps SDPA's own choice.
NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class AttentionPlan:
    """Where each new token's query sits in the padded block and what it may attend to."""

    lo: int  # first slot of the key range (range mode) — unused when ``gather`` is set
    hi: int  # one past the last slot of the key range
    q_max: int  # longest new-token run of any sequence
    kv_len: int  # keys read per slot: the longest ctx + q_len
    q_index: torch.Tensor  # [T] int64 row of each new token in the flattened [Sb * q_max] block
    mask: torch.Tensor  # [Sb, 1, q_max, kv_len] bool, True = attend
    gather: torch.Tensor | None  # [B] int64 slots to gather, or None to read the view [lo:hi]
    identity: bool  # q_index is 0..T-1 and T == Sb * q_max: no scatter/gather of queries needed
    causal: bool  # one sequence, empty cache, causal order, no window: SDPA's own causal mask suffices
    row_slots: torch.Tensor | None = None  # exact: [T] int64 slot of each new token
    row_mask: torch.Tensor | None = None  # exact: [T, kv_len] bool, the keys each new token sees
    block_table: torch.Tensor | None = None  # exact over a paged cache: [S, nb] int64 blocks of each slot

    @property
    def exact(self) -> bool:
        """Whether the row-invariant kernel runs this plan (``build(..., exact=True)``)."""
        return self.row_mask is not None

    @staticmethod
    def build(q_lens: list[int], ctx_lens: list[int], slots: list[int], tree_masks: list[torch.Tensor | None],
              window: int | None, device: torch.device | str, exact: bool = False,
              block_table: torch.Tensor | None = None) -> "AttentionPlan":
        """One plan per forward. ``tree_masks[i]``: [q, p + q] bool over sequence i's last ``p``
        cached tokens and its ``q`` new ones (p = 0: among the new tokens only; the cache before
        them is visible to all), or None for causal order. ``p > 0`` lets a tree grow level by
        level, each level's K/V kept in the cache where the next level reads it under the mask.
        ``window``: sliding window over cache offsets, or None. ``exact``: a plan for the
        row-invariant kernel (one mask row per token, nothing padded; module docstring), which
        reads a paged cache through ``block_table`` ([S, nb] int64; only the exact kernel pages)."""
        if exact:
            plan = AttentionPlan._build_exact(q_lens, ctx_lens, slots, tree_masks, window, device)
            plan.block_table = block_table
            return plan
        if block_table is not None:
            raise ValueError("a paged KV cache is read by the exact attention kernel only")
        B = len(q_lens)
        lo, hi = min(slots), max(slots) + 1
        gather = None
        if hi - lo > 2 * B:  # scattered slots: copy just the batch's keys rather than read a wide range
            base = list(range(B))
            gather = torch.tensor(slots, dtype=torch.int64, device=device)
        else:
            base = [s - lo for s in slots]
        num_rows = B if gather is not None else hi - lo
        q_max = max(q_lens)
        kv_len = max(c + q for c, q in zip(ctx_lens, q_lens))
        mask = torch.zeros(num_rows, 1, q_max, kv_len, dtype=torch.bool)
        mask[:, :, :, 0] = True  # padding rows (and unused slots) look at key 0 only
        index: list[int] = []
        for b, q, c, tmask in zip(base, q_lens, ctx_lens, tree_masks):
            _visible_keys(mask[b, 0, :q], q, c, tmask, window)
            index.extend(range(b * q_max, b * q_max + q))
        identity = index == list(range(num_rows * q_max))
        causal = B == 1 and ctx_lens[0] == 0 and tree_masks[0] is None and window is None and q_max == q_lens[0]
        return AttentionPlan(lo, hi, q_max, kv_len, torch.tensor(index, dtype=torch.int64, device=device),
                             mask.to(device), gather, identity, causal)

    @staticmethod
    def _build_exact(q_lens: list[int], ctx_lens: list[int], slots: list[int],
                     tree_masks: list[torch.Tensor | None], window: int | None,
                     device: torch.device | str) -> "AttentionPlan":
        T = sum(q_lens)
        kv_len = max(c + q for c, q in zip(ctx_lens, q_lens))
        row_mask = torch.zeros(T, kv_len, dtype=torch.bool)
        row_slots: list[int] = []
        start = 0
        for q, c, slot, tmask in zip(q_lens, ctx_lens, slots, tree_masks):
            _visible_keys(row_mask[start:start + q], q, c, tmask, window)
            row_slots.extend([slot] * q)
            start += q
        ids = torch.arange(T, dtype=torch.int64, device=device)
        empty = torch.zeros(0, 1, 0, 0, dtype=torch.bool, device=device)
        return AttentionPlan(min(slots), max(slots) + 1, max(q_lens), kv_len, ids, empty, None, True, False,
                             torch.tensor(row_slots, dtype=torch.int64, device=device), row_mask.to(device))

    def read_slots(self, slots: list[int]) -> list[int]:
        """The slots whose first ``kv_len`` positions this plan reads (``slots``: the batch's)."""
        return list(slots) if self.gather is not None else list(range(self.lo, self.hi))

    def keys(self, cache: torch.Tensor) -> torch.Tensor:
        """[S, n_kv, L, hd] cache -> [Sb, n_kv, kv_len, hd] keys (or values) of the batch's slots."""
        if self.gather is not None:
            return cache[:, :, :self.kv_len].index_select(0, self.gather)
        return cache[self.lo:self.hi, :, :self.kv_len]

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, n_h, hd] (rope applied, K/V of these tokens already in the cache) -> [T, n_h, hd].
        ``scale``: the softmax scale (None: hd ** -0.5); ``softcap``: scores -> cap * tanh(score / cap);
        ``sinks`` [n_h]: a logit per head that joins the softmax and adds no value (gpt-oss)."""
        if self.row_mask is not None and self.row_slots is not None:
            return attend_exact(q, k_cache, v_cache, self.row_slots, self.row_mask, self.block_table, scale, softcap,
                                sinks)
        return attend_padded(q, None if self.identity else self.q_index, self.mask, self.keys(k_cache),
                             self.keys(v_cache), self.causal, scale, softcap, sinks)


def _visible_keys(rows: torch.Tensor, q: int, c: int, tmask: torch.Tensor | None, window: int | None) -> None:
    """Mark in ``rows`` ([q, kv_len] bool, all False) the keys each of a sequence's q new tokens
    sees after its c cached ones: the cache, then causal order or the tree mask (``tmask`` [q,
    p + q] over the last p cached tokens and the new ones), within the sliding window if any."""
    rows[:, :c] = True
    new = torch.ones(q, q, dtype=torch.bool).tril() if tmask is None else tmask.to("cpu", torch.bool)
    if new.dim() != 2 or new.shape[0] != q or not q <= new.shape[1] <= c + q:
        raise ValueError(f"tree mask {tuple(new.shape)} for {q} new tokens after {c} cached ones")
    rows[:, c + q - new.shape[1]:c + q] = new  # [q, p + q]: the last p cached tokens too
    if window is not None:  # a query at offset c + i sees keys at offsets > c + i - window
        qpos = torch.arange(c, c + q).unsqueeze(1)  # [q, 1]
        kpos = torch.arange(rows.shape[1]).unsqueeze(0)  # [1, kv_len]
        rows &= qpos - kpos < window


def transposed_keys(k_cache: torch.Tensor) -> bool:
    """Whether a key cache ([S, n_kv, L, hd]) is stored transposed (positions contiguous): the
    layout the row-invariant kernel reads, and the engine's sign that the target runs it."""
    return k_cache.device.type == "cpu" and k_cache.stride(2) == 1 and k_cache.shape[2] > 1


def attend_exact(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_slots: torch.Tensor,
                 row_mask: torch.Tensor, block_table: torch.Tensor | None = None,
                 scale: float | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Each new token attended on its own by ``tidespec::exact_attention``: q [T, n_h, hd], the whole
    caches [S, n_kv, L, hd] (keys transposed), row_slots [T], row_mask [T, kv_len] -> [T, n_h, hd].
    Paged: the caches are block pools [NB, n_kv, bs, hd] and ``block_table`` [S, nb] maps slots to blocks."""
    if not torch.compiler.is_compiling():  # built (or loaded from the cache) on first use; a graph finds it loaded
        exact_attention_op()
    return torch.ops.tidespec.exact_attention(q, k_cache, v_cache, row_slots, row_mask,
                                              q.shape[-1] ** -0.5 if scale is None else scale, block_table,
                                              softcap or 0.0, sinks)


def attend_padded(q: torch.Tensor, q_index: torch.Tensor | None, mask: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, causal: bool = False, scale: float | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One SDPA call for a ragged batch laid out as a padded block (the eager plan and the compiled
    step both run it).

    q: [T, n_h, hd]; q_index: [T] row of each token in the ``[Sb * q_max]`` block, or None when the
    tokens already fill it in order; mask: [Sb, 1, q_max, Lk] bool; keys/values: [Sb, n_kv, Lk, hd].
    ``causal``: one sequence from an empty cache, where SDPA's own causal mask replaces ``mask``
    (the kernel then skips the masked blocks). ``scale``: the softmax scale (None: hd ** -0.5);
    ``softcap``: Gemma 2's cap on the scores, ``sinks`` [n_h]: gpt-oss's per-head logits in each softmax's
    denominator; SDPA has a place for neither (``_written_out``). Returns [T, n_h, hd].
    """
    T, n_h, hd = q.shape
    rows, _, q_max, _ = mask.shape
    qp = q
    if q_index is not None:
        qp = q.new_zeros(rows * q_max, n_h, hd)  # [Sb * q_max, n_h, hd]
        qp.index_copy_(0, q_index, q)
    qb = qp.view(rows, q_max, n_h, hd).transpose(1, 2)  # [Sb, n_h, q_max, hd]
    eager_cuda = q.is_cuda and not torch.compiler.is_compiling()
    with sdpa_kernel(NOT_CUDNN) if eager_cuda else contextlib.nullcontext():
        out = _sdpa(qb, keys, values, mask, causal, scale) if softcap is None and sinks is None else \
            _written_out(qb, keys, values, mask, scale, softcap, sinks)
    out = out.transpose(1, 2).reshape(rows * q_max, n_h, hd)
    return out if q_index is None else out.index_select(0, q_index)


def _written_out(qb: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float | None,
                 softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention with soft-capped scores or sinks, written out as transformers' eager Gemma 2 and gpt-oss
    attention do (no fused kernel takes a cap or a sink): qb [Sb, n_h, q, hd], keys/values [Sb, n_kv, Lk, hd],
    mask [Sb, 1, q, Lk], sinks [n_h] -> [Sb, n_h, q, hd]. The softmax runs in float32 (float64 stays
    float64); a sink is one more column of it, dropped after."""
    group = qb.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)  # [Sb, n_h, Lk, hd]
    scores = torch.matmul(qb, k.transpose(2, 3)) * (qb.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap  # [Sb, n_h, q, Lk]
    scores = scores.masked_fill(~mask, float("-inf"))
    soft = torch.promote_types(qb.dtype, torch.float32)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=soft).to(qb.dtype)
    else:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)  # [Sb, n_h, q, 1]
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=soft)[..., :-1].to(qb.dtype)
    return torch.matmul(probs, v)


def _sdpa(qb: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, causal: bool,
          scale: float | None) -> torch.Tensor:
    if causal:
        return F.scaled_dot_product_attention(qb, keys, values, is_causal=True, enable_gqa=True,
                                              scale=scale)  # [1, n_h, q, hd]
    return F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask, enable_gqa=True,
                                          scale=scale)  # [Sb, n_h, q_max, hd]
