"""Row invariance: every projection of the target gives a row the same bits whatever the call holds.

Why this exists: greedy speculative decoding is bit-identical to plain decoding only if the target
computes each row's logits bit for bit the same in a verification forward (1 + gamma rows per
sequence), in a decode forward (1 row) and beside any other sequences or prompt chunks. Attention
gets that from its own kernel (``models/kernels/csrc/row_invariant.cpp``). The projections run library
kernels, and whether those are row-invariant depends on the library, the CPU and the shape: on a
Sapphire Rapids VM (torch 2.13, MKL 2024.2, 2 threads) MKL's packed sgemm and PyTorch's int8/int4
kernels give a row the same bits at any row count from 1 to 1024, while a plain float32 sgemm
changes its kernel after 1 row and again after 12, and oneDNN's bfloat16 GEMM after 32 rows; on
an AMD EPYC (Zen 4) MKL's packed sgemm changes kernel after 3 rows. For float32, bfloat16 and
float16 tidespec has a GEMM of its own, invariant by construction (``models/kernels/csrc/exact_linear.cpp``),
among the candidates.

So it is measured, per weight shape and kernel, on this machine, up to the engine's token budget
(``rows.frontier``): a kernel whose frontier covers the budget runs as it is, one with a smaller
frontier runs each call in pieces within it (``rows.pieces``). The measurements are cached per (CPU,
torch, threads) under ``cache_root() / "row-invariance"``. ``make_row_invariant`` applies them to a
model and returns the report the engine prints at start-up.

Worked example (SmolLM2-135M in bfloat16 on the VM above, budget 512)::

    report = make_row_invariant(model, 512)
    report.exact                  # True
    report.summary()              # "row invariance: exact (up to 512 rows a forward): attention exact;
                                  #  projections 960x576 linear in pieces of <= 32 rows, ..."
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from tidespec.files import atomic_write, cache_root, cpu_name, measure_once
from tidespec.models.execution.graphs import FIXED_ROWS
from tidespec.models.kernels.linear import Linear, tune_linears
from tidespec.models.kernels.ops import exact_attention_error
from tidespec.models.kernels.rows import PROBE_METHOD, frontier
from tidespec.models.quant.a8 import A8Linear
from tidespec.models.quant.quantize import Int4Linear, Int8Linear, QuantizedLinear

log = logging.getLogger(__name__)

# ``InvarianceReport.attention`` of a GPU target whose forwards replay CUDA graphs of one fixed shape
# per batch size (``models/execution/graphs.py``): a sequence's decode and verification rows run the same kernels
FIXED_SHAPE = "fixed-shape CUDA graphs"
# ... whose attention runs the fixed-order kernel of ``models/kernels/row_attention.py``
# (``--cuda-invariance row-attention``)
ROW_ATTENTION = "fixed-order attention"

@dataclass
class KernelChoice:
    """What one weight shape runs under row invariance."""

    shape: str  # "out x in:dtype:kind"
    kernel: str  # "mkl" (packed sgemm), "linear" (F.linear), "int8" or "int4" (the aten kernels)
    frontier: int  # rows up to which the kernel was measured row-invariant
    layers: int  # projections of this shape


@dataclass
class InvarianceReport:
    """The row-invariance state of a target: the kernels chosen, and anything not invariant."""

    budget: int  # the most rows one forward may hold (the engine's token budget)
    attention: str  # "exact" (the row-invariant kernel) or why not
    kernels: list[KernelChoice] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        """Speculation is bit-identical to plain decoding: every part row-invariant (and so batching
        too), or fixed-shape graphs (a sequence alone; ``batch_invariant`` tells batching apart)."""
        return self.attention in ("exact", FIXED_SHAPE, ROW_ATTENTION)

    @property
    def batch_invariant(self) -> bool:
        """Whether a sequence's greedy output is also the same beside any other sequences."""
        return self.attention == "exact"

    def chunked(self) -> list[KernelChoice]:
        """Shapes whose kernel runs in pieces (its frontier is below the budget)."""
        return [k for k in self.kernels if k.frontier < self.budget]

    def summary(self) -> str:
        """One line for the start-up log."""
        if self.attention == FIXED_SHAPE:
            return (f"row invariance: fixed-shape CUDA graphs ({FIXED_ROWS} rows a sequence, the whole key range): a "
                    "sequence's verification rows run its decode rows' kernels, so speculation is exact; "
                    "batches of different sizes run other kernels and may change greedy outputs at near-ties")
        if self.attention == ROW_ATTENTION:
            return ("row invariance: fixed-order attention on CUDA (--cuda-invariance row-attention, experimental: "
                    "not yet measured on a GPU): a row's attention does not depend on the rest of the forward")
        if not self.exact:
            return (f"row invariance: NOT guaranteed ({self.attention}); speculation and batching may change "
                    f"greedy outputs at near-ties")
        parts = [f"{k.shape.split(':')[0]} {k.kernel}" + (f" in pieces of <= {k.frontier} rows"
                                                           if k.frontier < self.budget else "")
                 for k in self.kernels]
        return (f"row invariance: exact (up to {self.budget} rows a forward): attention exact; "
                f"projections {', '.join(parts)}")

    def to_json(self) -> dict[str, object]:
        return {"budget": self.budget, "attention": self.attention, "exact": self.exact,
                "batch_invariant": self.batch_invariant,
                "kernels": [asdict(k) for k in self.kernels]}


