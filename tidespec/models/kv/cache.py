"""Slot-based KV cache with per-sequence ownership, multi-token append, rollback and compaction.

Why this exists: speculative decoding writes K/V for draft tokens that may be rejected, so the
cache must roll back to any earlier length cheaply; tree verification writes sibling branches
and must keep only the accepted path. Each sequence owns one contiguous slot of
``max_model_len`` positions: rollback is setting a length, compaction is a copy of a few
positions, and attention reads a contiguous view (no gather) — the right trade on CPU, where
a paged gather per step would cost more than it saves. Memory is reserved with ``torch.empty``
so untouched pages are never committed by the OS; positions are zero-filled only when a batched
attention call is about to read them unwritten (``make_readable``): a masked key's weight is 0,
but 0 x NaN from uninitialised memory would still be NaN. Because nothing is committed up front,
a cache far larger than the machine's memory would start fine and be killed later by the
kernel's OOM killer; so a CPU cache larger than the memory available is refused at start-up
(``overcommit=False``, the engine's default; ``--kv-overcommit`` lifts it, for sequences known to
stay short).

A row-invariant CPU target (``models/kernels/attention.py``) stores its keys transposed,
``transposed_keys=True``: memory [S, n_kv, hd, L], so that a run of consecutive positions of one
head dim is one vector load for the exact attention kernel; ``k[i]`` is still the [S, n_kv, L, hd]
view, so every reader and writer indexes it as before.

Worked example::

    kv = KVCache.for_model(cfg, num_slots=2, max_len=16, dtype=torch.float32)
    s = kv.allocate()            # -> 0
    kv.set_length(s, 7)          # after the model wrote 7 positions
    kv.set_length(s, 5)          # roll back 2 rejected drafts
    kv.compact(s, src=[6, 9], dst_start=5)   # keep tree tokens at offsets 6 and 9 as 5, 6
    kv.free(s)
"""

from __future__ import annotations

from pathlib import Path

import psutil
import torch

from tidespec.errors import ConfigError
from tidespec.models.target import TargetConfig

MAX_NUMEL = 2**62  # torch sizes are C int64: a larger tensor is not even attempted
CGROUP = Path("/sys/fs/cgroup")


