"""Where a differing output first leaves plain decoding, and the target's logit gap there."""

from __future__ import annotations

import pytest

from tests.helpers import full_logits, tiny_llama
from tidespec.bench.common import divergence
from tidespec.bench.common.divergence import divergence_report, first_divergence, first_index


def test_first_index():
    assert first_index([1, 2, 3], [1, 4, 3]) == 1
    assert first_index([1], [1, 2]) == 1
    assert first_index([1, 2], [1, 2]) is None


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(full_logits(model, seq)[-1].argmax()))
    return seq[len(prompt):]


def test_a_flip_to_the_runner_up_is_measured_and_classified(monkeypatch):
    model = tiny_llama(48, layers=2, seed=4)
    prompt = [3, 9, 17]
    plain = _greedy(model, prompt, 6)
    logits = full_logits(model, prompt + plain[:2])[-1]  # [V] where position 2 was chosen
    second = int(logits.topk(2).indices[1])
    spec = plain[:2] + [second, 5, 5]
    d = first_divergence(model, prompt, plain, spec, "p")
    assert d is not None and (d.position, d.plain_token, d.spec_token) == (2, plain[2], second)
    want = float(logits[plain[2]] - logits[second])
    assert d.gap == pytest.approx(want, rel=1e-9) and d.gap > 0
    assert d.relative_gap == pytest.approx(abs(want) / max(1.0, float(logits.abs().max())), rel=1e-9)
    assert not d.near_tie  # float64: a real margin is far beyond 4 epsilons
    monkeypatch.setattr(divergence, "NEAR_TIE_EPS", 1e20)
    assert first_divergence(model, prompt, plain, spec).near_tie
    report = divergence_report(model, [prompt, prompt], [plain, plain], [spec, plain], ["a", "b"])
    assert report["count"] == 1 and report["near_ties"] == 1 and report["divergences"][0]["prompt_id"] == "a"
    assert first_divergence(model, prompt, plain, plain[:3]) is None  # stopping early is no divergence
