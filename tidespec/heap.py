"""glibc's ``malloc_trim``: hand the heap's freed pages back to the operating system.

Why this exists: glibc keeps freed pages in its arenas. Two places free a lot at once and then
hold still:
- The server, after bursts of large requests (``server.guard.MemoryTrimmer``).
- ``load_model``, after a quantized model is built. Each layer's float weights and the unpacking's
  temporaries are freed as it goes, and they stayed resident: a Qwen3-MoE on its GGUF blocks held
  7.0 GB for 4.3 GB of tensors, and 4.7 GB after one trim of 0.1 s.
Where there is no glibc (musl, macOS), there is no trim and nothing happens.

Example::

    trim = find_malloc_trim()
    if trim is not None:
        trim(0)       # 0: keep no padding at the top of the heap
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim(pad)`` as a callable, or None where the C library has none."""
    path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(path) if path else None
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
    return trim
