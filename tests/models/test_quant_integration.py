"""``--quantization`` end to end: the flags reach the loaded target (CLI, ``load_target``), a bad
group size is a one-line CLI error, and on the embedded SmolLM2-135M in int8 speculative decoding
gives exactly the quantized model's own plain greedy output."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_hf_model, write_tiny_checkpoint
from tests.speculative.test_embedded_lossless import run
from tidespec.cli import main
from tidespec.config import ModelConfig, SpecConfig
from tidespec.llm import load_target
from tidespec.models.loading.loader import LoadedModel, load_model
from tidespec.models.quant.a8 import a8_error, quantize_q4_1, quantize_q8_0
from tidespec.models.quant.quantize import Int8Linear, ModelQuantizer, quantization_of, quantize_model
from tidespec.speculative.drafters.draft_model import DraftModelOptions
from tidespec.workloads.loader import load_prompts


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf, _ = tiny_hf_model("llama", torch.float32)  # hidden 64, intermediate 128, vocab 96
    return write_tiny_checkpoint(hf, tmp_path_factory.mktemp("q") / "ckpt")


def test_load_target_quantizes_as_configured(ckpt: Path) -> None:
    assert quantization_of(load_target(ModelConfig(model=str(ckpt))).model) == "none"
    loaded = load_target(ModelConfig(model=str(ckpt), quantization="int4", quant_group_size=64))
    assert quantization_of(loaded.model) == "int4-g64"
    assert loaded.model.dtype == torch.float32  # the rest of the model keeps --dtype
    assert quantization_of(load_target(ModelConfig(model=str(ckpt), quantization="int8")).model) == "int8"


@pytest.mark.parametrize("mode", ["int8", "int4", pytest.param("w4a8", marks=pytest.mark.skipif(
    a8_error() is not None, reason=f"a8 kernels unavailable: {a8_error()}"))])
def test_a_quantized_load_holds_one_float_layer_at_a_time(ckpt: Path, mode: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # each layer is quantized as soon as its weights are read, while the layers after it are not yet
    # allocated (meta), and the model is the same as one loaded in float and quantized after
    reference = load_model(str(ckpt)).model
    quantize_model(reference, mode)
    seen: list[int] = []
    layer = ModelQuantizer.layer

    def checked(self: ModelQuantizer, i: int, module: torch.nn.Module) -> None:
        later = list(self.model.layers)[i + 1:]
        assert all(p.is_meta for m in later for p in m.parameters()), f"layer {i}: a later layer is allocated"
        assert not any(p.is_meta for p in module.parameters())
        seen.append(i)
        layer(self, i, module)

    monkeypatch.setattr(ModelQuantizer, "layer", checked)
    loaded = load_model(str(ckpt), quantization=mode).model
    assert seen == list(range(reference.cfg.num_layers))
    assert quantization_of(loaded) == quantization_of(reference)
    ref, got = reference.state_dict(), loaded.state_dict()
    assert ref.keys() == got.keys()
    for name, t in ref.items():
        assert torch.equal(t, got[name]), name


def test_generate_cli_runs_quantized_and_rejects_a_bad_group_size(ckpt: Path, capsys) -> None:
    argv = ["generate", "w3 w4 w5", "--model", str(ckpt), "--max-tokens", "6", "--drafter", "ngram",
            "--max-model-len", "64", "--max-num-seqs", "1", "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert main(argv + ["--quantization", "int8"]) == 0
        assert "6 tokens" in capsys.readouterr().err
        assert main(argv + ["--quantization", "int4", "--quant-group-size", "128"]) == 2
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    assert "int4 group size 128 does not divide this model's input sizes [64, 128]; use --quant-group-size 32 or 64" in err


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("dtype,mode", [(torch.float32, "int8"), (torch.bfloat16, "int4")])
def test_embedded_quantized_speculation_equals_its_plain_decoding(embedded, dtype: torch.dtype, mode: str) -> None:
    """The embedded model with quantized weights: speculation and batching reproduce the quantized
    model's plain greedy decoding alone exactly (``make test-slow``: ``make test`` checks the int8 and
    int4 paths in the exactness subset, ``tests/speculative/test_exact_matrix.py``). The engine runs row-invariant kernels
    (``models/execution/invariance.py``): the quantized matmuls were measured row-invariant, attention runs
    tidespec's exact kernel, so a verification row, and a row batched with other sequences, has the
    bits of a decode row alone."""
    model = copy.deepcopy(embedded.model).to(dtype)
    quantize_model(model, mode)
    assert isinstance(model.lm_head, Int8Linear) and model.embed_tokens.weight.dtype == dtype
    target = LoadedModel(model=model, tokenizer=embedded.tokenizer, config=embedded.config, path=embedded.path)
    prompts = [p.token_ids for w in ("code", "chat") for p in load_prompts(w, embedded.tokenizer, limit=1)]
    plain = [run(target, SpecConfig(), [p], slots=1)[0] for p in prompts]
    assert plain != run(embedded, SpecConfig(), prompts, slots=2)  # control: quantized is another model
    for spec in (SpecConfig(drafter="suffix", num_speculative_tokens=4),
                 SpecConfig(drafter="draft-model", num_speculative_tokens=3, tree=True,
                            options={"draft-model": DraftModelOptions(layers=6, tree_top_k=2)})):
        assert [run(target, spec, [p], slots=1)[0] for p in prompts] == plain, spec.drafter
        assert run(target, spec, prompts, slots=2) == plain, spec.drafter  # batched: still each alone's
    assert model.row_invariant  # the engine chose row-invariant kernels


@pytest.mark.integration
def test_w4a8_takes_the_embedded_gguf_blocks_back_exactly(embedded: LoadedModel) -> None:
    """The embedded model ships Q4_1 projections and a Q8_0 output matrix: re-quantized from the
    dequantized weights, every block comes back as the file holds it (so w4a8 multiplies by exactly
    the GGUF's weights, as llama.cpp does)."""
    for layer in embedded.model.layers[:6]:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            w = linear.weight.detach()
            q, d, m = quantize_q4_1(w)
            blocks = q.float().reshape(w.shape[0], -1, 32) * d.float().unsqueeze(2) + m.float().unsqueeze(2)
            assert torch.equal(blocks.reshape(w.shape), w)
    head = embedded.model.embed_tokens.weight.detach()  # tied: the output matrix
    q8, d8 = quantize_q8_0(head)
    assert torch.equal((q8.float().reshape(head.shape[0], -1, 32) * d8.float().unsqueeze(2)).reshape(head.shape), head)
