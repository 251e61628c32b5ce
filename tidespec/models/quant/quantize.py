"""Weight-only quantization of a ``TargetModel``: int8 per output channel, int4 per group of inputs.

Why this exists: on a CPU, a decode step is bound by reading the weights (SmolLM2-135M in float32
is ~0.5 GB per token), and the embedded model even ships 4-bit — dequantized to float32 on load.
Storing the linear layers' weights as int8 (a quarter of float32) or int4 (an eighth) and
multiplying them with PyTorch's own CPU kernels cuts that traffic. Only the weights are
quantized; activations stay in floating point and everything else in the model (norms, rope,
attention, the KV cache, the token embedding) keeps the model's dtype.

The quantized model *is* the target: speculative decoding verifies drafts against it, so greedy
output with any drafter equals the quantized model's own plain decoding. That rests on one
property, checked in ``tests/models/test_quant.py``: both kernels compute each output row from its
input row alone, bit for bit whatever the number of rows in the call (a decode step has one row per
sequence, a verification 1 + gamma). For the same reason there is no bfloat16-GEMM path for many
rows, although it would prefill 3x faster (256 rows, 30 layers: 96 ms against the int8 kernel's
360 ms): oneDNN's bfloat16 GEMM gives a row different bits depending on how many rows share the
call, and the bfloat16 rounding of the next layer's input turns such last-bit differences into
logit differences of up to ~0.5 — the target would depend on the batch. The rest of the model must
be row-invariant too: in float64 it is (exact on the embedded model); in float32, SDPA over 1 +
gamma query rows differs from 1 row by ~5e-7, amplified the same way, so greedy output can leave
plain decoding's at a near-tie. Quality against float32 is measured by ``tidespec bench quality``.

Schemes and kernels (``torch.ops.aten``; the activations are cast to bfloat16 for the call and the
result back to the input's dtype, because both kernels are vectorised on x86 only for bfloat16 —
with float32 activations ``_weight_int8pack_mm`` is a scalar loop, 10x slower for one row, 22x
for 16; the two casts cost nothing measurable):

* **int8**: symmetric, one scale per output channel (row): ``w[n, k] ~ q[n, k] * s[n]`` with
  ``q`` in [-128, 127] and ``s = max_k |w[n, k]| / 127`` rounded to bfloat16;
  ``_weight_int8pack_mm(x_bf16 [T, K], q [N, K] int8, s [N] bf16) -> [T, N]``.
* **int4**: asymmetric, one scale and one zero per group of ``group_size`` consecutive inputs of a
  row (tinygemm's convention, the same as GGUF's Q4_1 blocks of 32, so the embedded Q4_1 model's
  layers are re-quantized to within 1 % of a step on average):
  ``w ~ (q - 8) * scale + zero`` with ``q`` in [0, 15], ``scale = (max - min) / 15`` and
  ``zero = min + 8 * scale`` (bfloat16). ``_convert_weight_to_int4pack_for_cpu(q [N, K] int32, 1)
  -> [N, K/2] uint8`` once, then ``_weight_int4pack_mm_for_cpu(x_bf16 [T, K], packed, group_size,
  scale_zero [K/G, N, 2] bf16) -> [T, N]``. The kernel takes group sizes 32/64/128/256 and N a
  multiple of 16 (rows are zero-padded up to one and the padding sliced off). On AVX512, layers of a
  multiple of 64 outputs run tidespec's ``int4_linear`` instead (``csrc/quant_linear.cpp``): the same
  bits, with the weights dequantized once for up to 8 rows where ATen's kernel does it per 4, so a
  verification of 5 rows is not charged for 8.
* The LM head is int8 in both modes (``quantize_model``).
* **w4a8** / **w8a8** (``models/quant/a8.py``): not weight-only. GGUF Q4_1 / Q8_0 weights times
  activations quantized to int8 per block inside tidespec's kernel, integer dot products
  (llama.cpp's arithmetic; 1.6x int4's decode speed on a 2-core Xeon).
* Every scheme's layer derives from ``QuantizedLinear`` (``models/quant/base.py``, re-exported here
  with ``QuantizationError``), so ``quant_a8`` does not import this module.

Both kernels are GEMVs: their time grows with the rows (30 layers' projections, 2 threads, ms for
1 / 5 / 16 / 64 / 256 rows: int8 9 / 17 / 33 / 100 / 360, int4-g32 5 / 13 / 25 / 85 / 340,
float32 ``F.linear`` 17 / 31 / 43 / 77 / 192, bfloat16 ``F.linear`` 18 / 19 / 19 / 26 / 58), so
they win at decode and small verifications and lose on prefill chunks and large batches.

Why these kernels and not torchao (0.18, same stack, 2-core Sapphire Rapids VM,
docs/benchmarks/cpu.md): torchao's int8 weight-only tensor dequantizes the whole int8 matrix to bfloat16 on
every eager call (``mm(x, q.to(bf16)) * s``): 31-33 ms at any row count, 3x the aten kernel at one
row. ``torch.compile`` fuses that into a loop that comes close to the kernel but never beats it
(1 / 2 / 5 / 16 rows: 10.0-10.6 / 11.2-11.6 / 18.6-19.3 / 33.9-35.1 ms against 9.1-10.0 /
10.3-10.9 / 17.3-17.9 / 33.1-33.8 over three runs), and compiles per row count (19 s cold, 3-4 s
with inductor's cache warm) — which the engine's ragged row counts would keep triggering. torchao's
CPU int4 layout calls the same ``_weight_int4pack_mm_for_cpu`` as this module. So torchao would add
a dependency and buy nothing here.

Worked example::

    model = load_model(None).model                 # float32 SmolLM2-135M
    quantize_model(model, "int8", group_size=32)    # in place; group_size is used by int4 only
    type(model.layers[0].mlp.down_proj).__name__    # 'Int8Linear'
    model.layers[0].mlp.down_proj.forward(torch.randn(5, 1536)).dtype   # torch.float32 (x's dtype)
    quantization_of(model)                          # 'int8'
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from tidespec.config import INT4_GROUP_SIZES, QUANTIZATIONS
from tidespec.models.kernels.ops import quant_linear_available
from tidespec.models.kernels.rows import in_pieces
from tidespec.models.quant.a8 import A8_BLOCK, W4A8Linear, W8A8Linear, a8_error, check_a8
from tidespec.models.quant.base import KERNEL_DTYPE, QuantizationError, QuantizedLinear
from tidespec.models.quant.gguf_blocks import GgufBlocks, gguf_head, gguf_layer
from tidespec.models.target import TargetModel

INT4_ROW_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu needs N % 16 == 0
INT4_PANEL = 64  # tidespec::int4_linear reads ATen's AVX512 packing of whole panels of 64 outputs
INT8_K_MULTIPLE = 16  # tidespec::int8_linear reads 16 input features at a time
A8_QUANTIZATIONS = ("w4a8", "w8a8", "gguf")  # int8 activations on integer dot products (models/quant/a8.py)
# The projections of a decoder layer that ``quantize_model`` replaces (attribute paths).
LAYER_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def layer_projections(layer: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every projection of a decoder layer that quantization replaces: a dense
    layer's four (``LAYER_PROJECTIONS``), a mixture's attention and every expert's. A mixture's router
    (``gate`` beside ``experts``) stays in floating point, as llama.cpp keeps it: it picks the experts."""
    return [(parent, name) for parent in layer.modules() for name, child in parent.named_children()
            if isinstance(child, nn.Linear) and not (name == "gate" and hasattr(parent, "experts"))]


