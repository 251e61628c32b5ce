"""``tidespec::exact_attention`` alone: its time per call at serving's shapes, and its bits before / after a change.

The row-invariant attention kernel (``models/kernels/csrc/row_invariant.cpp``) on a paged pool laid out as
the engine's (keys transposed, blocks of 16 scattered over the pool), the embedded model's heads (9 query
heads, 3 KV heads, head size 64) by default:

* ``time``: warm caches, the same call repeated (median of 7 passes of 100 calls);
* ``cold``: 30 layers' caches called in turn, as a forward does (median of 15 passes, per layer);
* ``dump FILE`` / ``check FILE``: the outputs of 1,440 cases (float32 and bfloat16, 1 and 2 threads, block
  sizes 16 / 48 / 128 and a contiguous cache, chains and trees, five head layouts) saved, or compared bit for
  bit with a saved set: a change that only reorders memory traffic must leave every bit where it was.

    PYTHONPATH=. .venv/bin/python docs/benchmarks/attention_kernel.py time|cold [--shapes 4/1/300,4/2/300]
    PYTHONPATH=. .venv/bin/python docs/benchmarks/attention_kernel.py dump|check FILE

A shape is batch / rows per sequence / keys before them. Before / after a change: ``dump`` with
``PYTHONPATH`` at a ``git worktree`` of the older commit, ``check`` with the newer one; timings alternating
between the two, in one quiet machine's run.
"""
import argparse
import statistics
import time

import torch

from tidespec.models.kernels.attention import attend_exact

SHAPES = "1/1/300,1/2/300,1/5/300,4/1/300,4/2/300,4/5/300,16/1/300,1/1/2000,4/3/1000"


def case(batch: int, rows: int, ctx: int, seed: int = 0, dtype: torch.dtype = torch.float32, tree: bool = False,
         heads: tuple[int, int, int] = (9, 3, 64), bs: int = 16, contiguous: bool = False) -> tuple:
    """Arguments of one call: q [T, n_h, hd], the K / V pools (keys transposed), row slots [T], masks
    [T, ctx + rows], the block table (None: one contiguous slot per sequence)."""
    n_h, n_kv, hd = heads
    g = torch.Generator().manual_seed(seed)
    length = ctx + rows
    nb = -(-length // bs)
    pool = max(128, 3 * batch * nb)
    T = batch * rows
    q = torch.randn(T, n_h, hd, generator=g).to(dtype)
    mask = torch.zeros(T, length, dtype=torch.bool)
    for b in range(batch):
        for i in range(rows):
            mask[b * rows + i, :ctx + i + 1] = True
            if tree and i >= 2:
                mask[b * rows + i, ctx + 1] = False  # a tree row that does not see a sibling
    slots = torch.arange(batch).repeat_interleave(rows)
    if contiguous:
        cap = -(-(length + 3) // 16) * 16
        k = torch.randn(batch, n_kv, hd, cap, generator=g).to(dtype).transpose(2, 3)  # [S, n_kv, L, hd]
        v = torch.randn(batch, n_kv, cap, hd, generator=g).to(dtype)
        return q, k, v, slots, mask, None
    k = torch.randn(pool, n_kv, hd, bs, generator=g).to(dtype).transpose(2, 3)  # [NB, n_kv, bs, hd]
    v = torch.randn(pool, n_kv, bs, hd, generator=g).to(dtype)
    table = torch.zeros(batch, nb + 2, dtype=torch.int64)
    table[:, :nb] = (torch.randperm(pool - 1, generator=g)[:batch * nb] + 1).view(batch, nb)
    return q, k, v, slots, mask, table


def shapes_of(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in s.split("/")) for s in text.split(",")]


def timed(shapes: str, cold: bool) -> None:
    torch.set_num_threads(2)
    for shape in shapes_of(shapes):
        calls = [case(*shape, seed=i) for i in range(30 if cold else 1)]
        times = []
        for _ in range(15 if cold else 7):
            for c in calls if not cold else ():
                for _ in range(20):
                    attend_exact(*c)
            n = 30 if cold else 100
            t = time.perf_counter()
            for i in range(n):
                attend_exact(*calls[i % len(calls)])
            times.append((time.perf_counter() - t) / n * 1e6)
        print(f"{'cold' if cold else 'warm'} {'/'.join(map(str, shape))}: {statistics.median(times):.1f} us a call")


def outputs() -> list[torch.Tensor]:
    out = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            for shape in shapes_of(SHAPES + ",3/4/37,2/7/129,5/1/17"):
                for tree in (False, True):
                    for heads in ((9, 3, 64), (8, 8, 64), (16, 2, 128), (4, 1, 80), (12, 4, 32)):
                        for bs, contiguous in ((16, False), (48, False), (128, False), (16, True)):
                            if threads == 2 and bs != 16:
                                continue
                            c = case(*shape, dtype=dtype, tree=tree, heads=heads, bs=bs, contiguous=contiguous)
                            out.append(attend_exact(*c).float())
    return out


ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=("time", "cold", "dump", "check"))
ap.add_argument("file", nargs="?")
ap.add_argument("--shapes", default=SHAPES)
ns = ap.parse_args()
if ns.mode in ("time", "cold"):
    timed(ns.shapes, ns.mode == "cold")
elif ns.mode == "dump":
    saved = outputs()
    torch.save(saved, ns.file)
    print(f"{len(saved)} cases saved to {ns.file}")
else:
    ref, new = torch.load(ns.file), outputs()
    print(f"{len(new)} cases, {sum(not torch.equal(a, b) for a, b in zip(ref, new))} differ")
