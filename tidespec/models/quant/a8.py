"""w4a8 and w8a8: GGUF-style block-quantized weights times int8 activations, llama.cpp's CPU arithmetic.

Why this exists: ``--quantization int4`` runs PyTorch's weight-only kernels, which dequantize every
weight to float32 and multiply it with a bfloat16 activation: on a 2-core Xeon the 30 layers'
projections take ~7 ms of a 14.7 ms token where llama.cpp decodes the same GGUF in 11.3 ms. llama.cpp
instead quantizes each activation row to int8 per block of 32 (its Q8 "vec_dot" type) and sums
weight x activation products as integers. These layers do the same, in ``csrc/a8_linear.cpp``
(AVX512-VNNI): int4 projections 3.4x faster at one row, the LM head 2x.

Schemes (blocks of 32 inputs, as GGUF's; scales float16):

* **w4a8**: the layers' projections as Q4_1, ``w = d * q + m`` with ``q`` in 0..15, ``d = (max -
  min) / 15`` and ``m = min`` of the block: the embedded model's Q4_1 weights come back as they are
  in the file. The LM head is w8a8 (as the GGUF's Q8_0 output matrix).
* **w8a8**: every projection and the LM head as Q8_0, ``w = d * q`` with ``q`` in -127..127 and
  ``d = max |w| / 127``.

Activations: per row and block, ``dx = max |x| / 127`` and ``qx = round(x / dx)`` (int8). So the
arithmetic itself changes, not only the weights: these modes are targets of their own, and
``tidespec bench quality`` measures them against float32 beside int8 and int4. Lossless speculation
holds as for every target: the kernel computes each row from that row alone (the activation scales
are per row, the integer sums exact, the float steps in one order), whatever the number of rows in
the call. Both need AVX512-VNNI (Intel since Cascade Lake, AMD since Zen 4); elsewhere
``check_a8`` says so in one line.

Worked example::

    layer = W4A8Linear.from_weight(torch.randn(960, 576))   # packed [60, 72, 64] uint8, dm [60, 18, 2, 16]
    layer(torch.randn(5, 576)).shape                         # torch.Size([5, 960]), float32
    q, d, m = quantize_q4_1(torch.tensor([[0.0, 1.5] * 16]))  # d = 0.1, m = 0: q = [0, 15, 0, 15, ...]
"""

from __future__ import annotations

import torch

from tidespec.models.kernels.ops import ensure_built
from tidespec.models.kernels.rows import in_pieces
from tidespec.models.quant.base import QuantizationError, QuantizedLinear

A8_BLOCK = 32  # inputs per weight and activation block (GGUF's Q4_1 / Q8_0)
A8_PANEL = 16  # outputs per packed panel (one vector of 16 int32 sums)
SCALE_DTYPE = torch.float16  # GGUF's block scales
PACK_WEIGHTS = 1 << 22  # weights per piece of a packing with large temporaries (``pack_high``)


def a8_error() -> str | None:
    """Why the w4a8 / w8a8 kernels cannot run here (one line), or None when they can."""
    error = ensure_built()
    if error is not None:
        return f"tidespec's kernels could not be built ({error})"
    if not torch.ops.tidespec.a8_linear_available():
        return "this CPU has no AVX512-VNNI (integer dot products); use --quantization int4 or int8"
    return None


