"""What many tests share: tiny random Llama models, a word-level tokenizer, running an engine to
completion, a slow signal store, and the reference tap capture.

Why this exists: one copy of each, so two tests never drift apart on what "run the engine until
it is done" or "the target's taps over a sequence" mean; also the HF side: a tiny transformers
model of each architecture with our model holding the same weights, and checkpoint directories.
The fixtures are in ``conftest.py``.

Worked example::

    model, tok = tiny_llama(), tiny_tokenizer(64)
    engine = LLMEngine(model, tok, EngineConfig(cache=CacheConfig(max_model_len=128, max_num_seqs=4)))
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=8), request_id="a")
    run_to_completion(engine)["a"].token_ids          # the 8 generated ids

    hf, ours = tiny_hf_model("qwen3", torch.float32)  # same random weights in both
    logits = full_logits(ours, [1, 2, 3])             # [3, vocab], one prefill
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import gguf
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch import nn
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tidespec.bench.anchor.run import synthetic_tokenizer
from tidespec.config import SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.engine.output import RequestOutput
from tidespec.llm import build_drafter
from tidespec.models.families.decoder import DecoderModel
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.models.target import TargetConfig
from tidespec.online.store import SignalShard, SignalStore
from tidespec.speculative.api import Drafter
from tidespec.speculative.drafters.draft_model import DraftModelOptions
from tidespec.speculative.drafters.eagle3 import Eagle3Drafter
from tidespec.speculative.policy.api import PlanInput
from tidespec.stats import StepStats

# every drafter once, chain and tree, on a tiny target of >= 3 layers (the exactness tests of
# structured outputs, logprobs and penalties run each; EAGLE-3's head is fresh and random)
EVERY_DRAFTER: dict[str, SpecConfig] = {
    "ngram": SpecConfig(drafter="ngram", num_speculative_tokens=4),
    "suffix": SpecConfig(drafter="suffix", num_speculative_tokens=4),
    "suffix-tree": SpecConfig(drafter="suffix", num_speculative_tokens=4, tree=True),
    "draft-model": SpecConfig(drafter="draft-model", num_speculative_tokens=3,
                              options={"draft-model": DraftModelOptions(layers=1)}),
    "eagle3": SpecConfig(drafter="eagle3", num_speculative_tokens=3),
    "eagle3-tree": SpecConfig(drafter="eagle3", num_speculative_tokens=3, tree=True),
}


def tiny_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over tokens ``t0 .. t{V-1}``; ``t0`` doubles as EOS."""
    return synthetic_tokenizer(vocab_size)


def checkpoint_tokenizer(vocab: int = 96) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``<s>``, ``</s>``, ``<unk>``, ``w3`` ... ``w{vocab-1}`` (split
    on whitespace), saved into tiny HF checkpoint directories (``write_tiny_checkpoint``)."""
    words = ["<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(3, vocab)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


# merges of the byte tokenizer: JSON's punctuation gets more than one tokenization (`{"` or `{` `"`)
BYTE_MERGES = [("Ġ", '"'), ('"', ":"), ('"', ","), ("{", '"'), ("Ġ", "Ġ"), ("t", "r"), ("tr", "u"), ("n", "u")]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's byte alphabet, as SmolLM2, Llama 3 and Qwen use) of 265
    tokens: ``<eos>`` (id 0), the 256 bytes, and ``BYTE_MERGES``. Unlike the word-level tokenizers
    above, any text has a tokenization, which a grammar library needs (structured outputs)."""
    vocab = {"<eos>": 0}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    for a, b in BYTE_MERGES:
        vocab[a + b] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, BYTE_MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def tiny_config(vocab_size: int = 64, layers: int = 2, eos: int = 0, **kw: object) -> TargetConfig:
    base = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=layers, num_heads=4,
                num_kv_heads=2, head_dim=8, max_position_embeddings=512, rope_theta=10000.0,
                eos_token_ids=(eos,))
    base.update(kw)
    return TargetConfig(**base)  # type: ignore[arg-type]


def tiny_llama(vocab_size: int = 64, layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.float64,
               scale: float = 1.0, **kw: object) -> DecoderModel:
    """Random tiny model; ``scale`` > 1 sharpens its distributions (more repetitive text)."""
    torch.manual_seed(seed)
    m = DecoderModel(tiny_config(vocab_size, layers, **kw))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2 * scale)
    return m.to(dtype).eval()


