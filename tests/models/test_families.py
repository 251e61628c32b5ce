"""Every family tidespec runs decodes as transformers does, and speculation never changes its tokens.

Per architecture of ``TINY_HF_ARCHS`` (tiny random configs; their logits against transformers':
``test_model_reference.py``): greedy decoding through the engine in float64 equals transformers'
``generate``; in float32 on the row-invariant kernels (the engine's CPU path), suffix, a draft
model and EAGLE-3, alone and four in flight, give the plain decoding's tokens. Also the family
parts that a tiny prompt does not reach (LongRoPE's long factors) and what is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from tests.helpers import (
    EVERY_DRAFTER,
    TINY_HF_ARCHS,
    full_logits,
    run_to_completion,
    spec_drafter,
    tiny_hf_model,
    tiny_tokenizer,
    write_tiny_checkpoint,
)
from tidespec.config import CacheConfig, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.engine.output import RequestOutput
from tidespec.models.execution.executor import check_compilable
from tidespec.models.execution.invariance import make_row_invariant
from tidespec.models.families.decoder import DecoderModel
from tidespec.models.families.moe import SparseMoE
from tidespec.models.families.rope import rope_table
from tidespec.models.kernels.linear import Linear
from tidespec.models.loading.loader import load_model
from tidespec.models.quant.a8 import a8_error
from tidespec.models.quant.base import QuantizedLinear
from tidespec.models.quant.quantize import quantize_model
from tidespec.models.target import ModelConfigError, TargetConfig
from tidespec.sampling import SamplingParams

ARCHS = sorted(TINY_HF_ARCHS)
NEW_TOKENS = 16
MAX_LEN = 64
DRAFTERS = ("suffix", "draft-model", "eagle3")


def _prompts(vocab: int) -> list[list[int]]:
    """Four prompts, repetitive enough for suffix to draft, with random tails."""
    gen = torch.Generator().manual_seed(0)
    tails = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (3, 5, 2, 4)]
    return [[5, 6, 7, 8] * 3 + tails[0], [9, 10, 11] * 4 + tails[1], tails[2] * 5, [20, 21] * 5 + tails[3]]


def _decode(model: DecoderModel, spec: SpecConfig, prompts: list[list[int]], slots: int) -> tuple[list[list[int]], LLMEngine]:
    cfg = EngineConfig(cache=CacheConfig(max_model_len=MAX_LEN, max_num_seqs=slots), spec=spec)
    engine = LLMEngine(model, tiny_tokenizer(model.cfg.vocab_size), cfg,
                       drafter=spec_drafter(spec, model, slots, MAX_LEN))
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, RequestOutput] = run_to_completion(engine)
    return [done[i].token_ids for i in ids], engine


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decoding_matches_transformers_generate(arch: str, honest_hf_dtype: None) -> None:
    hf, ours = tiny_hf_model(arch, torch.float64, seed=11)
    prompts = _prompts(hf.config.vocab_size)[:2]
    got, _ = _decode(ours, SpecConfig(), prompts, slots=2)
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=0,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.int64))
        assert tokens == out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=ARCHS)
def float32_family(request: pytest.FixtureRequest) -> tuple[DecoderModel, list[list[int]], list[list[int]]]:
    """A family's tiny float32 model, the prompts, and plain decoding's tokens, each prompt alone."""
    layers = {} if "num_hidden_layers" in TINY_HF_ARCHS[request.param][2] else {"num_hidden_layers": 3}  # EAGLE-3 taps 3
    _, ours = tiny_hf_model(request.param, torch.float32, seed=12, **layers)
    prompts = _prompts(ours.cfg.vocab_size)
    plain, _ = _decode(ours, SpecConfig(), prompts, slots=1)
    return ours, prompts, plain


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_speculation_alone_and_batched_gives_the_plain_tokens(
        float32_family: tuple[DecoderModel, list[list[int]], list[list[int]]], drafter: str) -> None:
    model, prompts, plain = float32_family
    assert model.row_invariant, "the engine's CPU path: row-invariant kernels"
    drafted = 0
    for slots in (1, 4):
        got, engine = _decode(model, EVERY_DRAFTER[drafter], prompts, slots)
        assert got == plain, f"{model.cfg.architecture}, {drafter}, {slots} in flight"
        drafted += sum(s.num_draft_tokens for s in engine.history)
    assert drafted > 0, "the drafter never proposed: verification not exercised"


@pytest.mark.parametrize("arch", ARCHS)
def test_a_saved_checkpoint_loads_with_the_same_logits(arch: str, tmp_path: Path) -> None:
    """What a user points ``--model`` at: transformers' ``save_pretrained`` directory (on-disk tensor
    names, e.g. a mixture's experts one by one) loads through ``load_model`` into the same model."""
    hf, ours = tiny_hf_model(arch, torch.float32, seed=13)
    loaded = load_model(str(write_tiny_checkpoint(hf, tmp_path / arch)))
    assert type(loaded.model) is DecoderModel and loaded.config == ours.cfg
    ids = _prompts(hf.config.vocab_size)[0]
    assert torch.equal(full_logits(loaded.model, ids), full_logits(ours, ids))


FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 codes


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_loads_them_dequantized(tmp_path: Path) -> None:
    """The released gpt-oss checkpoints hold their experts as MXFP4 (``*_blocks``: two e2m1 codes a byte, the
    low nibble first; ``*_scales``: a power of two per 32 values, biased by 127). Such a directory loads with
    those experts dequantized: the logits of the same model whose experts are the decoded values."""
    from safetensors.torch import load_file, save_file

    hf, _ = tiny_hf_model("gpt-oss", torch.float32, seed=13, intermediate_size=64)  # blocks of 32 inputs
    directory = write_tiny_checkpoint(hf, tmp_path / "gpt-oss-mxfp4")
    tensors = load_file(str(directory / "model.safetensors"))
    gen = torch.Generator().manual_seed(2)
    lut = torch.tensor(FP4)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, rows, cols = tensors[name].transpose(1, 2).shape  # [E, out, in]: the blocks run along the inputs
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(124, 129, (e, rows, cols // 32), generator=gen, dtype=torch.uint8)
        codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(e, rows, cols // 32, 32).long()
        values = lut[codes] * torch.pow(2.0, scales.float() - 127).unsqueeze(-1)  # [E, out, in / 32, 32]
        tensors.pop(name)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        layer, kind = int(name.split(".")[2]), name.rpartition(".")[2]
        with torch.no_grad():
            getattr(hf.model.layers[layer].mlp.experts, kind).copy_(values.reshape(e, rows, cols).transpose(1, 2))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (directory / "config.json").write_text(json.dumps(config))
    ids = list(range(3, 20))
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = full_logits(load_model(str(directory)).model, ids)
    assert (got - want).abs().max().item() < 1e-4


def test_longrope_uses_the_long_factors_past_the_original_length() -> None:
    """Positions from ``original_max_position_embeddings`` on: transformers' cos/sin of a sequence
    longer than that (its long factors); before it: those of a short one."""
    hf, ours = tiny_hf_model("phi3-longrope", torch.float32)
    rotary = hf.model.rotary_emb
    cos, sin = rope_table(ours.cfg, "global", torch.device("cpu"), torch.float32)
    x = torch.zeros(1, 1, dtype=torch.float32)
    for length in (20, 48):  # original length 32
        with torch.no_grad():
            ref_cos, ref_sin = rotary(x, torch.arange(length).unsqueeze(0))
        rows = slice(0, length) if length <= 32 else slice(32, length)
        assert torch.equal(cos[rows], ref_cos[0, rows]) and torch.equal(sin[rows], ref_sin[0, rows])
    assert not torch.equal(cos[32:48], rope_table(ours.cfg, "global", torch.device("cpu"), torch.float32)[0][:16])


def test_gemma3_layers_differ_and_the_cuda_graphs_say_so() -> None:
    """The compiled step builds a mask per window (``test_compiled.py``); the CUDA graphs one only."""
    _, ours = tiny_hf_model("gemma3", torch.float32)
    cfg = ours.cfg
    assert [cfg.layer_window(i) for i in range(3)] == [5, None, 5]
    assert [cfg.layer_rope(i) for i in range(3)] == ["local", "global", "local"]
    assert not cfg.uniform_attention
    with pytest.raises(ModelConfigError, match="--enforce-eager"):
        check_compilable(cfg, graphed=True, compiled=False)
    check_compilable(cfg, graphed=False, compiled=True)


def test_smollm3_nope_layers_and_truncation_keep_per_layer_fields() -> None:
    _, ours = tiny_hf_model("smollm3", torch.float32)
    assert [ours.cfg.layer_rope(i) for i in range(3)] == ["global", None, "global"]
    small = ours.truncated(2)
    assert small.cfg.rope_layers == (True, False) and small.layers[1].self_attn.rope_variant is None


def test_unsupported_family_features_are_one_line_errors() -> None:
    gemma3 = transformers.Gemma3Config(text_config={"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
                                                        "num_hidden_layers": 2, "num_attention_heads": 4}).to_dict()
    gemma3["architectures"] = ["Gemma3ForConditionalGeneration"]  # the multimodal checkpoints (4B and up)
    with pytest.raises(ModelConfigError, match="unknown architecture 'Gemma3ForConditionalGeneration'"):
        TargetConfig.from_hf(gemma3)
    llama = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4).to_dict()
    llama["architectures"] = ["LlamaForCausalLM"]
    llama["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(ModelConfigError, match="unsupported rope_scaling type 'dynamic'"):
        TargetConfig.from_hf(llama)
    phi3 = transformers.Phi3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, pad_token_id=None).to_dict()
    phi3["architectures"] = ["Phi3ForCausalLM"]
    phi3["rope_parameters"] = {"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0,
                               "original_max_position_embeddings": 64, "short_factor": [1.0] * 8}
    with pytest.raises(ModelConfigError, match="longrope needs long_factor: a list of 8 numbers"):
        TargetConfig.from_hf(phi3)
    phi3.pop("rope_parameters")
    phi3["partial_rotary_factor"] = 0.1  # int(16 * 0.1) = 1 dim: rope rotates pairs
    with pytest.raises(ModelConfigError, match="partial_rotary_factor"):
        TargetConfig.from_hf(phi3)


def test_a_tokens_expert_mixture_does_not_depend_on_the_other_rows() -> None:
    """On the row-invariant kernels a row's mixture output has the same bits alone, among all rows,
    and among rows that chose other experts (what makes a verification row equal its decode row)."""
    _, ours = tiny_hf_model("qwen3-moe", torch.float32, seed=4)
    make_row_invariant(ours, budget=64)
    moe = ours.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    x = torch.randn(9, ours.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        together = moe(x)
        chosen = torch.topk(moe.gate(x), 2, dim=-1).indices
        assert len(set(chosen.flatten().tolist())) == ours.cfg.num_experts, "every expert must be used"
        for i in range(9):
            assert torch.equal(moe(x[i:i + 1])[0], together[i])
        assert torch.equal(moe(x[2:7:2]), together[2:7:2])
    with pytest.raises(ModelConfigError, match="mixture of experts"):
        check_compilable(ours.cfg, graphed=False, compiled=True)


def test_an_older_config_json_gets_transformers_defaults() -> None:
    """A Gemma 3 config.json of transformers 4.x names its sliding layers by ``sliding_window_pattern``
    and its ropes by ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``; a Qwen2 one slides
    only when ``use_sliding_window`` says so: read through transformers' config classes."""
    gemma3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 16, "vocab_size": 96, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
              "sliding_window_pattern": 6, "query_pre_attn_scalar": 16}
    cfg = TargetConfig.from_hf(gemma3)
    assert [cfg.layer_window(i) for i in range(7)] == [512] * 5 + [None, 512]
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling["factor"]) == (1000000.0, 10000.0, 8.0)
    assert cfg.local_rope_scaling is None and cfg.attention_scale == 0.25
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96, "use_sliding_window": False,
             "sliding_window": 4096, "max_window_layers": 2}
    assert TargetConfig.from_hf(qwen2).uniform_attention and TargetConfig.from_hf(qwen2).layer_window(3) is None


