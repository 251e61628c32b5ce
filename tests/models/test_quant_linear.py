"""tidespec's int4 and int8 kernels (``csrc/quant_linear.cpp``) against PyTorch's: the same bits for
every row count, group size and shape they take, the layers that run them, and their refusals. The
engine runs them in place of ``_weight_int4pack_mm_for_cpu`` and ``_weight_int8pack_mm`` on AVX512,
so a quantized target's outputs rest on this equality (and on the kernels' own row invariance,
which the first tests cover too)."""

from __future__ import annotations

import pytest
import torch

from tidespec.models.kernels.ops import quant_linear_available
from tidespec.models.quant.quantize import Int4Linear, Int8Linear, quantize_int8

pytestmark = pytest.mark.skipif(not quant_linear_available(), reason="tidespec's quantized kernels need AVX512 here")
ROW_COUNTS = (1, 2, 4, 5, 6, 7, 8, 9, 13, 16, 19)


def _packed(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    scale_zero = (torch.randn(k // group, n, 2, generator=g) * 0.05).to(torch.bfloat16)
    scale_zero[0, 0] = torch.tensor([3e4, -2e4])  # outputs of very different ranges
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scale_zero


def _bits(y: torch.Tensor) -> torch.Tensor:
    return y.view(torch.int16)


@pytest.mark.parametrize(("n", "k", "group"), [(64, 64, 32), (960, 576, 32), (576, 1536, 64), (192, 512, 128),
                                               (128, 256, 256)])
def test_the_same_bits_as_pytorchs_kernel_at_every_row_count(n: int, k: int, group: int) -> None:
    packed, scale_zero = _packed(n, k, group, seed=n + k)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    x[3, :7] = 0.0
    for rows in ROW_COUNTS:
        ours = torch.ops.tidespec.int4_linear(x[:rows], packed, group, scale_zero)
        theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(x[:rows], packed, group, scale_zero)
        assert torch.equal(_bits(ours), _bits(theirs)), rows
        assert torch.equal(_bits(ours), _bits(torch.ops.tidespec.int4_linear(x, packed, group, scale_zero)[:rows]))


@pytest.mark.parametrize(("n", "k"), [(1, 16), (7, 64), (16, 576), (49, 1536), (130, 48)])
def test_int8_the_same_bits_as_pytorchs_kernel_at_every_row_count(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    w[0] *= 1e3  # outputs of very different ranges
    qweight, scales = quantize_int8(w)
    x = torch.randn(19, k, generator=g).to(torch.bfloat16)
    x[2, :5] = 0.0
    for rows in ROW_COUNTS:
        ours = torch.ops.tidespec.int8_linear(x[:rows], qweight, scales)
        theirs = torch.ops.aten._weight_int8pack_mm(x[:rows], qweight, scales)
        assert torch.equal(_bits(ours), _bits(theirs)), rows
        assert torch.equal(_bits(ours), _bits(torch.ops.tidespec.int8_linear(x, qweight, scales)[:rows]))


def test_int8_layers_run_it_where_the_features_allow() -> None:
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    ours, odd = Int8Linear.from_weight(w), Int8Linear.from_weight(w[:, :56])  # 56 features: not a multiple of 16
    assert ours.own_kernel and "kernel=tidespec" in repr(ours)
    assert not odd.own_kernel and "kernel=aten" in repr(odd)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    expected = ours(x)
    ours.own_kernel = False
    assert torch.equal(ours(x), expected)


def test_the_layer_runs_it_where_it_applies_and_pytorchs_kernel_elsewhere() -> None:
    w = torch.randn(200, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    wide, narrow = Int4Linear.from_weight(w[:192], 32), Int4Linear.from_weight(w[:144], 32)  # 192 = 3 panels of 64
    assert wide.own_kernel and "kernel=tidespec" in repr(wide)
    assert not narrow.own_kernel and "kernel=aten" in repr(narrow)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    assert torch.equal(wide(x)[:, :144], narrow(x))  # the same weights' first 144 outputs, either kernel
    wide.own_kernel = False
    assert torch.equal(wide(x)[:, :144], narrow(x))


def test_bad_operands_are_refused() -> None:
    packed, scale_zero = _packed(64, 64, 32, seed=0)
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.tidespec.int4_linear(x.float(), packed, 32, scale_zero)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        torch.ops.tidespec.int4_linear(x, packed[:48], 32, scale_zero)
    with pytest.raises(RuntimeError, match="group size"):
        torch.ops.tidespec.int4_linear(x, packed, 48, scale_zero)
    with pytest.raises(RuntimeError, match="scale_zero"):
        torch.ops.tidespec.int4_linear(x, packed, 32, scale_zero[:, :32])
    qweight, scales = quantize_int8(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.tidespec.int8_linear(x[:, :56].contiguous(), qweight[:, :56].contiguous(), scales)
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.tidespec.int8_linear(x, qweight, scales[:4])
