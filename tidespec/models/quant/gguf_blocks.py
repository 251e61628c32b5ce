"""``--quantization gguf``: a GGUF file's own quantized blocks, run as they are on the int8-activation kernels.

Why this exists: a self-hoster downloads a Q4_K_M, Q5_K_M, Q6_K or Q8_0 file and expects the model it
holds. The other modes dequantize the file and quantize again to tidespec's own schemes (w4a8 is
Q4_1 everywhere): a different, lossier target than the file the user chose. Here every projection and
the LM head keep the file's codes and scales; only the arithmetic is tidespec's (``csrc/gguf_linear.cpp``:
activations quantized to int8 per block of 32, integer dot products, per-block float steps in one
order: row-invariant, so speculation stays exact on this target as on every other).

Each type unpacks, per output row, into codes ``q`` and float32 ``scale`` per sub-block of ``sub``
inputs and, for the types with one, ``mins`` per 32 inputs, with ``w = scale * q + mins`` equal to
gguf-py's ``dequantize`` bit for bit (``tests/models/test_gguf_blocks.py``):

========  =======================================  ==================================================
type      w (j: a sub-block)                       on the nibble tile (bits per weight read here)
========  =======================================  ==================================================
Q4_0      d * q - 8 d, q in 0..15                  4 bits, mins; float16 d, -8 d (5.0; file 4.5)
Q4_1      d * q + m                                4 bits, mins; float16 d, m (5.0; file 5.0)
Q4_K      (d sc_j) * q - (dmin m_j), j of 32       4 bits, mins; int8 sc, m, float16 d, dmin (4.625; 4.5)
Q5_0      d * (q - 16), q in 0..31                 5 bits, offset 16; float16 d (5.5; 5.5)
Q5_1      d * q + m                                5 bits, mins; float16 d, m (6.0; 6.0)
Q5_K      (d sc_j) * q - (dmin m_j), j of 32       5 bits, mins; as Q4_K (5.625; 5.5)
Q3_K      (d (sc_j - 32)) * (q - 4), j of 16       3 bits in a nibble, offset 4; int8 sc, float16 d (4.5625; 3.44)
Q6_K      (d sc_j) * (q - 32), j of 16             6 bits, offset 32; int8 sc, float16 d (6.5625; 6.5625)
Q8_0      d * q, q in -127..127                    the w8 tile; float16 d, int32 code sum (9.5; 8.5)
MXFP4     2^(e-128) * q, q an e2m1 value doubled   Q5_0's tile: q + 16 in 4..28; float16 d (5.5; 4.25)
========  =======================================  ==================================================

MXFP4 (gpt-oss's experts) runs on Q5_0's tile: its values are exactly integers of -12..12 (an e2m1
value doubled) times a power of two, so the codes with Q5_0's offset of 16 and the exponent as a
float16 scale keep the file's weights bit for bit, at 5.5 bits read per weight (a kernel that looked
up the e2m1 values from the file's nibbles would read its 4.25; not written).

The kernel reads the scales as the file holds them (``KFactors``: a K-quant's int8 sub-block codes and
its float16 ``d`` per 256 inputs, the product formed in float32, where it is exact: a float16 times a
7-bit integer fits float32's mantissa, so the bits are those of ``scale`` above), so a token reads
about the file's bytes: at batch 1 the projections are bound by memory bandwidth (on a 2-core EPYC,
float32 scales per sub-block read 1.26x the bytes of a Llama-3.2-1B Q4_K_M and decoded 1.2-1.35x
slower). A code's bits above the 4th are bit planes beside the nibbles (``a8.pack_high``). A mixture's
experts run on their blocks too, each expert's rows of the file's [E, out, in] tensors as one matrix
(the converter keeps them per expert). Other types (Q2_K, the IQ types, F16 / BF16 / F32 projections)
are not run natively: ``gguf_layer`` / ``gguf_head`` convert them to Q8_0 (``w8a8``) and says so, per type.

The bit unpacking repeats gguf-py's ``dequantize_blocks`` lines (``gguf.quants``) up to the product:
gguf-py does not return the codes and scales apart, and the kernel needs them apart.

Worked example (one Q8_0 row of 32 inputs, d = 0.5, codes 0..31)::

    raw = np.concatenate([np.float16(0.5).reshape(1).view(np.uint8), np.arange(32, dtype=np.int8).view(np.uint8)])
    u = unpack(raw.reshape(1, 34), GGMLQuantizationType.Q8_0)
    u.sub, u.mins, u.scale.tolist()              # 32, None, [[0.5]]
    dequantize(u)[0, :3].tolist()                # [0.0, 0.5, 1.0]: gguf.dequantize's values
    native_linear(u).forward(torch.ones(1, 32)).shape     # torch.Size([1, 1])
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import MXFP4, Q4_K
from safetensors import safe_open
from torch import nn

from tidespec.models.quant.a8 import A8_BLOCK, A8Linear, W8A8Linear, pack_high, pack_nibbles, pack_w8, panel_values
from tidespec.models.quant.base import QuantizationError
from tidespec.models.target import TargetModel

BLOCKS_FILE = "gguf_blocks.safetensors"  # written beside a converted GGUF's model.safetensors
TYPES_KEY = "ggml_types"  # its metadata: {tensor name: GGML type name}


@dataclass(frozen=True)
class Unpacked:
    """One matrix's blocks apart: ``w[n, k] = scale[n, k // sub] * q[n, k] + mins[n, k // 32]``; the
    kernel reads the codes ``q + offset``, in ``0 .. 2^bits - 1`` (8 bits: Q8_0's signed codes as they are)."""

    type_name: str
    q: np.ndarray  # [N, K] int8
    scale: np.ndarray  # [N, K / sub] float32
    mins: np.ndarray | None  # [N, K / 32] float32
    sub: int  # inputs per scale: 32 or 16
    bits: int  # 3-6: the nibble tile; 8: the w8 tile
    offset: int  # subtracted from the kernel's codes ``q + offset`` (Q5_0 16, Q3_K 4, Q6_K 32)
    factors: KFactors | None = None  # a K-quant's scales (and mins) as the file holds them


@dataclass(frozen=True)
class KFactors:
    """A K-quant matrix's scales as its file holds them: ``scale = d[n, k // 256] * codes`` (and
    ``mins = min_d * min_codes``), products exact in float32, so the kernel forms them itself and reads
    8 bits per 16 or 32 inputs and 16 per 256 instead of a float32 per 16 or 32."""

    codes: np.ndarray  # [N, K / sub] int8
    d: np.ndarray  # [N, K / 256] float16
    mins: tuple[np.ndarray, np.ndarray] | None  # ([N, K / 32] int8 codes, [N, K / 256] float16 (-dmin))

    def exact(self, u: Unpacked) -> bool:
        """Whether these factors give ``u``'s float32 scales and mins bit for bit (they do for any file:
        a float16 times a 7-bit integer fits float32's mantissa); the kernel reads them only then."""
        def product(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
            return np.repeat(d.astype(np.float32), codes.shape[1] // d.shape[1], axis=1) * codes
        if not np.array_equal(product(self.codes, self.d), u.scale):
            return False
        return self.mins is None or (u.mins is not None and np.array_equal(product(*self.mins), u.mins))


def _h16(a: np.ndarray) -> np.ndarray:
    """[nb, 2] uint8 -> [nb, 1] float16 (a block's float16 field as it is)."""
    return a.copy().view(np.float16)


def _f16(a: np.ndarray) -> np.ndarray:
    """[nb, 2] uint8 -> [nb, 1] float32 (a block's float16 field)."""
    return _h16(a).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[nb, B] uint8 -> [nb, 2B] uint8: per run of ``width`` bytes, the low nibbles, then the high."""
    nb = qs.shape[0]
    q = qs.reshape(nb, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(nb, -1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's 32 high bits [nb, 4] uint8 -> [nb, 32] uint8 (0 or 16)."""
    bits = qh.copy().view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return ((bits & np.uint32(1)).astype(np.uint8)) << np.uint8(4)


@dataclass(frozen=True)
class _Parts:
    """One type's blocks unpacked, per block: codes, float32 scales (and mins) and, for the K-quants, the
    file's factors of them, ``scale = d * sc`` and ``mins = dmin * m`` (d, dmin float16 per 256 inputs,
    dmin negated here; sc, m the int8 sub-block codes): what the kernel reads instead of float32 scales."""

    q: np.ndarray  # [nb, block]
    scale: np.ndarray  # [nb, block / sub] float32
    mins: np.ndarray | None = None  # [nb, block / 32] float32
    d: np.ndarray | None = None  # [nb, 1] float16
    sc: np.ndarray | None = None  # [nb, block / sub] int8
    dmin: np.ndarray | None = None  # [nb, 1] float16
    m: np.ndarray | None = None  # [nb, block / 32] int8


def _q4_0(b: np.ndarray) -> _Parts:
    d = _f16(b[:, :2])
    return _Parts(_nibbles(b[:, 2:], 16), d, -8 * d)  # d * (q - 8) == d * q + (-8 d) exactly (exact products)


def _q4_1(b: np.ndarray) -> _Parts:
    return _Parts(_nibbles(b[:, 4:], 16), _f16(b[:, :2]), _f16(b[:, 2:4]))


def _q5_0(b: np.ndarray) -> _Parts:
    q = _nibbles(b[:, 6:], 16) | _fifth_bits(b[:, 2:6])
    return _Parts(q.astype(np.int8) - np.int8(16), _f16(b[:, :2]))


def _q5_1(b: np.ndarray) -> _Parts:
    return _Parts(_nibbles(b[:, 8:], 16) | _fifth_bits(b[:, 4:8]), _f16(b[:, :2]), _f16(b[:, 2:4]))


def _q8_0(b: np.ndarray) -> _Parts:
    return _Parts(b[:, 2:].copy().view(np.int8), _f16(b[:, :2]))


_E2M1_DOUBLED = np.array(MXFP4.kvalues, dtype=np.int8)  # a 4-bit code's e2m1 value times 2


def _mxfp4(b: np.ndarray) -> _Parts:
    # [nb, 17]: an E8M0 exponent e, then 32 4-bit codes (the low nibbles first); w = 2^(e - 128) * 2 * e2m1(code)
    return _Parts(_E2M1_DOUBLED[_nibbles(b[:, 1:], 16)], MXFP4.e8m0_to_fp32_half(b[:, :1]))


def _k_scales(q: np.ndarray, b: np.ndarray) -> _Parts:
    """Q4_K / Q5_K's codes ``q`` and super-block head ``b`` -> scales ``d * sc_j`` and mins ``-(dmin * m_j)``
    ([nb, 8]), with their factors (``(-dmin) * m_j`` is the same float32 as ``-(dmin * m_j)``)."""
    sc, m = Q4_K.get_scale_min(b[:, 4:16])
    d, dmin = _h16(b[:, :2]), -_h16(b[:, 2:4])
    return _Parts(q, d.astype(np.float32) * sc.astype(np.float32), dmin.astype(np.float32) * m.astype(np.float32),
                  d, sc.astype(np.int8), dmin, m.astype(np.int8))


def _q4_k(b: np.ndarray) -> _Parts:
    return _k_scales(_nibbles(b[:, 16:], 32), b)


def _q5_k(b: np.ndarray) -> _Parts:
    nb = b.shape[0]
    qh = b[:, 16:48].reshape(nb, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    return _k_scales(_nibbles(b[:, 48:], 32) | ((qh & np.uint8(1)).reshape(nb, -1) << np.uint8(4)), b)


def _q6_k(b: np.ndarray) -> _Parts:
    nb = b.shape[0]
    ql = _nibbles(b[:, :128], 64)
    qh = b[:, 128:192].reshape(nb, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (ql | ((qh & np.uint8(3)).reshape(nb, -1) << np.uint8(4))).astype(np.int8) - np.int8(32)
    d, sc = _h16(b[:, 208:210]), b[:, 192:208].copy().view(np.int8)
    return _Parts(q, d.astype(np.float32) * sc.astype(np.float32), None, d, sc)


def _q3_k(b: np.ndarray) -> _Parts:
    nb = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    low = (scales[:, :8].reshape(nb, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(nb, 16)
    high = (scales[:, 8:].reshape(nb, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(nb, 16)
    sc = ((low & np.uint8(0x0F)) | ((high & np.uint8(3)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    ql = qs.reshape(nb, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = hmask.reshape(nb, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    q = (ql.reshape(nb, -1) & np.uint8(3)).astype(np.int8) - ((qh.reshape(nb, -1) & np.uint8(1)) ^ np.uint8(1)).astype(np.int8) * np.int8(4)
    d = _h16(b[:, 108:110])
    return _Parts(q, d.astype(np.float32) * sc.astype(np.float32), None, d, sc)


_Unpack = Callable[[np.ndarray], _Parts]
# type -> (unpack one block per row of [nb, bytes], inputs per block, inputs per scale, code bits, offset)
NATIVE: dict[T, tuple[_Unpack, int, int, int, int]] = {
    T.Q4_0: (_q4_0, 32, 32, 4, 0), T.Q4_1: (_q4_1, 32, 32, 4, 0), T.Q4_K: (_q4_k, 256, 32, 4, 0),
    T.Q5_0: (_q5_0, 32, 32, 5, 16), T.Q5_1: (_q5_1, 32, 32, 5, 0), T.Q5_K: (_q5_k, 256, 32, 5, 0),
    T.Q3_K: (_q3_k, 256, 16, 3, 4), T.Q6_K: (_q6_k, 256, 16, 6, 32), T.Q8_0: (_q8_0, 32, 32, 8, 0),
    T.MXFP4: (_mxfp4, 32, 32, 5, 16),
}
NATIVE_NAMES = tuple(t.name for t in NATIVE)
UNPACK_WEIGHTS = 1 << 22  # weights unpacked at a time (``unpack``)


def unpack(raw: np.ndarray, qtype: T) -> Unpacked:
    """A matrix's raw blocks ``[N, bytes per row]`` uint8 (as gguf-py's reader holds them) -> ``Unpacked``.
    At most ``UNPACK_WEIGHTS`` weights at a time: the per-type unpacking holds ~40 bytes of numpy
    temporaries per weight, 10 GB at once for the 128k-token vocabulary's tied head of Llama 3.2 1B
    (measured), ~170 MB per piece."""
    fn, block, sub, bits, offset = NATIVE[qtype]
    n, row_bytes = raw.shape
    rows = max(1, UNPACK_WEIGHTS // (row_bytes // GGML_QUANT_SIZES[qtype][1] * block))
    if n > rows:
        return _stacked([unpack(raw[i:i + rows], qtype) for i in range(0, n, rows)])
    type_bytes = GGML_QUANT_SIZES[qtype][1]
    if row_bytes % type_bytes:
        raise QuantizationError(f"a {qtype.name} row of {row_bytes} bytes is not whole blocks of {type_bytes}")
    p = fn(np.ascontiguousarray(raw).reshape(-1, type_bytes))
    k = row_bytes // type_bytes * block
    factors = None
    if p.d is not None and p.sc is not None:
        mins = None if p.m is None or p.dmin is None else (p.m.reshape(n, k // 32), p.dmin.reshape(n, k // 256))
        factors = KFactors(p.sc.reshape(n, k // sub), p.d.reshape(n, k // 256), mins)
    return Unpacked(qtype.name, p.q.reshape(n, k).astype(np.int8), p.scale.reshape(n, k // sub).astype(np.float32),
                    None if p.mins is None else p.mins.reshape(n, k // 32).astype(np.float32), sub, bits, offset,
                    factors)


def dequantize(u: Unpacked) -> np.ndarray:
    """``scale * q + mins`` [N, K] float32, in gguf-py's float32 steps (the file's weights)."""
    w = np.repeat(u.scale, u.sub, axis=1) * u.q.astype(np.float32)
    return w if u.mins is None else w + np.repeat(u.mins, 32, axis=1)


def _as_float16(a: np.ndarray | None) -> np.ndarray | None:
    """``a`` in float16 when that holds every value exactly (the legacy types' d and m are the file's
    float16 fields), else None."""
    if a is None:
        return None
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
    return h if np.array_equal(h.astype(np.float32), a) else None


class GgufNibLinear(A8Linear):
    """Codes of 3-6 bits (a nibble and up to two high bit planes) with scales per 32 or 16 inputs, an
    offset, and mins per 32 for the types with them: ``tidespec::gguf_nib_linear``. The scales are held as
    the file holds them, so a token reads about the file's bytes: a K-quant's int8 sub-block codes and
    float16 super-block ``d`` (``scale_super``, ``min_super``), a legacy type's float16 ``d`` and ``m``;
    float32 only where neither is exact (never for a well-formed file)."""

    scheme = "gguf"
    kernel_dtype = torch.float16
    packed: torch.Tensor  # [N_pad/16, K/8, 64] uint8
    scales: torch.Tensor  # [N_pad/16, K/sub, 16] int8 codes, float16 or float32
    mins: torch.Tensor | None  # [N_pad/16, K/32, 16], the scales' dtype
    high: torch.Tensor | None  # [N_pad/16, K/8, bits - 4, 2, 8] uint8
    scale_super: torch.Tensor | None  # [N_pad/16, K/256, 16] float16 with int8 codes
    min_super: torch.Tensor | None  # [N_pad/16, K/256, 16] float16 with int8 codes and mins

    def __init__(self, u: Unpacked) -> None:
        n, k = u.q.shape
        super().__init__(k, n, None)
        # q + offset is in [0, 2^bits - 1] (bits <= 6): in int8 without overflow, viewed as uint8 (one pass)
        codes = torch.from_numpy((u.q + np.int8(u.offset)).view(np.uint8))
        self.register_buffer("packed", pack_nibbles(codes))
        self.register_buffer("high", pack_high(codes, u.bits - 4) if u.bits > 4 else None)
        f = u.factors
        supers: tuple[np.ndarray | None, np.ndarray | None] = (None, None)
        if f is not None and f.exact(u):
            scales, mins = f.codes, None if f.mins is None else f.mins[0]
            supers = (f.d, None if f.mins is None else f.mins[1])
        else:
            scales, mins = _as_float16(u.scale), _as_float16(u.mins)
            if scales is None or (u.mins is not None and mins is None):
                scales, mins = u.scale, u.mins
                self.kernel_dtype = torch.float32
        for name, values in (("scales", scales), ("mins", mins), ("scale_super", supers[0]),
                             ("min_super", supers[1])):
            self.register_buffer(name, None if values is None else panel_values(torch.from_numpy(values)))
        self._kernel_buffers = tuple(name for name in ("scales", "mins", "scale_super", "min_super")
                                     if getattr(self, name) is not None and getattr(self, name).is_floating_point())
        self.type_name, self.offset = u.type_name, u.offset

    @property
    def kernel_name(self) -> str:
        return f"tidespec-a8-{self.type_name.lower()}"

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] float32 -> [T, N_pad] float32
        return torch.ops.tidespec.gguf_nib_linear(x, self.packed, self.scales, self.mins, self.high, self.offset,
                                                  self.scale_super, self.min_super)


class GgufW8Linear(W8A8Linear):
    """Q8_0 codes with the file's float16 scales on the w8 tile (w8a8's layer, the file's blocks)."""

    scheme = "gguf"
    type_name = "Q8_0"

    @property
    def kernel_name(self) -> str:
        return "tidespec-a8-q8_0"


def native_linear(u: Unpacked) -> GgufNibLinear | GgufW8Linear:
    """The kernel layer of one matrix's blocks (no bias: ``gguf_layer`` keeps the model's)."""
    n, k = u.q.shape
    if k % A8_BLOCK:
        raise QuantizationError(f"a {u.type_name} matrix of {k} inputs: the kernels take multiples of {A8_BLOCK}")
    if u.bits <= 6:
        return GgufNibLinear(u)
    half = _as_float16(u.scale)  # Q8_0's d: the file's float16 (float32 kept if a value were not)
    scale = torch.from_numpy(u.scale if half is None else half)
    layer = GgufW8Linear(*pack_w8(torch.from_numpy(u.q), scale), k, n)
    layer.kernel_dtype = scale.dtype
    return layer


class StackedLinear(nn.Module):
    """Projections fused in tidespec's model (q|k|v, gate|up) but stored apart in the file, in types
    that may differ (a Q4_K_M keeps q and k in Q4_K and v in Q6_K): each part on its own kernel, the
    outputs side by side. Row-invariant as its parts are."""

    bias: torch.Tensor | None

    def __init__(self, parts: list[nn.Module], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features  # type: ignore[union-attr]
        self.out_features = sum(p.out_features for p in parts)  # type: ignore[union-attr, misc]
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, sum of the parts' outputs]
        y = torch.cat([part(x) for part in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias


@dataclass
class GgufBlocks:
    """A converted GGUF's raw blocks (``BLOCKS_FILE``): HF tensor name -> (``[N, bytes]`` uint8, type)."""

    path: Path
    types: dict[str, str]
    native: Counter[str] = field(default_factory=Counter)  # type -> matrices run as they are
    converted: Counter[str] = field(default_factory=Counter)  # type (or "float") -> matrices converted to Q8_0

    @classmethod
    def read(cls, hf_dir: Path) -> GgufBlocks | None:
        """The blocks of the GGUF ``hf_dir`` was converted from; None for any other checkpoint."""
        types = cls.types_in(hf_dir)
        return cls(hf_dir / BLOCKS_FILE, types) if types else None

    @staticmethod
    def types_in(hf_dir: Path) -> dict[str, str]:
        """Tensor name -> GGML type of the blocks beside a converted GGUF (its header only); {} elsewhere."""
        path = hf_dir / BLOCKS_FILE
        if not path.is_file():
            return {}
        with safe_open(str(path), framework="numpy") as f:
            types: dict[str, str] = json.loads((f.metadata() or {}).get(TYPES_KEY, "{}"))
        return types

    def unpacked(self, name: str) -> Unpacked | None:
        """``name``'s blocks unpacked, or None where the file has none in a native type."""
        type_name = self.types.get(name)
        if type_name is None or type_name not in NATIVE_NAMES:
            return None
        with safe_open(str(self.path), framework="numpy") as f:
            raw = f.get_tensor(name)
        return unpack(raw, T[type_name])

    def rows(self, names: list[str], total: int) -> list[int] | None:
        """Output rows of each stored part of a projection of ``total`` rows: read from the blocks'
        shapes, one part stored as floats (no blocks) taking the rest; None when two or more are."""
        with safe_open(str(self.path), framework="numpy") as f:
            known = {n: f.get_slice(n).get_shape()[0] for n in names if n in self.types}
        missing = [n for n in names if n not in known]
        rest = total - sum(known.values())
        if len(missing) > 1 or (missing and rest <= 0) or (not missing and rest):
            return None
        return [known.get(n, rest) for n in names]

    def read_natively(self, num_layers: int, float_rows: Callable[[str], int]) -> set[str]:
        """HF names of the projection weights that ``gguf_layer`` takes from the blocks and never from
        the float weights, as ``_replacement`` decides (``float_rows``: a float tensor's row count, from
        the checkpoint's header): the loader need not read them. A projection that would go through
        the fallback whole (two or more parts without blocks) keeps all its parts."""
        names_read: set[str] = set()
        for i in range(num_layers):
            for path in PROJECTIONS:
                names = _names(f"model.layers.{i}.", path, self)
                try:
                    total = sum(float_rows(n) for n in names)
                except KeyError:  # not in the checkpoint (a mixture's layer): nothing to leave out
                    continue
                if self.rows(names, total) is not None:
                    names_read.update(n for n in names if self.types.get(n) in NATIVE_NAMES)
        # a mixture's experts held per expert (``convert_gguf`` without floats): every native one's
        names_read.update(n for n, t in self.types.items() if ".mlp.experts." in n and t in NATIVE_NAMES)
        return names_read

    def summary(self) -> str:
        """One line: what runs natively and what was converted, per type."""
        native = ", ".join(f"{t} x{c}" for t, c in sorted(self.native.items())) or "none"
        line = f"GGUF blocks run as they are: {native}"
        if self.converted:
            conv = ", ".join(f"{t} x{c}" for t, c in sorted(self.converted.items()))
            line += f"; not run natively, converted to Q8_0 (w8a8): {conv}"
        return line


# a decoder layer's projections in tidespec's model, and the fused ones' parts in the file (HF names,
# after the layer prefix)
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")  # an expert's, after ``mlp.experts.{e}.``


def _names(prefix: str, path: str, blocks: GgufBlocks) -> list[str]:
    """The file's tensors of projection ``path`` of layer ``prefix``: the whole one where the file holds
    it so (or it is not fused in tidespec), else its parts."""
    whole = f"{prefix}{path}.weight"
    return [whole] if whole in blocks.types or path not in _PARTS else [f"{prefix}{p}.weight" for p in _PARTS[path]]


def gguf_layer(i: int, layer: nn.Module, blocks: GgufBlocks, fallback: Callable[[nn.Module], nn.Module]) -> None:
    """Replace, in place, decoder layer ``i``'s projections by the file's own blocks (``native_linear``;
    fused ones from their parts, ``StackedLinear``; a mixture's experts each from its own blocks); a
    projection the file holds in another type (or an expert of a cache converted before experts had
    blocks) goes through ``fallback`` (the w8a8 layer) and is counted in ``blocks.converted``.
    ``ModelQuantizer`` (``models/quant/quantize.py``) calls it per layer, then ``gguf_head``."""
    for path in PROJECTIONS:
        parent_path, _, attr = path.rpartition(".")
        parent = layer.get_submodule(parent_path)
        module = getattr(parent, attr, None)
        if module is None:
            continue
        setattr(parent, attr, _replacement(module, f"model.layers.{i}.", path, blocks, fallback))
    for parent_name, parent in layer.named_modules():  # a mixture's experts: each one's blocks, as a layer's
        experts = getattr(parent, "experts", None)
        if isinstance(experts, nn.ModuleList):
            for e, expert in enumerate(experts):
                prefix = f"model.layers.{i}.{parent_name}.experts.{e}."
                for path in EXPERT_PROJECTIONS:
                    setattr(expert, path, _replacement(getattr(expert, path), prefix, path, blocks, fallback))


def gguf_head(model: TargetModel, blocks: GgufBlocks, fallback: Callable[[nn.Module], nn.Module]) -> None:
    """Replace the LM head by the file's blocks (the token embedding's when the head is tied), else
    ``fallback``. The token embedding stays the float tensor it was loaded as."""
    head = "lm_head.weight" if "lm_head.weight" in blocks.types else "model.embed_tokens.weight"
    u = blocks.unpacked(head)
    if u is not None and u.q.shape == tuple(model.lm_head.weight.shape):
        model.lm_head = native_linear(u)
        blocks.native[u.type_name] += 1
    else:
        model.lm_head = fallback(model.lm_head)
        blocks.converted[blocks.types.get(head, "float")] += 1


def _merged(pieces: list[Unpacked | nn.Module]) -> list[nn.Module]:
    """The kernel layers of a projection's pieces, neighbouring blocks of one type as one matrix (their
    rows stacked): one kernel call for q|k|v when the file holds them alike, two for a Q4_K_M's q|k in
    Q4_K beside v in Q6_K. Converted pieces (already layers) stay as they are."""
    layers: list[nn.Module] = []
    for type_name, group in itertools.groupby(pieces, key=lambda p: p.type_name if isinstance(p, Unpacked) else None):
        run = list(group)
        if type_name is None:
            layers.extend(p for p in run if isinstance(p, nn.Module))
        else:
            layers.append(native_linear(_stacked([p for p in run if isinstance(p, Unpacked)])))
    return layers


def _stacked(run: list[Unpacked]) -> Unpacked:
    """Blocks of one type, rows of ``run[0]`` first."""
    if len(run) == 1:
        return run[0]
    mins = [u.mins for u in run if u.mins is not None]
    factors = [u.factors for u in run if u.factors is not None]
    stacked = None
    if len(factors) == len(run):
        parts = [f.mins for f in factors if f.mins is not None]
        min_parts = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])) if parts else None
        stacked = KFactors(np.concatenate([f.codes for f in factors]), np.concatenate([f.d for f in factors]),
                           min_parts)
    return Unpacked(run[0].type_name, np.concatenate([u.q for u in run]), np.concatenate([u.scale for u in run]),
                    np.concatenate(mins) if mins else None, run[0].sub, run[0].bits, run[0].offset, stacked)


def _rows_of(module: nn.Module, start: int, count: int) -> nn.Module:
    """Rows ``start .. start + count`` of a projection as a bias-free ``nn.Linear`` (for the fallback)."""
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    part = nn.Linear(weight.shape[1], count, bias=False, dtype=weight.dtype)
    part.weight.copy_(weight[start:start + count])
    return part


def _replacement(module: nn.Module, prefix: str, path: str, blocks: GgufBlocks,
                 fallback: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """``module`` (a projection of layer ``prefix``) on the file's blocks: each stored part natively
    where its type is, through ``fallback`` where not; the whole projection through ``fallback`` when
    its parts' rows cannot be told apart (two or more stored as floats)."""
    bias: torch.Tensor | None = getattr(module, "bias", None)
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    names = _names(prefix, path, blocks)
    rows = blocks.rows(names, weight.shape[0])
    if rows is None:
        for name in names:
            blocks.converted[blocks.types.get(name, "float")] += 1
        return fallback(module)
    pieces: list[Unpacked | nn.Module] = []
    start = 0
    for name, count in zip(names, rows):
        u = blocks.unpacked(name)
        if u is not None:
            blocks.native[u.type_name] += 1
            pieces.append(u)
        else:
            blocks.converted[blocks.types.get(name, "float")] += 1
            pieces.append(fallback(module if len(names) == 1 else _rows_of(module, start, count)))
        start += count
    if len(pieces) == 1 and isinstance(pieces[0], nn.Module):
        return pieces[0]  # the fallback of the whole module: its bias included
    layers = _merged(pieces)
    if len(layers) == 1 and bias is None:
        return layers[0]
    return StackedLinear(layers, bias)
