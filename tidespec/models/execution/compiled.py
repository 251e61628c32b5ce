"""The compiled decode step: ``torch.compile`` (inductor) of the target forward for decode batches.

Why this exists: an eager decode step of SmolLM2-135M is ~6,000 small ATen calls (norms, rope,
SiLU x up, residual adds, casts, views), each paying dispatch overhead that on a 2-core CPU is a
large share of the step. Inductor fuses them into a few generated C++ loops around the matmul and
attention kernels. Only decode batches are compiled (every sequence feeds its last token, plus a
chain of drafts when it speculates): prefill chunks, trees and batches whose KV slots lie far apart
run the eager forward, which shares every line of model code with this one (``DecoderModel.run``
over a ``ForwardLayout``).

Shapes: the graph is compiled with ``dynamic=True``, so one graph serves every batch size, draft
length and context length: PyTorch specializes sizes 0 and 1 only, which makes four graphs at most
(one or several sequences x one or several rows per sequence). ``warm_up`` compiles them before
the first request; inductor's cache (``TORCHINDUCTOR_CACHE_DIR`` under tidespec's cache root)
keeps the generated code across processes, so a later start only loads it. The slot range start
is passed as ``lo + LO_BIAS`` so that it is never 0 or 1 and never specialized (a slot 0 / slot 3
batch would otherwise compile twice).

Inside the graph the layout is tensors only (``StepLayout``): rope positions, the K/V write
slots and offsets, each token's row in the padded attention block, and the block's mask per layer
window (one; Gemma 2/3's sliding and global layers: two), built by
the same ``AttentionPlan`` the eager forward uses. A row-invariant target (keys stored transposed,
``models/kernels/attention.py``) gets one mask row per token instead and calls the exact attention kernel,
an op inductor leaves as it is. No host sync and no data-dependent shape in the compiled region: the same
step is what a CUDA run can capture as a graph (``mode="reduce-overhead"``).

Worked example::

    step = CompiledStep(model, kv, tap_layers=())
    step.warm_up(max_q=5)           # compiles the four graphs (printed by the caller)
    layout = BatchLayout.build([1, 5], [40, 61], [0, 1])
    out = step(ids, layout, tap_layers=())   # ModelOutput, logits at all 6 rows; None -> run eager
"""

from __future__ import annotations

import os
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tidespec.files import cache_root
from tidespec.models.kernels.attention import AttentionPlan, attend_exact, attend_padded, transposed_keys
from tidespec.models.kernels.ops import library_name
from tidespec.models.kv.cache import KVCache
from tidespec.models.kv.paged import PagedKVCache
from tidespec.models.layout import BatchLayout, ModelOutput
from tidespec.models.target import TargetModel

RECOMPILE_LIMIT = 64
# positions a cache needs beyond the longest sequence: a graph traced on a key length below the
# cache's full length is guarded on it, and reading the whole length would compile it again (the
# row-invariant padding rounds the key length up by at most 15)
KV_MARGIN = 16
LOW_PRECISION = (torch.bfloat16, torch.float16)
LO_BIAS = 2  # the slot range start enters the graph as lo + 2: never 0 or 1, so never specialized


@dataclass
class StepLayout:
    """The compiled step's ``ForwardLayout``: tensors and one symbolic int, nothing per sequence."""

    positions: torch.Tensor  # [T] int64 rope positions
    write_slots: torch.Tensor  # [T] int64 slot of each new token
    write_offsets: torch.Tensor  # [T] int64 cache offset of each new token
    q_index: torch.Tensor  # [T] int64 row of each new token in the padded [Sb * q, ...] block
    masks: tuple[torch.Tensor, ...]  # per window of ``windows``: [Sb, 1, q, Lk] bool, True = attend (slots lo ..)
    lo_biased: int  # first slot of the key range + LO_BIAS
    windows: tuple[int | None, ...]  # the model's distinct layer windows (a constant of the graph)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # k_cache/v_cache: [S, n_kv, L, hd]; k/v: [T, n_kv, hd]
        k_cache[self.write_slots, :, self.write_offsets] = k
        v_cache[self.write_slots, :, self.write_offsets] = v

    def attend(self, window: int | None, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, n_h, hd] -> [T, n_h, hd] under the mask of the layer's ``window``."""
        mask = self.masks[self.windows.index(window)]
        rows, kv_len = mask.shape[0], mask.shape[3]
        lo = self.lo_biased - LO_BIAS
        keys = k_cache.narrow(0, lo, rows)[:, :, :kv_len]  # [Sb, n_kv, Lk, hd], a view
        values = v_cache.narrow(0, lo, rows)[:, :, :kv_len]
        return attend_padded(q, self.q_index, mask, keys, values, scale=scale, softcap=softcap, sinks=sinks)


