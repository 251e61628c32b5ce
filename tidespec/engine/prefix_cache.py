"""Automatic prefix caching: which cached block holds which prefix, least recently used evicted.

Why this exists: users of an OpenAI-compatible server resend the same system prompt, few-shot
block or chat history with every request, and recomputing it is most of their time to first
token. As in vLLM, a prompt is cut into full blocks of ``block_size`` tokens and a block is named
by its tokens *and* the block before it (here: the cached parent's id), so one lookup per block
walks the longest cached prefix. The K/V stays where it is (``models/kv/blocks.py``): over the
paged cache a cached block *is* the sequence's block, kept past it and shared with every prompt
that hits it (``SharedBlocks``: no copy, one copy of a shared system prompt in memory however many
requests use it); beside a slot cache it is copied into a pool of its own (``KVBlockPool``).
Blocks are saved when a prompt's prefill completes and when a request finishes (its output too:
a multi-turn chat resends it as history), and evicted least recently used; a match touches its
blocks last-first, so a shared root outlives the leaves that hang from it, and evicting a block
evicts the blocks that can only be reached through it.

Lossless: a hit gives a prompt exactly the K/V its own prefill would have computed only when the
target is row-invariant (each row's bits do not depend on the other rows of the forward, so a
prompt computed in chunks equals one computed whole); the engine turns the cache on only then.
At least one prompt token is always computed: its logits give the first output token.

Side rows: a drafter that reads the target's taps (EAGLE-3) or final hidden states gets them for
the prompt in prefill. So the cache also keeps those rows per block, recorded from the
observations (``record``), and a match only uses blocks that hold every side row the engine needs
now; the engine hands the loaded rows to the drafter as one observation of the cached positions,
so the drafter's state is what a full prefill would have left.

Worked example (blocks of 4 tokens)::

    pc = PrefixCache(pool)                       # e.g. KVBlockPool(kv, num_blocks=64, block_size=4)
    pc.match([1, 2, 3, 4, 5, 6, 7, 8, 9])        # [] (nothing cached yet)
    # a sequence with that prompt is prefilled in slot 0, then:
    pc.insert(seq_id=7, slot=0, tokens=[1, 2, 3, 4, 5, 6, 7, 8, 9], num_final=9)   # 2 blocks saved
    pc.match([1, 2, 3, 4, 5, 6, 7, 8, 42])      # both blocks: 8 tokens reused, 1 computed
    pc.match([1, 2, 3, 4, 5, 6, 7, 8])          # 1 block: the last prompt token is always computed
    pc.match([1, 2, 3, 5, 5, 6, 7, 8, 9])       # []: the first block differs
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from tidespec.config import CacheConfig
from tidespec.models.execution.invariance import InvarianceReport
from tidespec.models.kv.blocks import KVBlockPool, SharedBlocks
from tidespec.models.kv.cache import KVCache, available_memory
from tidespec.models.kv.paged import PagedKVCache

log = logging.getLogger(__name__)

ROOT = 0  # the parent id of a prompt's first block


@dataclass(eq=False)
class CachedBlock:
    """One cached block: ``tokens`` at its positions, after the prefix its ``parent`` names."""

    uid: int
    parent: int  # uid of the block before it, ROOT for a prompt's first block
    tokens: tuple[int, ...]
    index: int  # its block in the store (the paged cache's block id, or a row of the pool)
    side: frozenset[str]  # side rows it holds ("taps", "hidden")
    children: set[int] = field(default_factory=set)


@dataclass
class _Coverage:
    """A sequence's side rows of one kind, contiguous from position 0 (``end`` positions so far)."""

    rows: list[torch.Tensor] = field(default_factory=list)  # each [n, width]
    end: int = 0
    open: bool = True  # False after a hole: later rows cannot extend it

    def take(self, upto: int) -> torch.Tensor:
        """The rows of positions ``[0, upto)`` as one tensor ``[upto, width]``."""
        if len(self.rows) > 1:
            self.rows = [torch.cat(self.rows)]
        return self.rows[0][:upto]


