"""tidespec's own CPU kernels (``models/kernels/csrc``), compiled on first use and cached per machine.

Why this exists: exact speculative decoding needs an attention whose per-row arithmetic does not
depend on the other rows of the call (``csrc/row_invariant.cpp`` says why none of PyTorch's does),
projections (float32, bfloat16, float16) invariant by construction where no library GEMM is
(``csrc/exact_linear.cpp``), PyTorch's int4 and int8 GEMVs with the weights converted once
for a verification's rows, bit for bit (``csrc/quant_linear.cpp``), and llama.cpp-style block-quantized
weights times int8 activations with integer dot products (``csrc/a8_linear.cpp``).
The kernel is C++ built with PyTorch's own extension builder (``torch.utils.cpp_extension.load``:
the compiler on PATH and ninja), once per (CPU vector capability, torch version, source), into
``cache_root() / "kernels"``; a later process only loads the shared library (~0.1 s). It is built
for the vector width PyTorch itself dispatches to on this CPU (AVX512, AVX2 or plain C++), with
``-ffp-contract=off`` so that no multiply-add is fused where the source did not ask for it, and with
OpenMP, so that ATen's ``parallel_for`` in the kernels runs on PyTorch's threads (without it the
template runs everything on the calling thread: until 2026-11-28 both kernels ran on one core).

When the build cannot run (no C++ compiler, a read-only cache) the engine keeps PyTorch's SDPA and
says at start-up that speculation is then not guaranteed bit-identical (``exact_attention_error``).

Worked example::

    op = exact_attention_op()            # builds on the first call of the process (~15 s the first time)
    out = op(q, k_cache, v_cache, slots, mask, 0.125)   # q [T, n_h, hd] -> [T, n_h, hd]
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from tidespec.files import cache_root

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("row_invariant.cpp", "exact_linear.cpp",
                                                                     "quant_linear.cpp", "a8_linear.cpp",
                                                                     "gguf_linear.cpp"))
# included by the sources: part of the library's name, so a change to one builds a new library
HEADERS = (Path(__file__).parent / "csrc" / "a8_tiles.h",)
# per vector capability: the flags that make ATen's Vectorized<float> use it (what PyTorch's own
# kernels are compiled with for that capability)
CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}
# -fopenmp: ATen's parallel_for is a template compiled into the kernel; without OpenMP it runs the
# whole range on the calling thread (ParallelOpenMP.h). The library then uses the libgomp PyTorch
# has loaded (same soname), so at::set_num_threads governs its threads too.
COMMON_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]
LINK_FLAGS = ["-fopenmp"]


def _capability() -> str:
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap in CAPABILITY_FLAGS else "DEFAULT"


def library_name() -> str:
    """Library name keyed by what changes the binary: source, flags, capability, torch version."""
    cap = _capability()
    key = hashlib.sha256()
    for source in SOURCES + HEADERS:
        key.update(source.read_bytes())
    key.update(" ".join(COMMON_FLAGS + CAPABILITY_FLAGS.get(cap, []) + LINK_FLAGS).encode())
    key.update(torch.__version__.encode())
    return f"tidespec_kernels_{cap.lower()}_{key.hexdigest()[:12]}"


def _load() -> None:
    from torch.utils import cpp_extension  # imported lazily: it pulls in setuptools

    name = library_name()
    build_dir = cache_root() / "kernels" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / f"{name}.so").exists():
        log.info("building tidespec's CPU kernels for this CPU (once; cached in %s)", build_dir)
    flags = COMMON_FLAGS + CAPABILITY_FLAGS.get(_capability(), [])
    # A copy: cpp_extension.load appends torch's libraries to the list it is given, and LINK_FLAGS is
    # part of the library's name (library_name), so mutating it would name a second library.
    cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=flags, extra_ldflags=list(LINK_FLAGS),
                       build_directory=str(build_dir), is_python_module=False, verbose=False)
    torch.library.register_fake("tidespec::exact_attention")(_exact_attention_fake)
    torch.library.register_fake("tidespec::packed_linear")(_packed_linear_fake)
    torch.library.register_fake("tidespec::exact_linear")(_exact_linear_fake)
    torch.library.register_fake("tidespec::int4_linear")(_int4_linear_fake)
    torch.library.register_fake("tidespec::int8_linear")(_int8_linear_fake)
    torch.library.register_fake("tidespec::w4a8_linear")(_w4a8_linear_fake)
    torch.library.register_fake("tidespec::w8a8_linear")(_w8a8_linear_fake)
    torch.library.register_fake("tidespec::gguf_nib_linear")(_gguf_nib_linear_fake)


def _exact_attention_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                          mask: torch.Tensor, scale: float, block_table: torch.Tensor | None = None,
                          softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Shape function for torch.compile: the output has q's shape and dtype."""
    return torch.empty_like(q)


