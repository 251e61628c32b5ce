"""Where automatic prefix caching keeps a prefix's K/V: the paged cache's own blocks, shared, or a
pool of blocks beside a slot cache, copied.

Why this exists: a server meets the same long system prompt, few-shot block or chat history again
and again; its K/V at those positions is the same every time (the target is causal, so position
``p``'s K/V depends only on tokens ``0..p``), and on a row-invariant target it is the same bits
however the prompt was chunked. Which block holds which prefix is the engine's bookkeeping
(``engine/prefix_cache.py``); the two stores here hold the K/V and know nothing of tokens:

- ``SharedBlocks`` over a paged cache (``models/kv/paged.py``, every row-invariant CPU target):
  a sequence's full blocks are kept as they are (``claim``: the cache holds them past their
  sequence), and a prompt that starts with the same tokens gets them in its block table
  (``load``: ``PagedKVCache.share``). Nothing is copied, and N requests that share a 1,024-token
  system prompt hold its 64 blocks once, as in vLLM.
- ``KVBlockPool`` beside a slot cache (contiguous slots, e.g. CUDA graphs over fixed slots): blocks
  of its own, copied out of a sequence's slot once final (``save``) and into a new sequence's slot
  on a hit (``load``): one copy of the prefix's K/V per layer, about 0.7 MB per 16 tokens of
  SmolLM2-135M in float32, a few milliseconds for 1k tokens against the seconds of its prefill.

Both keep optional side rows per position (the target's taps, its final hidden state) for the
drafters and observers that read them in prefill (``SideRows``).

Worked example (a cache of 2 slots, blocks of 4 positions)::

    kv = KVCache.for_model(cfg, num_slots=2, max_len=32, dtype=torch.float32)
    pool = KVBlockPool(kv, num_blocks=8, block_size=4)
    # ... slot 0 holds 10 final positions
    a, b = pool.claim(0, 0), pool.claim(0, 1)          # two free rows of the pool
    pool.save(0, first_position=0, blocks=[a, b])      # positions 0..7 -> blocks a and b
    pool.load(1, [a, b])                               # slot 1 positions 0..7 = the same bits
"""

from __future__ import annotations

import torch

from tidespec.models.kv.cache import KVCache
from tidespec.models.kv.paged import PagedKVCache


