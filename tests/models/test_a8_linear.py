"""tidespec's w4a8 / w8a8 kernels (csrc/a8_linear.cpp): equal, bit for bit, to a PyTorch rendering of
their arithmetic (llama.cpp's: Q4_1 / Q8_0 weights, activations quantized to int8 per block of 32,
integer sums, per-block float steps in order), row-invariant at every row count, and a model
quantized with them keeps its scales through ``.to(dtype)``."""

from __future__ import annotations

import pytest
import torch

from tidespec.models.families.decoder import DecoderModel
from tidespec.models.quant.a8 import W4A8Linear, W8A8Linear, a8_error, pack_w4, pack_w8, quantize_q4_1, quantize_q8_0
from tidespec.models.quant.quantize import QuantizationError, quantization_of, quantize_model
from tidespec.models.target import TargetConfig

pytestmark = pytest.mark.skipif(a8_error() is not None, reason=f"w4a8 kernels unavailable: {a8_error()}")


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, K] float32 -> (qx [R, K/32, 32] int64, dx [R, K/32], sx [R, K/32]), the kernel's lines."""
    r, k = x.shape
    g = x.reshape(r, k // 32, 32)
    dx = g.abs().amax(dim=2) / 127.0
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    qx = torch.round(g * inv.unsqueeze(2)).clamp(-127, 127)
    return qx.to(torch.int64), dx, dx * qx.sum(dim=2)


def reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """The kernels' arithmetic in PyTorch: per block b in order, acc += (dw * dx) * isum (+ mw * sx)."""
    qx, dx, sx = quantize_activations(x)
    r, n, kb = x.shape[0], q.shape[0], x.shape[1] // 32
    isum = torch.einsum("rbk,nbk->rnb", qx, q.to(torch.int64).reshape(n, kb, 32)).to(torch.float32)
    acc = torch.zeros(r, n)
    for b in range(kb):
        acc = acc + (d[:, b].float().unsqueeze(0) * dx[:, b:b + 1]) * isum[:, :, b]
        if m is not None:
            acc = acc + m[:, b].float().unsqueeze(0) * sx[:, b:b + 1]
    return acc


@pytest.mark.parametrize("n,k", [(64, 32), (40, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_kernels_equal_their_arithmetic_in_pytorch(n: int, k: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(n * 31 + k + rows)
    w, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen) * 3
    x[0, :32] = 0.0  # a zero block: dx = 0, the block adds nothing
    q4, d4, m4 = quantize_q4_1(w)
    y4 = torch.ops.tidespec.w4a8_linear(x, *pack_w4(q4, d4, m4))[:, :n]
    assert torch.equal(y4, reference(x, q4, d4, m4))
    q8, d8 = quantize_q8_0(w)
    y8 = torch.ops.tidespec.w8a8_linear(x, *pack_w8(q8, d8))[:, :n]
    assert torch.equal(y8, reference(x, q8, d8, None))


@pytest.mark.parametrize("layer_type", [W4A8Linear, W8A8Linear])
def test_a_row_has_the_same_bits_whatever_else_the_call_holds(layer_type: type, two_threads) -> None:
    gen = torch.Generator().manual_seed(7)
    layer = layer_type.from_weight(torch.randn(200, 576, generator=gen))
    x = torch.randn(13, 576, generator=gen)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(13)])
    for rows in range(1, 14):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    assert torch.equal(layer(x[5:9]), alone[5:9])


def test_q4_1_weights_come_back_as_the_gguf_file_holds_them() -> None:
    """Weights already on a Q4_1 grid (a dequantized GGUF) quantize to the same codes and scales."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.uint8)
    q[:, 0], q[:, 1], q[:, 32], q[:, 33] = 0, 15, 0, 15  # each block spans the full code range, as Q4_1 stores it
    d = (torch.rand(32, 2, generator=gen) * 0.1 + 0.01).half()
    m = (-torch.rand(32, 2, generator=gen)).half()
    w = (q.float().reshape(32, 2, 32) * d.float().unsqueeze(2) + m.float().unsqueeze(2)).reshape(32, 64)
    q2, d2, m2 = quantize_q4_1(w)
    assert torch.equal(q2, q) and torch.equal(d2, d) and torch.equal(m2, m)


def test_close_to_the_float_product() -> None:
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(256, 576, generator=gen) * 0.05, torch.randn(4, 576, generator=gen)
    exact = x @ w.T
    for layer, tol in ((W8A8Linear.from_weight(w), 0.02), (W4A8Linear.from_weight(w), 0.15)):
        err = (layer(x) - exact).norm() / exact.norm()
        assert err < tol, (type(layer).__name__, err)


def tiny(hidden: int = 64) -> DecoderModel:
    torch.manual_seed(0)
    cfg = TargetConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=hidden // 4, max_position_embeddings=256)
    return DecoderModel(cfg)


def test_quantize_model_w4a8_and_w8a8() -> None:
    for mode, proj_type in (("w4a8", W4A8Linear), ("w8a8", W8A8Linear)):
        model = tiny()
        quantize_model(model, mode)
        assert isinstance(model.layers[0].mlp.down_proj, proj_type) and isinstance(model.lm_head, W8A8Linear)
        assert quantization_of(model) == mode
        model.to(torch.float64)  # a model-wide cast leaves the kernel's float16 scales alone
        qkv = model.layers[1].self_attn.qkv_proj
        assert (qkv.dm if mode == "w4a8" else qkv.scales).dtype == torch.float16
        assert model.lm_head.scales.dtype == torch.float16
        out = model.layers[0].mlp.down_proj(torch.randn(3, 128, dtype=torch.float64))
        assert out.dtype == torch.float64 and out.shape == (3, 64)


def test_input_sizes_not_a_multiple_of_32_are_refused_in_one_line() -> None:
    model = tiny(hidden=48)
    with pytest.raises(QuantizationError, match=r"w4a8 needs input sizes that are multiples of 32; this model has \[48\]"):
        quantize_model(model, "w4a8")
    assert quantization_of(model) == "none"
