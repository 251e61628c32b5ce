"""Threads beside the one that steps the engine: one intra-op thread each, so the step's OpenMP team stays hot.

Why this exists: PyTorch runs a CPU op's parallel regions on an OpenMP team that belongs to the
calling OS thread, and a thread's team lives as long as the thread. GNU OpenMP (the runtime in
PyTorch's Linux wheels) counts the threads of all teams; once they outnumber the CPUs it stops
spin-waiting between parallel regions, and every one of a decode step's hundreds of small
parallel regions then wakes its workers through the kernel (a futex each). Measured on the 2-core
development VM, the embedded model's batch-2 decode step (docs/benchmarks/cpu.md):

- a helper thread that once ran a 2-thread op (the capture flusher's first copy of a shard) and
  stayed alive took the step from 26 to 42 ms, ~570 voluntary context switches per step, for the
  rest of the process (it hit plain decoding's engine in the same process as much);
- ``tidespec serve`` stepped its engine on a thread of its own after the main thread had loaded the
  model with 2 threads: 48 ms instead of 26, for every request the server ever answered.

So the rule: only the thread that steps an engine has a team. Helper threads start through
``start_helper`` (one intra-op thread first thing: their own OpenMP setting and MKL's thread-local
one; they never create a team and never take a core from the step). PyTorch also keeps the last
``set_num_threads`` value as the default of threads that start later, so a thread that steps an
engine sets its own count when it starts (``pin_threads``, as ``AsyncEngine`` does), and
``LLMEngine.step`` pins the count the engine was built with again whenever it changed under it:
another thread's call reaches a running thread's count, for a reason we have not found. The
server's main thread's ``release_team`` lowered the running engine thread's count to 1 (measured
2026-11-28: every step on one core, a 1,551-token prefill through the server 5.3 s instead of
2.9 s); in ``bench shift`` the training governor's first ``pin_threads(1)``, on its own helper
thread, lowered the main thread's to 1 during the first warm-up (2026-11-29: every online run's
report said "1 threads", and every configuration stepped on one core from then on). A thread that
handed the stepping to another one (the server's main thread, after loading the model) gives its
team back with ``release_team`` (OpenMP 5.0's ``omp_pause_resource_all`` on the runtime PyTorch
loaded).

Worked example::

    t = start_helper(flush_forever, "tidespec-capture-flusher")   # runs with 1 intra-op thread
    release_team()           # in the server's main thread, before the engine thread takes over
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the runtime's threads, keep what can be reused
OPENMP_RUNTIMES = ("libgomp", "libomp", "libiomp5")  # GNU, LLVM, Intel: each has omp_pause_resource_all


def pin_threads(n: int) -> None:
    """Set the calling thread's intra-op thread count to ``n`` for good. PyTorch initialises a
    thread's count lazily, at its first op, from the process-wide last ``set_num_threads`` value,
    and that initialisation would overwrite an earlier ``set_num_threads`` of the same thread (e.g.
    with the 1 a helper thread set meanwhile): ``get_num_threads`` runs it first."""
    torch.get_num_threads()
    torch.set_num_threads(n)


def helper_init() -> None:
    """Make the calling (helper) thread run PyTorch ops on itself alone: no OpenMP team."""
    pin_threads(1)


def start_helper(target: Callable[[], None], name: str) -> threading.Thread:
    """Start a daemon thread that runs ``target`` with one intra-op thread (module docstring)."""

    def run() -> None:
        helper_init()
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process loaded (PyTorch's), or None (none loaded, not Linux)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for path in {line.split()[-1] for line in lines if "/" in line}:  # each mapped file once
        if Path(path).name.split(".")[0].split("-")[0] in OPENMP_RUNTIMES:  # libgomp.so.1, libgomp-<hash>.so.1
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            if hasattr(lib, "omp_pause_resource_all"):
                return lib
    return None


def release_team() -> bool:
    """Free the calling thread's OpenMP team and keep it from making another (one intra-op thread
    from now on): for a thread that handed the stepping over to another one. True when the
    runtime freed its threads; False where there is none to call (then only the thread count is
    lowered, which keeps new teams from forming)."""
    lib = _openmp_runtime()
    freed = False
    if lib is not None:
        lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
        lib.omp_pause_resource_all.restype = ctypes.c_int
        freed = lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
    if not freed:
        log.debug("no OpenMP runtime freed this thread's team")
    pin_threads(1)
    return freed
