"""``--quantization gguf`` (models/quant/gguf_blocks.py): a GGUF's own blocks, run as they are.

Every native type's blocks unpack to gguf-py's ``dequantize`` bit for bit; the kernel's output is a
float32 rendering of its block arithmetic bit for bit, and that arithmetic in float64 to float32
rounding; a file laid out as llama.cpp's Q4_K_M / Q5_K_M / Q6_K / Q8_0 (random blocks of each type:
gguf-py cannot write K-quants, any bytes with sane scales are valid blocks) runs every projection on
its own blocks, in the right rows, and speculation on it gives plain decoding's tokens; a type that is
not native is converted and said so.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from tests.helpers import (
    EVERY_DRAFTER,
    full_logits,
    run_to_completion,
    spec_drafter,
    tiny_gguf_writer,
    tiny_hf_model,
    tiny_tokenizer,
    write_tiny_checkpoint,
)
from tidespec.config import CacheConfig, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.models.loading.loader import LoadedModel, ModelLoadError, load_model, read_state_dict
from tidespec.models.quant import a8, gguf_blocks
from tidespec.models.quant.a8 import a8_error
from tidespec.models.quant.gguf_blocks import (
    BLOCKS_FILE,
    NATIVE,
    GgufBlocks,
    GgufNibLinear,
    GgufW8Linear,
    StackedLinear,
    Unpacked,
    dequantize,
    native_linear,
    unpack,
)
from tidespec.models.quant.quantize import quantization_of, quantize_model
from tidespec.sampling import SamplingParams

KERNEL_FREE = frozenset({"test_unpacked_blocks_are_gguf_py_dequantize_bit_for_bit"})  # numpy against gguf-py only


@pytest.fixture(autouse=True)
def _needs_the_a8_kernels(request: pytest.FixtureRequest) -> None:
    """Every test but the ``KERNEL_FREE`` ones runs the a8 kernels (AVX512-VNNI): skipped on a CPU without them."""
    if a8_error() is not None and request.node.originalname not in KERNEL_FREE:
        pytest.skip(f"a8 kernels unavailable: {a8_error()}")

# the byte offsets of each type's float16 scale fields (d, and dmin / m where the type has one)
SCALE_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2),
                T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q3_K: (108,), T.Q2_K: (80, 82)}
VOCAB = 261


def random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator, rms: float = 0.0) -> np.ndarray:
    """``[rows, bytes]`` of random ``qtype`` blocks: random codes and sub-block scales, float16 scales
    ~ N(0, 0.01), rescaled so that the weights' root mean square is ``rms`` when given."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    if qtype == T.MXFP4:  # an E8M0 exponent per block: scales 2^-9 .. 2^-6, shifted by whole powers for ``rms``
        raw[:, 0] = rng.integers(119, 123, size=raw.shape[0])
        if rms:
            have = float(np.sqrt(np.mean(gguf.dequantize(raw, qtype) ** 2)))
            raw[:, 0] += np.uint8(round(np.log2(rms / have)))
        return raw.reshape(rows, -1)
    scales = rng.standard_normal((raw.shape[0], 1)) * 0.01
    for off in SCALE_FIELDS[qtype]:
        raw[:, off:off + 2] = scales.astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    if rms:
        have = float(np.sqrt(np.mean(gguf.dequantize(raw, qtype) ** 2)))
        flat = raw.reshape(-1, size)
        for off in SCALE_FIELDS[qtype]:
            flat[:, off:off + 2] = (scales * rms / have).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", list(NATIVE), ids=lambda t: t.name)