@dataclass
class ExactStepLayout:
    """The compiled step's layout for the row-invariant attention kernel: no padded block. Over a
    paged cache (``block_table`` set) the K/V goes to (block, row) ``write_slots`` / ``write_offsets``."""

    positions: torch.Tensor  # [T] int64 rope positions
    write_slots: torch.Tensor  # [T] int64 slot (paged: block) each new token's K/V is written to
    write_offsets: torch.Tensor  # [T] int64 cache offset (paged: row within the block) of each new token
    row_slots: torch.Tensor  # [T] int64 slot whose keys each new token's query reads
    row_masks: tuple[torch.Tensor, ...]  # per window of ``windows``: [T, Lk] bool, the keys each new token sees
    block_table: torch.Tensor | None  # [S, nb] int64 of a paged cache, else None
    windows: tuple[int | None, ...]  # the model's distinct layer windows (a constant of the graph)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # k_cache/v_cache: [S, n_kv, L, hd] (paged: [NB, n_kv, bs, hd]); k/v: [T, n_kv, hd]
        k_cache[self.write_slots, :, self.write_offsets] = k
        v_cache[self.write_slots, :, self.write_offsets] = v

    def attend(self, window: int | None, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, n_h, hd] -> [T, n_h, hd] under the row mask of the layer's ``window``."""
        row_mask = self.row_masks[self.windows.index(window)]
        return attend_exact(q, k_cache, v_cache, self.row_slots, row_mask, self.block_table, scale, softcap, sinks)


def inductor_cache_dir() -> str:
    """Inductor's on-disk cache: ``$TORCHINDUCTOR_CACHE_DIR``, pointed into tidespec's cache root
    unless the user chose a place. Inductor writes its own default (``/tmp/torchinductor_<user>``)
    into the variable the first time anything asks for the directory (loading a model does), so
    that default counts as not chosen; inductor reads the variable again at every cache access.

    One directory per build of tidespec's kernels (``kernels.ops.library_name()``): inductor's keys do
    not cover a custom op's schema, and a graph compiled against an older ``tidespec::`` op (one more
    argument) was loaded and failed at its first call."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # private, but the one source

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or current == default_cache_dir():
        current = os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor" / library_name())
    return current


def own_code(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound) with a code object of its own. Dynamo keeps its graphs per code object, so
    two steps compiling the same method share one cache, and only the guards on their models tell
    one model's graphs from another's; with a code object per step, a graph only ever serves the
    step that compiled it.

    Example::

        a, b = own_code(step_a._body), own_code(step_b._body)
        a.__func__.__code__ is not b.__func__.__code__   # True: two dynamo caches
    """
    fn = method.__func__  # type: ignore[attr-defined]
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return types.MethodType(copy, method.__self__)  # type: ignore[attr-defined]