# --------------------------------------------------------------------------- the schemes (pure functions)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``w [N, K]`` -> ``(q [N, K] int8, scales [N] bfloat16)``.

    The scale is rounded to bfloat16 *before* ``q`` is computed, so ``q * scales`` is the nearest
    grid point to ``w`` under the scale the kernel will use (error <= scale / 2 per element).

    Example: ``w = [[0.5, -1.27]]`` -> scale 0.01 (bf16 0.010009765625), ``q = [[50, -127]]``.
    """
    wf = w.detach().to(torch.float32)
    scales = (wf.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(KERNEL_DTYPE)  # [N]
    q = torch.round(wf / scales.float().unsqueeze(1)).clamp(-128, 127).to(torch.int8)  # [N, K]
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``q [N, K] int8``, ``scales [N]`` -> float32 ``[N, K]`` (what the kernel multiplies by)."""
    return q.to(torch.float32) * scales.to(torch.float32).unsqueeze(1)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4: ``w [N, K]`` -> ``(q [N, K] int32 in 0..15, scales [N, K/G],
    zeros [N, K/G])`` (bfloat16), with ``w ~ (q - 8) * scale + zero`` per group of ``G`` inputs.

    Scale and zero are rounded to bfloat16 before ``q`` is computed (as for int8).

    Example (G = 2): ``w = [[0.0, 1.5]]`` -> scale 0.1, zero 0.8, ``q = [[0, 15]]``.
    """
    n, k = w.shape
    if k % group_size:
        raise QuantizationError(f"int4 group size {group_size} does not divide the input size {k}")
    g = w.detach().to(torch.float32).reshape(n, k // group_size, group_size)  # [N, K/G, G]
    lo, hi = g.amin(dim=2), g.amax(dim=2)  # [N, K/G]
    scales = ((hi - lo) / 15.0).clamp(min=1e-6).to(KERNEL_DTYPE)
    zeros = (lo + 8.0 * scales.float()).to(KERNEL_DTYPE)
    q = torch.round((g - zeros.float().unsqueeze(2)) / scales.float().unsqueeze(2) + 8.0).clamp(0, 15)
    return q.to(torch.int32).reshape(n, k), scales, zeros


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """``q [N, K]``, ``scales``/``zeros [N, K/G]`` -> float32 ``[N, K]``: ``(q - 8) * scale + zero``."""
    n, k = q.shape
    g = q.to(torch.float32).reshape(n, k // group_size, group_size) - 8.0  # [N, K/G, G]
    return (g * scales.float().unsqueeze(2) + zeros.float().unsqueeze(2)).reshape(n, k)


# --------------------------------------------------------------------------- the modules


class Int8Linear(QuantizedLinear):
    """int8 weights, one bfloat16 scale per output channel; ``_weight_int8pack_mm``.

    Example: ``Int8Linear.from_weight(torch.randn(960, 576))``; ``.forward(x [5, 576]) -> [5, 960]``.
    """

    _kernel_buffers = ("scales",)
    qweight: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] bfloat16

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.to(KERNEL_DTYPE).contiguous())
        # tidespec's int8_linear (the same bits, csrc/quant_linear.cpp) where it applies; fixed per layer
        self.own_kernel = own_kernel_applies(qweight, qweight.shape[1] % INT8_K_MULTIPLE == 0)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        q, s = quantize_int8(weight)
        return cls(q.to(weight.device), s.to(weight.device), bias)

    @classmethod
    def concat(cls, layers: Sequence[Int8Linear]) -> Int8Linear:
        """One layer whose outputs are ``layers``' outputs side by side: the rows stacked. Exact
        (each output channel has its own scale), so a layer over rows ``[a; b]`` can be built from
        the quantized ``a`` kept from before and a newly quantized ``b``: a copy, no requantizing.

        Example: ``concat([from_weight(w[:3]), from_weight(w[3:])])`` equals ``from_weight(w)``.
        """
        if not layers or any(layer.bias is not None for layer in layers):
            raise QuantizationError("concat needs at least one layer, none with a bias")
        return cls(torch.cat([layer.qweight for layer in layers]), torch.cat([layer.scales for layer in layers]))

    def _kernel(self, xb: torch.Tensor) -> torch.Tensor:
        # xb: [T, K] bfloat16 -> [T, N] bfloat16
        return int8_mm(xb, self.qweight, self.scales, self.own_kernel)

    def _compiled_in_pieces(self, xb: torch.Tensor) -> torch.Tensor:
        return torch.ops.tidespec.int8_in_pieces(xb, self.qweight, self.scales, self.row_limit, self.own_kernel)

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, float32 ``[N, K]``."""
        return dequantize_int8(self.qweight, self.scales)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", kernel={self.kernel_name}"


