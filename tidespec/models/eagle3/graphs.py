"""CUDA graphs of the EAGLE-3 head: the catch-up forward and a whole greedy drafting chain.

Why this exists: on a GPU an eager head step is ~30 small kernels plus a host read of the drafted
token, so a chain of gamma drafts cost ~70 ms on an H100 where its arithmetic takes microseconds
(docs/benchmarks/gpu.md: EAGLE-3 at 0.06x plain decoding, drafting launch-bound). Here the
two forwards a greedy proposal needs are replayed from CUDA graphs, laid out like the target's
(``models/execution/graphs.py``: a static block of ``B`` KV slots x ``q`` rows, padding rows writing into the
head cache's spare slot, keys ``[0, L)`` of the first ``B`` slots):

* ``catch_up``: the head's forward over the tap rows that became final since the last proposal
  (``q`` rows per sequence: the accepted tokens and the bonus), graph ``("catch", B, q, L)``;
  returns each sequence's last pre-norm output and logits, where its chain starts.
* ``chain``: ``gamma`` greedy drafts for every sequence, graph ``("chain", B, gamma, L)``: argmax,
  draft id -> target id (``d2t``), the target's embedding of it, the head's step at the next
  position, ``gamma - 1`` times, all on the device; the drafted ids and each step's top
  probability (for ``min_draft_prob``) come back in one host read per proposal.

Sampled chains, trees and a dynamic draft vocabulary (whose size changes between steps) stay on
the drafter's eager path, as does anything no graph fits (more rows, a key range past the cache);
the methods then return None. ``warm_up`` captures the graphs when the engine is built (per batch
bucket x key bucket: catch-ups of 1 .. gamma + 1 rows, chains of 1 .. gamma drafts); a shape it did
not capture is captured on first use. ``capture=False`` runs the same static bodies
eagerly: the CPU tests check the layout that way against the drafter's eager path.

Worked example (sequences in head slots 0 and 2, one accepted token each, gamma 3)::

    g = HeadGraphs(head, embed, kv)              # kv: KVCache(..., spare_slot=True) on the GPU
    hidden, logits = g.catch_up(taps, [t1, t2], q_lens=[2, 2], ctx_lens=[40, 17], slots=[0, 2])
    ids, top = g.chain(hidden, logits, ctx_lens=[42, 19], slots=[0, 2], gamma=3)
    # ids == [[a1, a2, a3], [b1, b2, b3]] target ids; top[i][j] the head's probability of ids[i][j]
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tidespec.models.eagle3.head import Eagle3Head
from tidespec.models.execution.graphs import SlotBlockLayout, batch_buckets, block_rows, capture_graph, key_buckets
from tidespec.models.kv.cache import KVCache

MAX_CATCH_UP_ROWS = 16  # rows per sequence a catch-up graph takes (more: the eager forward)
MAX_CHAIN = 16  # the longest chain a graph drafts

_Body = Callable[[], tuple[torch.Tensor, ...]]  # a graph's body: its static outputs over the input buffers


def _catch_forward(head: Eagle3Head, embed: nn.Embedding, taps: torch.Tensor, ids: torch.Tensor,
                   layout: SlotBlockLayout, k: list[torch.Tensor], v: list[torch.Tensor],
                   last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over a block's tap rows ``taps`` [n, 3H] and tokens ``ids`` [n] -> the rows ``last``
    [B]: (pre-norm output [B, H], logits [B, Vd]). What ``compile=True`` compiles."""
    out = head.run(head.fuse(taps), embed(ids).to(taps.dtype), layout, k, v)  # [n, H]
    root = out.index_select(0, last)
    return root, head.logits(root)