def test_unpacked_blocks_are_gguf_py_dequantize_bit_for_bit(qtype: T) -> None:
    raw = random_blocks(qtype, 40, 512, np.random.default_rng(int(qtype)))
    u = unpack(raw, qtype)
    assert u.q.shape == (40, 512) and u.scale.shape == (40, 512 // u.sub)
    assert np.array_equal(dequantize(u), gguf.dequantize(raw, qtype))


def _activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's int8 activations: x [R, K] -> (qx [R, K/32, 32] int64, dx [R, K/32], sx [R, K/32])."""
    g = x.reshape(x.shape[0], -1, 32)
    dx = g.abs().amax(dim=2) / 127.0
    qx = torch.round(g * torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx)).unsqueeze(2)).clamp(-127, 127)
    return qx.to(torch.int64), dx, dx * qx.sum(dim=2)


def block_arithmetic(x: torch.Tensor, u: Unpacked, dtype: torch.dtype) -> torch.Tensor:
    """csrc/a8_tiles.h's lines in ``dtype``: per block b of 32 inputs in order, per sub-block s
    ``acc += (scale * dx) * isum``, then ``acc += mins * sx``. In float32: the kernel's bits."""
    qx, dx, sx = _activations(x)
    n, k = u.q.shape
    ns = 32 // u.sub
    q = torch.from_numpy(u.q).to(torch.int64).reshape(n, k // u.sub, u.sub)
    isum = torch.einsum("rsk,nsk->rns", qx.reshape(x.shape[0], k // u.sub, u.sub), q).to(dtype)
    scale, dx, sx = torch.from_numpy(u.scale).to(dtype), dx.to(dtype), sx.to(dtype)
    acc = torch.zeros(x.shape[0], n, dtype=dtype)
    for b in range(k // 32):
        for s in range(b * ns, b * ns + ns):
            acc = acc + (scale[:, s].unsqueeze(0) * dx[:, b:b + 1]) * isum[:, :, s]
        if u.mins is not None:
            acc = acc + torch.from_numpy(u.mins[:, b]).to(dtype).unsqueeze(0) * sx[:, b:b + 1]
    return acc


@pytest.mark.parametrize("rows", [1, 3, 5, 9])
@pytest.mark.parametrize("qtype", list(NATIVE), ids=lambda t: t.name)
def test_the_kernel_is_its_block_arithmetic(qtype: T, rows: int) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    u = unpack(random_blocks(qtype, 40, 512, rng), qtype)
    layer = native_linear(u)
    assert isinstance(layer, GgufW8Linear if qtype == T.Q8_0 else GgufNibLinear)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :32] = 0.0  # a zero block: dx = 0
    y = layer(x)
    assert torch.equal(y, block_arithmetic(x, u, torch.float32))
    exact = block_arithmetic(x, u, torch.float64)
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
    assert torch.equal(y, alone), "a row's output depends on the other rows of the call"


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0], ids=lambda t: t.name)
def test_unpacking_and_packing_in_pieces_equal_them_at_once(qtype: T, monkeypatch: pytest.MonkeyPatch) -> None:
    # a large matrix (a 128k vocabulary's head) is unpacked and packed a few million weights at a time, so
    # that loading does not hold ~40 bytes of temporaries per weight: the pieces must join to the same layer
    raw = random_blocks(qtype, 72, 512, np.random.default_rng(3 + int(qtype)))
    whole = native_linear(unpack(raw, qtype))
    monkeypatch.setattr(gguf_blocks, "UNPACK_WEIGHTS", 5 * 512)  # 5 rows a piece: 15 pieces, the last of 2
    monkeypatch.setattr(a8, "PACK_WEIGHTS", 16 * 512)  # one 16-row panel a piece (72 rows pad to 80)
    pieces = native_linear(unpack(raw, qtype))
    assert whole.state_dict().keys() == pieces.state_dict().keys()
    for name, t in whole.state_dict().items():
        assert torch.equal(t, pieces.state_dict()[name]), name


# bits per weight each layer reads (codes, high planes, scales, mins, super-scales): about the file's
BITS_READ = {T.Q4_0: 5.0, T.Q4_1: 5.0, T.Q4_K: 4.625, T.Q5_0: 5.5, T.Q5_1: 6.0, T.Q5_K: 5.625, T.Q3_K: 4.5625,
             T.Q6_K: 6.5625, T.Q8_0: 9.5, T.MXFP4: 5.5}  # MXFP4: on Q5_0's tile (the file: 4.25)


@pytest.mark.parametrize("qtype", list(NATIVE), ids=lambda t: t.name)
def test_the_scales_are_read_as_the_file_holds_them(qtype: T) -> None:
    u = unpack(random_blocks(qtype, 48, 512, np.random.default_rng(7 + int(qtype))), qtype)
    layer = native_linear(u)
    read = sum(b.numel() * b.element_size() for b in layer.buffers() if b is not None)
    assert read * 8 / (48 * 512) == BITS_READ[qtype]
    held = layer.scales.dtype
    assert held == (torch.int8 if qtype.name.endswith("_K") else torch.float16)
    layer.to(torch.float64)  # a model-wide cast leaves the kernel's scales as they are
    assert layer.scales.dtype == held


def test_scales_that_float16_or_the_factors_cannot_hold_stay_float32() -> None:
    """A legacy block whose -8 d overflows float16 (and a K-quant whose factors were tampered with) keeps
    float32 scales: the same kernel arithmetic, the bits of the reference."""
    raw = random_blocks(T.Q4_0, 16, 256, np.random.default_rng(3))
    raw.reshape(-1, GGML_QUANT_SIZES[T.Q4_0][1])[0, :2] = np.array([30000.0], dtype=np.float16).view(np.uint8)
    u = unpack(raw, T.Q4_0)
    k = unpack(random_blocks(T.Q4_K, 16, 256, np.random.default_rng(4)), T.Q4_K)
    assert k.factors is not None
    bent = dataclasses.replace(k, factors=dataclasses.replace(k.factors, codes=k.factors.codes + 1))
    for case in (u, bent):
        layer = native_linear(case)
        assert layer.scales.dtype == torch.float32 and getattr(layer, "scale_super", None) is None
        x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
        assert torch.equal(layer(x), block_arithmetic(x, case, torch.float32))


# llama.cpp's mixes (llama_model_quantize's choices for a small model, simplified): the tensor kind -> type
MIXES: dict[str, dict[str, T]] = {
    "Q4_K_M": {"default": T.Q4_K, "attn_v": T.Q6_K, "ffn_down": T.Q6_K, "token_embd": T.Q4_K},
    "Q5_K_M": {"default": T.Q5_K, "attn_v": T.Q6_K, "ffn_down": T.Q6_K, "token_embd": T.Q5_K},
    "Q6_K": {"default": T.Q6_K},
    "Q8_0": {"default": T.Q8_0},
    "legacy": {"default": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q5_0, "attn_output": T.Q5_1, "ffn_up": T.Q3_K,
               "ffn_down": T.Q8_0},
    "with-Q2_K": {"default": T.Q4_K, "ffn_up": T.Q2_K},
}
LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def write_mix_gguf(path: Path, mix: dict[str, T], seed: int = 0) -> tuple[Path, dict[T, int]]:
    """A tiny tied Llama (hidden 256: whole K-quant super-blocks) whose matrices are random blocks of
    the mix's types; returns the file and how many matrices it holds per type."""
    hf, _ = tiny_hf_model("llama", torch.float32, seed=seed, vocab_size=VOCAB, tie_word_embeddings=True,
                          hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    cfg, rng = hf.config, np.random.default_rng(seed)
    w = tiny_gguf_writer(hf, path, "llama")
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    counts: dict[T, int] = {}

    def add(name: str, rows: int, cols: int) -> None:
        qtype = mix.get(name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0], mix["default"])
        w.add_tensor(name, random_blocks(qtype, rows, cols, rng, rms=cols ** -0.5), raw_dtype=qtype)
        counts[qtype] = counts.get(qtype, 0) + 1

    add("token_embd.weight", VOCAB, cfg.hidden_size)
    w.add_tensor("output_norm.weight", np.ones(cfg.hidden_size, np.float32))
    for i in range(cfg.num_hidden_layers):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(cfg.hidden_size, np.float32))
        for hf_name, name in LAYER_NAMES.items():
            out_f, in_f = hf.get_submodule(f"model.layers.{i}.{hf_name}").weight.shape
            add(f"blk.{i}.{name}.weight", out_f, in_f)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, counts


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TIDESPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _projections(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules()
            if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")) or name == "lm_head"}


def _decode(model: torch.nn.Module, spec: SpecConfig, prompts: list[list[int]], slots: int) -> tuple[list[list[int]], int]:
    cfg = EngineConfig(cache=CacheConfig(max_model_len=64, max_num_seqs=slots), spec=spec)
    engine = LLMEngine(model, tiny_tokenizer(VOCAB), cfg, drafter=spec_drafter(spec, model, slots, 64))
    ids = [engine.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts]
    done = run_to_completion(engine)
    return [done[i].token_ids for i in ids], sum(s.num_draft_tokens for s in engine.history)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_a_gguf_runs_its_own_blocks_in_the_right_rows(mix: str, tmp_path: Path, private_cache: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    path, counts = write_mix_gguf(tmp_path / f"tiny.{mix}.gguf", MIXES[mix])
    with caplog.at_level(logging.INFO, logger="tidespec.models.loading.loader"):
        floats = load_model(str(path)).model  # the file dequantized by gguf-py
        assert any("blocks run dequantized to float32 (--quantization gguf" in r.getMessage() for r in caplog.records)
        unread: list[set[str]] = []
        with pytest.MonkeyPatch.context() as patch:  # what the loader leaves unread: the natively run parts
            spy = GgufBlocks.read_natively
            patch.setattr(GgufBlocks, "read_natively", lambda self, *a: unread.append(spy(self, *a)) or unread[-1])
            native = load_model(str(path), quantization="gguf").model
        with pytest.MonkeyPatch.context() as patch:  # control: every float weight read
            patch.setattr(GgufBlocks, "read_natively", lambda self, *a: set())
            read_all = load_model(str(path), quantization="gguf").model
    assert quantization_of(native) == "gguf"
    assert unread and unread[0], "no projection left unread"
    assert all(n.startswith("model.layers.") and n.endswith("_proj.weight") for n in unread[0])
    ours, control = native.state_dict(), read_all.state_dict()
    assert ours.keys() == control.keys() and all(torch.equal(ours[k], control[k]) for k in ours)
    converted = {t: c for t, c in counts.items() if t not in NATIVE}
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("GGUF blocks"))
    for qtype, count in counts.items():
        assert (f"{qtype.name} x{count}" in summary.partition("; ")[2 if qtype in converted else 0]), summary
    if converted:
        assert any(r.levelno == logging.WARNING and "Q2_K" in r.getMessage() for r in caplog.records)
    if mix == "Q4_K_M":  # q|k in Q4_K beside v in Q6_K: two kernels side by side
        qkv = native.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, StackedLinear) and [p.type_name for p in qkv.parts] == ["Q4_K", "Q6_K"]
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    float_layers = _projections(floats)
    for name, layer in _projections(native).items():
        ref = float_layers[name]
        xi = x[:, :ref.weight.shape[1]]
        want = xi.double() @ ref.weight.double().T  # the file's weights: an error of int8 activations only
        got = layer(xi).double()
        assert ((got - want).norm() / want.norm()).item() < 0.03, name  # a misplaced row or part: O(1)


