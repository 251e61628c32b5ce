"""The projection layer of the model, with a matmul kernel measured per row count on this machine.

Why this exists: a decode step multiplies every weight by 1 row per sequence, a verification by
gamma + 1 rows, and which BLAS call is fastest for those skinny products depends on the CPU, the
BLAS library, the dtype and the thread count — not on anything we can know in advance:

- on an AMD EPYC (MKL, fp32, 2 threads) ``F.linear`` ran 1 row on one core; splitting the
  weight's output rows into one block per thread (``torch.bmm``) was 1.6-2.4x faster, and
  ``W @ x^T`` (MKL's tall-skinny orientation) was fastest for 2..16 rows;
- on an Intel Xeon with AMX (oneDNN, same torch build), ``F.linear`` is the fastest fp32 kernel
  at every row count and ``W @ x^T`` is 2.4x *slower* at 2..16 rows, while in bfloat16 ``W @ x^T``
  is fastest from 2 rows and 1 row is faster padded to 2 (13.9 vs 18.4 ms per 30 layers).

- on that same Xeon in fp32, oneDNN's kernel behind ``F.linear`` is bandwidth-bound up to 3 rows
  and then turns 1.5x slower (the MLP's [3072, 576] weights x 30 layers: 9.3 ms at 3 rows, 14.6
  at 4), which made every 4th draft token cost half a decode step; MKL's packed sgemm
  (``cblas_sgemm_compute`` on a weight packed once by ``cblas_sgemm_pack``, reached through
  PyTorch's ``mkl::_mkl_linear``, the op inductor's CPU freezing pass emits) stays near the
  bandwidth bound to 8-16 rows (9.7 ms at 4, 11.5 at 8).

- on an AMD EPYC Zen 5 (MKL, fp32, 2 threads) one row is fastest padded to two, ``mm(W, [x; x]^T)``
  (the 2-row "tall" product, keep row 0): 1.1-1.6x faster than "split" (30 x [3072, 576]: 4.9 vs
  6.9 ms; the LM head 2.4 vs 3.9 ms) — but only with ``[x; x]`` copied: as the stride-0 view
  ``x.expand(2, -1)`` MKL ran it 1.6-2x slower than "split", so it never won a measurement. On the
  same host "tall" costs less at 4 rows than at 3 (30 x [3072, 576]: 5.8 vs 6.7 ms) and grows
  faster than the rows beyond 4, so 3 rows go padded to 4 and 8 rows as two products of 4 ("tall4",
  10.5 vs 11.5 ms at 8 rows).

So the choice is measured, not guessed: ``tune_linears`` times each candidate on the real weights
(all layers' matrices of one shape in turn, so the weights stream from memory as in a forward)
for row counts 1..``max_rows`` and stores the fastest per row count in each ``Linear``. The
result is cached on disk per (CPU, torch version, threads, dtype, shapes), so a process pays the
few seconds of measuring once per machine. Only forwards that are not row-invariant run the plan:
``models.invariance.clear_row_invariance`` (``--no-row-invariant``, GPU engines) tunes, as do a
separate draft model, the trainer and ``bench profile``; a row-invariant engine never measures it.
Untuned layers (tiny test models, CUDA, another
thread count than the one tuned for) use ``F.linear``.

Every candidate computes each output element as one dot product over the full input dimension,
so results agree up to the kernel's summation order, as between any two BLAS kernels.

Worked example (weight [3072, 576], 2 threads)::

    "linear": F.linear(x [T, 576], W)                         -> [T, 3072]
    "tall":   mm(W [3072, 576], x^T [576, T])^T               -> [T, 3072]
    "split":  bmm(x [2, T, 576], W blocks [2, 576, 1536])     -> [2, T, 1536] -> [T, 3072]
    "pad2":   (1 row only) tall on [x; x] [2, 576] (a copy), keep row 0 -> [1, 3072]
    "tall4":  (3+ rows) tall on chunks of 4 rows, a chunk of 3 padded to 4 (and of 1 to 2) -> [T, 3072]
    "mkl":    (fp32, MKL builds) packed sgemm of x [T, 576] with W packed once -> [T, 3072]
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tidespec.files import atomic_write, cache_root, cpu_name, measure_once
from tidespec.models.kernels.ops import ensure_built
from tidespec.models.kernels.rows import in_pieces

log = logging.getLogger(__name__)

STRATEGIES = ("linear", "tall", "split", "pad2", "mkl", "tall4")
TUNED_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)  # measured; other counts use the next one up
PREFER_MARGIN = 1.1  # another kernel replaces F.linear only when >= 10 % faster (noise must not flip it)
# Rows the MKL packing is laid out for. The packed weight serves every row count (``_mkl_linear``
# uses it whenever its last argument equals the input's rows); packing for 16 was as fast as or
# faster than packing for 4 at 4..32 rows, and as packing for 1 at 1 row, on the AMX Xeon.
MKL_PACK_ROWS = 16
EXACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what ``tidespec::exact_linear`` multiplies


def mkl_packing_available() -> bool:
    """Whether this PyTorch build has MKL's packed sgemm behind ``torch.ops.mkl._mkl_linear``."""
    return bool(getattr(torch._C, "has_mkl", False)) and hasattr(torch.ops.mkl, "_mkl_linear")


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in] -> MKL's packed copy (an opaque mkldnn tensor, same bytes again)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), MKL_PACK_ROWS)


