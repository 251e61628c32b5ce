"""Shared test fixtures and model builders.

Why this exists: most tests need a model, and the right one is almost always a tiny random one
(seconds, deterministic, float64 so near-ties cannot hide bugs). Integration tests share one
embedded SmolLM2-135M load per session.

Reuse from any test module (our model alone, without transformers: ``tests/tiny.py``)::

    from tests.conftest import tiny_hf_model, full_logits, write_tiny_checkpoint

    hf, ours = tiny_hf_model("qwen3", torch.float32)          # same random weights in both
    logits = full_logits(ours, [1, 2, 3])                     # [3, vocab], one prefill
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn

from tidespec.models.kv_cache import KVCache
from tidespec.models.llama import BatchLayout, LlamaConfig, LlamaModel
from tidespec.models.loader import LoadedModel, load_model

# Tiny HF configs per architecture key: (config class, model class, config kwargs).
# Each exercises what distinguishes its family: llama3 rope scaling (with a short original
# context so scaled/smoothed/unscaled frequency bands all occur), Mistral's sliding window,
# Qwen2's q/k/v bias, Qwen3's per-head q/k RMSNorm with an explicit head_dim.
_COMMON: dict[str, Any] = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY_HF_ARCHS: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=10000.0)),
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        num_hidden_layers=3, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=6)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(num_hidden_layers=3)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=24)),
}


def randomize_(module: nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded O(1)-scale values (HF's 0.02-std init gives logits so
    small that a wrong model would still pass a 1e-4 test). Matrices ~ N(0, 1/fan_in), norm
    weights ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.5^2). Parameters are visited in sorted-name order."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() >= 2:
                vals = torch.randn(p.shape, generator=gen, dtype=torch.float64) * p.shape[-1] ** -0.5
            elif name.endswith("bias"):
                vals = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5
            else:
                vals = 1.0 + 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(vals)


def tiny_hf_model(arch: str, dtype: torch.dtype, seed: int = 0,
                  **overrides: Any) -> tuple[transformers.PreTrainedModel, LlamaModel]:
    """A random tiny HF model (key of ``TINY_HF_ARCHS``; sdpa attention, eval mode) and our
    ``LlamaModel`` holding the same weights, both in ``dtype``. ``overrides`` patch the HF config."""
    if arch not in TINY_HF_ARCHS:
        raise KeyError(f"unknown tiny arch {arch!r}; choose from {sorted(TINY_HF_ARCHS)}")
    cfg_cls, model_cls, extra = TINY_HF_ARCHS[arch]
    hf_cfg = cfg_cls(**{**_COMMON, **extra, **overrides})
    hf_cfg.architectures = [model_cls.__name__]
    hf = model_cls._from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32)
    randomize_(hf, seed)
    hf = hf.to(dtype).eval()
    ours = LlamaModel(LlamaConfig.from_hf(hf_cfg.to_dict()))
    ours.load_hf_state_dict(hf.state_dict())
    return hf, ours.to(dtype).eval()


def full_logits(model: LlamaModel, ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Logits [T, V] (float32 as ``ModelOutput`` gives them) of one sequence prefilled in one
    forward into a fresh single-slot KV cache."""
    ids_t = torch.as_tensor(ids, dtype=torch.int64)
    kv = KVCache.for_model(model.cfg, num_slots=1, max_len=len(ids_t), dtype=model.dtype)
    layout = BatchLayout.build(q_lens=[len(ids_t)], ctx_lens=[0], slots=[0])
    out = model(ids_t, layout, kv)
    assert out.logits is not None
    return out.logits


def tiny_tokenizer(vocab: int = 96) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over ``<s>``, ``</s>``, ``<unk>``, ``w3`` ... ``w{vocab-1}`` (split
    on whitespace), for checkpoints that need tokenizer files but no real text."""
    words = ["<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(3, vocab)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")


def write_tiny_checkpoint(hf: transformers.PreTrainedModel, directory: Path, **save_kwargs: Any) -> Path:
    """Save ``hf`` as an HF safetensors directory with a ``tiny_tokenizer``; returns ``directory``."""
    hf.save_pretrained(str(directory), **save_kwargs)
    tiny_tokenizer(hf.config.vocab_size).save_pretrained(str(directory))
    return directory


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