def test_gguf_mode_converts_without_the_floats_it_never_reads(tmp_path: Path, private_cache: Path) -> None:
    # a fresh cache, --quantization gguf first: the conversion keeps the native projections as blocks only
    # (Q2_K's ffn_up, converted to Q8_0 at load, keeps its floats); the model equals the one from the full
    # conversion, and the blocks-only matrices read as floats are the full conversion's bit for bit
    path, _ = write_mix_gguf(tmp_path / "tiny.with-Q2_K.gguf", MIXES["with-Q2_K"])
    light = load_model(str(path), quantization="gguf")
    assert Path(light.path).name.endswith("-blocks")
    floats = {n for n, f in read_state_dict(Path(light.path))._where.items() if f.name != BLOCKS_FILE}
    assert "model.layers.0.mlp.up_proj.weight" in floats and "model.embed_tokens.weight" in floats
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight", "down_proj.weight")) for n in floats)
    full = load_model(str(path))  # a float model needs the full conversion: made beside the other
    assert not Path(full.path).name.endswith("-blocks")
    again = load_model(str(path), quantization="gguf")
    assert again.path == full.path  # the full conversion serves every mode once it exists
    ours, control = light.model.state_dict(), again.model.state_dict()
    assert ours.keys() == control.keys() and all(torch.equal(ours[k], control[k]) for k in ours)
    sd_light, sd_full = read_state_dict(Path(light.path)), read_state_dict(Path(full.path))
    assert set(sd_light) == set(sd_full)
    for name in sd_full:
        assert torch.equal(sd_light[name], sd_full[name]), name