def exact_panels(w: torch.Tensor) -> torch.Tensor:
    """[out, in] (a dtype of ``EXACT_DTYPES``) -> the panels ``tidespec::exact_linear`` reads:
    [P, in, VL] in w's dtype, panel p holding outputs p * VL .. p * VL + VL - 1 (the last
    zero-padded), VL the kernel's float32 vector width.

    Example: VL 16, w [40, 576] -> [3, 576, 16]; panel 2 holds outputs 32..39 and 8 zero columns."""
    error = ensure_built()
    if error is not None:
        raise RuntimeError(f"tidespec's exact_linear kernel is unavailable: {error}")
    lanes = int(torch.ops.tidespec.exact_linear_lanes())
    n_out, n_in = w.shape
    panels = -(-n_out // lanes)
    padded = F.pad(w.detach(), (0, 0, 0, panels * lanes - n_out))  # [P * VL, in]
    if w.dtype == torch.bfloat16 and torch.ops.tidespec.exact_linear_bf16_pairs():
        pairs = -(-n_in // 2)  # AVX512-BF16: feature pairs, an odd count zero-padded -> [P, in/2, VL * 2]
        padded = F.pad(padded, (0, pairs * 2 - n_in))  # [P * VL, 2 * pairs]
        return padded.view(panels, lanes, pairs, 2).permute(0, 2, 1, 3).reshape(panels, pairs, lanes * 2)
    return padded.view(panels, lanes, n_in).transpose(1, 2).contiguous()


def _zero_padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [T, in] with zero rows appended up to ``rows`` (x itself when T == rows) -> [rows, in]."""
    return torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])]) if rows > x.shape[0] else x


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, tile: int) -> torch.Tensor:
    """``F.linear(x, weight)`` over row tiles of exactly ``tile`` rows (the last one zero-padded):
    every call the BLAS library sees has the same shape, so it picks the same kernel, and a row's
    bits depend only on its own values (measured per machine: ``models/execution/invariance.py``).
    x [T, in] -> [T, out].

    Example: 20 rows, tile 16 -> F.linear on rows 0..15, then on rows 16..19 and 12 rows of zeros."""
    T = x.shape[0]
    xp = _zero_padded(x, T + -T % tile)  # [T + pad, in]
    if xp.shape[0] == tile:
        return F.linear(xp, weight)[:T]
    return torch.cat([F.linear(chunk, weight) for chunk in xp.split(tile)])[:T]


TALL_TILES = (2, 4, 8, 16, 32, 64)  # the row counts "tall64" pads a tile to


def tall_tiled_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` as ``mm(weight, tile^T)`` (BLAS's tall-skinny orientation, the
    per-row-count "tall"/"pad2" kernels of ``tune_linears``) over row tiles of at most 64 rows,
    each zero-padded to the next of ``TALL_TILES``: the library sees only these six shapes, so a
    row's bits depend on its own values only (measured per machine: ``models/execution/invariance.py``),
    while a decode row pays for 2 rows, not for a 16-row tile. x [T, in] -> [T, out].

    Example: 70 rows -> a tile of 64 rows and one of 6 padded to 8: ``mm(W, [64, in]^T)``,
    ``mm(W, [8, in]^T)``; rows 64..69 are the first 6 columns of the second product."""
    outs = []
    for chunk in x.split(TALL_TILES[-1]):
        n = chunk.shape[0]
        tile = next(t for t in TALL_TILES if t >= n)
        outs.append(torch.mm(weight, _zero_padded(chunk, tile).t()).t()[:n])  # [out, tile] -> [n, out] (a view)
    return outs[0].contiguous() if len(outs) == 1 else torch.cat(outs)


# The compiled step calls these through ops of their own, so that a graph keeps the row count
# symbolic (splitting the rows in the graph would specialise every count) and calls the kernel as
# it is; eager code calls the functions directly (a custom op's Python dispatch costs ~70 us a call).


@torch.library.custom_op("tidespec::linear_in_pieces", mutates_args=())
def linear_in_pieces(x: torch.Tensor, weight: torch.Tensor, limit: int) -> torch.Tensor:
    """``F.linear(x, weight)`` in row pieces of at most ``limit`` (``rows.pieces``). x [T, in] -> [T, out]."""
    return in_pieces(lambda p: F.linear(p, weight), x, limit)


@linear_in_pieces.register_fake
def _linear_in_pieces_fake(x: torch.Tensor, weight: torch.Tensor, limit: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("tidespec::linear_tiles", mutates_args=())
def linear_tiles(x: torch.Tensor, weight: torch.Tensor, tile: int) -> torch.Tensor:
    """``tiled_linear`` as an op. x [T, in] -> [T, out]."""
    return tiled_linear(x, weight, tile)


@linear_tiles.register_fake
def _linear_tiles_fake(x: torch.Tensor, weight: torch.Tensor, tile: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("tidespec::linear_tall_tiles", mutates_args=())
def linear_tall_tiles(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``tall_tiled_linear`` as an op. x [T, in] -> [T, out]."""
    return tall_tiled_linear(x, weight)


@linear_tall_tiles.register_fake
def _linear_tall_tiles_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _split_weight(w: torch.Tensor, s: int) -> torch.Tensor:
    """[out, in] -> [s, in, out/s]: the output rows in one block per thread (a view)."""
    return w.view(s, w.shape[0] // s, w.shape[1]).transpose(1, 2)


def _tall_even(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [r <= 4, in] @ w^T by "tall", an odd r padded with a copy of its last row -> [r, out] (a view):
    "pad2" for one row, "tall4" per chunk."""
    r = x.shape[0]
    xp = torch.cat((x, x[-1:])) if r % 2 else x  # [r or r + 1, in]
    return torch.mm(w, xp.t())[:, :r].t()


def run_strategy(name: str, x: torch.Tensor, w: torch.Tensor, blocks: torch.Tensor | None,
                 packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ w [out, in]^T -> [T, out] by the named kernel (no bias)."""
    if name == "mkl":
        assert packed is not None
        return torch.ops.mkl._mkl_linear(x, packed, w, None, x.shape[0])
    if name == "tall":
        return torch.mm(w, x.t()).t().contiguous()  # [out, T] -> [T, out]
    if name == "pad2":  # [x; x] copied: MKL ran the stride-0 view x.expand(2, -1) 1.6-2x slower than "split"
        return _tall_even(x, w).contiguous()  # [1, out]
    if name == "tall4":
        return torch.cat([_tall_even(x[i:i + 4], w) for i in range(0, x.shape[0], 4)])  # [T, out]
    if name == "split":
        assert blocks is not None
        s, T = blocks.shape[0], x.shape[0]
        return torch.bmm(x.expand(s, T, -1), blocks).transpose(0, 1).reshape(T, w.shape[0])
    return F.linear(x, w)


class Linear(nn.Linear):
    """``nn.Linear`` whose kernel per row count was measured by ``tune_linears`` (else F.linear).

    Module hooks are not supported on the hot path (the model calls ``.forward`` directly).
    """

    choice: tuple[str, ...] = ()  # kernel for 1, 2, ... rows; beyond its length: F.linear
    tuned_threads = 0  # the intra-op thread count the choice was measured with
    # row invariance (models/execution/invariance.py): one kernel for every row count ("exact", "mkl", ...),
    # run in pieces of at most ``invariant_limit`` rows when that is > 0; replaces ``choice``
    invariant: str = ""
    invariant_limit = 0
    _blocks_key: tuple[int, int] | None = None
    _blocks: torch.Tensor | None = None
    _packed_key: tuple[int, int] | None = None
    _packed: torch.Tensor | None = None
    _panels_key: tuple[int, int] | None = None
    _panels: torch.Tensor | None = None

    def blocks(self, s: int) -> torch.Tensor | None:
        """The weight split in ``s`` output blocks (rebuilt only if the weight moved), or None."""
        if self.weight.shape[0] % s:
            return None
        key = (s, self.weight.data_ptr())
        if self._blocks_key != key:
            self._blocks = _split_weight(self.weight, s)
            self._blocks_key = key
        return self._blocks

    def _weight_key(self) -> tuple[int, int]:
        """What a packed copy of the weight is valid for: its storage and its version (a weight
        that moved or was written in place, e.g. by ``load_state_dict``, is packed again; an
        inference-mode weight has no version counter, so only a move is seen there)."""
        w = self.weight
        return w.data_ptr(), -1 if w.is_inference() else w._version

    def packed(self) -> torch.Tensor:
        """The weight packed for MKL's sgemm (``tune_linears`` packs layers that chose "mkl"),
        packed again when ``_weight_key`` changes."""
        key = self._weight_key()
        if self._packed_key != key:
            self._packed = pack_weight(self.weight)
            self._packed_key = key
        assert self._packed is not None
        return self._packed

    def panels(self) -> torch.Tensor:
        """The weight packed for ``tidespec::exact_linear`` (``exact_panels``), remade as ``packed``
        is when ``_weight_key`` changes."""
        key = self._weight_key()
        if self._panels_key != key:
            self._panels = exact_panels(self.weight)
            self._panels_key = key
        assert self._panels is not None
        return self._panels

    def __getstate__(self) -> dict[str, object]:
        """Copies and pickles leave the packed weights behind (MKL's is an opaque tensor that cannot
        be copied; the panels are the weight again); a copy packs its own on its first forward."""
        state = dict(super().__getstate__())
        for key in ("_packed", "_packed_key", "_panels", "_panels_key"):
            state.pop(key, None)
        return state

    def set_packing(self, used: bool) -> None:
        """Pack the weight now if a row count runs "mkl" (not on the first forward), else drop it;
        the panels of "exact" are dropped unless it runs them."""
        if used:
            self.packed()
        else:
            self._packed_key, self._packed = None, None
        if self.invariant != "exact":
            self._panels_key, self._panels = None, None

    def invariant_kernels(self) -> tuple[str, ...]:
        """Kernels ``models/execution/invariance.py`` measures for row invariance (it runs the fastest of those
        invariant at every probed row count): tidespec's ``exact_linear`` (float32, bfloat16 and
        float16, where its library builds), MKL's packed sgemm (float32 on MKL builds),
        ``tall_tiled_linear``, ``F.linear``, ``F.linear`` on 16-row tiles."""
        fp32 = self.weight.dtype == torch.float32
        exact = ("exact",) if self.weight.dtype in EXACT_DTYPES and ensure_built() is None else ()
        mkl = ("mkl",) if fp32 and mkl_packing_available() else ()
        return (*exact, *mkl, "tall64", "linear", "tile16")

    def set_invariant(self, kernel: str, limit: int) -> None:
        """Run ``kernel`` ("exact": ``tidespec::exact_linear``, "mkl": MKL's packed sgemm, "tall64":
        ``tall_tiled_linear``, "linear":
        F.linear, "tile16": F.linear on 16-row tiles; "": the measured per-row-count choice) for
        every row count, in pieces of at most ``limit`` rows (0: whole); the packed weight is made
        now."""
        self.invariant, self.invariant_limit = kernel, limit
        if kernel == "mkl":
            self.packed()
        if kernel == "exact":
            self.panels()

    def _invariant_forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out], each row's bits independent of T (models/execution/invariance.py)
        limit, w = self.invariant_limit, self.weight
        if not limit or x.shape[0] <= limit:
            out = self._invariant_kernel(x)
        elif self.invariant == "linear" and torch.compiler.is_compiling():  # keeps the graph's row count symbolic
            out = torch.ops.tidespec.linear_in_pieces(x, w, limit)
        else:  # a kernel invariant only up to ``limit`` rows runs bigger calls in pieces (compiled: a graph per count)
            out = in_pieces(self._invariant_kernel, x, limit)
        return out if self.bias is None else out + self.bias

    def _invariant_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """``self.invariant``'s kernel on x [T, in] -> [T, out], no bias: the function in eager code,
        its op in a compiled graph (the functions split rows, which a graph would specialise)."""
        compiling, w = torch.compiler.is_compiling(), self.weight
        if self.invariant == "exact":
            assert self._panels is not None  # packed by set_invariant
            return torch.ops.tidespec.exact_linear(x, self._panels if compiling else self.panels(), w.shape[0])
        if self.invariant == "mkl":
            assert self._packed is not None  # packed by set_invariant (a weight written since: repacked eagerly)
            return torch.ops.tidespec.packed_linear(x, self._packed if compiling else self.packed(), w)
        if self.invariant == "tall64":
            return torch.ops.tidespec.linear_tall_tiles(x, w) if compiling else tall_tiled_linear(x, w)
        if self.invariant == "tile16":
            return torch.ops.tidespec.linear_tiles(x, w, 16) if compiling else tiled_linear(x, w, 16)
        return F.linear(x, w)  # "linear"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        T = x.shape[0]
        if self.invariant and x.dim() == 2 and not x.requires_grad:
            return self._invariant_forward(x)
        if torch.compiler.is_compiling():  # inductor picks its own kernel; the measured one is for eager
            return F.linear(x, self.weight, self.bias)
        if (T > len(self.choice) or x.dim() != 2 or torch.get_num_threads() != self.tuned_threads
                or x.requires_grad):  # measured kernels are for inference ("mkl" has no backward)
            return F.linear(x, self.weight, self.bias)
        name = self.choice[T - 1]
        if name == "linear":
            return F.linear(x, self.weight, self.bias)
        if name == "mkl":
            if self.weight.dtype != torch.float32:  # converted after tuning: MKL's packing is fp32 only
                return F.linear(x, self.weight, self.bias)
            out = run_strategy(name, x, self.weight, None, self.packed())
        else:
            out = run_strategy(name, x, self.weight, self.blocks(self.tuned_threads))
        return out if self.bias is None else out + self.bias


def _candidates(rows: int, out_features: int, threads: int, dtype: torch.dtype) -> list[str]:
    names = ["linear", "tall"]
    if threads > 1 and out_features % threads == 0:
        names.append("split")
    if rows == 1:
        names.append("pad2")
    elif 3 <= rows <= 16:  # more chunks read the weight more often: never faster, only slower to tune
        names.append("tall4")
    if dtype == torch.float32 and mkl_packing_available():
        names.append("mkl")
    return names


def _plan_key(groups: dict[tuple[int, int, str], list[Linear]], max_rows: int, threads: int) -> str:
    # method: bumped when the candidate kernels change (4: "pad2" multiplies a copied [x; x]; 5: "tall4"),
    # so plans measured without them are measured again
    ident = {"method": 5, "cpu": cpu_name(), "torch": torch.__version__, "threads": threads, "max_rows": max_rows,
             "shapes": sorted(f"{o}x{i}:{d}:{len(m)}" for (o, i, d), m in groups.items())}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def tune_linears(root: nn.Module, repeats: int = 5, cache_dir: Path | None = None) -> dict[str, list[str]]:
    """Measure the fastest kernel for the row counts ``TUNED_ROWS`` for every CPU ``Linear`` under
    ``root`` and store it in the layers; returns {"out x in:dtype": [kernel for 1, 2, ... rows]}
    (a count between two measured ones takes the larger one's kernel).

    Layers of one shape share one choice, timed over all of them in turn; each kernel keeps its
    best of ``repeats`` interleaved rounds, and replaces ``F.linear`` only when ``PREFER_MARGIN``
    faster. The plan is read from and written to ``cache_dir`` (default: ``cache_root() /
    "matmul-plans"``); delete it to measure again (e.g. after it was measured on a busy machine).
    Example: SmolLM2-135M's four projection shapes and its LM head, 13 row counts, 3-4 kernels
    each: a few seconds the first time on 2 cores, then a file read.
    """
    max_rows = TUNED_ROWS[-1]
    groups: dict[tuple[int, int, str], list[Linear]] = {}
    for module in root.modules():
        if isinstance(module, Linear) and module.weight.device.type == "cpu":
            key = (module.out_features, module.in_features, str(module.weight.dtype).removeprefix("torch."))
            groups.setdefault(key, []).append(module)
    if not groups:
        return {}
    threads = torch.get_num_threads()
    path = (cache_dir or cache_root() / "matmul-plans") / f"{_plan_key(groups, max_rows, threads)}.json"
    names = {key: f"{key[0]}x{key[1]}:{key[2]}" for key in groups}

    def cached() -> dict[str, list[str]] | None:
        plan = _read_plan(path)
        return plan if _complete(plan, names.values(), max_rows) else None

    def measure() -> dict[str, list[str]]:
        log.info("measuring matmul kernels for this CPU (once; cached in %s)", path.parent)
        plan = {names[key]: _measure(mods, repeats, threads) for key, mods in groups.items()}
        atomic_write(path, json.dumps(plan, indent=1).encode())
        return plan

    plan = measure_once(path, cached, measure)  # timed alone: another process measuring the same plan waits
    for key, mods in groups.items():
        for m in mods:
            m.choice = tuple(plan[names[key]])
            m.tuned_threads = threads
            m.set_packing("mkl" in m.choice)
    return plan


def _read_plan(path: Path) -> dict[str, list[str]]:
    """The plan cached at ``path``, {} when there is none or it cannot be read."""
    try:
        plan = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return plan if isinstance(plan, dict) else {}


def _complete(plan: dict[str, list[str]], names: Iterable[str], max_rows: int) -> bool:
    """Whether ``plan`` has a kernel for every row count of every shape in ``names``."""
    return all(isinstance(plan.get(n), list) and len(plan[n]) == max_rows and set(plan[n]) <= set(STRATEGIES)
               for n in names)


@torch.inference_mode()
def _measure(mods: list[Linear], repeats: int, threads: int) -> list[str]:
    """The fastest kernel for 1..max(TUNED_ROWS) rows over all ``mods`` (one weight shape) in turn."""
    w0 = mods[0].weight
    mkl = w0.dtype == torch.float32 and mkl_packing_available()
    weights = [(m.weight, _split_weight(m.weight, threads) if m.out_features % threads == 0 else None,
                m.packed() if mkl else None) for m in mods]
    best: dict[int, str] = {}
    for rows in TUNED_ROWS:
        x = torch.randn(rows, w0.shape[1], dtype=w0.dtype)
        names = _candidates(rows, w0.shape[0], threads, w0.dtype)
        timings = dict.fromkeys(names, float("inf"))
        for round_ in range(repeats + 1):  # rounds interleave the kernels, so a burst of load hits all
            for name in names:
                t0 = time.perf_counter()
                for w, blocks, packed in weights:
                    run_strategy(name, x, w, blocks, packed)
                if round_:  # round 0 warms up (first-call allocations, kernel selection)
                    timings[name] = min(timings[name], time.perf_counter() - t0)
        fastest = min(timings, key=timings.__getitem__)
        best[rows] = fastest if timings[fastest] < timings["linear"] / PREFER_MARGIN else "linear"
    return [best[min(r for r in TUNED_ROWS if r >= rows)] for rows in range(1, TUNED_ROWS[-1] + 1)]


@contextmanager
def untuned(root: nn.Module) -> Iterator[None]:
    """Within the block every ``Linear`` under ``root`` runs ``F.linear`` (its measured kernels are
    restored after): the baseline ``tidespec bench profile --compare-untuned`` times beside them."""
    layers = [m for m in root.modules() if isinstance(m, Linear)]
    saved = [m.choice for m in layers]
    for m in layers:
        m.choice = ()
    try:
        yield
    finally:
        for m, choice in zip(layers, saved):
            m.choice = choice
