"""Paged KV cache: a pool of fixed-size blocks shared by all sequences, a block table per sequence.

Why this exists: a slot cache (``models/kv/cache.py``) reserves ``max_model_len`` positions per
sequence, so ``--max-num-seqs`` multiplies the worst case and the number of sequences in flight is
bounded by it rather than by the tokens really held. Here a sequence (still named by its slot, now
a row of the block table) holds only the blocks its positions need, taken from one pool sized by
the memory given to it; the engine admits by free blocks and preempts when they run out
(``engine/scheduler.py``). Only the row-invariant CPU target uses it: its attention kernel reads
keys and values through the block table (``tidespec::exact_attention``, ``models/kernels/csrc``) with the
same arithmetic as over a contiguous slot, so paging changes no bit of any output.

Layout: per layer, keys ``[NB, n_kv, hd, bs]`` in memory (``k[i]`` is the ``[NB, n_kv, bs, hd]``
view, as the slot cache's transposed keys), values ``[NB, n_kv, bs, hd]``. Block 0 is never handed
out: a table entry past a sequence's blocks points at it, so a read there stays inside the pool
(the kernel never reads past a row's visible keys; the entry only has to be a valid index).

Blocks are taken by ``reserve`` before a forward writes positions and given back by ``free``. A
rollback (rejected drafts) keeps them: the next step writes there again. When the pool runs dry,
``reserve`` first takes back such slack (blocks wholly past a sequence's length and past what was
reserved for the coming forward) from every sequence, then asks the prefix cache to let go of
blocks only it holds (``evict_idle``).

Shared blocks (automatic prefix caching, ``engine/prefix_cache.py``): a full block whose K/V is
final never changes again (a sequence writes only past its length, and its length never falls
below its prompt), so several holders may point at it, as in vLLM: the prefix cache ``hold``s a
sequence's full blocks, and a later prompt that starts with the same tokens gets them in its
table (``share``) instead of computing or copying them. A block is counted per holder and goes
back to the free list when its last holder lets go; a block only the prefix cache holds is
"idle": counted as free for admission and evicted when the free list runs dry.

Worked example (blocks of 16, a pool of 4 usable blocks)::

    kv = PagedKVCache(num_layers=2, num_slots=3, max_len=64, num_kv_heads=1, head_dim=16,
                      dtype=torch.float32, block_size=16, num_blocks=4)
    s = kv.allocate()             # -> 0, no block yet
    kv.reserve(s, 20)             # True: blocks for positions 0..19 (2 blocks), table row [1, 2, 0, 0]
    kv.set_length(s, 20)
    t = kv.allocate(); kv.reserve(t, 40)   # False: 3 blocks needed, 2 free (t keeps the 2 it got)
    kv.free(s); kv.reserve(t, 40)          # True
    kv.set_length(t, 40); kv.hold(kv.blocks[t][0])   # the prefix cache keeps t's first block
    u = kv.allocate(); kv.share(u, [kv.blocks[t][0]])  # u starts with it: length 16, nothing copied
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tidespec.errors import ConfigError
from tidespec.models.kv.cache import KVCache, available_memory
from tidespec.models.target import TargetConfig

log = logging.getLogger(__name__)

KERNEL_BLOCK_MULTIPLE = 16  # the kernel loads VL (8 or 16) consecutive keys at once within one block


def kernel_block_size(block_size: int) -> int:
    """The paged cache's block size for a requested one: rounded up to a multiple of 16, so that
    no vector of keys straddles two blocks. Example: 4 -> 16, 16 -> 16, 24 -> 32."""
    return -(-block_size // KERNEL_BLOCK_MULTIPLE) * KERNEL_BLOCK_MULTIPLE


class PagedKVCache(KVCache):
    """A ``KVCache`` whose slots hold blocks of a shared pool (module docstring)."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, block_size: int, num_blocks: int) -> None:
        if block_size % KERNEL_BLOCK_MULTIPLE:
            raise ValueError(f"block size {block_size} is not a multiple of {KERNEL_BLOCK_MULTIPLE}")
        if num_blocks < 1:
            raise ConfigError(f"the KV cache holds no block of {block_size} tokens; raise --kv-cache-memory-mb")
        from tidespec.models.kernels.ops import exact_attention_error  # the kernel that reads through the table

        error = exact_attention_error()
        if error is not None:
            raise RuntimeError(f"a paged KV cache needs tidespec's exact attention kernel: {error}")
        total = num_blocks + 1  # block 0: what unused table entries point at
        try:
            keys = [torch.empty((total, num_kv_heads, head_dim, block_size), dtype=dtype) for _ in range(num_layers)]
            self.k = [k.transpose(2, 3) for k in keys]  # [NB, n_kv, bs, hd] views, positions contiguous
            self.v = [torch.empty((total, num_kv_heads, block_size, head_dim), dtype=dtype) for _ in range(num_layers)]
        except RuntimeError as exc:
            need = 2 * num_layers * total * num_kv_heads * block_size * head_dim * dtype.itemsize
            raise ConfigError(f"the KV cache of {num_blocks} blocks x {block_size} tokens needs "
                              f"{need / 2**30:,.1f} GiB: out of memory; lower --kv-cache-memory-mb") from exc
        self.num_slots = num_slots
        self.spare_slot = None
        self.max_len = max_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.lengths = [0] * num_slots
        self.finite = [max_len] * num_slots  # nothing to zero: the kernel never reads an unwritten value
        self._free = list(range(num_slots - 1, -1, -1))
        self.max_blocks = -(-max_len // block_size)
        self.block_table = torch.zeros(num_slots, self.max_blocks, dtype=torch.int64)  # [S, nb], 0 = none
        self.blocks: list[list[int]] = [[] for _ in range(num_slots)]
        self.reserved = [0] * num_slots  # positions reserved for the coming forward
        self._free_blocks = list(range(num_blocks, 0, -1))  # pop() hands out block 1 first
        # each slot's slack (blocks past what it keeps: ``_kept``) and their sum, kept up to date at
        # every change of a slot's blocks, length or reservation: the scheduler asks for the free
        # blocks once per prompt chunk, and summing over every slot then made admission quadratic
        self._slack = [0] * num_slots
        self._total_slack = 0
        self._refs = [0] * total  # holders of each block: sequences' tables and the prefix cache
        self._held = [False] * total  # the prefix cache holds it
        self._idle = 0  # blocks only the prefix cache holds (free for admission, evicted on demand)
        # set by the prefix cache: let go of idle blocks, least recently used first, until this
        # many more are on the free list (or none is left)
        self.evict_idle: Callable[[int], None] | None = None

    @property
    def paged(self) -> bool:
        return True

    @property
    def capacity(self) -> int:
        """Positions the whole pool holds (the longest sequence it can ever serve, alone)."""
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (free, or idle in the prefix cache), plus the slack ``reserve``
        would take back."""
        return len(self._free_blocks) + self._total_slack + self._idle

    @property
    def num_idle_blocks(self) -> int:
        """Blocks only the prefix cache holds."""
        return self._idle

    def refs(self, block: int) -> int:
        """How many holders ``block`` has (sequences and the prefix cache)."""
        return self._refs[block]

    def _acquire(self, block: int) -> None:
        """One more holder of ``block``."""
        self._refs[block] += 1
        if self._held[block] and self._refs[block] == 2:
            self._idle -= 1

    def _drop(self, block: int) -> None:
        """One holder fewer; the last one gives the block back to the free list."""
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free_blocks.append(block)
        elif self._held[block] and self._refs[block] == 1:
            self._idle += 1

    def hold(self, block: int) -> None:
        """The prefix cache keeps ``block`` (a sequence's full block, final K/V) past its sequence."""
        if self._held[block] or self._refs[block] < 1:
            raise ValueError(f"block {block} is {'held already' if self._held[block] else 'free'}")
        self._held[block] = True
        self._refs[block] += 1

    def unhold(self, block: int) -> None:
        """The prefix cache lets go of ``block``; free again when no sequence holds it."""
        if not self._held[block]:
            raise ValueError(f"block {block} is not held")
        if self._refs[block] == 1:
            self._idle -= 1
        self._held[block] = False
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free_blocks.append(block)

    def share(self, slot: int, blocks: list[int]) -> None:
        """Start the empty ``slot`` with ``blocks`` (each holding final K/V of a full block, e.g. a
        cached prefix): its first ``len(blocks) * block_size`` positions, written and final."""
        if self.blocks[slot] or self.lengths[slot]:
            raise ValueError(f"slot {slot} is not empty: it cannot start with shared blocks")
        n = len(blocks) * self.block_size
        if n > self.max_len:
            raise ValueError(f"{n} shared positions past the longest sequence, {self.max_len}")
        free = [block for block in blocks if self._refs[block] < 1]
        if free:  # checked before anything changes: a refused share leaves the slot empty
            raise ValueError(f"blocks {free} are free: only a held block can be shared")
        for i, block in enumerate(blocks):
            self._acquire(block)
            self.block_table[slot, i] = block
        self.blocks[slot].extend(blocks)
        self.set_length(slot, n)

    def blocks_for(self, positions: int) -> int:
        """Blocks that ``positions`` positions take. Example (blocks of 16): 33 -> 3."""
        return -(-positions // self.block_size)

    def _kept(self, slot: int) -> int:
        """Blocks of ``slot`` in use: its length's, or what was reserved for the coming forward."""
        return min(len(self.blocks[slot]), self.blocks_for(max(self.lengths[slot], self.reserved[slot])))

    def _recount(self, slot: int) -> None:
        """Bring ``slot``'s slack and the total up to date after its blocks, length or reservation changed."""
        slack = len(self.blocks[slot]) - self._kept(slot)
        self._total_slack += slack - self._slack[slot]
        self._slack[slot] = slack

    def reserve(self, slot: int, upto: int) -> bool:
        """Blocks for positions ``[0, upto)`` of ``slot`` (taking back other sequences' slack when the
        pool is dry); False when the pool cannot give them all (the slot keeps what it got)."""
        if upto > self.max_len:
            raise ValueError(f"position {upto} past the longest sequence, {self.max_len}")
        self.reserved[slot] = max(self.reserved[slot], upto)
        held = self.blocks[slot]
        need = self.blocks_for(upto) - len(held)
        if need > len(self._free_blocks):
            self._reclaim()
        if need > len(self._free_blocks) and self._idle and self.evict_idle is not None:
            self.evict_idle(need - len(self._free_blocks))
        while need > 0 and self._free_blocks:
            block = self._free_blocks.pop()
            self._acquire(block)
            self.block_table[slot, len(held)] = block
            held.append(block)
            need -= 1
        self._recount(slot)
        return need <= 0

    def _reclaim(self) -> None:
        """Take back every sequence's slack: blocks wholly past its length and its reservation."""
        for slot, held in enumerate(self.blocks):
            keep = self._kept(slot)
            if len(held) > keep:
                for block in reversed(held[keep:]):
                    self._drop(block)
                self.block_table[slot, keep:len(held)] = 0
                del held[keep:]
            self._recount(slot)

    def room(self, slot: int) -> int:
        """Positions ``slot`` could reach now: its blocks and every free or reclaimable one."""
        return min(self.max_len, (len(self.blocks[slot]) + self.num_free_blocks) * self.block_size)

    def allocate(self) -> int | None:
        slot = super().allocate()
        if slot is not None:
            self.reserved[slot] = 0
            self._recount(slot)
        return slot

    def free(self, slot: int) -> None:
        super().free(slot)
        self.release(slot)

    def release(self, slot: int) -> None:
        """Give back every block of ``slot`` (a freed sequence's, or what a warm-up wrote into a free slot)."""
        held = self.blocks[slot]
        for block in reversed(held):
            self._drop(block)
        self.block_table[slot, :len(held)] = 0
        held.clear()
        self.reserved[slot] = 0
        self.lengths[slot] = 0
        self._recount(slot)

    def set_length(self, slot: int, length: int) -> None:
        super().set_length(slot, length)
        self.reserved[slot] = 0  # the forward ran: from now on the length says what is in use
        self._recount(slot)

    def locate(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, row) of positions ``start .. end - 1`` of ``slot``: two [end - start] int64 tensors."""
        pos = torch.arange(start, end, dtype=torch.int64)
        return self.block_table[slot, pos // self.block_size], pos % self.block_size

    def make_readable(self, slots: list[int], upto: int) -> None:
        """Nothing to do: the exact kernel never does arithmetic on a masked key's value."""

    def mark_written(self, slot: int, upto: int) -> None:
        """Nothing to do (``make_readable``)."""

    def compact(self, slot: int, src: list[int], dst_start: int) -> None:
        """Move K/V at offsets ``src`` (ascending) to ``dst_start, dst_start+1, ...`` in every layer."""
        if not src or src == list(range(dst_start, dst_start + len(src))):
            return
        idx = torch.tensor(src, dtype=torch.int64)
        sb, so = self.block_table[slot, idx // self.block_size], idx % self.block_size
        db, do = self.locate(slot, dst_start, dst_start + len(src))
        for k, v in zip(self.k, self.v):
            k[db, :, do] = k[sb, :, so]  # the gather copies first: sources overwritten later are read already
            v[db, :, do] = v[sb, :, so]

    def usage(self) -> float:
        """Fraction of the pool's blocks in use by sequences, as vLLM's ``kv_cache_usage``: a block
        several share counts once; free, idle (only the prefix cache holds it) and slack do not."""
        return (self.num_blocks - self.num_free_blocks) / float(self.num_blocks)


def paged_kv_cache(cfg: TargetConfig, num_slots: int, max_len: int, dtype: torch.dtype, block_size: int,
                   memory: int = 0, overcommit: bool = False) -> PagedKVCache:
    """The paged cache of a target: ``memory`` bytes of blocks (``--kv-cache-memory-mb``), or by default
    room for every slot's full length, capped at 90 % of the memory available now (then fewer
    sequences run at once than ``--max-num-seqs`` when they grow long; the scheduler preempts).

    Example: SmolLM2-135M in float32, blocks of 16: 2 x 30 x 3 x 16 x 64 x 4 = 737,280 bytes a block;
    512 MiB -> 728 blocks = 11,648 tokens, e.g. 45 sequences of 256 (a slot cache of --max-model-len
    2048 fits 5 sequences in the same memory)."""
    per_block = 2 * cfg.num_layers * cfg.num_kv_heads * block_size * cfg.head_dim * dtype.itemsize
    worst = num_slots * -(-max_len // block_size)
    available = available_memory()
    if memory:
        blocks = memory // per_block
        if not overcommit and blocks * per_block > available:
            raise ConfigError(f"--kv-cache-memory-mb {memory // 2**20} is more than the {available / 2**30:,.1f} GiB of "
                              f"memory available; lower it, or pass --kv-overcommit")
    else:
        blocks = worst if overcommit else min(worst, int(0.9 * available) // per_block)
        if blocks < worst:
            log.info("KV cache: %d blocks of %d tokens (%.1f GiB, 90%% of the memory available) hold %d of the %d "
                     "tokens --max-num-seqs x --max-model-len would reserve; sequences beyond wait or are preempted",
                     blocks, block_size, blocks * per_block / 2**30, blocks * block_size, worst * block_size)
    # a running sequence holds at least one block: more slots than blocks would never all be used
    return PagedKVCache(cfg.num_layers, min(num_slots, max(1, blocks)), max_len, cfg.num_kv_heads, cfg.head_dim,
                        dtype, block_size, blocks)
