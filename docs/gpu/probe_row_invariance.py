"""GPU probe (docs/benchmarks/exactness.md, "CUDA"): which operation of a forward gives a row other
bits when the call holds other rows, and what fixed-shape graphs cost.

Part 1, per operation, bfloat16 (then float32) on the device: row 0's output computed in a call of m
rows against the same row computed alone (m = 1), for the projections of SmolLM2-135M's shape and
its LM head (``F.linear``, cuBLAS), the RMS norm as the model computes it, and SDPA with a boolean
mask (the graphs' attention, cuDNN excluded as eager CUDA attention runs it): more query rows, a
longer key range whose tail is masked, more sequences. Prints, per case, the row counts whose bits
match the 1-row call.

Part 2, the graphs (random weights of the 135M shape, bfloat16, compiled layer): one sequence's
logits at a position from a decode step (1 row) and from a 5-row verification, in the usual graphs,
in fixed-shape graphs (``GraphStep(fixed_shape=True)``) and in the usual graphs with the fixed-order
attention kernel (``row_kernel=True``, ``models/kernels/row_attention.py``), beside another sequence too,
and the replay time of a decode step in each. Usage (about a minute): ``PYTHONPATH=$PWD python3
docs/gpu/probe_row_invariance.py [cuda]``; on a CPU it runs part 1 only.
"""
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tidespec.bench.anchor.run import SHAPES, random_model
from tidespec.models.execution.graphs import GraphStep
from tidespec.models.kernels.attention import NOT_CUDNN
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
ROWS = (1, 2, 3, 4, 5, 8, 16, 32, 40, 64, 80, 128, 256, 512)


def same_rows(f, make, rows=ROWS) -> str:
    """The row counts m at which f(make(m))[0] has the bits of f(make(1))[0]."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    big = make(max(rows), gen)
    ref = f(big[:1])[0]
    ok = [m for m in rows if torch.equal(f(big[:m])[0], ref)]
    return f"{len(ok)}/{len(rows)} match" + ("" if len(ok) == len(rows) else f" (at m = {ok})")


def part1(dtype: torch.dtype) -> None:
    cfg = SHAPES["smollm2-135m"]
    print(f"-- per operation, {dtype}, {DEVICE}")
    rnd = lambda *shape: lambda m, g: torch.randn(m, *shape, generator=g).to(DEVICE, dtype)
    for n_out, n_in in ((576, 576), (192, 576), (1536, 576), (576, 1536), (cfg.vocab_size, 576)):
        w = (torch.randn(n_out, n_in) * 0.02).to(DEVICE, dtype)
        print(f"linear {n_out}x{n_in}: {same_rows(lambda x: F.linear(x, w), rnd(n_in))}")
    wn = torch.ones(576, device=DEVICE, dtype=dtype)

    def norm(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * wn
    print(f"rms norm 576: {same_rows(norm, rnd(576))}")
    hd, n_h, n_kv = 64, 9, 3
    for name, backends in (("sdpa (cuDNN excluded)", NOT_CUDNN), ("sdpa (any backend)", NOT_CUDNN + [SDPBackend.CUDNN_ATTENTION])):
        g = torch.Generator().manual_seed(1)
        k = torch.randn(4, n_kv, 1024, hd, generator=g).to(DEVICE, dtype)
        v = torch.randn(4, n_kv, 1024, hd, generator=g).to(DEVICE, dtype)
        q = torch.randn(4, n_h, 8, hd, generator=g).to(DEVICE, dtype)
        ctx = 200

        def att(b: int, qn: int, length: int) -> torch.Tensor:  # row 0 of sequence 0, keys 0..ctx visible
            mask = torch.zeros(b, 1, qn, length, dtype=torch.bool, device=DEVICE)
            mask[..., :ctx + 1] = True
            with sdpa_kernel(backends):
                out = F.scaled_dot_product_attention(q[:b, :, :qn], k[:b, :, :length], v[:b, :, :length],
                                                     attn_mask=mask, enable_gqa=True)
            return out[0, :, 0]
        ref = att(1, 1, 256)
        cases = {f"q {qn}": att(1, qn, 256) for qn in (2, 5, 8)}
        cases.update({f"keys {n}": att(1, 1, n) for n in (512, 1024)})
        cases.update({f"batch {b}": att(b, 1, 256) for b in (2, 4)})
        cases["batch 4, q 8, keys 1024"] = att(4, 8, 1024)
        print(f"{name}: " + ", ".join(f"{c} {'same' if torch.equal(o, ref) else 'DIFFERS'}" for c, o in cases.items()))


def part2() -> None:
    cfg = SHAPES["smollm2-135m"]
    model = random_model(cfg, torch.bfloat16, DEVICE, seed=0)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, cfg.vocab_size, (300,), generator=gen).tolist()
    cont = torch.randint(3, cfg.vocab_size, (5,), generator=gen).tolist()
    print("-- graphs, random 135M, bfloat16, compiled layer; logits of the row at position 300")
    for fixed, row_kernel in ((False, False), (True, False), (False, True)):
        kv = KVCache.for_model(cfg, 4, 1024, torch.bfloat16, DEVICE, spare_slot=True)
        step = GraphStep(model, kv, (), max_q=5, compile=True, fixed_shape=fixed, prompt_rows=512,
                         row_kernel=row_kernel)
        t0 = time.perf_counter()
        step.warm_up()
        warm = time.perf_counter() - t0
        for slot in (0, 1):
            with torch.inference_mode():
                model(torch.tensor(prompt, device=DEVICE), BatchLayout.build([300], [0], [slot], device=DEVICE), kv)
        dec = step([cont[0]], [1], [300], [0])
        ver = step(cont, [5], [300], [0])
        both = step(cont + cont[:3], [5, 3], [300, 300], [0, 1])
        assert dec is not None and ver is not None and both is not None
        ref = dec.logits[0]
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                step([cont[0]], [1], [300], [0])
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / 200 * 1e3)
        vt = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                step(cont, [5], [300], [0])
            torch.cuda.synchronize()
            vt.append((time.perf_counter() - t0) / 200 * 1e3)
        print(f"fixed_shape={fixed} row_kernel={row_kernel}: {len(step.graphs)} graphs captured in {warm:.1f} s; verification row 0 "
              f"{'same' if torch.equal(ver.logits[0], ref) else 'DIFFERS'}, beside another sequence "
              f"{'same' if torch.equal(both.logits[0], ref) else 'DIFFERS'}; decode step "
              f"{min(times):.3f} ms, 5-row verification {min(vt):.3f} ms (best of 3 x 200, host included)")


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    part1(torch.bfloat16)
    part1(torch.float32)
    if DEVICE.startswith("cuda"):
        part2()