class SideRows:
    """Per-position side rows of blocks: name -> ``[num_blocks, block_size, width]``, made on first save."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.rows: dict[str, torch.Tensor] = {}

    def save(self, blocks: list[int], side: dict[str, torch.Tensor]) -> None:
        """Store side rows ``[len(blocks) * block_size, width]`` for ``blocks``. A kind keeps the width
        and dtype of its first rows (one engine's taps never change them). On a CPU the store's
        pages are committed as blocks are written (``torch.empty``)."""
        n, b = len(blocks), self.block_size
        for name, rows in side.items():
            if rows.shape[0] != n * b:
                raise ValueError(f"side rows {name!r}: {rows.shape[0]} positions for {n * b}")
            store = self.rows.get(name)
            if store is None:
                store = self.rows[name] = torch.empty((self.num_blocks, b, rows.shape[1]), dtype=rows.dtype,
                                                      device=rows.device)
            elif store.shape[2] != rows.shape[1] or store.dtype != rows.dtype:
                raise ValueError(f"side rows {name!r} of width {rows.shape[1]} ({rows.dtype}); the pool holds "
                                 f"{store.shape[2]} ({store.dtype})")
            idx = torch.tensor(blocks, dtype=torch.int64, device=store.device)
            store.index_copy_(0, idx, rows.reshape(n, b, rows.shape[1]).to(store.device))

    def load(self, blocks: list[int], names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """The rows ``names`` of ``blocks``, in order: ``[len(blocks) * block_size, width]`` each."""
        out = {}
        for name in names:
            store = self.rows[name]
            idx = torch.tensor(blocks, dtype=torch.int64, device=store.device)
            out[name] = store.index_select(0, idx).reshape(len(blocks) * self.block_size, store.shape[2])
        return out


class KVBlockPool:
    """Per-layer K/V blocks ``[num_blocks, n_kv, block_size, hd]`` beside a slot cache, copied in and out."""

    shared = False  # a hit copies

    def __init__(self, kv: KVCache, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs >= 1 block of >= 1 position, got {num_blocks} x {block_size}")
        if isinstance(kv, PagedKVCache):
            raise TypeError("a paged cache shares its own blocks: use SharedBlocks")
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
        self.side = SideRows(num_blocks, block_size)
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @staticmethod
    def block_bytes(kv: KVCache, block_size: int, side_width: int = 0) -> int:
        """Bytes one block takes: its K/V in every layer plus ``side_width`` values per position
        (counted at the cache's element size).

        Example: SmolLM2-135M (30 layers, 3 KV heads of 64) in float32, blocks of 16, no side rows
        -> 2 x 30 x 3 x 16 x 64 x 4 = 737,280 bytes."""
        k0 = kv.k[0]
        per_position = 2 * len(kv.k) * int(k0.shape[1]) * int(k0.shape[3]) + side_width
        return per_position * block_size * k0.dtype.itemsize

    def claim(self, slot: int, number: int) -> int | None:
        """A free row of the pool for block ``number`` of ``slot`` (saved later), or None when full."""
        return self._free.pop() if self._free else None

    def release(self, index: int) -> bool:
        """Row ``index`` is free again; True (every row the cache lets go of is free memory)."""
        self._free.append(index)
        return True

    def idle(self, index: int) -> bool:
        """Whether letting go of ``index`` frees memory: always (the pool is the cache's alone)."""
        return True

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
        for pool, cache in ((self.k, self.kv.k), (self.v, self.kv.v)):
            for p, c in zip(pool, cache):
                rows = c[slot, :, first_position:end]  # [n_kv, n*b, hd]
                p.index_copy_(0, idx, rows.reshape(self.num_kv_heads, n, b, self.head_dim).transpose(0, 1))
        self.side.save(blocks, side or {})

    def load(self, slot: int, blocks: list[int], side: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """Copy ``blocks`` into positions ``0 .. len(blocks) * block_size`` of ``slot`` and mark them
        final (the slot's length); returns the side rows named in ``side``, ``[n * block_size, width]``."""
        n, b = len(blocks), self.block_size
        if not n:
            return {}
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.k[0].device)
        for pool, cache in ((self.k, self.kv.k), (self.v, self.kv.v)):
            for p, c in zip(pool, cache):
                c[slot, :, :n * b] = p.index_select(0, idx).transpose(0, 1).reshape(self.num_kv_heads, n * b,
                                                                                    self.head_dim)
        self.kv.mark_written(slot, n * b)
        self.kv.set_length(slot, n * b)
        return self.side.load(blocks, side)


class SharedBlocks:
    """A paged cache's own blocks, kept by the prefix cache and shared with the prompts that hit them."""

    shared = True  # a hit shares

    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.num_blocks = kv.num_blocks
        self.side = SideRows(kv.num_blocks + 1, kv.block_size)  # indexed by the cache's block ids

    @staticmethod
    def side_bytes(kv: PagedKVCache, side_width: int) -> int:
        """Bytes of side rows a cached block takes at most (``side_width`` values per position, at
        the cache's element size), beyond its K/V in the paged cache.

        Example: SmolLM2-135M in float32, EAGLE-3 (3 taps of 576) + the final hidden state, blocks
        of 16 -> 4 x 576 x 16 x 4 = 147,456 bytes (a fifth of the block's K/V)."""
        return side_width * kv.block_size * kv.k[0].dtype.itemsize

    def claim(self, slot: int, number: int) -> int:
        """Block ``number`` of ``slot``, held by the cache from now on (its K/V is final)."""
        block = self.kv.blocks[slot][number]
        self.kv.hold(block)
        return block

    def release(self, index: int) -> bool:
        """The cache lets go of block ``index``; True when that freed it (no sequence holds it)."""
        idle = self.idle(index)
        self.kv.unhold(index)
        return idle

    def idle(self, index: int) -> bool:
        """Whether only the cache holds block ``index``."""
        return self.kv.refs(index) == 1

    def save(self, slot: int, first_position: int, blocks: list[int],
             side: dict[str, torch.Tensor] | None = None) -> None:
        """Nothing to copy (the blocks are the slot's own, ``claim``); only ``side`` rows are stored."""
        first = first_position // self.block_size
        if first_position % self.block_size or self.kv.blocks[slot][first:first + len(blocks)] != blocks:
            raise ValueError(f"blocks {blocks} are not slot {slot}'s from position {first_position}")
        self.side.save(blocks, side or {})

    def load(self, slot: int, blocks: list[int], side: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """Put ``blocks`` at the start of the empty ``slot`` (``PagedKVCache.share``); returns the side
        rows named in ``side``."""
        if not blocks:
            return {}
        self.kv.share(slot, blocks)
        return self.side.load(blocks, side)
