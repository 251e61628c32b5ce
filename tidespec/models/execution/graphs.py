"""CUDA graphs of the decode, verification and prompt-chunk forwards, one per (batch bucket, rows per sequence, key bucket).

Why this exists: an eager decode step of a 30-layer model launches ~800 small kernels; on a GPU
the launches and the Python around them, not the arithmetic, set the step time (21 ms for the
135M shape on an H100, where its weights are read in 0.1 ms). A CUDA graph replays all of a
step's kernels with one launch (nano-vllm's ``model_runner.py`` captures one per batch size; vLLM
and SGLang do the same). A graph fixes every shape and every address, so the forward is laid out
in a static block:

* graph (B, q, L) runs ``B x q`` rows: row ``b * q + i`` is the ``i``-th new token of the
  sequence in KV slot ``b``. Slots are handed out lowest first, so a batch whose highest slot is
  below B fits the bucket ``B`` (buckets 1, 2, 4, 8, then steps of 16, up to the cache's slots).
* every sequence's ``n <= q`` new tokens (its last token plus a chain of drafts) fill the first
  ``n`` rows of its slot's block; every other row is padding: token 0, position 0, its K/V written
  into the cache's spare slot, which no sequence owns (``KVCache(spare_slot=True)``).
* attention reads the keys ``k[:B, :, :L]`` of the first ``B`` slots (a view: the cache's address
  never changes), ``L`` the smallest key bucket (256, 512, ... the cache's length) that holds
  every sequence's context plus its new tokens; the mask is computed inside the graph from each
  slot's context length and each row's ``lim`` and ``bits``: row ``i`` of slot ``b`` sees the keys
  ``0 .. ctx[b] - 1`` and the new rows ``j <= lim[i]`` whose bit ``j`` is set — ``lim = i`` and
  every bit for a chain, the ancestors for a tree (so trees of up to 63 tokens verify in the
  graphs too) — within the sliding window. Padding rows see key 0 (finite: a CUDA cache is
  zero-filled once) and are discarded.
* fixed shapes (``fixed_shape=True``, what row invariance is on a GPU): every decode and
  verification block has ``FIXED_ROWS`` (8) rows per sequence and reads the cache's whole length,
  so a plain decode step and a verification of up to 7 drafts replay the same graph of a batch
  size: each row's logits come out of the same kernels at the same shapes, whatever the other
  rows hold, and speculation cannot change a greedy token.
* a prompt chunk is such a run of new tokens too (row ``i`` sees the cache and the rows before it):
  blocks of 16, 32, 64, ... rows per sequence, of at most ``prompt_rows`` rows in all (the step's
  token budget), take prompt chunks with the sequences decoding beside them, so a prompt's prefill
  replays one graph instead of launching ~800 eager kernels (13-17 ms for an 80-token prompt on an
  H200, ``docs/benchmarks/gpu.md``). A block computes every row's logits; only the rows
  asked for (a last chunk's last row, every verification row) are returned.
* the step's inputs are one int64 buffer the host fills with one copy: ids, positions, write
  slots, write offsets, lim, bits (``B x q`` each), context lengths (``B``), and the rows to keep (``T``).
  After the replay the kept rows of logits, taps and hidden states are gathered out of the
  graph's static outputs (the next replay overwrites them). Every graph writes its logits into
  the first ``B x q`` rows of one buffer they share: a graph's own ``[B * q, V]`` float32 output
  would add up over the graphs — at 256 slots, 2,048 tokens, gamma 4 and a 49,152-token vocabulary
  (20 batch buckets x 5 row counts x 4 key buckets) to 26 GB, at the default 32 slots to 0.74 GB;
  shared, one buffer of the largest block's rows (slots x q, or ``prompt_rows``): 0.25 GB and
  0.1 GB (nano-vllm's graphs share their output buffer the same way).

Batches that fit no graph (a prompt chunk in a block over ``prompt_rows`` rows: one in a high
slot, or a long one; a tree over cached levels) run the eager forward (the runner falls back
when ``__call__`` returns None). With ``compile=True`` one decoder layer is compiled by inductor
(``dynamic=True``: one compile serves every bucket and, the weights being its inputs, every layer:
the whole model compiled took 70-160 s on the H100 machine) before the graphs capture it, as
SGLang does under ``--enable-torch-compile``. ``capture=False`` runs the same static body without graphs: the CPU
tests check the layout that way against the eager forward.

Worked example (slots 0 and 2 decoding, slot 2 verifying 2 drafts; graph B=4, q=3, L=256)::

    step = GraphStep(model, kv, tap_layers=(), max_q=3)
    step.warm_up()                                        # captures every (B, q, L) graph
    out = step([a9, b4, d1, d2], q_lens=[1, 3], ctx_lens=[40, 61], slots=[0, 2])
    # rows kept: 0 (slot 0, i=0) and 6, 7, 8 (slot 2, i=0..2); out.logits.shape == (4, V)
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from tidespec.models.kernels.attention import attend_padded
from tidespec.models.kernels.row_attention import block_mask
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import ModelOutput
from tidespec.models.target import TargetModel

log = logging.getLogger(__name__)

MIN_KEY_BUCKET = 256  # the shortest key range a graph reads
# rows per sequence of every decode and verification block when shapes are fixed (row invariance on
# a GPU): one block shape serves a sequence's decode (1 row) and its verification (1 + gamma <= 8)
FIXED_ROWS = 8
CHAIN = -1  # a row's ``bits`` when it sees every new row up to its own (all bits set)

_T = TypeVar("_T")  # what a captured body returns


def uses_graphs(device: torch.device, enforce_eager: bool) -> bool:
    """Whether forwards on ``device`` replay CUDA graphs: on a GPU, unless --enforce-eager."""
    return device.type == "cuda" and not enforce_eager


def batch_buckets(max_slots: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, then every 16, and ``max_slots`` itself.

    Example: ``batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]``."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_slots] + list(range(16, max_slots, 16))
    return sorted(set(sizes + [max_slots]))


def key_buckets(max_len: int) -> list[int]:
    """Key lengths a graph reads: powers of two from ``MIN_KEY_BUCKET``, and ``max_len`` itself.

    Example: ``key_buckets(1040) == [256, 512, 1024, 1040]``."""
    sizes = []
    length = MIN_KEY_BUCKET
    while length < max_len:
        sizes.append(length)
        length *= 2
    return sizes + [max_len]


def prompt_row_sizes(max_q: int, max_rows: int) -> list[int]:
    """Rows per sequence of the blocks that take prompt chunks: powers of two from 16, above the
    verification rows ``max_q``, up to ``max_rows`` (the most rows a prompt block holds).

    Example: ``prompt_row_sizes(5, 512) == [16, 32, 64, 128, 256, 512]``; ``prompt_row_sizes(5, 0) == []``."""
    sizes = []
    rows = 16
    while rows <= max_rows:
        if rows > max_q:
            sizes.append(rows)
        rows *= 2
    return sizes


def capture_graph(body: Callable[[], _T], device: torch.device,
                  pool: tuple[int, int] | None) -> tuple[torch.cuda.CUDAGraph, _T]:
    """A CUDA graph of ``body`` and its static outputs: two warm-up runs on a side stream first
    (cuBLAS handles, compiles happen outside the capture), then the capture into ``pool``
    (graphs sharing it reuse each other's freed memory). The caller has filled the inputs."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # no garbage collection during the capture: a collection there can free an earlier engine's
    # graphs (their reset is illegal while a stream captures, and invalidates this capture: seen on
    # an H200, where torch.cuda.graph no longer collects before it captures)
    collecting = gc.isenabled()
    gc.disable()
    try:
        # thread_local: a trainer thread using the same GPU does not break the capture
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            outputs = body()
    finally:
        if collecting:
            gc.enable()
    return graph, outputs


@dataclass
class BlockRows:
    """The host-side inputs of a static block: where each new token of each sequence goes."""

    ids: list[int]  # [B * q] token of each block row (0 on padding)
    positions: list[int]  # [B * q] its position (0 on padding)
    write_slots: list[int]  # [B * q] KV slot its K/V is written to (the spare slot on padding)
    write_offsets: list[int]  # [B * q] offset there
    lim: list[int]  # [B * q] the last of its sequence's new rows a row may see (0 on padding)
    bits: list[int]  # [B * q] which of those it sees: bit j for new row j (CHAIN: all; a tree's ancestors)
    ctx: list[int]  # [B] tokens in each slot before this forward (0 where no sequence is)
    kept: list[int]  # the block row of each token, in the order of ``tokens``


def block_rows(tokens: list[int], q_lens: list[int], ctx_lens: list[int], slots: list[int], batch: int,
               rows: int, spare: int, depths: list[list[int] | None] | None = None,
               masks: list[torch.Tensor | None] | None = None) -> BlockRows:
    """Lay the new tokens of sequences (``q_lens[j]`` of them, in ``tokens`` in sequence order, after
    ``ctx_lens[j]`` cached ones, in KV slot ``slots[j]``) into a block of ``batch`` slots x ``rows``.
    A tree sequence (``depths[j]`` its tokens' depths, ``masks[j]`` [q, q] bool its ancestor mask;
    ``block_tree`` checks that it fits) gets positions ``c + depth`` and its ancestors as ``bits``.

    Example: tokens [7, 8, 9], q_lens [1, 2], ctx_lens [5, 3], slots [0, 2], batch 4, rows 2 ->
    ids [7, 0, 0, 0, 8, 9, 0, 0], positions [5, 0, 0, 0, 3, 4, 0, 0], write slots [0, S, S, S, 2, 2,
    S, S] (S the spare slot), lim [0, 0, 0, 0, 0, 1, 0, 0], bits all CHAIN, ctx [5, 0, 3, 0], kept
    [0, 4, 5]. A 3-token tree in slot 0 (depths [0, 1, 1], rows 1 and 2 both children of row 0)
    gets positions c, c + 1, c + 1 and bits 0b1, 0b11, 0b101.
    """
    n = batch * rows
    out = BlockRows([0] * n, [0] * n, [spare] * n, [0] * n, [0] * n, [CHAIN] * n, [0] * batch, [])
    t = 0
    for j, (q, c, s) in enumerate(zip(q_lens, ctx_lens, slots)):
        out.ctx[s] = c
        depth = depths[j] if depths is not None else None
        mask = masks[j] if masks is not None else None
        tree = mask.tolist() if mask is not None else None
        for i in range(q):
            r = s * rows + i
            out.ids[r], out.write_slots[r], out.write_offsets[r] = tokens[t], s, c + i
            out.positions[r] = c + (depth[i] if depth is not None else i)
            out.lim[r] = i if tree is None else q - 1
            if tree is not None:
                out.bits[r] = sum(1 << k for k, seen in enumerate(tree[i]) if seen)
            out.kept.append(r)
            t += 1
    return out


def block_tree(q: int, depth: list[int] | None, mask: torch.Tensor | None) -> bool:
    """Whether a sequence's new tokens fit a block's in-graph mask: a chain, or a tree over its new
    tokens only (mask [q, q], depths >= 0) of at most 63 tokens (its ancestors are bits of an int64)."""
    if mask is None:
        return depth is None or all(d == i for i, d in enumerate(depth))
    return tuple(mask.shape) == (q, q) and q < 64 and depth is not None and min(depth) >= 0


@dataclass
class SlotBlockLayout:
    """The ``ForwardLayout`` of a static block: ``B`` slots x ``q`` rows, keys ``[0, L)``."""

    positions: torch.Tensor  # [B * q] int64
    write_slots: torch.Tensor  # [B * q] int64
    write_offsets: torch.Tensor  # [B * q] int64
    ctx: torch.Tensor  # [B] int64 tokens in each slot before this forward
    batch: int
    rows: int
    keys: int
    window: int | None  # the model's sliding window
    lim: torch.Tensor | None = None  # [B * q] int64 the last new row each row may see (None: a chain's, row i)
    bits: torch.Tensor | None = None  # [B * q] int64 which new rows up to ``lim`` it sees (None: all)
    row_kernel: bool = False  # attention by ``models/kernels/row_attention.py`` (needs lim and bits), not SDPA
    mask: torch.Tensor | None = field(init=False)  # [B, 1, q, L] bool, built once per forward for SDPA

    def __post_init__(self) -> None:
        """Row i of slot b sees the slot's cache (keys 0 .. ctx[b] - 1) and the new rows j <= lim[i]
        whose bit is set (a chain's row i: j = 0 .. i; a tree's: its ancestors), within the window
        (``row_attention.block_mask``)."""
        if self.lim is None or self.bits is None:  # chains (the EAGLE-3 head's graphs)
            if self.row_kernel:
                raise ValueError("the row attention kernel needs each row's lim and bits")
            self.lim = torch.arange(self.rows, device=self.ctx.device).repeat(self.batch)  # [B * q]
            self.bits = torch.full_like(self.lim, CHAIN)
        self.mask = None if self.row_kernel else block_mask(self.ctx, self.lim, self.bits, self.write_offsets,
                                                            self.rows, self.keys, self.window)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # k_cache/v_cache: [S, n_kv, Lmax, hd]; k/v: [B * q, n_kv, hd]
        k_cache[self.write_slots, :, self.write_offsets] = k
        v_cache[self.write_slots, :, self.write_offsets] = v

    def attend(self, window: int | None, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B * q, n_h, hd] -> [B * q, n_h, hd] over the keys of slots 0 .. B-1 (``window`` is in the
        mask; ``scale`` is hd ** -0.5, ``softcap`` and ``sinks`` None: the graphs take only such models,
        ``execution/executor.py``'s ``check_compilable``)."""
        if self.mask is None:  # the row kernel: a row's bits do not depend on the rest of the block
            assert self.lim is not None and self.bits is not None
            return torch.ops.tidespec_gpu.row_attention(q, k_cache, v_cache, self.ctx, self.lim, self.bits,
                                                        self.write_offsets, self.rows, self.keys,
                                                        -1 if window is None else window)
        keys = k_cache[:self.batch, :, :self.keys]  # [B, n_kv, L, hd], a view
        values = v_cache[:self.batch, :, :self.keys]
        return attend_padded(q, None, self.mask, keys, values)


def _layer_forward(layer: nn.Module, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                   layout: SlotBlockLayout, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """One decoder layer over the static block (what ``compile=True`` compiles)."""
    return layer.forward(h, rope, layout, k_cache, v_cache)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: run the body (capture=False)
    logits: torch.Tensor  # [B * q, V] float32, a view of the buffer every graph writes its logits to
    taps: torch.Tensor | None  # [B * q, num_taps * H]
    hidden: torch.Tensor  # [B * q, H]


class GraphStep:
    """Decode/verification forwards of chains replayed from CUDA graphs; ``__call__`` returns None
    for a batch no graph fits (the caller then runs the eager forward)."""

    def __init__(self, model: TargetModel, kv: KVCache, tap_layers: tuple[int, ...], max_q: int,
                 capture: bool = True, compile: bool = False, prompt_rows: int = 0,
                 fixed_shape: bool = False, row_kernel: bool = False) -> None:
        """``max_q``: rows per sequence of a verification (1 + gamma); ``prompt_rows``: the most rows
        (batch bucket x rows per sequence) a block holding a prompt chunk may have (0: prompt chunks
        run the eager forward). ``fixed_shape``: every decode and verification block has
        ``FIXED_ROWS`` rows per sequence and reads the cache's whole length, so a sequence's
        verification rows run exactly the kernels, at exactly the shapes, of its decode rows (what
        row invariance is on a GPU: ``models/execution/executor.py``). ``row_kernel``: attention by the
        fixed-order kernel of ``models/kernels/row_attention.py`` instead of SDPA (``--cuda-invariance
        row-attention``), which makes a row's bits independent of the block without fixing shapes."""
        if kv.spare_slot is None:
            raise ValueError("GraphStep needs a KVCache with a spare slot (KVCache(spare_slot=True))")
        self.model = model
        self.kv = kv
        self.tap_layers = tuple(tap_layers)
        self.max_q = max_q
        self.capture = capture
        self.fixed_shape = fixed_shape
        self.row_kernel = row_kernel
        self.batches = batch_buckets(kv.num_slots)
        self.key_lens = [kv.max_len] if fixed_shape else key_buckets(kv.max_len)
        self.device = model.device
        # rows per sequence of the verification blocks: 1 .. max_q, or the one fixed size
        verify = [FIXED_ROWS] if fixed_shape and max_q <= FIXED_ROWS else list(range(1, max_q + 1))
        self.verify_rows = verify[-1]
        self.row_sizes = verify + prompt_row_sizes(self.verify_rows, prompt_rows)
        self.prompt_rows = prompt_rows
        # the blocks with a graph: every block of verification rows, prompt blocks up to ``prompt_rows``
        self.blocks = [(b, r) for b in self.batches for r in self.row_sizes if self._fits(b, r)]
        n = max(b * r for b, r in self.blocks)
        # ids, positions, write slots, write offsets, lim, bits (n each), ctx (B), kept rows (<= n),
        # rows of logits (<= n)
        self.inputs = torch.zeros(8 * n + self.batches[-1], dtype=torch.int64, device=self.device)
        # [n, V] the logits of every graph, in its first B * q rows
        dtype = torch.promote_types(model.embed_tokens.weight.dtype, torch.float32)
        self.logits = torch.zeros(n, model.cfg.vocab_size, dtype=dtype, device=self.device)
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.num_replayed = 0  # forwards served by a graph
        self.num_declined = 0  # decode forwards handed back to eager (too many rows, slot or keys)
        # the rope table is built before any capture: a graph only reads it
        model.warm_rope(self.device, model.embed_tokens.weight.dtype)
        # compiled: one decoder layer, which serves all of them (their weights are the graph's
        # inputs), so the compile costs one layer's, not the model's; the graphs capture it
        self._layer: Callable[..., torch.Tensor] | None = None
        if compile:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._layer = torch.compile(_layer_forward, dynamic=True, fullgraph=True)

    def _run_static(self, batch: int, rows: int, keys: int) -> _Graph:
        """One forward of the static block over the input buffer's current contents."""
        n = batch * rows
        ids, positions, write_slots, write_offsets, lim, bits = self.inputs[:6 * n].view(6, n)
        layout = SlotBlockLayout(positions, write_slots, write_offsets, self.inputs[6 * n:6 * n + batch], batch, rows,
                                 keys, self.model.cfg.sliding_window, lim, bits, self.row_kernel)
        with torch.inference_mode():
            out = self.model.run(ids, layout, self.kv.k, self.kv.v, None, self.tap_layers, self._layer, self.logits)
        assert out.logits is not None
        return _Graph(None, out.logits, out.taps, out.last_hidden)

    def _graph(self, batch: int, rows: int, keys: int) -> _Graph:
        key = (batch, rows, keys)
        found = self.graphs.get(key)
        if found is not None:
            return found
        self._fill_padding(batch, rows)
        graph, out = capture_graph(lambda: self._run_static(batch, rows, keys), self.device, self.pool)
        found = _Graph(graph, out.logits, out.taps, out.hidden)
        self.graphs[key] = found
        return found

    def _fill_padding(self, batch: int, rows: int) -> None:
        """Inputs of an all-padding block (for warm-up and capture)."""
        n = batch * rows
        self.inputs.zero_()
        self.inputs[2 * n:3 * n] = self.kv.spare_slot
        self.inputs[5 * n:6 * n] = CHAIN  # padding rows see key 0 (a fully masked row would be NaN)

    def _fits(self, batch: int, rows: int) -> bool:
        """Whether a block of ``batch`` slots x ``rows`` has a graph: every verification block, and a
        prompt block of at most ``prompt_rows`` rows."""
        return rows <= self.verify_rows or batch * rows <= self.prompt_rows

    def warm_up(self) -> float:
        """Capture every graph (largest block first, so smaller ones reuse its memory). Returns seconds."""
        t0 = time.perf_counter()
        if not self.capture:
            return 0.0
        for batch, rows in sorted(self.blocks, key=lambda br: (-br[0] * br[1], -br[0])):
            for keys in reversed(self.key_lens):
                self._graph(batch, rows, keys)
        return time.perf_counter() - t0

    def __call__(self, tokens: list[int], q_lens: list[int], ctx_lens: list[int], slots: list[int],
                 tap_layers: tuple[int, ...] = (), logits_rows: list[int] | None = None,
                 depths: list[list[int] | None] | None = None,
                 masks: list[torch.Tensor | None] | None = None) -> ModelOutput | None:
        """Taps and hidden states at every row of a batch of chains, trees (``depths`` / ``masks`` per
        sequence, as ``BatchLayout.build`` takes them) and prompt chunks (rows in the order of
        ``tokens``), logits at ``logits_rows`` of them (None: every row; []: none), or None when no
        graph fits the batch."""
        ri = bisect.bisect_left(self.row_sizes, max(q_lens))
        bi = bisect.bisect_left(self.batches, max(slots) + 1)
        ki = bisect.bisect_left(self.key_lens, max(c + q for c, q in zip(ctx_lens, q_lens)))
        trees_fit = all(block_tree(q, depths[j] if depths else None, masks[j] if masks else None)
                        for j, q in enumerate(q_lens))
        if (tap_layers and tuple(tap_layers) != self.tap_layers) or ri == len(self.row_sizes) \
                or bi == len(self.batches) or ki == len(self.key_lens) or not trees_fit \
                or not self._fits(self.batches[bi], self.row_sizes[ri]):
            self.num_declined += 1
            return None
        batch, rows, keys = self.batches[bi], self.row_sizes[ri], self.key_lens[ki]
        n = batch * rows
        assert self.kv.spare_slot is not None
        blk = block_rows(tokens, q_lens, ctx_lens, slots, batch, rows, self.kv.spare_slot, depths, masks)
        kept = blk.kept
        logit_kept = [] if logits_rows is None else [kept[r] for r in logits_rows]  # block rows of the logits asked for
        self.kv.make_readable(list(range(batch)), keys)  # a no-op on a GPU, whose cache starts zeroed
        values = torch.tensor(blk.ids + blk.positions + blk.write_slots + blk.write_offsets + blk.lim + blk.bits
                              + blk.ctx + kept + logit_kept, dtype=torch.int64)
        self.inputs[:values.numel()].copy_(values, non_blocking=True)
        if self.capture:
            graph = self._graph(batch, rows, keys)
            assert graph.graph is not None
            graph.graph.replay()
        else:
            graph = self._run_static(batch, rows, keys)
        self.num_replayed += 1
        start = 6 * n + batch
        keep = self.inputs[start:start + len(kept)]  # [T] rows of the block to return
        # [R] the logits' rows: every kept row, or those asked for (written after the kept rows)
        logit_keep = keep if logits_rows is None else self.inputs[start + len(kept):start + len(kept) + len(logit_kept)]
        taps = graph.taps.index_select(0, keep) if (tap_layers and graph.taps is not None) else None
        logits = graph.logits.index_select(0, logit_keep) if logit_keep.numel() else None
        return ModelOutput(logits=logits, taps=taps, last_hidden=graph.hidden.index_select(0, keep))
