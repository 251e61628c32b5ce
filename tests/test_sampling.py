"""The one logits -> probabilities transform: edge values of the sampling parameters."""

from __future__ import annotations

import torch

from tidespec.sampling import SamplingParams, target_probs


def test_top_p_smaller_than_float32_keeps_the_most_likely_token() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 1.0]])  # float32
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=1e-300))
    assert torch.isfinite(p).all()
    assert torch.equal(p, torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]))


def test_top_p_keeps_the_smallest_prefix_reaching_it() -> None:
    p = target_probs(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([[0.731, 0.269, 0.0, 0.0]]), atol=1e-3)