@pytest.mark.parametrize("mix", ["Q4_K_M", "legacy"])
def test_speculation_on_a_gguf_gives_the_plain_tokens(mix: str, tmp_path: Path, private_cache: Path) -> None:
    path, _ = write_mix_gguf(tmp_path / f"tiny.{mix}.gguf", MIXES[mix], seed=3)
    model = load_model(str(path), quantization="gguf").model
    gen = torch.Generator().manual_seed(0)
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4, torch.randint(3, VOCAB, (6,), generator=gen).tolist() * 2]
    plain, _ = _decode(model, SpecConfig(), prompts, slots=1)
    for slots in (1, 3):
        for drafter in ("suffix", "draft-model"):
            got, drafted = _decode(model, EVERY_DRAFTER[drafter], prompts, slots)
            assert got == plain and drafted > 0, (drafter, slots)


def test_gguf_mode_on_a_checkpoint_without_blocks_is_a_one_line_error(tmp_path: Path) -> None:
    hf, _ = tiny_hf_model("llama", torch.float32, seed=1)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    with pytest.raises(ModelLoadError, match="not loaded from a quantized .gguf file") as exc:
        load_model(str(ckpt), quantization="gguf")
    assert "\n" not in str(exc.value)


@pytest.mark.integration
def test_the_embedded_q4_1_file_runs_as_w4a8_bit_for_bit(embedded: LoadedModel) -> None:
    """w4a8 re-quantizes the embedded file's dequantized Q4_1 layers (and Q8_0 head) to the blocks
    they came from; gguf takes the blocks themselves: the same weights, so the exactness subset's
    w4a8 cells hold for gguf on this file."""
    native, requantized = copy.deepcopy(embedded.model), copy.deepcopy(embedded.model)
    blocks = quantize_model(native, "gguf", checkpoint=Path(embedded.path))
    quantize_model(requantized, "w4a8")
    assert blocks is not None and not blocks.converted and set(blocks.native) == {"Q4_1", "Q8_0"}
    mine, theirs = native.layers[3].mlp.down_proj, requantized.layers[3].mlp.down_proj
    assert torch.equal(mine.packed, theirs.packed)
    assert torch.equal(mine.scales, theirs.dm[:, :, 0].float()) and torch.equal(mine.mins, theirs.dm[:, :, 1].float())
    ids = embedded.tokenizer("def fib(n):\n    return fib(n - 1) +")["input_ids"]
    assert torch.equal(full_logits(native, ids), full_logits(requantized, ids))
