"""A pool of fixed-size K/V blocks beside the slot cache: where automatic prefix caching keeps prefixes.

Why this exists: a server meets the same long system prompt, few-shot block or chat history again
and again; its K/V at those positions is the same every time (the target is causal, so position
``p``'s K/V depends only on tokens ``0..p``), and on a row-invariant target it is the same bits
however the prompt was chunked. This pool stores such K/V in blocks of ``block_size`` positions,
copied out of a sequence's slot once they are final (``save``) and copied into a new sequence's
slot when its prompt starts with the same tokens (``load``), so that prompt's prefill starts after
them. It knows nothing of tokens or requests: which block holds which prefix is the engine's
bookkeeping (``engine/prefix_cache.py``).

The slots stay contiguous (``models/kv_cache.py`` says why: the exact attention kernel reads one
run of positions per head), so a hit costs one copy of the prefix's K/V per layer, about 0.7 MB per
16 tokens of SmolLM2-135M in float32: a 1,024-token prefix is ~47 MB, a few milliseconds, against
the seconds its prefill takes on a CPU. Optional side rows (the target's taps, its final hidden
state) are stored per position too, for the drafters and observers that read them in prefill.

Worked example (a cache of 2 slots, blocks of 4 positions)::

    kv = KVCache.for_model(cfg, num_slots=2, max_len=32, dtype=torch.float32)
    pool = KVBlockPool(kv, num_blocks=8, block_size=4)
    # ... slot 0 holds 10 final positions
    pool.save(0, first_position=0, blocks=[5, 2])     # positions 0..7 -> blocks 5 and 2
    pool.load(1, [5, 2])                               # slot 1 positions 0..7 = the same bits
"""

from __future__ import annotations

import torch

from tidespec.models.kv_cache import KVCache
from tidespec.models.kv_paged import PagedKVCache


class KVBlockPool:
    """Per-layer K/V blocks ``[num_blocks, n_kv, block_size, hd]`` and optional per-position side rows."""

    def __init__(self, kv: KVCache, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs >= 1 block of >= 1 position, got {num_blocks} x {block_size}")
        self.kv = kv
        self.num_blocks = num_blocks
        self.block_size = block_size
        k0 = kv.k[0]  # [S, n_kv, L, hd] (a view when the keys are stored transposed)
        self.num_kv_heads, self.head_dim = int(k0.shape[1]), int(k0.shape[3])
        shape = (num_blocks, self.num_kv_heads, block_size, self.head_dim)
        # torch.empty: on a CPU the pages are committed as blocks are written; a block is only ever
        # read after it was written (the engine loads only blocks it saved)
        self.k = [torch.empty(shape, dtype=k0.dtype, device=k0.device) for _ in kv.k]
        self.v = [torch.empty(shape, dtype=k0.dtype, device=k0.device) for _ in kv.v]
        self.side: dict[str, torch.Tensor] = {}  # name -> [num_blocks, block_size, width], made on first save

    @staticmethod
    def block_bytes(kv: KVCache, block_size: int, side_width: int = 0) -> int:
        """Bytes one block takes: its K/V in every layer plus ``side_width`` values per position
        (counted at the cache's element size).

        Example: SmolLM2-135M (30 layers, 3 KV heads of 64) in float32, blocks of 16, no side rows
        -> 2 x 30 x 3 x 16 x 64 x 4 = 737,280 bytes."""
        k0 = kv.k[0]
        per_position = 2 * len(kv.k) * int(k0.shape[1]) * int(k0.shape[3]) + side_width
        return per_position * block_size * k0.dtype.itemsize

    def save(self, slot: int, first_position: int, blocks: list[int],
             side: dict[str, torch.Tensor] | None = None) -> None:
        """Copy positions ``first_position .. first_position + len(blocks) * block_size`` of ``slot``
        into ``blocks`` (in order), with ``side[name]`` rows ``[len(blocks) * block_size, width]``
        for those positions when given."""
        if not blocks:
            return
        n, b = len(blocks), self.block_size
        end = first_position + n * b
        if first_position < 0 or end > self.kv.lengths[slot]:
            raise ValueError(f"positions {first_position}..{end} of slot {slot} are not all final "
                             f"(length {self.kv.lengths[slot]})")
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.k[0].device)
        where = self.kv.locate(slot, first_position, end) if isinstance(self.kv, PagedKVCache) else None
        for pool, cache in ((self.k, self.kv.k), (self.v, self.kv.v)):
            for p, c in zip(pool, cache):
                if where is not None:  # a paged cache: positions gathered from their blocks
                    rows = c[where[0], :, where[1]].transpose(0, 1)  # [n_kv, n*b, hd]
                else:
                    rows = c[slot, :, first_position:end]  # [n_kv, n*b, hd]
                p.index_copy_(0, idx, rows.reshape(self.num_kv_heads, n, b, self.head_dim).transpose(0, 1))
        self.save_side(blocks, side or {})

    def load(self, slot: int, blocks: list[int], side: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """Copy ``blocks`` into positions ``0 .. len(blocks) * block_size`` of ``slot`` and mark them
        final (the slot's length); returns the side rows named in ``side``, ``[n * block_size, width]``."""
        n, b = len(blocks), self.block_size
        if not n:
            return {}
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.k[0].device)
        where = None
        if isinstance(self.kv, PagedKVCache):  # blocks of the cache's own pool for the positions first
            if not self.kv.reserve(slot, n * b):
                raise RuntimeError(f"the KV cache has no free block for {n * b} cached positions")
            where = self.kv.locate(slot, 0, n * b)
        for pool, cache in ((self.k, self.kv.k), (self.v, self.kv.v)):
            for p, c in zip(pool, cache):
                rows = p.index_select(0, idx).transpose(0, 1).reshape(self.num_kv_heads, n * b, self.head_dim)
                if where is not None:
                    c[where[0], :, where[1]] = rows.transpose(0, 1)  # [n*b, n_kv, hd]
                else:
                    c[slot, :, :n * b] = rows
        self.kv.mark_written(slot, n * b)
        self.kv.set_length(slot, n * b)
        out = {}
        for name in side:
            store = self.side[name]
            out[name] = store.index_select(0, idx.to(store.device)).reshape(n * b, store.shape[2])
        return out

    def save_side(self, blocks: list[int], side: dict[str, torch.Tensor]) -> None:
        """Store side rows ``[len(blocks) * block_size, width]`` for ``blocks``. A kind keeps the width
        and dtype of its first rows (one engine's taps never change them)."""
        n, b = len(blocks), self.block_size
        for name, rows in side.items():
            if rows.shape[0] != n * b:
                raise ValueError(f"side rows {name!r}: {rows.shape[0]} positions for {n * b}")
            store = self.side.get(name)
            if store is None:
                store = self.side[name] = torch.empty((self.num_blocks, b, rows.shape[1]), dtype=rows.dtype,
                                                      device=rows.device)
            elif store.shape[2] != rows.shape[1] or store.dtype != rows.dtype:
                raise ValueError(f"side rows {name!r} of width {rows.shape[1]} ({rows.dtype}); the pool holds "
                                 f"{store.shape[2]} ({store.dtype})")
            idx = torch.tensor(blocks, dtype=torch.int64, device=store.device)
            store.index_copy_(0, idx, rows.reshape(n, b, rows.shape[1]).to(store.device))
