"""Row invariance of the projections (``models/kernels/rows.py``, ``models/execution/invariance.py``): the frontier
probe finds where a kernel stops being row-invariant, calls within it split into probed pieces,
and on a real model every projection is chosen row-invariant up to the engine's budget."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import tiny_llama
from tidespec.models.execution import invariance
from tidespec.models.execution.invariance import choose_float_kernels, make_row_invariant
from tidespec.models.kernels.linear import Linear
from tidespec.models.kernels.ops import exact_attention_error
from tidespec.models.kernels.rows import PROBE_ROWS, frontier, in_pieces, pieces, probed
from tidespec.models.quant.quantize import quantize_model


def test_probed_and_pieces_worked_examples() -> None:
    assert probed(20) == list(range(1, 17)) + [20]
    assert pieces(100, 32) == [32, 32, 32, 4]
    assert pieces(40, 24) == [24, 16]
    assert pieces(0, 8) == []
    for rows in range(1, 300):  # every piece a probed size within the limit, summing to the rows
        ps = pieces(rows, 48)
        assert sum(ps) == rows and all(p in PROBE_ROWS and p <= 48 for p in ps)


def _switching_kernel(at: int, w: torch.Tensor):
    """A kernel that sums in another order above ``at`` rows (as BLAS libraries switch kernels)."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        prod = x.unsqueeze(1) * w  # [T, out, in]: each output summed on its own, in a fixed order
        return prod.sum(-1) if x.shape[0] <= at else prod.flip(-1).sum(-1)  # other order, other rounding
    return fn


def test_frontier_finds_where_a_kernel_switches_and_pieces_restore_the_bits() -> None:
    w = torch.randn(48, 64)
    fn = _switching_kernel(24, w)
    assert frontier(fn, 64, torch.float32, 200) == 24
    x = torch.randn(100, 64)
    alone = torch.cat([fn(x[i:i + 1]) for i in range(100)])
    assert not torch.equal(fn(x), alone)  # the whole call rounds otherwise
    assert torch.equal(in_pieces(fn, x, 24), alone)


def test_make_row_invariant_on_a_quantized_model_keeps_every_row_bit_exact() -> None:
    """int8 target (float32 activations): after ``make_row_invariant`` each projection's rows, and
    the whole model's logits of a row, have the same bits in a 1-row and in a 70-row call."""
    model = tiny_llama(vocab_size=64, layers=2, dtype=torch.float32)
    quantize_model(model, "int8")
    report = make_row_invariant(model, budget=96)
    assert report.exact and model.row_invariant
    layer = model.layers[0].mlp.gate_up_proj
    assert {k.kernel for k in report.kernels} == {f"int8-{layer.kernel_name}"}  # tidespec's kernel or ATen's
    x = torch.randn(70, model.cfg.hidden_size)
    alone = torch.cat([layer.forward(x[i:i + 1]) for i in range(70)])
    assert torch.equal(layer.forward(x), alone)