class PrefixCache:
    """The hash chain over a block store's blocks; see the module docstring."""

    def __init__(self, pool: KVBlockPool | SharedBlocks) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.blocks: OrderedDict[int, CachedBlock] = OrderedDict()  # uid -> block, least recently used first
        self.index: dict[tuple[int, tuple[int, ...]], CachedBlock] = {}  # (parent uid, tokens) -> block
        if isinstance(pool, SharedBlocks):  # the paged cache asks for its idle blocks when it runs dry
            pool.kv.evict_idle = self._evict_idle
        self._uids = itertools.count(ROOT + 1)
        self._coverage: dict[int, dict[str, _Coverage]] = {}  # seq_id -> side rows seen from position 0
        self.num_evicted = 0  # blocks evicted so far
        self.query_tokens = 0  # prompt tokens looked up (``reuse``)
        self.hit_tokens = 0  # of those, reused

    @property
    def num_cached_blocks(self) -> int:
        return len(self.blocks)

    def usage(self) -> float:
        """Fraction of the pool's blocks holding a cached prefix."""
        return len(self.blocks) / self.pool.num_blocks

    # ----------------------------------------------------------------- reuse
    def match(self, tokens: list[int], need: frozenset[str] = frozenset()) -> list[CachedBlock]:
        """The cached blocks of the longest prefix of ``tokens`` (never all of them: the last token
        is always computed), each holding the side rows ``need`` names. Changes nothing."""
        b = self.block_size
        parent, out = ROOT, []
        for i in range((len(tokens) - 1) // b):
            block = self.index.get((parent, tuple(tokens[i * b:(i + 1) * b])))
            if block is None or not need <= block.side:
                break
            out.append(block)
            parent = block.uid
        return out

    def reuse(self, seq_id: int, slot: int, tokens: list[int],
              need: frozenset[str] = frozenset()) -> tuple[int, dict[str, torch.Tensor]]:
        """``match`` then ``load``, counted: the prompt tokens now in ``slot`` and their side rows."""
        self.query_tokens += len(tokens)
        blocks = self.match(tokens, need)
        if not blocks:
            return 0, {}
        side = self.load(seq_id, slot, blocks, need)
        self.hit_tokens += len(blocks) * self.block_size
        return len(blocks) * self.block_size, side

    def load(self, seq_id: int, slot: int, blocks: list[CachedBlock],
             need: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
        """Put ``blocks`` (a ``match``) at the start of ``slot`` (shared, or copied; its length becomes
        theirs) and return their side rows ``need`` names, ``[n * block_size, width]`` each; the sequence's side
        rows are recorded from there on (``record``)."""
        side = self.pool.load(slot, [blk.index for blk in blocks], tuple(sorted(need)))
        self._touch(blocks)
        self._coverage.pop(seq_id, None)
        if side:
            self.record(seq_id, 0, side)
        return side

    # ----------------------------------------------------------------- saving
    def record(self, seq_id: int, start: int, rows: dict[str, torch.Tensor]) -> None:
        """Side rows of a sequence's positions ``start ..``: kept while they extend what was seen
        from position 0, so the blocks saved later carry them. Example: rows at 0..9, then 10..14,
        then 20..21 (a hole) -> taps for positions 0..14 only."""
        if not rows and seq_id not in self._coverage:
            return  # nothing recorded for it, nothing to close (a target without taps: every step)
        cov = self._coverage.setdefault(seq_id, {})
        for name, t in rows.items():
            c = cov.get(name)
            if c is None:
                if start != 0:
                    cov[name] = _Coverage(open=False)
                    continue
                c = cov[name] = _Coverage()
            if c.open and start == c.end:
                c.rows.append(t)
                c.end += int(t.shape[0])
            elif start + int(t.shape[0]) > c.end:
                c.open = False
        for name, c in cov.items():  # a kind this step lacks is a hole in it
            if name not in rows and c.open:
                c.open = False

    def forget(self, seq_id: int) -> None:
        """Drop a finished sequence's recorded side rows."""
        self._coverage.pop(seq_id, None)

    def insert(self, seq_id: int, slot: int, tokens: list[int], num_final: int) -> int:
        """Save the full blocks of ``tokens[:num_final]`` (final K/V in ``slot``) that are not cached
        yet, with the side rows recorded for them; a cached block that lacks a side row now
        recorded gets it. Returns the blocks saved. Evicts least recently used blocks for room,
        never one of this prefix's."""
        b = self.block_size
        cov = self._coverage.get(seq_id, {})
        parent, chain = ROOT, []
        new: list[tuple[int, CachedBlock]] = []  # (block number, block) to copy, ascending
        upgrades: list[tuple[int, CachedBlock, frozenset[str]]] = []
        try:  # until the new blocks are registered, a failure gives back every one claimed
            for i in range(min(num_final, len(tokens)) // b):
                have = frozenset(name for name, c in cov.items() if c.end >= (i + 1) * b)
                toks = tuple(tokens[i * b:(i + 1) * b])
                block = self.index.get((parent, toks)) if not new else None  # after a new block all are new
                if block is None:
                    index = self._take({blk.uid for blk in chain}, slot, i)
                    if index is None:
                        break
                    block = CachedBlock(next(self._uids), parent, toks, index, have)
                    new.append((i, block))
                else:
                    if have - block.side:
                        upgrades.append((i, block, have | block.side))
                    self.blocks.move_to_end(block.uid)
                chain.append(block)
                parent = block.uid
            self._save(slot, new, cov)
        except Exception:
            for _, block in new:  # nothing was registered: no block half-saved
                self.pool.release(block.index)
            raise
        for _, block in new:  # registered only once their K/V is in the pool
            self.blocks[block.uid] = block
            self.index[(block.parent, block.tokens)] = block
            if block.parent in self.blocks:
                self.blocks[block.parent].children.add(block.uid)
        for i, block, side in upgrades:
            self.pool.side.save([block.index], {name: cov[name].take((i + 1) * b)[i * b:] for name in side - block.side})
            block.side = side
        self._touch(chain)
        return len(new)

    def _save(self, slot: int, new: list[tuple[int, CachedBlock]], cov: dict[str, _Coverage]) -> None:
        """Copy the new blocks (consecutive block numbers) out of ``slot``, one copy per run of
        blocks that hold the same side rows."""
        b = self.block_size
        for side, group in itertools.groupby(new, key=lambda item: item[1].side):
            run = list(group)
            first = run[0][0]
            rows = {name: cov[name].take((first + len(run)) * b)[first * b:] for name in side}
            self.pool.save(slot, first * b, [blk.index for _, blk in run], rows)

    def reset(self) -> int:
        """Drop every cached block (vLLM's ``reset_prefix_cache``), e.g. so that a benchmark times
        each prompt's prefill from a cold cache; returns how many. Sequences in flight keep what
        they loaded (a shared block stays theirs until they finish; a copied one is in their slot)."""
        dropped = len(self.blocks)
        for block in self.blocks.values():
            self.pool.release(block.index)
        self.blocks.clear()
        self.index.clear()
        return dropped

    # ----------------------------------------------------------------- eviction
    def _touch(self, chain: list[CachedBlock]) -> None:
        """Mark a prefix used, its first block most recently (leaves are evicted before roots)."""
        for block in reversed(chain):
            if block.uid in self.blocks:
                self.blocks.move_to_end(block.uid)

    def _take(self, keep: set[int], slot: int, number: int) -> int | None:
        """The store's block for block ``number`` of ``slot``: the slot's own (shared), or a free pool
        row, evicting the least recently used block (and what hangs from it) when none is free;
        None when only blocks of ``keep`` are left."""
        index = self.pool.claim(slot, number)
        while index is None:
            victim = next((blk for blk in self.blocks.values() if blk.uid not in keep), None)
            if victim is None:
                return None
            self._evict(victim)
            index = self.pool.claim(slot, number)
        return index

    def _evict_idle(self, n: int) -> None:
        """Shared blocks, the paged cache ran dry: evict least recently used blocks that only the
        cache holds until ``n`` are free again, or none is left. A block some sequence holds frees
        nothing: the scan moves it to the back (it is in use, so recently used)."""
        freed = 0
        while freed < n and self.blocks:
            busy, victim = [], None
            for blk in self.blocks.values():
                if self.pool.idle(blk.index):
                    victim = blk
                    break
                busy.append(blk)
            for blk in busy:
                self.blocks.move_to_end(blk.uid)
            if victim is None:
                return
            freed += self._evict(victim)

    def _evict(self, block: CachedBlock) -> int:
        """Drop ``block`` and every block reachable only through it (iteratively: a chain may be
        thousands of blocks long); returns how many blocks that freed (shared blocks that a
        sequence still holds stay its own)."""
        if block.parent in self.blocks:
            self.blocks[block.parent].children.discard(block.uid)
        stack, freed = [block], 0
        while stack:
            blk = stack.pop()
            stack.extend(self.blocks[child] for child in blk.children)
            del self.blocks[blk.uid]
            del self.index[(blk.parent, blk.tokens)]
            freed += self.pool.release(blk.index)
            self.num_evicted += 1
        return freed


def build_prefix_cache(kv: KVCache, cfg: CacheConfig, invariance: InvarianceReport, hidden_size: int,
                       num_taps: int) -> PrefixCache | None:
    """The engine's prefix cache, or None when it is turned off or would not be lossless: only a
    row-invariant target computes a prompt's K/V bit for bit the same in chunks as whole.

    Over a paged cache it keeps the cache's own blocks (``SharedBlocks``): as many as the cache
    holds, evicted when sequences need the blocks. A cached block's side rows (``num_taps`` taps
    and the final hidden state per position, for the drafters) take memory beyond the cache's.
    Beside a slot cache its blocks fill ``--prefix-cache-mb`` (side rows counted); on a CPU at
    most half the memory available now.

    Example: SmolLM2-135M in float32 with EAGLE-3 (3 taps of 576) beside a slot cache, 1,024 MiB ->
    blocks of 16 at (2 x 30 x 3 x 64 + 4 x 576) x 16 x 4 bytes = 884,736 bytes: 1,213 blocks,
    19,408 tokens."""
    if not cfg.enable_prefix_caching:
        return None
    if not invariance.batch_invariant:
        log.info("prefix caching off: the target is not row-invariant (%s), so a reused prefix could change "
                 "greedy outputs at near-ties", invariance.attention)
        return None
    if isinstance(kv, PagedKVCache):
        log.info("prefix cache: the KV cache's own blocks, shared (side rows up to %.0f KiB a cached block)",
                 SharedBlocks.side_bytes(kv, hidden_size * (num_taps + 1)) / 1024)
        return PrefixCache(SharedBlocks(kv))
    per_block = KVBlockPool.block_bytes(kv, cfg.block_size, hidden_size * (num_taps + 1))
    budget = cfg.prefix_cache_mb * 2**20
    if kv.k[0].device.type == "cpu":
        budget = min(budget, available_memory() // 2)
    num_blocks = budget // per_block
    if num_blocks < 1:
        log.warning("prefix caching off: %d MiB holds no block of %d tokens (%d bytes)", budget // 2**20,
                    cfg.block_size, per_block)
        return None
    log.info("prefix cache: %d blocks of %d tokens (%.0f MiB)", num_blocks, cfg.block_size,
             num_blocks * per_block / 2**20)
    return PrefixCache(KVBlockPool(kv, num_blocks, cfg.block_size))
