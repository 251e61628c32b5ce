"""What many tests share: tiny random Llama models, a word-level tokenizer, running an engine to
completion, a slow signal store, and the reference tap capture.

Why this exists: one copy of each, so two tests never drift apart on what "run the engine until
it is done" or "the target's taps over a sequence" mean. HF-side builders (tiny transformers
models of each architecture, checkpoint directories) and the fixtures stay in ``conftest.py``.

Worked example::

    model, tok = tiny_llama(), tiny_tokenizer(64)
    engine = LLMEngine(model, tok, EngineConfig(cache=CacheConfig(max_model_len=128, max_num_seqs=4)))
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=8), request_id="a")
    run_to_completion(engine)["a"].token_ids          # the 8 generated ids
"""

from __future__ import annotations

import time

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tidespec.engine.engine import LLMEngine
from tidespec.engine.output import RequestOutput
from tidespec.models.kv_cache import KVCache
from tidespec.models.llama import BatchLayout, LlamaConfig, LlamaModel
from tidespec.online.store import SignalShard, SignalStore


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


def run_to_completion(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step ``engine`` until no request is left; the final output of every request that finished."""
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done


def capture(target: LlamaModel, token_ids: list[int], taps: tuple[int, ...]) -> torch.Tensor:
    """[len, 3H] target taps over a whole sequence (one prefill): the reference the engine's
    captured taps are compared with."""
    kv = KVCache.for_model(target.cfg, 1, 256, target.dtype)
    out = target(torch.tensor(token_ids), BatchLayout.build([len(token_ids)], [0], [0]), kv, tap_layers=taps)
    assert out.taps is not None
    return out.taps


class SlowStore(SignalStore):
    """A signal store whose every append takes ``sleep_s`` longer (a congested shared filesystem)."""

    sleep_s = 0.5

    def append(self, shard: SignalShard) -> str:
        time.sleep(self.sleep_s)
        return super().append(shard)
