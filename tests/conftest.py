"""Shared test fixtures and model builders.

Why this exists: most tests need a model, and the right one is almost always a tiny random one
(seconds, deterministic, float64 so near-ties cannot hide bugs). Integration tests share one
embedded SmolLM2-135M load per session.

The builders themselves (tiny models, the tokenizer, HF checkpoints) are in ``tests/helpers.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tidespec.models.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def embedded() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct in float32 on CPU (converted once into the user cache)."""
    return load_model(None, dtype=torch.float32)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """Run all tests' torch ops on one thread. The suite's models are tiny (or 135M at batch 1):
    intra-op threads only add spin-wait overhead, and on a small CPU shared with other processes
    two OpenMP threads waiting on each other make a forward several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Two intra-op threads for one test, as served (``--threads 2``): the row-blocked GEMM paths
    of ``models.llama.Linear`` only run with two or more threads; the rest of the suite runs on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