def seed_generators_from_counter(monkeypatch: Any, start: int) -> None:
    """Unseeded requests' generators (the engine's, the draft model's, EAGLE-3's) seeded from a counter
    from ``start``, so that a sampling test is deterministic; seeded requests keep their seed."""
    import tidespec.engine.engine as engine_mod
    import tidespec.speculative.drafters.draft_model as draft_model_mod
    import tidespec.speculative.drafters.eagle3 as eagle3_mod

    counter = itertools.count(start)

    def counted_generator(seed: int | None, device: Any = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed(next(counter) if seed is None else seed)
        return g

    for mod in (engine_mod, draft_model_mod, eagle3_mod):
        monkeypatch.setattr(mod, "make_generator", counted_generator)


def run_to_completion(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step ``engine`` until no request is left; the final output of every request that finished."""
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done


def capture(target: DecoderModel, token_ids: list[int], taps: tuple[int, ...]) -> torch.Tensor:
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


# Tiny HF configs per architecture key: (config class, model class, config kwargs).
# Each exercises what distinguishes its family: llama3 rope scaling (with a short original
# context so scaled/smoothed/unscaled frequency bands all occur), Mistral's sliding window,
# Qwen2's q/k/v bias, Qwen3's per-head q/k RMSNorm with an explicit head_dim, and the rest below.
_COMMON: dict[str, Any] = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY_HF_ARCHS: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=10000.0)),
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        num_hidden_layers=3, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    # biases on every projection (attention_bias puts one on o_proj too, unlike Qwen2's)
    "llama-bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(attention_bias=True, mlp_bias=True)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=6)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(num_hidden_layers=3)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=24)),
    # NoPE in the middle layer, tied head
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, dict(
        num_hidden_layers=3, no_rope_layer_interval=2, tie_word_embeddings=True, pad_token_id=None)),
    # norms after each block only, q/k norms over the whole projection
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, dict(pad_token_id=None, eos_token_id=2)),
    # multipliers on the embedding, the residual, the attention scale and the logits
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM, dict(
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.11, logits_scaling=1.5,
        bos_token_id=1, eos_token_id=2)),
    # rope over 3/4 of each head
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        partial_rotary_factor=0.75, pad_token_id=None, bos_token_id=1, eos_token_id=2)),
    # LongRoPE (prompts stay within its original length, where HF and tidespec both use the short factors)
    "phi3-longrope": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        pad_token_id=None, bos_token_id=1, eos_token_id=2, max_position_embeddings=256,
        original_max_position_embeddings=32, rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=32,
            short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8], long_factor=[1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 14.0, 16.0]))),
    # 4 experts, top 2 renormalized, the middle layer dense; Mixtral: every layer sparse, experts as wide as the MLP
    "qwen3-moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
        mlp_only_layers=[1])),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    # Gemma 2: soft caps on the attention scores and the logits (small, so that they bite), sliding and
    # global layers, sandwich norms with Gemma's offset weights, sqrt(H) embedding scale, gelu-tanh
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=5, tie_word_embeddings=True,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, pad_token_id=None,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # sliding (window 5) and global layers with their own ropes, sandwich norms with Gemma's offset
    # weights, q/k norms, sqrt(H) embedding scale, query_pre_attn_scalar, gelu-tanh, tied head
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=5, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], pad_token_id=None,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1000000.0)})),
    # attention sinks, sliding (window 5) and global layers, YaRN, a biased router (softmax over the top 2
    # logits), biased experts with gate|up interleaved, a SwiGLU clamp small enough to bite
    "gpt-oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, dict(
        num_hidden_layers=3, head_dim=16, sliding_window=5, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=48, swiglu_limit=1.5, pad_token_id=None, bos_token_id=1, eos_token_id=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=8.0, beta_slow=1.0,
                             original_max_position_embeddings=32, truncate=False))),
}


GGUF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_gguf_writer(hf: transformers.PreTrainedModel, path: Path, arch: str) -> gguf.GGUFWriter:
    """A ``gguf.GGUFWriter`` for ``arch`` with the metadata every tiny test GGUF shares: the shape of
    ``hf``'s config and a byte-level BPE vocabulary of 256 bytes + 2 merges + 3 control tokens (261
    ids; BOS and EOS the last two). The caller adds its family's keys and the tensors."""
    cfg = hf.config
    tokens = list(bytes_to_unicode().values()) + ["Ġt", "he"] + GGUF_SPECIALS
    assert cfg.vocab_size == len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - len(GGUF_SPECIALS)) + [3] * len(GGUF_SPECIALS))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    return w