def check_a8(mode: str, sizes: list[int]) -> None:
    """Raise ``QuantizationError`` unless ``mode``'s kernels run here and 32 divides every input size."""
    error = a8_error()
    if error is not None:
        raise QuantizationError(f"--quantization {mode}: {error}")
    bad = sorted({s for s in sizes if s % A8_BLOCK})
    if bad:
        raise QuantizationError(f"--quantization {mode} needs input sizes that are multiples of {A8_BLOCK}; "
                                f"this model has {bad}: use --quantization int8")


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> float32 [N, K/32, 32]."""
    n, k = w.shape
    if k % A8_BLOCK:
        raise QuantizationError(f"input size {k} is not a multiple of {A8_BLOCK}")
    return w.detach().to(torch.float32).cpu().reshape(n, k // A8_BLOCK, A8_BLOCK)


def _codes(g: torch.Tensor, offset: torch.Tensor, d: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """round((g - offset) / d) clamped to [lo, hi] per block, 0 where d is 0: [N, KB, 32] float32."""
    df = d.float().unsqueeze(2)
    q = torch.round((g - offset.float().unsqueeze(2)) / torch.where(df > 0, df, torch.ones_like(df)))
    return torch.where(df > 0, q, torch.zeros_like(q)).clamp(lo, hi)


def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF's Q4_1: ``w [N, K]`` -> ``(q [N, K] uint8 in 0..15, d [N, K/32], m [N, K/32] float16)``,
    ``w ~ d * q + m`` per block of 32 (``d = (max - min) / 15``, ``m = min``, both rounded to float16
    before ``q`` is computed)."""
    g = _blocks(w)
    lo = g.amin(dim=2)
    d = ((g.amax(dim=2) - lo) / 15.0).to(SCALE_DTYPE)
    m = lo.to(SCALE_DTYPE)
    return _codes(g, m, d, 0, 15).to(torch.uint8).reshape(w.shape), d, m


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q8_0: ``w [N, K]`` -> ``(q [N, K] int8 in -127..127, d [N, K/32] float16)``, ``w ~ d * q``."""
    g = _blocks(w)
    d = (g.abs().amax(dim=2) / 127.0).to(SCALE_DTYPE)
    return _codes(g, torch.zeros_like(d), d, -127, 127).to(torch.int8).reshape(w.shape), d


def _panels(t: torch.Tensor) -> torch.Tensor:
    """Per-output block values [N, KB] -> [N/16, KB, 16] (a panel's 16 outputs side by side)."""
    n, kb = t.shape
    return t.reshape(n // A8_PANEL, A8_PANEL, kb).permute(0, 2, 1).contiguous()


def _pad_rows(t: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """Pad dim 0 up to a multiple of the panel with ``fill`` (padding outputs are sliced off)."""
    pad = -t.shape[0] % A8_PANEL
    return torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)]) if pad else t