def _pick(head: Eagle3Head, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy drafts from logits [B, Vd] -> (target ids [B], their probability under the head [B])."""
    return head.draft_to_target(logits.argmax(dim=-1)), torch.softmax(logits.float(), dim=-1).amax(dim=-1)


def _chain_forward(head: Eagle3Head, embed: nn.Embedding, hidden: torch.Tensor, ids: torch.Tensor,
                   layout: SlotBlockLayout, k: list[torch.Tensor],
                   v: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One chain step: the previous output ``hidden`` [B, H] and the drafted ``ids`` [B] -> (the
    head's output [B, H], logits [B, Vd]) at the drafts' positions."""
    out = head.run(hidden, embed(ids).to(hidden.dtype), layout, k, v)
    return out, head.logits(out)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: the body ran uncaptured (capture=False)
    outputs: tuple[torch.Tensor, ...]  # the body's static outputs (the next replay overwrites them)


class HeadGraphs:
    """The head's catch-up and greedy chains replayed from CUDA graphs (see the module docstring)."""

    def __init__(self, head: Eagle3Head, embed: nn.Embedding, kv: KVCache, capture: bool = True,
                 compile: bool = False) -> None:
        if kv.spare_slot is None:
            raise ValueError("HeadGraphs needs a KVCache with a spare slot (KVCache(spare_slot=True))")
        if embed.weight.device != head.device:
            raise ValueError(f"the embedding ({embed.weight.device}) must be on the head's device ({head.device})")
        self.head, self.embed, self.kv, self.capture = head, embed, kv, capture
        self.batches = batch_buckets(kv.num_slots)
        self.key_lens = key_buckets(kv.max_len)
        device, cfg = head.device, head.cfg
        self.S = slots = self.batches[-1]
        self.R = rows = slots * MAX_CATCH_UP_ROWS
        # Every field sits at a fixed offset (a view's offset never depends on the block's size, so
        # a compiled body sees the same storage offsets every call and inductor does not recompile),
        # and in inference mode, where the drafter calls the graphs (one dispatch key set).
        with torch.inference_mode():
            # catch-up: ids, positions, write slots, write offsets at 0, R, 2R, 3R (rows each); ctx
            # and last row at 4R, 4R + S (slots each); what the host gathers with: each tap row's
            # block row at 4R + 2S, the sequences' slots at 5R + 2S
            self.catch_in = torch.zeros(5 * rows + 3 * slots, dtype=torch.int64, device=device)
            self.taps_in = torch.zeros(rows, cfg.tap_size, dtype=head.dtype, device=device)  # [R, 3H]
            # chain: ctx, write slot per slot and the sequences' slots at 0, S, 2S; the roots' output and logits
            self.chain_in = torch.zeros(3 * slots, dtype=torch.int64, device=device)
            self.hidden_in = torch.zeros(slots, cfg.hidden_size, dtype=head.dtype, device=device)  # [S, H]
            self.logits_in = torch.zeros(slots, cfg.draft_vocab_size, dtype=head.dtype, device=device)  # [S, Vd]
        self.graphs: dict[tuple[str, int, int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.window = cfg.layer_config().sliding_window
        # compiled (--compile): inductor fuses the ~40 small kernels of a head step (norms, rope,
        # SiLU, casts) into a few before the graphs capture them; dynamic shapes: a few compiles per
        # function (dimensions of size 1 specialise) serve every bucket
        self._catch, self._pick, self._step = _catch_forward, _pick, _chain_forward
        if compile:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._catch = torch.compile(_catch_forward, dynamic=True, fullgraph=True)
            self._pick = torch.compile(_pick, dynamic=True, fullgraph=True)
            self._step = torch.compile(_chain_forward, dynamic=True, fullgraph=True)
        self.num_replayed = 0  # forwards served by the static bodies

    def serves(self, head: Eagle3Head, embed: nn.Embedding, kv: KVCache) -> bool:
        """Whether these graphs were captured over exactly these modules (a rebuilt head or cache
        has other addresses; weights loaded in place keep theirs)."""
        return self.head is head and self.embed is embed and self.kv is kv

    # -- bodies (what a graph captures) ------------------------------------------------------------

    def _layout(self, positions: torch.Tensor, write_slots: torch.Tensor, write_offsets: torch.Tensor,
                ctx: torch.Tensor, batch: int, rows: int, keys: int) -> SlotBlockLayout:
        return SlotBlockLayout(positions, write_slots, write_offsets, ctx, batch, rows, keys, self.window)

    def _catch_body(self, batch: int, rows: int, keys: int) -> tuple[torch.Tensor, ...]:
        """The head over ``batch x rows`` tap rows -> each slot's last row: (pre-norm [B, H], logits [B, Vd])."""
        n, b, R, S = batch * rows, self.catch_in, self.R, self.S
        ids, pos, wslots, woffs = b[:n], b[R:R + n], b[2 * R:2 * R + n], b[3 * R:3 * R + n]
        ctx, last = b[4 * R:4 * R + batch], b[4 * R + S:4 * R + S + batch]
        layout = self._layout(pos, wslots, woffs, ctx, batch, rows, keys)
        return self._catch(self.head, self.embed, self.taps_in[:n], ids, layout, self.kv.k, self.kv.v, last)

    def _chain_body(self, batch: int, gamma: int, keys: int) -> tuple[torch.Tensor, ...]:
        """``gamma`` greedy drafts per slot -> [B, 2 * gamma] float64: target ids, then top probabilities."""
        ctx, wslots = self.chain_in[:batch], self.chain_in[self.S:self.S + batch]
        hidden, logits = self.hidden_in[:batch], self.logits_in[:batch]  # [B, H], [B, Vd]
        ids: list[torch.Tensor] = []
        tops: list[torch.Tensor] = []
        for step in range(gamma):
            drafted, top = self._pick(self.head, logits)  # [B], [B]
            ids.append(drafted)
            tops.append(top)
            if step == gamma - 1:
                break
            pos = ctx + step  # the drafted token's position: row 0 of each slot sees keys 0 .. pos
            layout = self._layout(pos, wslots, pos, pos, batch, 1, keys)
            hidden, logits = self._step(self.head, self.embed, hidden, drafted, layout, self.kv.k, self.kv.v)
        return (torch.cat([torch.stack(ids, dim=1).double(), torch.stack(tops, dim=1).double()], dim=1),)

    # -- capture and replay ------------------------------------------------------------------------

    def _prepared(self, key: tuple[str, int, int, int], body: _Body, pad: Callable[[], None]) -> _Graph | None:
        """``key``'s graph, captured over padding inputs (``pad``: the warm-up and the capture
        write only into the spare slot) the first time; None when not capturing."""
        if not self.capture:
            return None
        found = self.graphs.get(key)
        if found is None:
            pad()
            found = self.graphs[key] = _Graph(*capture_graph(body, self.head.device, self.pool))
        return found

    def _replay(self, graph: _Graph | None, body: _Body) -> tuple[torch.Tensor, ...]:
        """The body's outputs over the current inputs: the graph replayed, or the body run."""
        self.num_replayed += 1
        if graph is None:
            return body()
        assert graph.graph is not None
        graph.graph.replay()
        return graph.outputs

    def _catch_graph(self, batch: int, rows: int, keys: int) -> tuple[_Graph | None, _Body]:
        """The catch-up graph of a block (captured now if new) and its body."""
        n = batch * rows

        def pad() -> None:
            R, S = self.R, self.S
            self.catch_in.zero_()
            self.catch_in[2 * R:2 * R + n] = self.kv.spare_slot
            self.catch_in[4 * R + S:4 * R + S + batch] = torch.arange(batch, device=self.catch_in.device) * rows

        def body() -> tuple[torch.Tensor, ...]:
            return self._catch_body(batch, rows, keys)

        return self._prepared(("catch", batch, rows, keys), body, pad), body

    def _chain_graph(self, batch: int, gamma: int, keys: int) -> tuple[_Graph | None, _Body]:
        """The chain graph of a block (captured now if new) and its body."""
        def pad() -> None:
            self.chain_in.zero_()
            self.chain_in[self.S:self.S + batch] = self.kv.spare_slot

        def body() -> tuple[torch.Tensor, ...]:
            return self._chain_body(batch, gamma, keys)

        return self._prepared(("chain", batch, gamma, keys), body, pad), body

    @torch.inference_mode()
    def warm_up(self, max_gamma: int) -> float:
        """Capture now every graph chains of up to ``max_gamma`` drafts need (catch-ups of up to
        ``max_gamma + 1`` rows), largest first: the first requests never wait on a capture.
        Returns seconds."""
        t0 = time.perf_counter()
        if self.capture:
            for batch in reversed(self.batches):
                for keys in reversed(self.key_lens):
                    for rows in range(min(max_gamma + 1, MAX_CATCH_UP_ROWS), 0, -1):
                        self._catch_graph(batch, rows, keys)
                    for gamma in range(min(max_gamma, MAX_CHAIN), 0, -1):
                        self._chain_graph(batch, gamma, keys)
        return time.perf_counter() - t0

    def _bucket(self, slots: list[int], need_keys: int) -> tuple[int, int] | None:
        """(batch bucket, key bucket) holding these slots and keys, or None."""
        bi = bisect.bisect_left(self.batches, max(slots) + 1)
        ki = bisect.bisect_left(self.key_lens, need_keys)
        if bi == len(self.batches) or ki == len(self.key_lens):
            return None
        return self.batches[bi], self.key_lens[ki]

    @staticmethod
    def _fill(buffer: torch.Tensor, fields: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Write each (offset, values) field into an int64 input buffer (one host-to-device copy
        of a host array laid out like it)."""
        host = np.zeros(buffer.shape[0], dtype=np.int64)
        for offset, values in fields:
            host[offset:offset + len(values)] = values
        buffer.copy_(torch.from_numpy(host), non_blocking=True)
        return buffer

    @torch.inference_mode()
    def catch_up(self, taps: torch.Tensor, tokens: list[int], q_lens: list[int], ctx_lens: list[int],
                 slots: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The head's K/V for ``q_lens[j]`` new positions of each sequence (``taps`` [T, 3H] and
        ``tokens`` [T] in sequence order, head positions ``ctx_lens[j]`` on, in slot ``slots[j]``)
        -> (pre-norm output [J, H], logits [J, Vd]) at each sequence's last new position, or None
        when no graph fits."""
        rows = max(q_lens)
        found = self._bucket(slots, max(c + q for c, q in zip(ctx_lens, q_lens)))
        if found is None or rows > MAX_CATCH_UP_ROWS:
            return None
        batch, keys = found
        assert self.kv.spare_slot is not None
        blk = block_rows(tokens, q_lens, ctx_lens, slots, batch, rows, self.kv.spare_slot)
        last = [s * rows for s in range(batch)]  # each slot's last new row (padding: its first)
        for q, s in zip(q_lens, slots):
            last[s] = s * rows + q - 1
        kept = blk.kept  # the block row of each tap row

        graph, body = self._catch_graph(batch, rows, keys)
        self.kv.make_readable(list(range(batch)), keys)  # a no-op on a GPU, whose cache starts zeroed
        R, S = self.R, self.S
        b = self._fill(self.catch_in, [(0, blk.ids), (R, blk.positions), (2 * R, blk.write_slots),
                                       (3 * R, blk.write_offsets), (4 * R, blk.ctx), (4 * R + S, last),
                                       (4 * R + 2 * S, kept), (5 * R + 2 * S, slots)])
        self.taps_in.index_copy_(0, b[4 * R + 2 * S:4 * R + 2 * S + len(kept)], taps)
        root, logits = self._replay(graph, body)
        where = b[5 * R + 2 * S:5 * R + 2 * S + len(slots)]  # [J] each sequence's slot
        return root.index_select(0, where), logits.index_select(0, where)

    @torch.inference_mode()
    def chain(self, hidden: torch.Tensor, logits: torch.Tensor, ctx_lens: list[int], slots: list[int],
              gamma: int) -> tuple[list[list[int]], list[list[float]]] | None:
        """``gamma`` greedy drafts for each sequence from its root output (``hidden`` [J, H],
        ``logits`` [J, Vd], the head position after it ``ctx_lens[j]``, slot ``slots[j]``) ->
        (target ids [J][gamma], the head's top probability at each draft [J][gamma]), or None
        when no graph fits. The drafts' K/V land past ``ctx_lens`` and are simply forgotten."""
        found = self._bucket(slots, max(ctx_lens) + gamma)
        if found is None or not 1 <= gamma <= MAX_CHAIN:
            return None
        batch, keys = found
        spare = self.kv.spare_slot
        ctx, wslots = [0] * batch, [spare] * batch
        for c, s in zip(ctx_lens, slots):
            ctx[s], wslots[s] = c, s

        graph, body = self._chain_graph(batch, gamma, keys)
        self.kv.make_readable(list(range(batch)), keys)
        S = self.S
        where = self._fill(self.chain_in, [(0, ctx), (S, wslots), (2 * S, slots)])[2 * S:2 * S + len(slots)]  # [J]
        self.hidden_in.index_copy_(0, where, hidden)
        self.logits_in.index_copy_(0, where, logits)
        (drafts,) = self._replay(graph, body)
        rows = drafts.index_select(0, where).tolist()  # the one host read of the proposal
        return [[int(x) for x in r[:gamma]] for r in rows], [r[gamma:] for r in rows]
