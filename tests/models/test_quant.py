"""Weight-only quantization (``tidespec/models/quant/quantize.py``): the schemes' error bounds, the kernels
against a dequantized reference, row independence (what losslessness rests on), a quantized
model against float, the errors, and speculative decoding lossless w.r.t. the quantized target."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import full_logits, tiny_llama, tiny_tokenizer
from tests.speculative.test_spec_lossless import PROMPTS, V, generate, generate_in_batches
from tidespec.config import ConfigError, EngineConfig, ModelConfig, SpecConfig
from tidespec.models.quant.a8 import W8A8Linear, a8_error
from tidespec.models.quant.quantize import (
    LAYER_PROJECTIONS,
    Int4Linear,
    Int8Linear,
    QuantizationError,
    dequantize_int4,
    dequantize_int8,
    quantization_of,
    quantize_int4,
    quantize_int8,
    quantize_linears,
    quantize_model,
)
from tidespec.models.target import ModelConfigError
from tidespec.speculative.drafters.draft_model import DraftModelOptions


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0] *= 40.0  # rows and groups of very different ranges
    w[1, : k // 2] = 0.0
    return w


# ----------------------------------------------------------------------------- the schemes


def test_int8_error_is_at_most_half_a_step_per_channel() -> None:
    w = _weight(64, 96)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == (64, 96) and s.dtype == torch.bfloat16 and s.shape == (64,)
    err = (dequantize_int8(q, s) - w).abs()
    assert (err <= 0.5 * s.float().unsqueeze(1) * (1 + 1e-6)).all()
    assert int(q.abs().max()) >= 126  # the range is used: the largest |w| of a row maps near 127


@pytest.mark.parametrize("group", [32, 64])
def test_int4_error_is_at_most_half_a_step_per_group(group: int) -> None:
    w = _weight(48, 128, seed=1)
    q, s, z = quantize_int4(w, group)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15
    assert s.shape == z.shape == (48, 128 // group) and s.dtype == z.dtype == torch.bfloat16
    err = (dequantize_int4(q, s, z, group) - w).abs().reshape(48, -1, group)
    # half a step, plus the bfloat16 rounding of the zero point that q was computed against
    bound = 0.5 * s.float() + z.float().abs() * 2.0 ** -8 + 1e-7
    assert (err <= bound.unsqueeze(2)).all()
    coarse = (dequantize_int8(*quantize_int8(w)) - w).abs().mean()
    assert err.mean() > coarse  # int4 is the coarser scheme: the bound is not vacuous


def test_int4_group_must_divide_the_input_size() -> None:
    with pytest.raises(QuantizationError, match="does not divide the input size 96"):
        quantize_int4(torch.zeros(16, 96), 64)


# ----------------------------------------------------------------------------- the modules (kernels)


def _reference(x: torch.Tensor, w_deq: torch.Tensor) -> torch.Tensor:
    """bfloat16 activations times the dequantized weight in float32 — what the kernels compute."""
    return x.to(torch.bfloat16).float() @ w_deq.t()


@pytest.mark.parametrize("n", [96, 40])  # 40: int4 pads the rows to 48 and slices the padding off
@pytest.mark.parametrize("rows", [7, 70])
def test_modules_match_the_dequantized_weight(n: int, rows: int) -> None:
    w, bias = _weight(n, 128, seed=2), torch.randn(n) * 0.1
    x = torch.randn(rows, 128)
    int8 = Int8Linear.from_weight(w, bias)
    q, s, z = quantize_int4(w, 32)
    int4 = Int4Linear.from_weight(w, 32, bias)
    for mod, deq in ((int8, dequantize_int8(*quantize_int8(w))), (int4, dequantize_int4(q, s, z, 32))):
        y = mod.forward(x)
        ref = _reference(x, deq) + bias
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        assert torch.allclose(y, ref, atol=1e-2 * float(ref.abs().max()), rtol=0)  # bfloat16 output rounding
        assert mod.forward(x.double()).dtype == torch.float64


def test_a_row_does_not_depend_on_the_rows_beside_it() -> None:
    """Speculation verifies 1 + gamma rows per sequence and several sequences per call where plain
    decoding multiplies one row: the kernels must give each row the same bits either way."""
    w = _weight(96, 128, seed=3)
    x = torch.randn(37, 128)
    for mod in (Int8Linear.from_weight(w), Int4Linear.from_weight(w, 64)):
        batched = mod.forward(x)
        for rows in (slice(0, 1), slice(5, 6), slice(3, 8), slice(10, 27)):
            assert torch.equal(mod.forward(x[rows]), batched[rows])


def test_model_dtype_casts_leave_the_kernel_scales_in_bfloat16() -> None:
    model = tiny_llama(dtype=torch.float32)
    quantize_model(model, "int8")
    model.to(torch.float64)
    proj = model.layers[0].mlp.down_proj
    assert isinstance(proj, Int8Linear) and proj.scales.dtype == torch.bfloat16 and proj.qweight.dtype == torch.int8
    assert full_logits(model, [3, 4, 5]).dtype == torch.float64


# ----------------------------------------------------------------------------- a quantized model


def _fake_quantized(model, mode: str):
    """A float copy of ``model`` whose projection and head weights are replaced by their dequantized
    values: the same weights as the quantized model, float64 activations everywhere."""
    fake = copy.deepcopy(model)
    with torch.no_grad():
        for layer in fake.layers:
            for path in LAYER_PROJECTIONS:
                w = layer.get_submodule(path).weight
                w.copy_(dequantize_int8(*quantize_int8(w)) if mode == "int8" else dequantize_int4(*quantize_int4(w, 32), 32))
        w = fake.lm_head.weight  # int8 in both modes
        w.copy_(dequantize_int8(*quantize_int8(w)))
    return fake


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_equals_the_float_model_with_its_weights(mode: str) -> None:
    """The kernels, packing and scale layout at model level: a quantized tiny model's logits are the
    float64 model's with the dequantized weights, up to the bfloat16 activations of the matmuls
    (~2 % of the largest logit here; a swapped scale/zero or a mis-packed nibble gives ~100 %)."""
    ref_model = tiny_llama(V, layers=3, seed=2, dtype=torch.float64)
    ids = list(range(3, 40))
    fake = full_logits(_fake_quantized(ref_model, mode), ids)
    model = copy.deepcopy(ref_model)
    quantize_model(model, mode, 32)
    got = full_logits(model, ids)
    assert quantization_of(model) == ("int8" if mode == "int8" else "int4-g32")
    assert float((got - fake).abs().max() / fake.abs().max()) < 0.04
    assert float((got.argmax(-1) == fake.argmax(-1)).double().mean()) >= 0.9
    ref = full_logits(ref_model, ids)  # and int8 stays near the unquantized model (int4 of random weights does not)
    if mode == "int8":
        assert float((got - ref).abs().max() / ref.abs().max()) < 0.06


def test_every_projection_and_the_head_are_replaced_and_the_embedding_stays_real() -> None:
    model = tiny_llama(tie_word_embeddings=True, dtype=torch.float32)
    emb = model.embed_tokens.weight
    quantize_model(model, "int4", 32)
    for layer in model.layers:
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(mod, Int4Linear)
    assert isinstance(model.lm_head, Int8Linear)  # the head is int8 in both modes
    assert model.embed_tokens.weight is emb and emb.dtype == torch.float32 and model.dtype == torch.float32
    draft = model.truncated(1)  # a draft model shares the quantized layers and head
    assert draft.lm_head is model.lm_head and full_logits(draft, [3, 4]).shape == (2, 64)
    assert quantization_of(tiny_llama()) == "none"


def test_bad_group_size_and_device_are_one_line_errors() -> None:
    model = tiny_llama(hidden_size=48, num_heads=4, head_dim=12)  # input sizes 48 (hidden, heads) and 64
    with pytest.raises(QuantizationError, match=r"int4 group size 32 does not divide .*use --quantization int8") as e:
        quantize_model(model, "int4", 32)
    assert "\n" not in str(e.value) and isinstance(e.value, ModelConfigError)
    assert isinstance(model.layers[0].mlp.down_proj, torch.nn.Linear)  # nothing was touched
    with pytest.raises(QuantizationError, match="group size must be one of 32, 64, 128, 256"):
        quantize_model(tiny_llama(), "int4", 16)
    with pytest.raises(QuantizationError, match="must be one of none, int8, int4"):
        quantize_model(tiny_llama(), "int3", 32)
    done = tiny_llama()
    quantize_model(done, "int8")
    with pytest.raises(QuantizationError, match=r"already quantized \(int8\)"):
        quantize_model(done, "int4", 32)
    meta = tiny_llama().to("meta")
    with pytest.raises(QuantizationError, match="needs --device cpu"):
        quantize_model(meta, "int8")


def test_quantize_linears_reaches_every_linear_of_another_network() -> None:
    """The EAGLE-3 head's int8/int4 drafting copy: every nn.Linear at any depth, the output layer
    int8 under int4; a group that does not divide an input size or a non-CPU weight is refused
    before anything changes."""
    from tidespec.models.eagle3.head import Eagle3Config, Eagle3Head
    target = tiny_llama(V, layers=4)
    head = Eagle3Head(Eagle3Config.for_target(target.cfg, num_layers=2, fusion="gated")).double()
    linears = sum(isinstance(m, torch.nn.Linear) for m in head.modules())
    assert quantize_linears(head, "int4", 32, int8_names=("lm_head",)) == linears == 12
    assert isinstance(head.lm_head, Int8Linear) and isinstance(head.fc, Int4Linear)
    assert isinstance(head.blocks[0].mlp.down_proj, Int4Linear) and isinstance(head.midlayer.gated.gate, Int4Linear)
    assert not any(isinstance(m, torch.nn.Linear) for m in head.modules())
    if a8_error() is None:  # w8a8: every linear, the output layer too, on the a8 kernels
        w8 = Eagle3Head(Eagle3Config.for_target(target.cfg, num_layers=2, fusion="gated")).double()
        assert quantize_linears(w8, "w8a8", int8_names=("lm_head",)) == 12
        assert isinstance(w8.lm_head, W8A8Linear) and isinstance(w8.fc, W8A8Linear)
        mixed = torch.nn.Sequential(torch.nn.Linear(48, 32), torch.nn.Linear(32, 16))  # 48: not a whole block
        assert quantize_linears(mixed, "w8a8") == 2
        assert isinstance(mixed[0], Int8Linear) and isinstance(mixed[1], W8A8Linear)
    else:  # no AVX512-VNNI here: refused in one line, nothing touched
        w8 = Eagle3Head(Eagle3Config.for_target(target.cfg, num_layers=2, fusion="gated")).double()
        with pytest.raises(QuantizationError, match="w8a8"):
            quantize_linears(w8, "w8a8")
        assert isinstance(w8.lm_head, torch.nn.Linear)
    odd = torch.nn.Sequential(torch.nn.Linear(48, 32), torch.nn.Linear(32, 16))
    with pytest.raises(QuantizationError, match="does not divide 0's input size 48; use int8"):
        quantize_linears(odd, "int4", 32)
    assert isinstance(odd[1], torch.nn.Linear) and not isinstance(odd[1], Int4Linear)  # nothing was touched
    with pytest.raises(QuantizationError, match="need a CPU"):
        quantize_linears(torch.nn.Sequential(torch.nn.Linear(32, 16)).to("meta"), "int8")
    with pytest.raises(QuantizationError, match="int8, int4 or w8a8"):
        quantize_linears(odd, "none")


@pytest.mark.parametrize("kw,needle", [
    (dict(quant_group_size=48), "power of two in [32, 256]"),
    (dict(quant_group_size=16), "power of two in [32, 256]"),
    (dict(quant_group_size=0), "power of two in [32, 256]"),
    (dict(quant_group_size=512), "power of two in [32, 256]"),
    (dict(quantization="int3"), "quantization must be one of"),
    (dict(quantization="int8", device="cuda"), "needs --device cpu"),
])
def test_model_config_validates_quantization(kw: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig(**kw)
    assert ModelConfig(quantization="int4", quant_group_size=64).precision == "float32 + int4-g64 weights"
    assert EngineConfig().model.precision == "float32"


# ----------------------------------------------------------------------------- lossless w.r.t. the quantized target


@pytest.fixture(scope="module", params=["int8", "int4"])
def qmodel(request):
    model = tiny_llama(V, layers=3, seed=2, scale=3.0)  # the sharp float64 model of test_spec_lossless
    quantize_model(model, request.param, 32)
    return model


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(V)


@pytest.fixture(scope="module")
def qplain(qmodel, tok):
    return generate(qmodel, tok, SpecConfig(), PROMPTS, slots=4)[0]


def test_quantization_changes_the_greedy_output(qplain, tok):
    """Control: the quantized target is a different model, so equality below is w.r.t. it."""
    assert qplain != generate(tiny_llama(V, layers=3, seed=2, scale=3.0), tok, SpecConfig(), PROMPTS, slots=4)[0]


@pytest.mark.parametrize("drafter,tree", [("ngram", False), ("suffix", False), ("suffix", True),
                                          ("draft-model", True), ("eagle3", False)])
@pytest.mark.parametrize("gamma,batch", [(3, 1), (5, 4)])
def test_speculation_is_lossless_wrt_the_quantized_target(qmodel, tok, qplain, drafter, tree, gamma, batch):
    spec = SpecConfig(drafter=drafter, num_speculative_tokens=gamma, tree=tree,
                      options={"draft-model": DraftModelOptions(layers=1, tree_top_k=2)})
    got, drafted = generate_in_batches(qmodel, tok, spec, batch)
    assert got == qplain
    assert drafted > 0, "the drafter never proposed: the test would not exercise verification"
