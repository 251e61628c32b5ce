"""A forward's batch layout and what a target model gives back: the seam between the engine and any model family.

Why this exists: the engine, the drafters, capture and the executors lay out a step's tokens
(``BatchLayout``: ragged sequences flattened into ``T`` rows, each with its KV slot, positions and
tree mask) and read a forward's ``ModelOutput`` the same way whatever the model family; a family
module (``models/families/``) only consumes the layout. Moved out of the family module (then ``families/llama.py``) on
2026-12-03 with no change.

Worked example: two sequences, one decoding a verified token plus 2 draft tokens on a 10-token
cache, one prefilling a 4-token chunk from scratch::

    layout = BatchLayout.build(q_lens=[3, 4], ctx_lens=[10, 0], slots=[5, 2])
    layout.positions        # tensor([10, 11, 12, 0, 1, 2, 3])
    layout.write_slots      # tensor([5, 5, 5, 2, 2, 2, 2])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from tidespec.models.kernels.attention import AttentionPlan

SLICE_WRITE_MAX_SEQS = 2  # K/V writes of up to this many sequences use slice copies, else one index_put


@dataclass
class BatchLayout:
    """Where each sequence's new tokens sit in the flattened batch and in the KV cache.

    All per-sequence lists have length ``B``; ``T = sum(q_lens)``.
    """

    q_lens: list[int]  # new tokens per sequence
    ctx_lens: list[int]  # tokens already in the KV cache per sequence (write offset)
    slots: list[int]  # KV-cache slot owned by each sequence
    positions: torch.Tensor  # [T] int64 rope positions (ctx + depth for tree tokens)
    write_slots: torch.Tensor  # [T] int64 slot index of each new token
    write_offsets: torch.Tensor  # [T] int64 cache offset of each new token (ctx + index)
    tree_masks: list[torch.Tensor | None] = field(default_factory=list)  # per seq [q, p + q] bool or None (causal)
    _plans: dict[int | None, AttentionPlan] = field(default_factory=dict, repr=False)  # per sliding window
    # a paged cache (``page``): its block table [S, nb] and block size, and, when they are few, the
    # runs of new tokens within one block: (block, first row, first token, n)
    block_table: torch.Tensor | None = None
    block_size: int = 0
    write_runs: list[tuple[int, int, int, int]] | None = None

    def page(self, kv: KVStorage) -> None:
        """Lay this forward out over a paged cache (``models/kv/paged.py``): blocks for every new
        position first (raises RuntimeError when the pool cannot give them: the scheduler reserves
        ahead, so only a caller that did not gets it), then the runs of new tokens per block."""
        bs = kv.block_size
        runs: list[tuple[int, int, int, int]] = []
        start = 0
        for slot, c, q in zip(self.slots, self.ctx_lens, self.q_lens):
            if not kv.reserve(slot, c + q):
                raise RuntimeError(f"the KV cache has no free block for {c + q} positions of slot {slot}")
            pos = c
            while pos < c + q and len(runs) <= SLICE_WRITE_MAX_SEQS:
                n = min(c + q - pos, bs - pos % bs)
                runs.append((kv.blocks[slot][pos // bs], pos % bs, start + pos - c, n))
                pos += n
            start += q
        self.block_table, self.block_size = kv.block_table, bs
        self.write_runs = runs if len(runs) <= SLICE_WRITE_MAX_SEQS else None
        self._plans.clear()

    def paged_writes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each new token's block and row in a paged cache (after ``page``): two [T] int64 tensors."""
        assert self.block_table is not None
        return self.block_table[self.write_slots, self.write_offsets // self.block_size], \
            self.write_offsets % self.block_size

    def attention_plan(self, window: int | None, kv: "KVStorage | None" = None, exact: bool = False) -> AttentionPlan:
        """The attention plan of this layout, built on first use and shared by all layers; ``exact``:
        for the row-invariant kernel (``AttentionPlan.build``). With ``kv``, the key range the
        padded plan reads is made safe to read first (the exact kernel reads only visible keys)."""
        plan = self._plans.get(window)
        if plan is None:
            plan = AttentionPlan.build(self.q_lens, self.ctx_lens, self.slots, self.tree_masks, window,
                                       self.positions.device, exact, self.block_table)
            self._plans[window] = plan
        if kv is not None and not plan.exact:
            kv.make_readable(plan.read_slots(self.slots), plan.kv_len)
        return plan

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' K/V ([T, n_kv, hd]) into their slots ([S, n_kv, L, hd]), or their
        blocks ([NB, n_kv, bs, hd]) when paged."""
        if self.write_runs is not None:  # a decode step's few rows: slice copies into their blocks
            for block, row, t, n in self.write_runs:
                k_cache[block, :, row:row + n] = k[t:t + n].transpose(0, 1)
                v_cache[block, :, row:row + n] = v[t:t + n].transpose(0, 1)
        elif self.block_table is not None:
            blocks, rows = self.paged_writes()
            k_cache[blocks, :, rows] = k
            v_cache[blocks, :, rows] = v
        elif len(self.q_lens) <= SLICE_WRITE_MAX_SEQS:  # two slice copies beat two index_put calls
            start = 0
            for q_len, ctx, slot in zip(self.q_lens, self.ctx_lens, self.slots):
                k_cache[slot, :, ctx:ctx + q_len] = k[start:start + q_len].transpose(0, 1)
                v_cache[slot, :, ctx:ctx + q_len] = v[start:start + q_len].transpose(0, 1)
                start += q_len
        else:  # scatter the new K/V into each sequence's slot: cache[slot_t, :, off_t] = k[t]
            k_cache[self.write_slots, :, self.write_offsets] = k
            v_cache[self.write_slots, :, self.write_offsets] = v

    def attend(self, window: int | None, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, n_h, hd] (its K/V already written) -> attention output [T, n_h, hd]; ``scale``: the
        softmax scale (None: hd ** -0.5); ``softcap``: Gemma 2's cap on the scores; ``sinks`` [n_h]:
        gpt-oss's per-head logits that join each softmax and add no value."""
        return self.attention_plan(window).attend(q, k_cache, v_cache, scale, softcap, sinks)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.q_lens))

    @staticmethod
    def build(q_lens: list[int], ctx_lens: list[int], slots: list[int],
              depths: list[list[int] | None] | None = None,
              tree_masks: list[torch.Tensor | None] | None = None,
              device: torch.device | str = "cpu") -> "BatchLayout":
        """Derive positions and write offsets. ``depths[i]`` (tree sequences) gives each new
        token's position offset from ``ctx_lens[i]``, its depth below the context when the tree is
        fed whole (negative for a level fed above earlier levels kept in the cache, whose
        ``tree_masks[i]`` then covers them too); ``None`` means a chain (depth = index)."""
        pos: list[int] = []
        wslots: list[int] = []
        woffs: list[int] = []
        for i, (q, c, s) in enumerate(zip(q_lens, ctx_lens, slots)):
            d = depths[i] if depths is not None else None
            pos.extend([c + x for x in d] if d is not None else range(c, c + q))
            wslots.extend([s] * q)
            woffs.extend(range(c, c + q))
        as_t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        return BatchLayout(list(q_lens), list(ctx_lens), list(slots), as_t(pos), as_t(wslots), as_t(woffs),
                           list(tree_masks) if tree_masks is not None else [None] * len(q_lens))


class ForwardLayout(Protocol):
    """What the layers need from a forward's layout: rope positions, where the new tokens' K/V go,
    and attention over the slots. ``BatchLayout`` is the eager one; ``models/execution/compiled.py`` has a
    tensor-only one for the compiled step."""

    positions: torch.Tensor  # [T] int64

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def attend(self, window: int | None, q: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor: ...


class KVStorage(Protocol):
    """What the model needs from a KV cache: per-layer tensors ``[num_slots, n_kv, max_len, hd]``
    and a way to make unwritten positions safe to read (``KVCache.make_readable``)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    paged: bool  # a paged cache also has block_size, block_table, blocks and reserve (``models/kv/paged.py``)

    def make_readable(self, slots: list[int], upto: int) -> None: ...


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [R, V] float32, rows chosen by ``logits_rows``
    taps: torch.Tensor | None  # [T, num_taps * H] hidden states entering the tap layers
    last_hidden: torch.Tensor  # [T, H] after the final norm
