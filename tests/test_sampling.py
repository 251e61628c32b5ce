"""The one logits -> probabilities transform: edge values of the sampling parameters; the rows' argmax."""

from __future__ import annotations

import pytest
import torch

from tidespec.sampling import SamplingParams, row_argmax, target_probs


def test_top_p_smaller_than_float32_keeps_the_most_likely_token() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 1.0]])  # float32
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=1e-300))
    assert torch.isfinite(p).all()
    assert torch.equal(p, torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]))


def test_top_p_keeps_the_smallest_prefix_reaching_it() -> None:
    p = target_probs(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([[0.731, 0.269, 0.0, 0.0]]), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_row_argmax_is_torch_argmax(dtype: torch.dtype) -> None:
    """The same index as torch.argmax: random rows, ties (the first), NaN (the first NaN), all -inf,
    every value equal, one row alone and a 1-D row."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 49152, generator=gen).to(dtype)
    ties = torch.randint(0, 3, (64, 1000), generator=gen).to(dtype)
    odd = torch.randn(5, 300, generator=gen).to(dtype)
    odd[0, [7, 90]] = float("nan")
    odd[1] = float("-inf")
    odd[2] = 0.0
    odd[3, [3, 200]] = float("inf")
    for t in (x, ties, odd, x[:1], x[0], odd[0]):
        assert torch.equal(row_argmax(t), torch.argmax(t, -1))
    assert row_argmax(torch.tensor([[1.0, 3.0, 3.0], [0.0, float("nan"), 5.0]])).tolist() == [1, 1]
