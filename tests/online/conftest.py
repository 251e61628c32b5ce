"""Fixtures of the online-training tests: the tiny float64 target (8 layers, so EAGLE-3's three
taps are distinct) and its tokenizer; a module may define its own ``model`` instead."""

from __future__ import annotations

import pytest

from tests.helpers import tiny_llama, tiny_tokenizer
from tidespec.models.families.decoder import DecoderModel

V = 48
LAYERS = 8  # EAGLE-3 taps (2, 4, 5): distinct without the tiny-model fallback


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return tiny_llama(V, layers=LAYERS, seed=2, scale=3.0)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(V)
