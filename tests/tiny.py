"""Tiny random Llama models and a word-level tokenizer for fast, exact unit tests."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tidespec.models.llama import LlamaConfig, LlamaModel


def tiny_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over tokens ``t0 .. t{V-1}``; ``t0`` doubles as EOS."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", unk_token="t1")


def tiny_config(vocab_size: int = 64, layers: int = 2, eos: int = 0, **kw: object) -> LlamaConfig:
    base = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=layers, num_heads=4,
                num_kv_heads=2, head_dim=8, max_position_embeddings=512, rope_theta=10000.0,
                eos_token_ids=(eos,))
    base.update(kw)
    return LlamaConfig(**base)  # type: ignore[arg-type]


def tiny_llama(vocab_size: int = 64, layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.float64,
               scale: float = 1.0, **kw: object) -> LlamaModel:
    """Random tiny model; ``scale`` > 1 sharpens its distributions (more repetitive text)."""
    torch.manual_seed(seed)
    m = LlamaModel(tiny_config(vocab_size, layers, **kw))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2 * scale)
    return m.to(dtype).eval()