class CompiledStep:
    """The target's decode forward compiled once per process; ``__call__`` returns None for a
    batch it does not take (then the caller runs the eager forward)."""

    def __init__(self, model: TargetModel, kv: KVCache, tap_layers: tuple[int, ...] = ()) -> None:
        inductor_cache_dir()
        self.model = model
        self.kv = kv
        # the layers whose input hidden states every compiled forward returns (the drafter's), kept
        # as one flag per layer: under ``dynamic=True`` dynamo makes ints symbolic (attributes too)
        # and ``i in (s0, s1)`` was then False for every layer; bools and ``range`` stay constants
        self.tap_layers = tuple(tap_layers)
        self._tap_flags = tuple(i in self.tap_layers for i in range(model.cfg.num_layers))
        self.exact = transposed_keys(kv.k[0])  # the row-invariant attention kernel (models/kernels/attention.py)
        # one mask per distinct layer window (Gemma's sliding and global layers: two), built per forward
        self.windows = model.cfg.layer_windows
        if isinstance(kv, PagedKVCache):  # one table for the engine's life: its width must not become a
            torch._dynamo.mark_static(kv.block_table)  # symbol that a key length of the same size is tied to
        # the rope table is built on first use; built here, the graph only reads it (no guard on
        # its absence, no recompile once it exists)
        model.warm_rope(model.device, model.embed_tokens.weight.dtype)
        self.num_compiled = 0  # forwards run compiled
        self.num_declined = 0  # decode forwards handed back to eager (slots far apart, other taps)
        # dynamo keeps a code object's graphs in one cache (default limit 8): each step compiles a
        # code object of its own (``own_code``), 4 graphs at most; the limit is raised for a step whose
        # row counts vary more than the engine's (tests, benchmarks)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        # a row-invariant target's graphs round low-precision intermediates where eager code does:
        # otherwise each graph's fusions decide where bfloat16 rounding happens, and the 1-row
        # graph's differ from the k-row graph's
        options: dict[str, object] = {}
        if self.exact and model.dtype in LOW_PRECISION:
            options["emulate_precision_casts"] = True
        if self.exact and model.device.type == "cpu":
            # one thread per generated C++ kernel: inductor splits a reduction (a norm over the
            # hidden size) across threads when its graph has few rows (the 1-row graph: size 1 is
            # specialized) and splits over rows otherwise, so from a hidden size of 1,024 on 2
            # threads a decode row summed in another order than the same row in a verification
            # (row probe 14/32 at Llama-3.2-1B's width). The projections and attention are ops
            # inductor calls as they are, on torch's threads; what the generated loops keep is
            # elementwise work and norms.
            options["cpp.threads"] = 1
        # Guards: dynamo checks before every call that what the graph read still holds, and of the
        # ~3,600 checks on the embedded model all but ~280 are on the model's modules (their types,
        # attributes, parameters' shapes): 0.42 ms of a 6.9 ms decode step at batch 1 (w4a8 + compile).
        # The model's modules do not change while this step lives (the engine prepares them before
        # it is built), and the graphs are this step's alone (``own_code``), so those checks are
        # skipped; the inputs' and the KV cache's are kept (they pick among the step's graphs).
        options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        # For the same reason the generated wrapper does not assert every input's size and stride
        # before each call (~500 checks, mostly of the modules' tensors: 0.25-0.35 ms of a 6 ms step)
        options["size_asserts"] = False
        self._fn = torch.compile(own_code(self._body_exact if self.exact else self._body), dynamic=True,
                                 fullgraph=True, options=options)

    def _body(self, ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
              write_offsets: torch.Tensor, q_index: torch.Tensor, masks: tuple[torch.Tensor, ...],
              lo_biased: int) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        layout = StepLayout(positions, write_slots, write_offsets, q_index, masks, lo_biased, self.windows)
        taps = tuple(i for i, flag in enumerate(self._tap_flags) if flag)
        out = self.model.run(ids, layout, self.kv.k, self.kv.v, None, taps)
        return out.logits, out.taps, out.last_hidden

    def _body_exact(self, ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                    write_offsets: torch.Tensor, row_slots: torch.Tensor, row_masks: tuple[torch.Tensor, ...],
                    logits_rows: torch.Tensor, block_table: torch.Tensor | None
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        layout = ExactStepLayout(positions, write_slots, write_offsets, row_slots, row_masks, block_table,
                                 self.windows)
        taps = tuple(i for i, flag in enumerate(self._tap_flags) if flag)
        out = self.model.run(ids, layout, self.kv.k, self.kv.v, logits_rows, taps)
        return out.logits, out.taps, out.last_hidden

    def __call__(self, ids: torch.Tensor, layout: BatchLayout, tap_layers: tuple[int, ...] = (),
                 logits_rows: torch.Tensor | None = None) -> ModelOutput | None:
        """Logits at every row of a decode batch (chains only), or None when the slots are far apart
        or other taps than ``self.tap_layers`` are asked for. Asked for no taps, it runs the same
        graph and drops them (the in-graph taps cost next to nothing; a second set of graphs
        without them would double the compile time). A row-invariant target runs every forward
        here (prompt chunks and trees too, logits at ``logits_rows`` [R], default every row): an
        eager forward would round differently from the compiled one, so no row may ever take the
        other path than the same row in another batch."""
        if tap_layers and tuple(tap_layers) != self.tap_layers:
            self.num_declined += 1
            return None
        if self.kv.paged and layout.block_table is None:
            layout.page(self.kv)
        plans = [AttentionPlan.build(layout.q_lens, layout.ctx_lens, layout.slots, layout.tree_masks, window,
                                     ids.device, self.exact, layout.block_table) for window in self.windows]
        plan = plans[0]  # the windows' plans differ in their masks only
        if plan.row_mask is not None:  # every batch runs: the exact kernel reads each row's own slot
            rows = logits_rows if logits_rows is not None else torch.arange(ids.shape[0], device=ids.device)
            none = rows.shape[0] == 0  # a prompt chunk without logits: the last row's, dropped (no graph of its own)
            # made before inference mode, as every other input is: an inference tensor's dispatch keys
            # differ, and dynamo compiled a graph of its own for them at the first prompt longer than a
            # step's budget (measured: 6 s on that request, w4a8 + compile on the embedded model)
            picked = rows if not none else rows.new_full((1,), ids.shape[0] - 1)
            paged = layout.block_table is not None
            to, at = layout.paged_writes() if paged else (layout.write_slots, layout.write_offsets)
            with torch.inference_mode():
                logits, taps, last = self._fn(ids, layout.positions, to, at, layout.write_slots,
                                              tuple(p.row_mask for p in plans), picked, layout.block_table)
            self.num_compiled += 1
            if none and logits is not None:
                logits = logits[:0]
            return ModelOutput(logits=logits, taps=taps if tap_layers else None, last_hidden=last)
        if plan.gather is not None or plan.kv_len >= self.kv.max_len:
            # far-apart slots: reading the whole range would waste more than eager's gather; the
            # cache's full length: a graph of its own (caches get KV_MARGIN so this never happens)
            self.num_declined += 1
            return None
        self.kv.make_readable(plan.read_slots(layout.slots), plan.kv_len)
        with torch.inference_mode():
            logits, taps, last = self._fn(ids, layout.positions, layout.write_slots, layout.write_offsets, plan.q_index,
                                          tuple(p.mask for p in plans), plan.lo + LO_BIAS)
        self.num_compiled += 1
        return ModelOutput(logits=logits, taps=taps if tap_layers else None, last_hidden=last)

    def warm_up(self, max_q: int) -> float:
        """Compile (or load from the disk cache) the graphs decode batches will use: one and two
        sequences, one row and ``max_q`` rows each (``max_q`` = 1 + the largest draft); for a
        row-invariant target, one row, and several rows with logits at all or at one of them
        (prompt chunks). Writes only into free slots, which hold nothing. Returns the seconds it took."""
        free = self.kv.free_slots()
        t0 = time.perf_counter()
        if self.exact and free:
            device = self.model.device
            for q, rows in ((1, [0]), (max(max_q, 2), None), (4, [3])):
                if 8 + q > self.kv.max_len:
                    continue
                layout = BatchLayout.build([q], [8], free[:1], device=device)
                ids = torch.zeros(q, dtype=torch.int64, device=device)
                self(ids, layout, self.tap_layers,
                     None if rows is None else torch.tensor(rows, dtype=torch.int64, device=device))
            if isinstance(self.kv, PagedKVCache):
                self.kv.release(free[0])  # the blocks the warm-up wrote into go back to the pool
            return time.perf_counter() - t0
        for batch in (1, 2):
            if len(free) < batch:
                continue
            slots = free[:batch]
            for q in sorted({1, max_q}):
                ctx = 8
                if ctx + q > self.kv.max_len:
                    continue
                layout = BatchLayout.build([q] * batch, [ctx] * batch, slots, device=self.model.device)
                ids = torch.zeros(q * batch, dtype=torch.int64, device=self.model.device)
                self(ids, layout, self.tap_layers)
        return time.perf_counter() - t0