@pytest.mark.parametrize("arch", ["llama", "olmo2", "gemma3", "gpt-oss"])
def test_the_norm_rounds_bfloat16_where_the_family_does(arch: str) -> None:
    """Llama multiplies by the norm's weight after the cast to bfloat16, OLMo 2, Gemma and gpt-oss before it:
    the bits of a bfloat16 model's norm are transformers' for each."""
    hf, ours = tiny_hf_model(arch, torch.bfloat16, seed=2)
    x = torch.randn(5, hf.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    theirs, mine = hf.model.layers[0].post_attention_layernorm, ours.layers[0].post_attention_layernorm
    with torch.no_grad():
        assert torch.equal(mine(x), theirs(x))


@pytest.mark.parametrize("mode", ["int8", pytest.param("w4a8", marks=pytest.mark.skipif(
    a8_error() is not None, reason=f"the a8 kernels (AVX512-VNNI) are unavailable: {a8_error()}"))])
@pytest.mark.parametrize("arch", ["qwen3-moe", "gpt-oss"])
def test_a_quantized_mixture_keeps_its_router_and_speculates_exactly(arch: str, mode: str) -> None:
    """Quantization replaces the attention's and every expert's projections (gpt-oss's with their biases),
    not the router (it picks the experts, as llama.cpp keeps it float); suffix speculation then gives the
    plain tokens."""
    width = {"moe_intermediate_size": 64} if arch == "qwen3-moe" else {"intermediate_size": 64}
    _, model = tiny_hf_model(arch, torch.float32, seed=14, **width)
    quantize_model(model, mode)
    moe = model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and type(moe.gate) is Linear
    if arch == "qwen3-moe":
        assert isinstance(model.layers[1].mlp.down_proj, QuantizedLinear)  # the dense layer
    assert all(isinstance(e.down_proj, QuantizedLinear) for e in moe.experts)
    prompts = _prompts(model.cfg.vocab_size)
    plain, _ = _decode(model, SpecConfig(), prompts, slots=1)
    got, engine = _decode(model, EVERY_DRAFTER["suffix"], prompts, slots=4)
    assert got == plain and sum(s.num_draft_tokens for s in engine.history) > 0