def available_memory() -> int:
    """Bytes of host memory this process can still commit: what the OS reports available, bounded
    by the container's cgroup (v2) limit when there is one."""
    available = int(psutil.virtual_memory().available)
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int((CGROUP / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        pass
    return max(0, available)


class KVCache:
    """Per-layer K/V tensors ``[num_slots, n_kv, max_len, hd]`` plus slot bookkeeping."""

    zero_chunk = 64  # positions zero-filled at a time ahead of the reads (amortises the fill calls)

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", spare_slot: bool = False,
                 transposed_keys: bool = False, overcommit: bool = True) -> None:
        # ``spare_slot``: one more slot, ``num_slots``, that no sequence is ever given: the CUDA
        # graphs write their padding rows' K/V there (``models/execution/graphs.py``). ``transposed_keys``:
        # keys stored [S, n_kv, hd, L] for the row-invariant kernel (module docstring), CPU only
        total = num_slots + int(spare_slot)
        shape = (total, num_kv_heads, max_len, head_dim)
        if transposed_keys:
            if torch.device(device).type != "cpu":
                raise ValueError("transposed keys are the CPU's row-invariant layout")
            from tidespec.models.kernels.ops import exact_attention_error  # the kernel that reads them

            error = exact_attention_error()
            if error is not None:
                raise RuntimeError(f"transposed keys need tidespec's exact attention kernel: {error}")
        key_shape = (total, num_kv_heads, head_dim, max_len) if transposed_keys else shape
        # off the CPU the cache is zero-filled once (cheap on a GPU, and a captured graph cannot
        # call ``make_readable``); on the CPU untouched pages stay uncommitted (module docstring)
        fill = torch.empty if torch.device(device).type == "cpu" else torch.zeros
        numel = total * num_kv_heads * max_len * head_dim
        nbytes = 2 * num_layers * numel * dtype.itemsize
        need = f"{nbytes / 2**30:,.1f} GiB"
        if numel >= MAX_NUMEL:
            raise self._no_room(total, max_len, need, device, "larger than any tensor")
        if not overcommit and fill is torch.empty and nbytes > (free := available_memory()):
            raise self._no_room(total, max_len, need, device, f"only {free / 2**30:,.1f} GiB of memory is available",
                                "; or pass --kv-overcommit when sequences stay far shorter")
        try:
            keys = [fill(key_shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.k: list[torch.Tensor] = [k.transpose(2, 3) for k in keys] if transposed_keys else keys
            self.v: list[torch.Tensor] = [fill(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        except RuntimeError as exc:  # torch.OutOfMemoryError (a RuntimeError) and the CPU allocator's error
            text = str(exc)
            why = "out of memory" if "memory" in text.lower() else (text.strip().splitlines() or [repr(exc)])[0]
            raise self._no_room(total, max_len, need, device, why) from exc
        self.num_slots = num_slots
        self.spare_slot: int | None = num_slots if spare_slot else None
        self.max_len = max_len
        self.lengths: list[int] = [0] * total
        # positions [0, finite) hold written or zeroed values
        self.finite: list[int] = [0 if fill is torch.empty else max_len] * total
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @staticmethod
    def _no_room(slots: int, max_len: int, need: str, device: torch.device | str, why: str,
                 more: str = "") -> ConfigError:
        """The one-line error of a cache that cannot be allocated, naming the flags that size it."""
        return ConfigError(f"the KV cache of {slots} sequences x {max_len} positions needs {need} on {device}: "
                           f"{why}; lower --max-num-seqs or --max-model-len{more}")

    @classmethod
    def for_model(cls, cfg: TargetConfig, num_slots: int, max_len: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu", spare_slot: bool = False,
                  transposed_keys: bool = False, overcommit: bool = True) -> "KVCache":
        return cls(cfg.num_layers, num_slots, max_len, cfg.num_kv_heads, cfg.head_dim, dtype, device, spare_slot,
                   transposed_keys, overcommit)

    @property
    def capacity(self) -> int:
        """The most positions one sequence can hold: its slot's length."""
        return self.max_len

    @property
    def paged(self) -> bool:
        """Whether sequences hold blocks of a shared pool (``models/kv/paged.py``) rather than slots."""
        return False

    @property
    def transposed_keys(self) -> bool:
        """Whether the keys are stored transposed (the row-invariant kernel's layout)."""
        return self.k[0].stride(2) == 1 and self.k[0].stride(3) != 1

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def free_slots(self) -> list[int]:
        """The slots no sequence owns, ascending."""
        return sorted(self._free)

    def allocate(self) -> int | None:
        """Take a free slot, or None when all are owned."""
        if not self._free:
            return None
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def make_readable(self, slots: list[int], upto: int) -> None:
        """Make positions ``[0, upto)`` of ``slots`` safe to read: zero what was never written.

        Attention over a padded batch reads up to the longest sequence's length in every slot it
        covers; what it reads past a slot's own length is masked out but must be finite. Positions
        once written (by a forward, or zeroed here) stay finite across rollback and reuse.
        Example: finite = [0, 70], make_readable([0, 1], 5) zeroes slot 0 at 0..63 and leaves slot 1.
        """
        for slot in slots:
            start = self.finite[slot]
            if start >= upto:
                continue
            end = min(self.max_len, max(upto, start + self.zero_chunk))
            for k, v in zip(self.k, self.v):
                k[slot, :, start:end].zero_()
                v[slot, :, start:end].zero_()
            self.finite[slot] = end

    def mark_written(self, slot: int, upto: int) -> None:
        """Positions ``[0, upto)`` of ``slot`` were written outside a forward (a prefix copied in)."""
        self.finite[slot] = max(self.finite[slot], min(upto, self.max_len))

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} freed twice")
        self.lengths[slot] = 0
        self._free.append(slot)

    def release(self, slot: int) -> None:
        """Drop what ``slot`` holds and keep it owned: its length becomes 0 (a paged cache also gives
        its blocks back, shared ones to their other holders)."""
        self.set_length(slot, 0)

    def set_length(self, slot: int, length: int) -> None:
        """Mark the first ``length`` positions valid (append after a forward, or roll back)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length {length} outside [0, {self.max_len}]")
        self.lengths[slot] = length

    def compact(self, slot: int, src: list[int], dst_start: int) -> None:
        """Move K/V at offsets ``src`` (ascending) to ``dst_start, dst_start+1, ...`` in every layer."""
        if not src:
            return
        if src == list(range(dst_start, dst_start + len(src))):
            return
        idx = torch.tensor(src, dtype=torch.int64, device=self.k[0].device)
        for k, v in zip(self.k, self.v):
            k[slot, :, dst_start:dst_start + len(src)] = k[slot, :, idx]
            v[slot, :, dst_start:dst_start + len(src)] = v[slot, :, idx]

    def usage(self) -> float:
        """Fraction of all token positions holding valid K/V (for metrics and KV-pressure guards)."""
        return sum(self.lengths) / float(self.num_slots * self.max_len)

    def slot_usage(self) -> float:
        """Fraction of slots owned by a sequence."""
        return 1.0 - len(self._free) / self.num_slots
