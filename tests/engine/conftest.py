"""The engine tests' default target: a byte-level tokenizer (any text has a tokenization, as grammars,
logit biases and predictions need) and a sharp tiny model over it (it repeats itself, so the
model-free drafters find matches and penalties bite). A module that needs another target defines its
own ``tok`` and ``model`` fixtures, which take precedence over these."""

from __future__ import annotations

import pytest

from tests.helpers import byte_tokenizer, tiny_llama
from tidespec.models.families.decoder import DecoderModel


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok) -> DecoderModel:
    return tiny_llama(len(tok), layers=3, seed=2, scale=3.0, eos=0)
