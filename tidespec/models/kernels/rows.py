"""Row counts: the probe of a kernel's row invariance, and calls split into pieces within it.

Why this exists: a kernel is row-invariant when a row's result has the same bits whatever the
number of rows in the call (what exact speculative decoding rests on; ``models/execution/invariance.py``).
This module measures a kernel's **frontier** -- the largest row count M such that every probed
count up to M (all of 1..16, then the counts around each power of two) gives each row exactly
the bits of that row computed alone -- and runs a call whose rows exceed a frontier in pieces of
probed sizes within it (more passes over the weight, the same bits per row). It knows nothing of
models; the projection layers (``linear.py``, ``quant.py``) use it.

Worked example (a kernel that switches algorithm after 32 rows)::

    frontier(kernel, 576, torch.bfloat16, 512)     # -> 32: rows differ at 33
    pieces(100, 32)                                # -> [32, 32, 32, 4]: each a probed size <= 32
    in_pieces(kernel, x, 32)                       # kernel over x [100, 576] in those pieces
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# every count up to 16 (decode and verification rows), then around each power of two
PROBE_ROWS = tuple(range(1, 17)) + (24, 31, 32, 33, 48, 63, 64, 65, 96, 127, 128, 129, 192, 255, 256, 257,
                                    384, 511, 512, 513, 768, 1023, 1024, 1025, 1536, 2047, 2048, 2049)
PROBE_METHOD = 2  # bumped when the probe changes, so cached frontiers are measured again


def probed(max_rows: int) -> list[int]:
    """The row counts probed up to ``max_rows`` (always including ``max_rows`` itself).

    Example: ``probed(20) == [1, ..., 16, 20]``."""
    rows = [m for m in PROBE_ROWS if m <= max_rows]
    return rows if rows[-1] == max_rows else rows + [max_rows]


def checked_rows(m: int, seed: int = 0) -> list[int]:
    """The rows of an m-row call compared with their 1-row results: all of them up to 64 rows; else
    the first and last 32 (where kernels put their row blocks' edges and tails) and 32 between,
    drawn at random. Example: ``checked_rows(10) == list(range(10))``."""
    if m <= 64:
        return list(range(m))
    g = torch.Generator().manual_seed(seed + m)
    middle = (32 + torch.randperm(m - 64, generator=g)[:32]).tolist()
    return sorted(set(range(32)) | set(range(m - 32, m)) | set(middle))


def frontier(fn: Callable[[torch.Tensor], torch.Tensor], in_features: int, dtype: torch.dtype, max_rows: int,
             seed: int = 0) -> int:
    """The largest probed row count M <= ``max_rows`` such that for every probed count m up to M,
    the rows of ``fn(x[:m])`` (``checked_rows``) equal ``fn`` of each row alone (0 when already 1
    row differs, which cannot happen: a row alone is its own reference).

    Example: a kernel that switches algorithm after 32 rows -> 32."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(max_rows, in_features, generator=g) * 0.5).to(dtype)  # [M, in], activation-like
    alone: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        best = 0
        for m in probed(max_rows):
            rows = checked_rows(m, seed)
            for i in rows:
                if i not in alone:
                    alone[i] = fn(x[i:i + 1])[0]
            got = fn(x[:m])  # [m, out]
            if not all(torch.equal(got[i], alone[i]) for i in rows):
                return best
            best = m
    return best


def pieces(rows: int, limit: int) -> list[int]:
    """``rows`` split into pieces whose sizes were all probed and are at most ``limit``: as many of
    the largest probed size <= limit as fit, then the remainder the same way down to 16 (all of
    1..16 are probed). An empty list for 0 rows.

    Example: ``pieces(100, 32) == [32, 32, 32, 4]``; ``pieces(40, 24) == [24, 16]``."""
    sizes = [m for m in PROBE_ROWS if m <= limit] or [1]
    out: list[int] = []
    left = rows
    while left > 0:
        size = max(s for s in sizes if s <= left)
        out.append(size)
        left -= size
    return out


def in_pieces(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, limit: int) -> torch.Tensor:
    """``fn`` over the rows of ``x`` ([T, in]) in ``pieces(T, limit)``, concatenated (the rows'
    results have the bits of the whole call on a kernel row-invariant up to ``limit``)."""
    return torch.cat([fn(p) for p in x.split(pieces(x.shape[0], limit))])