def pack_w4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 ``(q [N, K], d, m [N, K/32])`` -> the kernel's ``packed [N/16, K/8, 64] uint8`` (at octet j,
    byte 4o + t: q[o, 8j + t] low, q[o, 8j + 4 + t] high) and ``dm [N/16, K/32, 2, 16] float16``;
    N is padded to a multiple of 16 with zero outputs."""
    return pack_nibbles(q), torch.stack([panel_values(d), panel_values(m)], dim=2).contiguous()


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes ``q [N, K]`` uint8 -> the nibble tile's ``packed [N/16, K/8, 64]`` (``pack_w4``'s layout) of
    their low 4 bits; N padded to a multiple of 16 with zero outputs."""
    q = _pad_rows(q) & 0x0F
    n, k = q.shape
    q5 = q.reshape(n // A8_PANEL, A8_PANEL, k // 8, 2, 4)  # [P, o, octet, half, t]
    byte = q5[:, :, :, 0, :] | (q5[:, :, :, 1, :] << 4)  # [P, o, octet, t]
    return byte.permute(0, 2, 1, 3).reshape(n // A8_PANEL, k // 8, 64).contiguous()


def pack_high(q: torch.Tensor, planes: int) -> torch.Tensor:
    """Codes ``q [N, K]`` uint8 of 4 + ``planes`` bits -> their high bits, ``[N/16, K/8, planes, 2, 8]``
    uint8: per octet j, plane h (bit 4 + h) and half (the nibbles of ``pack_nibbles``' low or high half),
    a 64-bit mask whose bit 4o + t is that of the byte at 4o + t (GGUF's Q5 / Q6_K codes)."""
    q = _pad_rows(q)
    n, k = q.shape
    step = max(1, PACK_WEIGHTS // (A8_PANEL * k)) * A8_PANEL  # whole panels at a time: bounded temporaries
    if n > step:
        return torch.cat([pack_high(q[i:i + step], planes) for i in range(0, n, step)])
    q5 = q.reshape(n // A8_PANEL, A8_PANEL, k // 8, 2, 4).permute(0, 2, 3, 1, 4)  # [P, octet, half, o, t]
    bits = torch.stack([(q5 >> (4 + h)) & 1 for h in range(planes)], dim=2)  # [P, octet, plane, half, o, t]
    flat = bits.reshape(-1, 8, 8)  # 8 bytes of 8 bits each, bit i of byte b = entry 8b + i
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return (flat * weights).sum(dim=2, dtype=torch.uint8).reshape(n // A8_PANEL, k // 8, planes, 2, 8).contiguous()


def panel_values(t: torch.Tensor) -> torch.Tensor:
    """Per-output values ``[N, B]`` (scales, mins, per block) -> the kernels' ``[N/16, B, 16]``, a panel's
    16 outputs side by side; N padded as the codes are."""
    return _panels(_pad_rows(t))


def pack_w8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q8_0 ``(q [N, K] int8, d [N, K/32])`` -> ``packed [N/16, K/4, 64] int8`` (at quad j, byte 4o + t:
    q[o, 4j + t]), ``scales [N/16, K/32, 16]`` (d's dtype) and ``corr`` of that shape, int32: 128 x each
    block's sum of q (the kernel's unsigned activations carry +128)."""
    q, d = _pad_rows(q), _pad_rows(d)
    n, k = q.shape
    packed = q.reshape(n // A8_PANEL, A8_PANEL, k // 4, 4).permute(0, 2, 1, 3).reshape(n // A8_PANEL, k // 4, 64)
    corr = 128 * q.reshape(n, k // A8_BLOCK, A8_BLOCK).to(torch.int32).sum(dim=2, dtype=torch.int32)
    return packed.contiguous(), _panels(d), _panels(corr)


class A8Linear(QuantizedLinear):
    """Base of the w4a8 / w8a8 layers: float32 in and out of the kernel (it quantizes the rows itself),
    float16 block scales that a model-wide ``.to(dtype)`` leaves alone, no row pieces (row-invariant
    at any row count by construction)."""

    kernel_dtype = SCALE_DTYPE
    own_kernel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, N] in x's dtype; in pieces only if the start-up probe found the kernel
        # row-invariant over fewer rows than the engine's budget (it is by construction: never seen)
        x32 = x.to(torch.float32).contiguous()
        y = in_pieces(self._kernel, x32, self.row_limit) if self.row_limit else self._kernel(x32)
        return self._finish(y[:, :self.out_features] if y.shape[1] != self.out_features else y, x.dtype)

    @property
    def kernel_name(self) -> str:
        return "tidespec-a8"


class W4A8Linear(A8Linear):
    """Q4_1 weights (blocks of 32, float16 d and m) times int8 activations: ``tidespec::w4a8_linear``.

    Example: ``W4A8Linear.from_weight(torch.randn(960, 576))(torch.randn(5, 576)).shape == (5, 960)``.
    """

    scheme = "w4a8"
    _kernel_buffers = ("dm",)
    packed: torch.Tensor  # [N_pad/16, K/8, 64] uint8
    dm: torch.Tensor  # [N_pad/16, K/32, 2, 16] float16

    def __init__(self, packed: torch.Tensor, dm: torch.Tensor, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer("packed", packed)
        self.register_buffer("dm", dm)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> W4A8Linear:
        n, k = weight.shape
        return cls(*pack_w4(*quantize_q4_1(weight)), k, n, bias)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] float32 -> [T, N_pad] float32
        return torch.ops.tidespec.w4a8_linear(x, self.packed, self.dm)


class W8A8Linear(A8Linear):
    """Q8_0 weights (blocks of 32, float16 d) times int8 activations: ``tidespec::w8a8_linear``.

    Example: ``W8A8Linear.from_weight(torch.randn(49152, 576))`` (an LM head); ``(x [1, 576]) -> [1, 49152]``.
    """

    scheme = "w8a8"
    _kernel_buffers = ("scales",)
    packed: torch.Tensor  # [N_pad/16, K/4, 64] int8
    scales: torch.Tensor  # [N_pad/16, K/32, 16] float16
    corr: torch.Tensor  # [N_pad/16, K/32, 16] int32

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, corr: torch.Tensor, in_features: int,
                 out_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("corr", corr)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> W8A8Linear:
        n, k = weight.shape
        return cls(*pack_w8(*quantize_q8_0(weight)), k, n, bias)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] float32 -> [T, N_pad] float32
        return torch.ops.tidespec.w8a8_linear(x, self.packed, self.scales, self.corr)