def _cache_path(ident: dict[str, object]) -> Path:
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "row-invariance" / f"{key}.json"


def _machine(kind: str) -> dict[str, object]:
    """What a cached measurement of ``kind`` depends on besides its own inputs."""
    return {"method": PROBE_METHOD, "cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "kind": kind}


def _read_cached(ident: dict[str, object], field_: str) -> object | None:
    """Field ``field_`` of the measurement cached under ``ident``, or None if none is readable."""
    try:
        return json.loads(_cache_path(ident).read_text())[field_]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cached(ident: dict[str, object], values: dict[str, object]) -> None:
    path = _cache_path(ident)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({**ident, **values}).encode())


def cached_frontier(kind: str, shape: tuple[int, int], dtype: torch.dtype, rows: int,
                    fn: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """``frontier`` of a kernel on a weight shape up to ``rows``, read from the disk cache when
    measured before on this CPU with this torch and thread count (it does not depend on the weight's
    values). A measurement up to more rows serves fewer, and one that found the kernel's frontier
    below its rows serves any: only a larger budget than any measured probes again.

    Example: measured up to 512 rows -> 512 (invariant throughout): asked for 128 rows, 512 from the
    cache; asked for 1,024, probed again. Measured up to 512 -> 32: 32 whatever is asked."""
    ident = {**_machine(kind), "shape": list(shape), "dtype": str(dtype)}

    def cached() -> int | None:
        probed, value = _read_cached(ident, "rows"), _read_cached(ident, "frontier")
        if isinstance(probed, int) and isinstance(value, int) and (value < probed or probed >= rows):
            return value
        return None

    def measure() -> int:
        value = frontier(fn, shape[1], dtype, rows)
        _write_cached(ident, {"rows": rows, "frontier": value})
        return value

    return measure_once(_cache_path(ident), cached, measure)


MAX_PROBE_ROWS = 1024  # rows probed at most: a larger budget runs bigger calls in pieces within this


TIMED_ROWS = (1, 5, 16)  # what decoding runs most: a decode row, a gamma-4 verification, 16 sequences' decodes


def _frontiers(layer: Linear, probe: int) -> dict[str, int]:
    """Each kernel of ``layer.invariant_kernels()`` -> its measured frontier on the layer's shape."""
    return {kernel: _frontier(layer, kernel, probe) for kernel in layer.invariant_kernels()}


def _frontier(layer: Linear, kernel: str, probe: int) -> int:
    """``kernel``'s measured (or cached) frontier on ``layer``'s weight shape, up to ``probe`` rows."""
    layer.set_invariant(kernel, 0)
    return cached_frontier(kernel, tuple(layer.weight.shape), layer.weight.dtype, probe, layer.forward)


def choose_float_kernels(groups: list[list[Linear]], probe: int) -> list[tuple[str, int]]:
    """A kernel and its frontier for each group of ``Linear`` layers (one weight shape a group, all
    of one dtype): the fastest (``ranked_kernels``) of the kernels row-invariant over every probed
    row count on every shape; for a shape where none of those is, the kernel invariant up to the
    most rows (run in pieces). One kernel for the whole model, because what makes one faster is
    how it streams the weights from memory in a forward, which one shape's weights alone (cache
    resident) do not show.

    The kernels are probed fastest first, each until a shape shows it is not invariant, and the
    first invariant on every shape is the choice: the same kernel as probing them all and then
    taking the fastest of those invariant, without probing slower ones (a frontier probe runs
    thousands of rows through every shape, the LM head's included: a cold float32 SmolLM2-135M took
    44 s on one thread of a 2-core Xeon probing all five, 12 s probing the fastest first).
    Example: float32 -> "exact" (tidespec's own GEMM) or "mkl" where MKL's packed sgemm is invariant
    and faster; bfloat16 -> "exact" on an AMD EPYC (Zen 4: AVX512-BF16 pairs), "tall64" where that is
    faster (``F.linear`` changes kernel after 32 rows: probed up to 33 rows, then "tall64")."""
    firsts = [layers[0] for layers in groups]
    ranked = ranked_kernels([layer for layers in groups for layer in layers], list(firsts[0].invariant_kernels()))
    for kernel in ranked:
        if all(_frontier(layer, kernel, probe) >= probe for layer in firsts):  # stops at the first shape short of it
            return [(kernel, probe)] * len(groups)
    return [max(_frontiers(layer, probe).items(), key=lambda kv: kv[1]) for layer in firsts]


def time_kernels(layers: list[Linear], kernels: list[str], rows: tuple[int, ...],
                 repeats: int = 5) -> dict[str, dict[int, float]]:
    """Seconds each kernel takes to run ``rows`` rows through ``layers`` (in order, so the weights
    stream from memory as in a forward), per row count: the best of ``repeats`` rounds that
    interleave the kernels (round 0 warms up: packing, first-call allocations). A kernel is a name
    of ``Linear.set_invariant``; "" is the per-row-count plan of ``tune_linears`` (not invariant).
    The layers are left running the last kernel timed.
    Example: SmolLM2-135M's 121 projections, ["exact", "tall64"], (1, 16) ->
    {"exact": {1: 0.0094, 16: 0.0164}, "tall64": {1: 0.0314, 16: 0.0333}} (bfloat16, 2 cores)."""
    g = torch.Generator().manual_seed(0)
    dtype = layers[0].weight.dtype
    inputs = {(n, n_in): (torch.randn(n, n_in, generator=g) * 0.5).to(dtype)
              for n in rows for n_in in {m.in_features for m in layers}}  # [n, in] each
    seconds = {kernel: dict.fromkeys(rows, float("inf")) for kernel in kernels}
    with torch.inference_mode():
        for round_ in range(repeats + 1):
            for kernel in kernels:
                for layer in layers:
                    layer.set_invariant(kernel, 0)
                for n in rows:
                    t0 = time.perf_counter()
                    for layer in layers:
                        layer.forward(inputs[n, layer.in_features])
                    if round_:
                        seconds[kernel][n] = min(seconds[kernel][n], time.perf_counter() - t0)
    return seconds


def ranked_kernels(layers: list[Linear], kernels: list[str], repeats: int = 5) -> list[str]:
    """``kernels`` fastest first: by the time each takes to run ``TIMED_ROWS`` rows through ``layers``
    (every projection of a model, in order; ``time_kernels``), cached on disk as the frontiers are
    (a measurement taken on a busy machine is taken again after deleting the cache).
    Example: SmolLM2-135M in float32 on a 2-core Xeon, two threads, its five kernels -> ["exact", "mkl",
    "linear", "tile16", "tall64"] (74, 89, 107, 144 and 161 ms for 1+5+16 rows through 121 layers)."""
    ident = {**_machine("ranked"), "kernels": kernels, "rows": list(TIMED_ROWS),
             "layers": [f"{tuple(m.weight.shape)}:{m.weight.dtype}" for m in layers]}

    def cached() -> list[str] | None:
        ranking = _read_cached(ident, "ranking")
        return list(ranking) if isinstance(ranking, list) and sorted(ranking) == sorted(kernels) else None

    def measure() -> list[str]:
        seconds = {kernel: sum(per_rows.values())
                   for kernel, per_rows in time_kernels(layers, kernels, TIMED_ROWS, repeats).items()}
        ranking = sorted(kernels, key=seconds.__getitem__)
        _write_cached(ident, {"ranking": ranking, "seconds": seconds})
        log.info("projection kernels, fastest first: %s (for %s rows through %d layers)",
                 ", ".join(f"{k} {seconds[k] * 1e3:.1f} ms" for k in ranking), "+".join(map(str, TIMED_ROWS)),
                 len(layers))
        return ranking

    return measure_once(_cache_path(ident), cached, measure)  # timed alone: another process timing them waits


def make_row_invariant(model: nn.Module, budget: int) -> InvarianceReport:
    """Choose, for every projection of ``model`` (``llama.Linear`` and the quantized layers), a kernel
    that is row-invariant up to ``budget`` rows (or runs in pieces within its frontier), build the
    exact attention kernel, and mark the model ``row_invariant`` when that succeeded. Layers of one
    shape share one measurement. Returns the report (``summary()`` for the log)."""
    error = exact_attention_error()
    report = InvarianceReport(budget, "exact" if error is None else f"no exact attention kernel: {error}")
    probe = min(budget, MAX_PROBE_ROWS)  # no forward holds more rows than the budget (a cached larger one serves)
    groups: dict[tuple[str, int, int, str], list[nn.Module]] = {}
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.device.type == "cpu":
            key = ("float", module.out_features, module.in_features, str(module.weight.dtype))
        elif isinstance(module, (Int8Linear, Int4Linear)):
            kind = ("int8" if isinstance(module, Int8Linear) else f"int4-g{module.group_size}") + f"-{module.kernel_name}"
            key = (kind, module.out_features, module.in_features, "bfloat16")
        elif isinstance(module, A8Linear):  # invariant by construction; measured like the others all the same
            kind = f"{module.scheme}-{module.kernel_name}"
            key = (kind, module.out_features, module.in_features, "float32")
        else:
            continue
        groups.setdefault(key, []).append(module)
    float_keys: dict[str, list[tuple[str, int, int, str]]] = {}  # dtype -> its shapes' keys
    for key in groups:
        if key[0] == "float":
            float_keys.setdefault(key[3], []).append(key)
    chosen: dict[tuple[str, int, int, str], tuple[str, int]] = {}
    for keys in float_keys.values():
        floats = [[m for m in groups[key] if isinstance(m, Linear)] for key in keys]
        chosen.update(zip(keys, choose_float_kernels(floats, probe)))
    for key, layers in groups.items():
        kind, n_out, n_in, dtype_name = key
        first = layers[0]
        if isinstance(first, QuantizedLinear):
            first.row_limit = 0
            a8 = isinstance(first, A8Linear)  # takes float32 rows (it quantizes them itself)
            value = cached_frontier(kind, (n_out, n_in), torch.float32 if a8 else torch.bfloat16, probe,
                                    first.forward if a8 else first._kernel)
        else:
            kind, value = chosen[key]
        for layer in layers:
            limit = value if value < min(budget, probe) or budget > probe else 0  # 0: whole calls
            if isinstance(layer, QuantizedLinear):
                layer.row_limit = limit
            else:
                assert isinstance(layer, Linear)
                layer.set_invariant(kind, limit)
                layer.set_packing(kind == "mkl")  # the packed copies made while timing or probing "mkl" go
        report.kernels.append(KernelChoice(f"{n_out}x{n_in}:{dtype_name.removeprefix('torch.')}", kind, value,
                                           len(layers)))
    model.row_invariant = report.exact  # type: ignore[assignment]  # DecoderModel's flag: caches transposed
    return report


def clear_row_invariance(model: nn.Module) -> None:
    """Undo ``make_row_invariant``: every projection back to its fastest kernel per row count (the
    plan of ``tune_linears`` at the current thread count, measured here once per machine: only these
    engines run it, so a row-invariant engine never pays for measuring it), the model's caches in the
    usual layout (SDPA). What ``--no-row-invariant`` and GPU engines run."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.set_invariant("", 0)
        elif isinstance(module, QuantizedLinear):
            module.row_limit = 0
    tune_linears(model)  # CPU layers only: a GPU model has none
    model.row_invariant = False  # type: ignore[assignment]