class Int4Linear(QuantizedLinear):
    """int4 weights packed by ``_convert_weight_to_int4pack_for_cpu``, a bfloat16 scale and zero per
    group of ``group_size`` inputs; ``_weight_int4pack_mm_for_cpu``, or where it applies (AVX512, a
    multiple of 64 outputs: ``own_kernel``) tidespec's ``int4_linear``, which computes the same bits
    with the weights dequantized once for up to 8 rows (``csrc/quant_linear.cpp``: a 5-row verification
    then costs 1.9x a 1-row call, not 2.8x).

    Example: ``Int4Linear.from_weight(torch.randn(960, 576), group_size=32)``: packed ``[960, 288]``
    uint8, scale_zero ``[18, 960, 2]``; ``.forward(x [5, 576]) -> [5, 960]``.
    """

    _kernel_buffers = ("scale_zero",)
    packed: torch.Tensor  # [N_pad, K/2] uint8
    scale_zero: torch.Tensor  # [K/G, N_pad, 2] bfloat16

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, in_features: int, out_features: int,
                 group_size: int, bias: torch.Tensor | None = None) -> None:
        super().__init__(in_features, out_features, bias)
        self.group_size = group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zero", scale_zero.to(KERNEL_DTYPE).contiguous())
        # fixed per layer, so every call of it runs one kernel (both give the same bits; the test
        # tests/models/test_quant_linear.py holds them to it)
        self.own_kernel = own_kernel_applies(packed, packed.shape[0] % INT4_PANEL == 0)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, group_size: int, bias: torch.Tensor | None = None) -> Int4Linear:
        n, k = weight.shape
        q, scales, zeros = quantize_int4(weight.cpu(), group_size)  # [N, K], [N, K/G], [N, K/G]
        pad = -n % INT4_ROW_MULTIPLE
        if pad:  # zero rows (q = 8, scale = zero = 0 dequantize to 0), sliced off after the kernel
            q = torch.cat([q, torch.full((pad, k), 8, dtype=q.dtype)])
            scales = torch.cat([scales, scales.new_zeros(pad, k // group_size)])
            zeros = torch.cat([zeros, zeros.new_zeros(pad, k // group_size)])
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # [N_pad, K/2] uint8
        scale_zero = torch.stack([scales, zeros], dim=2).transpose(0, 1).contiguous()  # [K/G, N_pad, 2]
        return cls(packed, scale_zero, k, n, group_size, bias)

    def _kernel(self, xb: torch.Tensor) -> torch.Tensor:
        # xb: [T, K] bfloat16 -> [T, N] bfloat16
        y = int4_mm(xb, self.packed, self.group_size, self.scale_zero, self.own_kernel)
        return y[:, :self.out_features].contiguous() if y.shape[1] != self.out_features else y

    def _compiled_in_pieces(self, xb: torch.Tensor) -> torch.Tensor:
        y = torch.ops.tidespec.int4_in_pieces(xb, self.packed, self.group_size, self.scale_zero, self.row_limit,
                                              self.own_kernel)
        return y[:, :self.out_features].contiguous() if y.shape[1] != self.out_features else y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}, kernel={self.kernel_name}"


def own_kernel_applies(weight: torch.Tensor, shape_fits: bool) -> bool:
    """Whether a quantized layer runs tidespec's kernel: its weight on the CPU, a shape the kernel
    reads, and the kernels built for AVX512 here."""
    return weight.device.type == "cpu" and shape_fits and quant_linear_available()


def int8_mm(xb: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, own: bool) -> torch.Tensor:
    """xb [T, K] bfloat16 times the int8 weight -> [T, N] bfloat16: tidespec's ``int8_linear`` when
    ``own``, else ATen's kernel (the same bits where both run)."""
    if own:
        return torch.ops.tidespec.int8_linear(xb, qweight, scales)
    return torch.ops.aten._weight_int8pack_mm(xb, qweight, scales)


def int4_mm(xb: torch.Tensor, packed: torch.Tensor, group_size: int, scale_zero: torch.Tensor,
            own: bool) -> torch.Tensor:
    """xb [T, K] bfloat16 times the packed int4 weight -> [T, N_pad] bfloat16: tidespec's
    ``int4_linear`` when ``own``, else ATen's kernel (the same bits where both run)."""
    if own:
        return torch.ops.tidespec.int4_linear(xb, packed, group_size, scale_zero)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, group_size, scale_zero)


# --------------------------------------------------------------------------- kernels in row pieces
# Ops of their own so that a compiled graph keeps the row count symbolic (splitting the rows in the
# graph would specialise every count) and calls the kernel as it is (models/execution/invariance.py).


@torch.library.custom_op("tidespec::int8_in_pieces", mutates_args=())
def int8_in_pieces(xb: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, limit: int,
                   own: bool) -> torch.Tensor:
    """``int8_mm`` over xb [T, K] bfloat16 in row pieces of at most ``limit`` -> [T, N]."""
    return in_pieces(lambda p: int8_mm(p, qweight, scales, own), xb, limit)


@int8_in_pieces.register_fake
def _int8_in_pieces_fake(xb: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, limit: int,
                         own: bool) -> torch.Tensor:
    return xb.new_empty(xb.shape[0], qweight.shape[0])


@torch.library.custom_op("tidespec::int4_in_pieces", mutates_args=())
def int4_in_pieces(xb: torch.Tensor, packed: torch.Tensor, group_size: int, scale_zero: torch.Tensor,
                   limit: int, own: bool) -> torch.Tensor:
    """``int4_mm`` over xb [T, K] bfloat16 in row pieces of at most ``limit`` -> [T, N_pad] (the
    padded output rows included, as the kernel gives them)."""
    return in_pieces(lambda p: int4_mm(p, packed, group_size, scale_zero, own), xb, limit)


@int4_in_pieces.register_fake
def _int4_in_pieces_fake(xb: torch.Tensor, packed: torch.Tensor, group_size: int, scale_zero: torch.Tensor,
                         limit: int, own: bool) -> torch.Tensor:
    return xb.new_empty(xb.shape[0], packed.shape[0])


# --------------------------------------------------------------------------- the model


def quantized_linear(linear: nn.Module, mode: str, group_size: int) -> QuantizedLinear:
    """The quantized replacement of one ``nn.Linear``-like module (``weight [out, in]``, ``bias``);
    ``mode`` int8, int4, w4a8 or w8a8."""
    weight: torch.Tensor = linear.weight  # type: ignore[assignment]
    bias: torch.Tensor | None = linear.bias  # type: ignore[assignment]
    if mode == "int8":
        return Int8Linear.from_weight(weight, bias)
    if mode == "w4a8":
        return W4A8Linear.from_weight(weight, bias)
    if mode == "w8a8":
        return W8A8Linear.from_weight(weight, bias)
    return Int4Linear.from_weight(weight, group_size, bias)


def check_quantizable(model: TargetModel, mode: str, group_size: int) -> None:
    """Raise ``QuantizationError`` (one line) if ``model`` cannot be quantized as asked: an unknown
    mode, a model quantized already, a device without the CPU kernels, an int4 group size that does
    not divide some layer's input size (the message lists the sizes that would)."""
    if mode not in QUANTIZATIONS:
        raise QuantizationError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    if mode == "none":
        return
    if quantization_of(model) != "none":
        raise QuantizationError(f"the model is already quantized ({quantization_of(model)})")
    if model.device.type != "cpu":
        raise QuantizationError(f"--quantization {mode} needs --device cpu (PyTorch's CPU kernels), "
                                f"the model is on {model.device}")
    inputs = [model.cfg.hidden_size, model.cfg.num_heads * model.cfg.head_dim, model.cfg.intermediate_size]
    if model.cfg.num_experts:
        inputs.append(model.cfg.moe_intermediate_size)
    if mode in A8_QUANTIZATIONS:
        check_a8(mode, inputs)
    if mode == "int4":
        if group_size not in INT4_GROUP_SIZES:
            raise QuantizationError(f"int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, "
                                    f"got {group_size}")
        sizes = set(inputs)
        if any(s % group_size for s in sizes):
            fits = [g for g in INT4_GROUP_SIZES if all(s % g == 0 for s in sizes)]
            raise QuantizationError(
                f"int4 group size {group_size} does not divide this model's input sizes {sorted(sizes)}; "
                + (f"use --quant-group-size {' or '.join(map(str, fits))}" if fits else "use --quantization int8"))


def quantize_model(model: TargetModel, mode: str, group_size: int = 32, lm_head: bool = True,
                   checkpoint: Path | None = None) -> GgufBlocks | None:
    """Replace, in place, the projections of every decoder layer (``layer_projections``) with
    ``Int8Linear`` / ``Int4Linear`` (``mode`` "int8" / "int4"; "none" does nothing) and, when
    ``lm_head``, the LM head with an ``Int8Linear`` in both modes. ``group_size`` is int4's group
    of inputs per scale. "w4a8" / "w8a8" (``models/quant/a8.py``): Q4_1 / Q8_0 projections and a
    Q8_0 LM head, times int8 activations.

    Why the head is int8 under int4 too: it writes the logits directly. On the embedded model an
    int4 head drops teacher-forced top-1 agreement with float32 from 97.0 % to 89.2 % (code + chat,
    16 prompts) for 0.1-0.3 ms per token (one row: int4 0.7-0.8 ms, int8 0.9-1.0, float32 2.4-2.8).

    The token embedding stays a real floating-point tensor even when the LM head is tied to it
    (the head gets its own quantized copy), so everything that reads ``embed_tokens.weight`` — the
    EAGLE-3 drafter, the online trainer, ``truncated`` draft models — works unchanged; a draft
    model from ``model.truncated(k)`` shares the quantized layers. Raises ``QuantizationError``
    (see ``check_quantizable``) before touching anything.

    "gguf" (``models/quant/gguf_blocks.py``): the blocks of the GGUF file ``checkpoint`` (the directory
    it was converted into) was made from, as they are; returns them, with what ran natively and what
    was converted to Q8_0 (``GgufBlocks.summary()``).
    """
    quantizer = ModelQuantizer(model, mode, group_size, lm_head, checkpoint)
    for i, layer in enumerate(model.layers):
        quantizer.layer(i, layer)
    return quantizer.finish()


class ModelQuantizer:
    """``quantize_model`` one layer at a time: ``layer(i, layer)`` replaces that layer's projections,
    ``finish()`` the LM head (and returns the GGUF blocks, mode "gguf"). The loader passes ``layer`` to
    ``load_hf_state_dict`` as ``each_layer``, so each layer is quantized as soon as its float weights are
    in and they are freed before the next layer is read. Checks everything (``check_quantizable``, the
    blocks of "gguf") on construction, before touching anything.

    Example: ``q = ModelQuantizer(model, "w4a8")``; ``model.load_hf_state_dict(state, each_layer=q.layer)``;
    ``q.finish()`` -> None."""

    def __init__(self, model: TargetModel, mode: str, group_size: int = 32, lm_head: bool = True,
                 checkpoint: Path | None = None) -> None:
        check_quantizable(model, mode, group_size)
        self.model, self.mode, self.group_size, self.lm_head = model, mode, group_size, lm_head
        self.blocks: GgufBlocks | None = None
        if mode == "gguf":
            self.blocks = GgufBlocks.read(checkpoint) if checkpoint is not None else None
            if self.blocks is None:
                raise QuantizationError("--quantization gguf runs a GGUF file's own blocks: this model was not "
                                        "loaded from a quantized .gguf file (use w4a8 or w8a8)")

    def _fallback(self, module: nn.Module) -> nn.Module:
        return quantized_linear(module, "w8a8", self.group_size)

    def layer(self, i: int, layer: nn.Module) -> None:
        """Quantize decoder layer ``i`` in place (its projections; the file's blocks in mode "gguf")."""
        if self.mode == "none":
            return
        with torch.no_grad():
            if self.blocks is not None:
                gguf_layer(i, layer, self.blocks, self._fallback)
                return
            for parent, name in layer_projections(layer):
                setattr(parent, name, quantized_linear(getattr(parent, name), self.mode, self.group_size))

    def finish(self) -> GgufBlocks | None:
        """Quantize the LM head (every layer done); the GGUF blocks in mode "gguf", else None."""
        model = self.model
        with torch.no_grad():
            if self.blocks is not None:
                gguf_head(model, self.blocks, self._fallback)
            elif self.mode != "none" and self.lm_head and not isinstance(model.lm_head, QuantizedLinear):
                model.lm_head = quantized_linear(model.lm_head, "w8a8" if self.mode in A8_QUANTIZATIONS else "int8",
                                                 self.group_size)
        return self.blocks


def quantize_linears(module: nn.Module, mode: str, group_size: int = 32, int8_names: tuple[str, ...] = ()) -> int:
    """Replace, in place, every ``nn.Linear`` inside ``module`` (any depth) with its ``mode``
    ("int8" / "int4" / "w8a8") quantized twin; under int4, children whose attribute name is in ``int8_names``
    get int8 (an output layer: see ``quantize_model``); under w8a8, a layer whose input size is not a multiple
    of 32 (the a8 kernels' block) gets int8: a drafting copy is lossless whatever its layers run. Returns how
    many were replaced.

    For networks that are not a ``TargetModel`` (the EAGLE-3 head). Raises ``QuantizationError``
    before touching anything: a mode other than int8/int4, a weight not on a CPU, an int4 group
    size that does not divide some layer's input size.

    Example: a head with ``fc`` [576, 1728], q/k/v [960, 1152], o, MLP and ``lm_head`` [8192, 576]
    -> ``quantize_linears(head, "int4", 32, ("lm_head",))`` == 6 (``lm_head`` int8, the rest int4).
    """
    if mode not in ("int8", "int4", "w8a8"):
        raise QuantizationError(f"quantization must be int8, int4 or w8a8, got {mode!r}")
    found = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear)]
    for _, name, child in found:
        if child.weight.device.type != "cpu":
            raise QuantizationError(f"{mode} weights need a CPU (PyTorch's CPU kernels); {name} is on "
                                    f"{child.weight.device}")
        if mode == "int4" and name not in int8_names and child.in_features % group_size:
            raise QuantizationError(f"int4 group size {group_size} does not divide {name}'s input size "
                                    f"{child.in_features}; use int8")
    if mode == "w8a8" and (error := a8_error()) is not None:
        raise QuantizationError(f"w8a8: {error}")
    with torch.no_grad():
        for parent, name, child in found:
            as_int8 = (mode == "int4" and name in int8_names) or (mode == "w8a8" and child.in_features % A8_BLOCK)
            setattr(parent, name, quantized_linear(child, "int8" if as_int8 else mode, group_size))
    return len(found)


def quantization_of(model: nn.Module) -> str:
    """What ``quantize_model`` did to ``model``: "none", "int8", "int4-g<group size>", "w4a8", "w8a8" or "gguf"
    (read from its first decoder layer's output projection; used to key cached cost profiles)."""
    layers = getattr(model, "layers", None)
    proj = getattr(getattr(layers[0], "self_attn", None), "o_proj", None) if layers else None
    if isinstance(proj, Int8Linear):
        return "int8"
    if isinstance(proj, Int4Linear):
        return f"int4-g{proj.group_size}"
    if isinstance(proj, QuantizedLinear) and proj.scheme:
        return proj.scheme
    return "none"