def test_float_linear_gets_an_invariant_kernel_and_runs_it_for_every_row_count() -> None:
    lin = Linear(96, 80, bias=False)
    model = torch.nn.Sequential(lin)
    report = make_row_invariant(model, budget=64)
    assert report.kernels and report.kernels[0].kernel in lin.invariant_kernels()
    assert lin.invariant == report.kernels[0].kernel
    x = torch.randn(64, 96)
    with torch.inference_mode():
        alone = torch.cat([lin.forward(x[i:i + 1]) for i in range(64)])
        assert torch.equal(lin.forward(x), alone)
        torch.testing.assert_close(lin.forward(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)


def test_every_invariant_kernel_computes_the_product_and_the_choice_is_the_fastest_invariant_one() -> None:
    """bfloat16: each candidate (``tall64`` pads tiles to 2..64 rows) gives F.linear's product up to
    rounding at row counts across its tile edges; ``make_row_invariant`` runs a kernel whose rows
    are bit-identical in a 1-row and a 70-row call (the probe's verdict, checked here again)."""
    lin = Linear(96, 80, bias=False).to(torch.bfloat16)
    x = torch.randn(70, 96).to(torch.bfloat16)
    with torch.inference_mode():
        for kernel in lin.invariant_kernels():
            lin.set_invariant(kernel, 0)
            for rows in (1, 3, 64, 65, 70):
                torch.testing.assert_close(lin.forward(x[:rows]).float(), F.linear(x[:rows], lin.weight).float(),
                                           rtol=2e-2, atol=2e-2)
        report = make_row_invariant(torch.nn.Sequential(lin), budget=96)
        assert lin.invariant == report.kernels[0].kernel and report.kernels[0].frontier >= 96
        alone = torch.cat([lin.forward(x[i:i + 1]) for i in range(70)])
        assert torch.equal(lin.forward(x), alone)


@pytest.mark.parametrize("frontiers,expected,probes", [
    # fastest first: "linear" stops at 32 rows on the second shape, "tall64" holds on both: chosen,
    # and "tile16", slower, is never probed
    ({"linear": (512, 32), "tall64": (512, 512), "tile16": (512, 512)}, [("tall64", 512)] * 2,
     [("linear", 0), ("linear", 1), ("tall64", 0), ("tall64", 1)]),
    # none holds on every shape: each shape runs in pieces within the kernel invariant up to the most rows
    ({"linear": (512, 32), "tall64": (64, 512), "tile16": (16, 16)}, [("linear", 512), ("tall64", 512)],
     [("linear", 0), ("linear", 1), ("tall64", 0)] + [(k, i) for i in (0, 1) for k in ("linear", "tall64", "tile16")]),
])
def test_kernels_are_probed_fastest_first_and_the_first_invariant_on_every_shape_is_chosen(
        monkeypatch: pytest.MonkeyPatch, frontiers: dict[str, tuple[int, int]], expected: list[tuple[str, int]],
        probes: list[tuple[str, int]]) -> None:
    """``choose_float_kernels`` probes no kernel slower than the one it chooses (a probe runs
    thousands of rows through every shape), and chooses what probing all of them would."""
    groups = [[Linear(8, 4, bias=False)], [Linear(8, 6, bias=False)]]
    monkeypatch.setattr(Linear, "invariant_kernels", lambda self: ("tile16", "tall64", "linear"))
    monkeypatch.setattr(invariance, "ranked_kernels", lambda layers, kernels: ["linear", "tall64", "tile16"])
    seen: list[tuple[str, int]] = []

    def probe(kind: str, shape: tuple[int, int], dtype: torch.dtype, rows: int, fn) -> int:
        i = [tuple(g[0].weight.shape) for g in groups].index(shape)
        seen.append((kind, i))
        return min(rows, frontiers[kind][i])

    monkeypatch.setattr(invariance, "cached_frontier", probe)
    assert choose_float_kernels(groups, 512) == expected
    assert sorted(set(seen)) == sorted(set(probes)) and seen[:len(probes[:3])] == probes[:3]


def test_exact_linear_is_one_fma_chain_per_output_whatever_the_rows_and_compiled_alike() -> None:
    """tidespec's own kernel (``csrc/exact_linear.cpp``): the worked example's bits; a row's bits the
    same in calls of 1 to 70 rows (every tile shape of the kernel) and within rounding of F.linear,
    in float32, bfloat16 and float16; panels remade when the weight is written; a compiled graph
    calls the same kernel."""
    assert exact_attention_error() is None
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)):
        one = Linear(2, 1, bias=False).to(dtype)
        with torch.no_grad():
            one.weight.copy_(torch.tensor([[3.0, 4.0]]))
        one.set_invariant("exact", 0)
        y = one.forward(torch.tensor([[1.0, 2.0]], dtype=dtype))
        assert y.dtype == dtype and y.item() == 11.0  # fma(2, 4, fma(1, 3, 0))
        lin = Linear(95, 300, bias=True).to(dtype)  # 300 outputs: a partial last panel; 95 inputs: a padded pair
        lin.set_invariant("exact", 0)
        x = torch.randn(70, 95).to(dtype)
        with torch.inference_mode():
            whole = lin.forward(x)
            for rows in (1, 2, 3, 4, 5, 7, 16, 33):
                assert torch.equal(torch.cat([lin.forward(x[i:i + rows]) for i in range(0, 70, rows)]), whole)
            torch.testing.assert_close(whole, F.linear(x, lin.weight, lin.bias), rtol=tol, atol=tol)
        with torch.no_grad():
            lin.weight.mul_(2.0)
        with torch.inference_mode():
            torch.testing.assert_close(lin.forward(x), F.linear(x, lin.weight, lin.bias), rtol=tol, atol=tol)
            compiled = torch.compile(lin.forward, dynamic=True, fullgraph=True)
            assert torch.equal(compiled(x[:5]), lin.forward(x[:5])) and torch.equal(compiled(x[:9]), lin.forward(x[:9]))


def test_exact_linear_rounds_a_bfloat16_sum_once_to_nearest_even() -> None:
    """bfloat16: the float32 chain's sum is rounded once to bfloat16, to nearest even, as
    ``Tensor.to`` does: 1 + 2^-8 (a tie between 1 and 1 + 2^-7) -> 1; 1 + 3 * 2^-8 -> 1 + 2^-6."""
    lin = Linear(2, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 2.0 ** -8]]))
    lin.set_invariant("exact", 0)
    x = torch.tensor([[1.0, 1.0], [1.0, 3.0]], dtype=torch.bfloat16)
    with torch.inference_mode():
        y = lin.forward(x)[:, 0].float()
    assert y.tolist() == [1.0, 1.0 + 2.0 ** -6]
    assert y.tolist() == torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8]).to(torch.bfloat16).float().tolist()
