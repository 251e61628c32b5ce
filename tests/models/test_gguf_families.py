"""GGUF files of the families beyond Llama load as the model they were written from.

Each file is written with gguf-py as llama.cpp's converter lays it out (its metadata keys, its
tensor names, Gemma's norm weights stored plus one, a mixture's experts as [E, out, in] tensors,
Phi-3's fused q|k|v and gate|up), from a tiny transformers model whose config follows what llama.cpp
assumes where a GGUF says nothing (Gemma's query scale, Gemma 3's sliding pattern of 6, Qwen3-MoE's
renormalized top k); an F32 file is lossless, so the converted model's logits equal the original's
to float32 rounding; a Q8_0 file's weights are its blocks dequantized. A K-quant file (gguf-py cannot
write K-quants) holds random blocks that the tiny model's matrices are set to, dequantized: its float
load is that model, and ``--quantization gguf`` runs it on the blocks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers

from tests.helpers import EVERY_DRAFTER, full_logits, tiny_gguf_writer, tiny_hf_model
from tests.models.test_gguf_blocks import MIXES, _decode, _projections, random_blocks
from tidespec.config import SpecConfig
from tidespec.models.families.decoder import DecoderModel
from tidespec.models.loading.loader import load_model, read_state_dict
from tidespec.models.quant.a8 import a8_error
from tidespec.models.quant.gguf_blocks import BLOCKS_FILE
from tidespec.models.target import TargetConfig

VOCAB = 261  # 256 bytes, 2 merges, 3 control tokens
# llama.cpp writes a Mixtral as "llama" with experts (and q/k permuted as for any llama)
GGUF_ARCH = {"gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "qwen3-moe": "qwen3moe", "mixtral": "llama",
             "olmo2": "olmo2", "granite": "granite", "smollm3": "smollm3", "qwen2": "qwen2", "qwen3": "qwen3",
             "gpt-oss": "gpt-oss"}
PERMUTED_QK = ("llama", "granite", "smollm3")  # llama.cpp's LlamaModel and its subclasses reorder q/k rows
# tiny configs in llama.cpp's conventions: a GGUF has no query_pre_attn_scalar (llama.cpp: head_dim
# below 27B), no layer types (Gemma 2 alternates, Gemma 3 slides 5 of every 6), Gemma 3's global
# rope scaled linearly as its metadata says; Qwen3-MoE's top k renormalized
CONFIGS: dict[str, dict[str, Any]] = {
    "gemma2": dict(num_hidden_layers=3, query_pre_attn_scalar=16, layer_types=None, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0),
    "gemma3": dict(num_hidden_layers=7, query_pre_attn_scalar=16, layer_types=None, sliding_window=5,
                   rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                    "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1000000.0)}),
    "phi3": dict(partial_rotary_factor=1.0),
    "qwen3-moe": dict(mlp_only_layers=[], moe_intermediate_size=64),  # Q8_0 rows: multiples of 32
    "mixtral": dict(intermediate_size=64),
    "olmo2": {},
    "granite": {},
    "smollm3": dict(num_hidden_layers=5, no_rope_layer_interval=4),  # llama.cpp: a NoPE layer every 4th
    "qwen2": {},
    "qwen3": {},
    # llama.cpp: layers alternate sliding and global from layer 0, SwiGLU clamped at 7, YaRN's betas 32 and 1
    # and (as the released checkpoints' config.json says) no truncation of its ramp
    "gpt-oss": dict(intermediate_size=64, swiglu_limit=7.0, layer_types=None, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
        original_max_position_embeddings=32, truncate=False)),
}
# K-quant files: every matrix's input width a multiple of 256 (a K-quant super-block), as in real models
KQUANT_SHAPE: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "head_dim": 64}
KQUANT_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma2": {"query_pre_attn_scalar": 64}, "gemma3": {"query_pre_attn_scalar": 64},
    "qwen3-moe": {"moe_intermediate_size": 256}, "mixtral": {"intermediate_size": 256},
    "gpt-oss": {"intermediate_size": 256}}
RowBlocks = dict[bytes, tuple[gguf.GGMLQuantizationType, np.ndarray]]  # a float32 row's bytes -> (type, its blocks)


def random_blocks_in_place(hf: transformers.PreTrainedModel, mix: dict[str, gguf.GGMLQuantizationType],
                           seed: int) -> RowBlocks:
    """Replace every matrix llama.cpp quantizes (embedding, projections, experts; not norms, biases or
    a router) by random blocks of the type ``mix`` gives its kind, dequantized by gguf-py; returns each
    row's blocks, so that a writer can write a matrix whose rows it reordered or split as their blocks."""
    rng, table = np.random.default_rng(seed), {}
    with torch.no_grad():
        for key, param in hf.named_parameters():
            if not (key.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight")) or ".experts." in key):
                continue
            if key.endswith("_bias"):  # gpt-oss's expert biases stay floats
                continue
            # gpt-oss holds its experts transposed ([E, in, out]): the file's rows are the columns
            p = param.transpose(-1, -2) if _oss_experts(hf) and ".experts." in key else param
            kind = ("attn_v" if key.endswith(".v_proj.weight") else "ffn_down" if "down_proj" in key
                    else "token_embd" if "embed_tokens" in key else "default")
            qtype = mix.get(kind, mix["default"])
            raw = random_blocks(qtype, p.numel() // p.shape[-1], p.shape[-1], rng, rms=p.shape[-1] ** -0.5)
            rows = gguf.dequantize(raw, qtype)
            p.copy_(torch.from_numpy(rows).reshape(p.shape))
            table.update((row.tobytes(), (qtype, r)) for row, r in zip(rows, raw, strict=True))
    return table


def _oss_experts(hf: transformers.PreTrainedModel) -> bool:
    """Whether ``hf``'s experts are gpt-oss's: transposed, gate and up interleaved, with biases."""
    return hf.config.model_type == "gpt_oss"


def write_family_gguf(hf: transformers.PreTrainedModel, arch: str, path: Path,
                      qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
                      blocks: RowBlocks | None = None, template: str | None = None,
                      expert_qtype: gguf.GGMLQuantizationType | None = None) -> Path:
    """``hf`` as llama.cpp's converter writes ``arch``: matrices in ``qtype`` (a mixture's experts in
    ``expert_qtype`` when given: gpt-oss's files hold them in MXFP4), or, with ``blocks``
    (``random_blocks_in_place``), each matrix as the blocks its rows were dequantized from; with
    ``template``, that chat template in ``tokenizer.chat_template``."""
    cfg, g = hf.config, GGUF_ARCH[arch]
    w = tiny_gguf_writer(hf, path, g)
    if template is not None:
        w.add_chat_template(template)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gemma3":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if arch == "qwen3-moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "mixtral":
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "gpt-oss":
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "granite":
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    w.add_pad_token_id(VOCAB - 3)

    def add(name: str, t: np.ndarray) -> None:
        rows = t.reshape(-1, t.shape[-1]) if t.ndim >= 2 else None
        kind = expert_qtype if expert_qtype is not None and "_exps.weight" in name else qtype
        if blocks is not None and rows is not None and rows[0].tobytes() in blocks:  # the rows' own blocks
            kind = blocks[rows[0].tobytes()][0]
            raw = np.stack([blocks[r.tobytes()][1] for r in rows])
            w.add_tensor(name, raw.reshape(*t.shape[:-1], -1), raw_dtype=kind)
        elif t.ndim >= 2 and kind != gguf.GGMLQuantizationType.F32 and not name.endswith(".bias"):
            w.add_tensor(name, gguf.quantize(np.ascontiguousarray(t), kind), raw_dtype=kind)
        else:
            w.add_tensor(name, np.ascontiguousarray(t))

    ids = {n: a for a, n in gguf.MODEL_ARCH_NAMES.items()}
    names = gguf.get_tensor_name_map(ids[g], cfg.num_hidden_layers)
    for key, value in hf.state_dict().items():
        t = value.detach().float().numpy()
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if key.endswith(".sinks"):  # gpt-oss: [n_h] per layer
            add(f"{names.get_name(key)}.weight", t)
            continue
        if _oss_experts(hf) and ".mlp.experts." in key:  # [E, H, 2I] gate|up interleaved, [E, I, H] down
            blk, kind = "blk." + key.split(".")[2], key.rpartition(".")[2]
            suffix = "bias" if kind.endswith("_bias") else "weight"
            t = t if suffix == "bias" else t.swapaxes(1, 2)  # [E, out, in] as llama.cpp holds a matrix
            if kind.startswith("gate_up_proj"):
                add(f"{blk}.ffn_gate_exps.{suffix}", t[:, 0::2])
                add(f"{blk}.ffn_up_exps.{suffix}", t[:, 1::2])
            else:
                add(f"{blk}.ffn_down_exps.{suffix}", t)
            continue
        if key.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] -> ffn_gate_exps, ffn_up_exps [E, I, H]
            blk = "blk." + key.split(".")[2]
            gate, up = np.split(t, 2, axis=1)
            add(f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            add(f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(up))
            continue
        if key.endswith("mlp.experts.down_proj"):
            add(f"blk.{key.split('.')[2]}.ffn_down_exps.weight", t)
            continue
        base, _, suffix = key.rpartition(".")
        name = names.get_name(base)
        assert name is not None, key
        if arch.startswith("gemma") and key.endswith("norm.weight"):
            t = t + 1.0  # llama.cpp's Gemma converter stores 1 + w
        if g in PERMUTED_QK and key.endswith(("q_proj.weight", "k_proj.weight")):  # its rope's row order
            heads = cfg.num_attention_heads if key.endswith("q_proj.weight") else cfg.num_key_value_heads
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(t.shape)
        add(f"{name}.{suffix}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TIDESPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("arch", sorted(GGUF_ARCH))
def test_a_family_gguf_loads_as_the_model_it_was_written_from(arch: str, qtype: gguf.GGMLQuantizationType,
                                                             tmp_path: Path, private_cache: Path) -> None:
    hf, ours = tiny_hf_model(arch, torch.float32, seed=9, vocab_size=VOCAB, **CONFIGS[arch])
    path = write_family_gguf(hf, arch, tmp_path / f"tiny-{arch}.{qtype.name}.gguf", qtype)
    loaded = load_model(str(path))
    assert loaded.config.architecture == ours.cfg.architecture
    for field in ("sliding_layers", "sliding_window", "attn_logit_softcap", "final_logit_softcap", "rope_scaling", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "tie_word_embeddings",
                  "rope_layers", "qk_norm", "norm_placement"):
        assert getattr(loaded.config, field) == getattr(ours.cfg, field), field
    for field in ("rms_norm_eps", "rope_theta", "attention_scale", "embedding_scale", "residual_scale",
                  "logits_divisor"):  # a GGUF holds its floats in float32
        assert getattr(loaded.config, field) == pytest.approx(getattr(ours.cfg, field), rel=1e-6), field
    if qtype == gguf.GGMLQuantizationType.F32:  # lossless: the same model
        ids = list(range(5, 25))
        assert (full_logits(loaded.model, ids) - full_logits(ours, ids)).abs().max().item() < 1e-4
    else:  # the file's blocks, dequantized as gguf-py does
        embed = hf.model.embed_tokens.weight.detach().numpy()
        want = torch.from_numpy(gguf.dequantize(gguf.quantize(embed, qtype), qtype))
        assert torch.equal(loaded.model.embed_tokens.weight, want)


KQUANT_IDS = list(range(5, 25))
NO_A8 = pytest.mark.skipif(a8_error() is not None, reason=f"the a8 kernels (AVX512-VNNI) are unavailable: {a8_error()}")


def _k_quant_file(arch: str, mix: str, tmp_path: Path) -> tuple[RowBlocks, Path, torch.Tensor]:
    """A tiny ``arch`` written as llama.cpp's ``mix``: its blocks, the file, and the logits [20, V] of
    the model whose matrices are those blocks dequantized (for ids 5..24)."""
    hf, _ = tiny_hf_model(arch, torch.float32, seed=9, vocab_size=VOCAB,
                          **{**CONFIGS[arch], **KQUANT_SHAPE, **KQUANT_CONFIGS.get(arch, {})})
    blocks = random_blocks_in_place(hf, MIXES[mix], seed=len(arch))
    ours = DecoderModel(TargetConfig.from_hf(hf.config.to_dict()))
    ours.load_hf_state_dict(hf.state_dict())
    path = write_family_gguf(hf, arch, tmp_path / f"tiny-{arch}.{mix}.gguf", blocks=blocks)
    return blocks, path, full_logits(ours.eval(), KQUANT_IDS)


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M", "Q6_K"])
@pytest.mark.parametrize("arch", sorted(GGUF_ARCH))
def test_a_family_k_quant_gguf_loads_as_its_blocks_dequantized(arch: str, mix: str, tmp_path: Path,
                                                               private_cache: Path) -> None:
    # llama.cpp's K-quant mixes of every family: the file's weights are its blocks, so the float load is
    # the model whose matrices are those blocks dequantized
    _, path, want = _k_quant_file(arch, mix, tmp_path)
    assert (full_logits(load_model(str(path)).model, KQUANT_IDS) - want).abs().max().item() < 1e-4


@NO_A8
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M", "Q6_K"])
@pytest.mark.parametrize("arch", sorted(GGUF_ARCH))
def test_a_family_k_quant_gguf_runs_its_own_blocks(arch: str, mix: str, tmp_path: Path, private_cache: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    # --quantization gguf runs every projection, a mixture's experts included, on the blocks (within int8
    # activations' error of the floats), from a conversion that wrote none of their floats
    blocks, path, want = _k_quant_file(arch, mix, tmp_path)
    ids = KQUANT_IDS
    with caplog.at_level(logging.INFO, logger="tidespec.models.loading.loader"):
        light = load_model(str(path), quantization="gguf")  # a fresh cache: the conversion without floats
    native = light.model
    stored = read_state_dict(Path(light.path))._where
    assert not [n for n, f in stored.items() if f.name != BLOCKS_FILE and n.endswith("_proj.weight")
                and n.startswith("model.layers.")], "a projection's floats written beside its blocks"
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("GGUF blocks"))
    assert "; " not in summary and all(f"{t.name} x" in summary for t in {q for q, _ in blocks.values()}), summary
    floats = load_model(str(path)).model  # the full conversion: the model the blocks are
    assert (full_logits(floats, ids) - want).abs().max().item() < 1e-4
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    float_layers = _projections(floats)
    for name, layer in _projections(native).items():  # each on its blocks: a misplaced row or part is O(1)
        ref = float_layers[name]
        xi = x[:, :ref.weight.shape[1]]
        bias = None if ref.bias is None else ref.bias.double()
        want_i = torch.nn.functional.linear(xi.double(), ref.weight.double(), bias)
        assert ((layer(xi).double() - want_i).norm() / want_i.norm()).item() < 0.03, name
    got = full_logits(native, ids)  # and the model end to end: int8 activations' error through every layer
    assert ((got - want).norm() / want.norm()).item() < 0.15


def test_a_gpt_oss_file_with_mxfp4_experts_loads_them_and_says_what_they_run_as(
        tmp_path: Path, private_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    # what gpt-oss files hold: the experts in MXFP4 (run on the w8 tile, their values exactly, no floats
    # written), the rest in Q8_0; the float load's experts are the MXFP4 blocks dequantized as gguf-py does
    hf, _ = tiny_hf_model("gpt-oss", torch.float32, seed=9, vocab_size=VOCAB, **CONFIGS["gpt-oss"])
    mx = gguf.GGMLQuantizationType.MXFP4
    path = write_family_gguf(hf, "gpt-oss", tmp_path / "tiny-gpt-oss.mxfp4.gguf", gguf.GGMLQuantizationType.Q8_0,
                             expert_qtype=mx)
    native = None
    if a8_error() is None:
        with caplog.at_level(logging.INFO, logger="tidespec.models.loading.loader"):
            light = load_model(str(path), quantization="gguf")  # a fresh cache: the conversion without floats
        native = light.model
        summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("GGUF blocks"))
        experts = 3 * 4 * 3  # layers x experts x (gate, up, down)
        assert "Q8_0 x" in summary and f"MXFP4 x{experts}" in summary and "; " not in summary, summary
        stored = read_state_dict(Path(light.path))._where
        assert not [n for n, f in stored.items() if f.name != BLOCKS_FILE and n.endswith("_proj.weight")
                    and n.startswith("model.layers.")], "a projection's floats written beside its blocks"
    floats = load_model(str(path)).model
    up = hf.model.layers[1].mlp.experts.gate_up_proj.detach()[2].t().numpy()  # expert 2: [2I, H] interleaved
    want = torch.from_numpy(gguf.dequantize(gguf.quantize(np.ascontiguousarray(up[0::2]), mx), mx))
    got = floats.layers[1].mlp.experts[2].gate_up_proj.weight[:up.shape[0] // 2]
    assert torch.equal(got, want) and not torch.equal(got, torch.from_numpy(up[0::2]))
    if native is not None:  # the blocks' values exactly: within int8 activations' error of the float load
        want_logits = full_logits(floats, KQUANT_IDS)
        assert ((full_logits(native, KQUANT_IDS) - want_logits).norm() / want_logits.norm()).item() < 0.15
        prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4, list(range(40, 52))]
        plain, _ = _decode(native, SpecConfig(), prompts, slots=1)
        for slots in (1, 3):  # each expert on its MXFP4 blocks over whatever rows chose it: exact speculation
            got, drafted = _decode(native, EVERY_DRAFTER["suffix"], prompts, slots)
            assert got == plain and drafted > 0, slots


@NO_A8
@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral", "gpt-oss"])
def test_speculation_on_a_mixtures_own_blocks_gives_the_plain_tokens(arch: str, tmp_path: Path,
                                                                    private_cache: Path) -> None:
    # each expert runs its blocks over whatever rows chose it: a verification row gets its decode row's bits
    hf, _ = tiny_hf_model(arch, torch.float32, seed=5, vocab_size=VOCAB,
                          **{**CONFIGS[arch], **KQUANT_SHAPE, **KQUANT_CONFIGS.get(arch, {})})
    path = write_family_gguf(hf, arch, tmp_path / f"tiny-{arch}.gguf", blocks=random_blocks_in_place(
        hf, MIXES["Q4_K_M"], seed=5))
    model = load_model(str(path), quantization="gguf").model
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4, list(range(40, 52))]
    plain, _ = _decode(model, SpecConfig(), prompts, slots=1)
    for slots in (1, 3):
        got, drafted = _decode(model, EVERY_DRAFTER["suffix"], prompts, slots)
        assert got == plain and drafted > 0, slots