def _packed_linear_fake(x: torch.Tensor, packed: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Shape function for torch.compile: [T, in] x [out, in] -> [T, out]."""
    return x.new_empty(x.shape[0], w.shape[0])


def _exact_linear_fake(x: torch.Tensor, wp: torch.Tensor, n_out: int) -> torch.Tensor:
    """Shape function for torch.compile: [T, in] x [P, in, VL] -> [T, n_out]."""
    return x.new_empty(x.shape[0], n_out)


def _int4_linear_fake(x: torch.Tensor, packed: torch.Tensor, group_size: int, scale_zero: torch.Tensor) -> torch.Tensor:
    """Shape function for torch.compile: [T, K] x [N, K / 2] -> [T, N]."""
    return x.new_empty(x.shape[0], packed.shape[0])


def _int8_linear_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Shape function for torch.compile: [T, K] x [N, K] -> [T, N]."""
    return x.new_empty(x.shape[0], qweight.shape[0])


def _w4a8_linear_fake(x: torch.Tensor, packed: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """Shape function for torch.compile: [T, K] x [N / 16, K / 8, 64] -> [T, N] float32."""
    return x.new_empty(x.shape[0], packed.shape[0] * 16)


def _w8a8_linear_fake(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, corr: torch.Tensor) -> torch.Tensor:
    """Shape function for torch.compile: [T, K] x [N / 16, K / 4, 64] -> [T, N] float32."""
    return x.new_empty(x.shape[0], packed.shape[0] * 16)


def _gguf_nib_linear_fake(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                          high: torch.Tensor | None, offset: int, scale_super: torch.Tensor | None = None,
                          min_super: torch.Tensor | None = None) -> torch.Tensor:
    """Shape function for torch.compile: [T, K] x [N / 16, K / 8, 64] -> [T, N] float32."""
    return x.new_empty(x.shape[0], packed.shape[0] * 16)


@functools.cache
def ensure_built() -> str | None:
    """Build or load the kernel library once per process (the result is cached: the library, once
    loaded, stays loaded); None when it is ready, else why not, in one line."""
    try:
        _load()
    except Exception as exc:  # noqa: BLE001 - any build failure (compiler, ninja, disk) means: no kernel
        text = str(exc).strip().splitlines()
        error = f"{type(exc).__name__}: {text[0] if text else exc!r}"
        log.warning("tidespec's row-invariant attention kernel could not be built (%s): speculation falls back "
                    "to SDPA and is not guaranteed bit-identical to plain decoding", error)
        return error
    return None


@functools.cache
def quant_linear_available() -> bool:
    """Whether ``torch.ops.tidespec.int4_linear`` and ``int8_linear`` run here: the library is built and
    was compiled for AVX512, the vector width whose packing of PyTorch's int4 weights they read."""
    return ensure_built() is None and bool(torch.ops.tidespec.quant_linear_available())


def exact_attention_error() -> str | None:
    """Why the kernel is unavailable (None when it is available); builds it on the first call."""
    return ensure_built()


def exact_attention_op() -> Callable[..., torch.Tensor]:
    """``torch.ops.tidespec.exact_attention`` (q, k_cache, v_cache, slots, mask, scale), built first.
    Raises RuntimeError when it cannot be built (callers check ``exact_attention_error`` first)."""
    error = ensure_built()
    if error is not None:
        raise RuntimeError(f"tidespec's exact attention kernel is unavailable: {error}")
    return torch.ops.tidespec.exact_attention