def spec_drafter(spec: SpecConfig, model: DecoderModel, slots: int, max_len: int) -> Drafter | None:
    """The drafter ``spec`` names for ``model`` (None for "none"); an EAGLE-3 head gets larger random
    weights, so that its drafts depend visibly on the taps it is given."""
    drafter = build_drafter(spec, model, slots, max_len) if spec.drafter != "none" else None
    if isinstance(drafter, Eagle3Drafter):
        torch.manual_seed(1)
        with torch.no_grad():
            for p in drafter.head.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.3)
    return drafter


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
                  **overrides: Any) -> tuple[transformers.PreTrainedModel, DecoderModel]:
    """A random tiny HF model (key of ``TINY_HF_ARCHS``; sdpa attention, eval mode) and our
    ``DecoderModel`` holding the same weights, both in ``dtype``. ``overrides`` patch the HF config."""
    if arch not in TINY_HF_ARCHS:
        raise KeyError(f"unknown tiny arch {arch!r}; choose from {sorted(TINY_HF_ARCHS)}")
    cfg_cls, model_cls, extra = TINY_HF_ARCHS[arch]
    hf_cfg = cfg_cls(**{**_COMMON, **extra, **overrides})
    hf_cfg.architectures = [model_cls.__name__]
    # experts looped one by one (transformers' reference; its grouped GEMM takes no float64); eager
    # attention where the scores are soft-capped (SDPA has no place for the cap)
    attn = "eager" if getattr(hf_cfg, "attn_logit_softcapping", None) or not model_cls._supports_sdpa else "sdpa"
    hf = model_cls._from_config(hf_cfg, attn_implementation=attn, experts_implementation="eager", dtype=torch.float32)
    randomize_(hf, seed)
    hf = hf.to(dtype).eval()
    ours = DecoderModel(TargetConfig.from_hf(hf_cfg.to_dict()))
    ours.load_hf_state_dict(hf.state_dict())
    return hf, ours.to(dtype).eval()


def full_logits(model: DecoderModel, ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Logits [T, V] (float32 as ``ModelOutput`` gives them) of one sequence prefilled in one
    forward into a fresh single-slot KV cache."""
    ids_t = torch.as_tensor(ids, dtype=torch.int64)
    kv = KVCache.for_model(model.cfg, num_slots=1, max_len=len(ids_t), dtype=model.dtype)
    layout = BatchLayout.build(q_lens=[len(ids_t)], ctx_lens=[0], slots=[0])
    out = model(ids_t, layout, kv)
    assert out.logits is not None
    return out.logits


def write_tiny_checkpoint(hf: transformers.PreTrainedModel, directory: Path, **save_kwargs: Any) -> Path:
    """Save ``hf`` as an HF safetensors directory with a ``checkpoint_tokenizer`` of its vocabulary;
    returns ``directory``."""
    hf.save_pretrained(str(directory), **save_kwargs)
    checkpoint_tokenizer(hf.config.vocab_size).save_pretrained(str(directory))
    return directory


class ScriptedPolicy:
    """A ``DrafterPolicy`` that plays a fixed schedule: ``choose(step, index in batch)`` -> (drafter, gamma)."""

    name = "script"

    def __init__(self, choose) -> None:
        self.choose = choose
        self.num_steps = 0
        self.seen: list[StepStats] = []

    def plan(self, inp: PlanInput) -> dict[int, int]:
        return {sid: g for sid, (_, g) in self.plan_drafters(inp).items()}

    def plan_drafters(self, inp: PlanInput) -> dict[int, tuple[str, int]]:
        self.num_steps += 1
        return {s.seq_id: self.choose(self.num_steps, i) for i, s in enumerate(inp.seqs)}

    def observe(self, step: StepStats) -> None:
        self.seen.append(step)

    def stats(self) -> dict[str, float]:
        return {}


def switching_drafters(step: int, i: int) -> tuple[str, int]:
    """Per step and sequence: the drafter rotates, gammas vary, and every 25 steps a stretch of 12
    off steps (longer than TAP_LINGER_STEPS) makes the engine stop computing taps."""
    if step % 25 >= 13:
        return "suffix", 0
    names = ["suffix", "eagle3", "draft-model", "ngram"]
    return names[(step + i) % 4], 1 + (step + 2 * i) % 4


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (Linux /proc): children a test expects gone, or
    processes it kills on purpose."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text in (d / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids
