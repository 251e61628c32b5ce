"""Attention with a fixed reduction order on the GPU: a row's output does not depend on the rest of the call.

Why this exists: on an H200 in bfloat16 the projections, the LM head and the norms give a row the
same bits at any row count, but SDPA does not: its kernels split the work by the number of query
rows, keys and sequences (``docs/gpu/probe_row_invariance.py``). Fixed-shape graphs
(``models/execution/graphs.py``) work around it by running every decode and verification at one shape, which
makes speculation exact but costs plain decoding about 13 % (the whole key range and 8 rows every
step) and leaves batching inexact. This kernel is the CUDA counterpart of ``tidespec::exact_attention``
(``models/kernels/csrc/row_invariant.cpp``): one program per (new token, query head) reads its slot's keys in
blocks of ``BLOCK_N`` in order, with an online softmax in float32; keys it may not see add exactly
nothing. What a row computes depends on its query, its slot's cache and its own mask, never on
how many rows, sequences or keys the call holds, so graphs can keep their row counts and key
buckets and still give a verification row (and a row batched with others) its decode row's bits.
Triton is written here rather than a library kernel because no maintained attention kernel offers
a reduction order independent of the batch (FlashAttention and SDPA choose splits by shape).

The mask is the graphs' (``SlotBlockLayout``): row ``r`` of slot ``b = r // rows`` sees the slot's
cache ``0 .. ctx[b] - 1`` and the new rows ``j <= lim[r]`` whose bit ``j`` of ``bits[r]`` is set,
within the sliding window (keys at offsets ``> write_offsets[r] - window``).

Status: run on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``) against SDPA; the GPU
checks are prepared (``docs/gpu/probe_row_invariance.py``, ``tests/cuda``) and not yet run, so the
engine does not use it yet.

Worked example (one sequence in slot 0, 40 cached tokens, a decode row and a 3-row chain)::

    out1 = row_attention(q1, k_cache, v_cache, ctx=[40], lim=[0], bits=[-1], offsets=[40], rows=1, keys=256)
    out3 = row_attention(q3, k_cache, v_cache, ctx=[40], lim=[0, 1, 2], bits=[-1] * 3,
                         offsets=[40, 41, 42], rows=3, keys=512)
    torch.equal(out3[0], out1[0])   # True: the same program computed row 0 both times
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from tidespec.models.kernels.attention import attend_padded

BLOCK_N = 64  # keys per block: part of the reduction order, so a constant, never tuned per shape


def block_mask(ctx: torch.Tensor, lim: torch.Tensor, bits: torch.Tensor, offsets: torch.Tensor, rows: int,
               keys: int, window: int | None) -> torch.Tensor:
    """The mask the kernel applies, as a tensor: [B, 1, rows, keys] bool (True = attend) from ctx
    [B] and lim, bits, offsets [B * rows] (module docstring). What SDPA is given in the graphs.

    Example: ctx [3], one 2-row chain (lim [0, 1], bits all set), keys 6 ->
    [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]."""
    shape = (-1, 1, rows, 1)
    kpos = torch.arange(keys, device=ctx.device).view(1, 1, 1, -1)
    rel = kpos - ctx.view(-1, 1, 1, 1)  # [B, 1, 1, L] offset of each key among the new rows
    bit = torch.bitwise_right_shift(bits.view(shape), rel.clamp(0, 63)) & 1  # [B, 1, rows, L]
    mask = (rel < 0) | ((rel <= lim.view(shape)) & (bit == 1))
    if window is not None:  # a query at offset c + i sees keys at offsets > c + i - window
        mask = mask & (offsets.view(shape) - kpos < window)
    return mask


def available() -> bool:
    """Whether Triton is importable (it ships with CUDA builds of torch)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernel():  # type: ignore[no-untyped-def]
    """The Triton kernel, defined once per process on first use (Triton is imported only where it is
    installed; it compiles the kernel per constexpr set on the first launch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def row_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, ctx_ptr, lim_ptr, bits_ptr, off_ptr,
                             rows, keys, group, window, scale,
                             sq_r, sq_h, sk_s, sk_h, sk_l, sv_s, sv_h, sv_l, so_r, so_h,
                             HD: tl.constexpr, BLOCK: tl.constexpr, WINDOW: tl.constexpr):
        r = tl.program_id(0)  # the new token (block row)
        h = tl.program_id(1)  # its query head
        b = r // rows  # its slot
        g = h // group  # the key/value head it reads
        ctx = tl.load(ctx_ptr + b)
        lim = tl.load(lim_ptr + r)
        bits = tl.load(bits_ptr + r)
        qoff = tl.load(off_ptr + r)
        d = tl.arange(0, HD)
        q = tl.load(q_ptr + r * sq_r + h * sq_h + d).to(tl.float32) * scale  # [HD]
        m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)  # running max (a float32 scalar)
        den = tl.sum(tl.zeros([BLOCK], tl.float32), 0)  # running denominator
        acc = tl.zeros([HD], tl.float32)
        end = ctx + lim + 1  # one past the last key this row may see
        # every block of the call's key range: a block past ``end`` is all masked, and after block 0
        # (key 0 is always seen) it adds 0 and rescales by exp(0) = 1, so the bits do not depend on
        # ``keys``; its masked loads read no memory
        for start in range(0, keys, BLOCK):
            n = start + tl.arange(0, BLOCK)  # [BLOCK] key offsets
            rel = n - ctx
            shift = tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)
            seen = (rel < 0) | ((rel <= lim) & (((bits >> shift) & 1) == 1))
            seen = seen & (n < end)
            if WINDOW:
                seen = seen & (qoff - n < window)
            k = tl.load(k_ptr + b * sk_s + g * sk_h + n[:, None] * sk_l + d[None, :], mask=seen[:, None],
                        other=0.0).to(tl.float32)  # [BLOCK, HD]
            s = tl.where(seen, tl.sum(k * q[None, :], 1), float("-inf"))  # [BLOCK]
            m_new = tl.maximum(m, tl.max(s, 0))
            alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
            p = tl.where(seen, tl.exp(s - m_new), 0.0)  # [BLOCK]
            v = tl.load(v_ptr + b * sv_s + g * sv_h + n[:, None] * sv_l + d[None, :], mask=seen[:, None],
                        other=0.0).to(tl.float32)  # [BLOCK, HD]
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            den = den * alpha + tl.sum(p, 0)
            m = m_new
        tl.store(o_ptr + r * so_r + h * so_h + d, (acc / den).to(o_ptr.dtype.element_ty))

    return row_attention_kernel


@torch.library.custom_op("tidespec_gpu::row_attention", mutates_args=())
def row_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: torch.Tensor,
                     lim: torch.Tensor, bits: torch.Tensor, offsets: torch.Tensor, rows: int, keys: int,
                     window: int) -> torch.Tensor:
    """``row_attention`` as an op (``window`` -1: none) that ``torch.compile`` leaves as it is: the
    compiled decoder layer calls it, and inductor does not look inside. Off CUDA (the CPU tests of
    the graphs' layout, without Triton) it runs SDPA over ``block_mask``: the same mask, not the
    same reduction order."""
    win = None if window < 0 else window
    if q.is_cuda:
        return row_attention(q, k_cache, v_cache, ctx, lim, bits, offsets, rows, keys, win)
    batch = ctx.shape[0]
    mask = block_mask(ctx, lim, bits, offsets, rows, keys, win)
    return attend_padded(q, None, mask, k_cache[:batch, :, :keys], v_cache[:batch, :, :keys])


@row_attention_op.register_fake
def _row_attention_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: torch.Tensor,
                        lim: torch.Tensor, bits: torch.Tensor, offsets: torch.Tensor, rows: int, keys: int,
                        window: int) -> torch.Tensor:
    return torch.empty_like(q)


def row_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: torch.Tensor,
                  lim: torch.Tensor, bits: torch.Tensor, offsets: torch.Tensor, rows: int, keys: int,
                  window: int | None = None) -> torch.Tensor:
    """q [B * rows, n_h, hd]; caches [S, n_kv, >= keys, hd] (slot b holds row block b); ctx [B], lim,
    bits, offsets [B * rows] int64 (module docstring); ``keys``: the key range read (at least every
    row's last visible key + 1) -> [B * rows, n_h, hd] in q's dtype."""
    n, n_h, hd = q.shape
    n_kv = k_cache.shape[1]
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache)):
        raise ValueError("row_attention needs the head dimension contiguous in q and the caches")
    if hd & (hd - 1) or n_h % n_kv:
        raise ValueError(f"row_attention needs a power-of-two head size and n_h % n_kv == 0, got hd={hd}, "
                         f"n_h={n_h}, n_kv={n_kv}")
    out = torch.empty_like(q)
    _kernel()[(n, n_h)](
        q, k_cache, v_cache, out, ctx, lim, bits, offsets, rows, keys, n_h // n_kv, window or 0, hd ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        HD=hd, BLOCK=BLOCK_N, WINDOW=window is not None)
    return out
