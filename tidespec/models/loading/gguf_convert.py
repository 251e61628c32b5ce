"""Convert a llama.cpp GGUF file into an HF directory (float32 safetensors, config, tokenizer), reading it once.

Why this exists: transformers loads a GGUF itself (``from_pretrained(gguf_file=...)``), and tidespec
converted with it until 2026-12-03, but for the llama family that path parses the file's metadata
with gguf-py's reader three times (the tokenizer's config, the model's config, the weights: ~6 s
each for a 49k-token vocabulary on the 2-core machine) and rebuilds gguf-py's name map once per
module (~8 s): 45 s for the embedded 135M model, paid at every first start and every CI run. Here
the file is parsed once with gguf-py (``gguf.GGUFReader``), the config comes from transformers'
own GGUF config mapping (``AutoConfig.from_pretrained(gguf_file=...)``, one more parse: the
mapping of metadata keys per family is transformers' to keep), names are mapped with one gguf-py
``TensorNameMap``, weights are dequantized by gguf-py, llama.cpp's q/k row permutation is undone
as transformers does, and the tokenizer is transformers' GGUF tokenizer converter. The result is
the same directory, bit for bit in every tensor, as transformers' conversion
(``tests/models/test_loader.py``): ~14 s for the embedded model.

Worked example::

    convert_gguf(Path("SmolLM2-135M-Instruct.Q4_1.gguf"), Path("/tmp/smol"))
    # /tmp/smol: config.json (LlamaForCausalLM), model.safetensors (float32, no lm_head: tied),
    #            tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file

from tidespec.errors import UserError
from tidespec.models.architectures import GGUF_ARCHITECTURES
from tidespec.models.quant.gguf_blocks import BLOCKS_FILE, NATIVE_NAMES, TYPES_KEY

# what a bad file raises from gguf-py, numpy, transformers or torch (RuntimeError's subclasses include the
# error of an architecture gguf-py or transformers does not map)
_READ_ERRORS = (ValueError, OSError, IndexError, KeyError, UnicodeDecodeError, RuntimeError, TypeError)
_DATA_ERRORS = tuple(e for e in _READ_ERRORS if e is not OSError)  # a bad tensor in a file that opened


class GgufConversionError(UserError):
    """A GGUF file could not be converted; the message is one line naming the file and the problem."""


def one_line(exc: BaseException) -> str:
    """An exception's first line (its class name when it has no text): the loading errors' messages."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _field(reader: gguf.GGUFReader, key: str) -> object | None:
    field = reader.fields.get(key)
    return field.contents() if field is not None else None


def read_gguf(gguf_path: Path) -> tuple[gguf.GGUFReader, str, str | None]:
    """``(reader, general.architecture, tokenizer.chat_template or None)``, validating the file."""
    try:
        reader = gguf.GGUFReader(str(gguf_path))
        arch, template = _field(reader, "general.architecture"), _field(reader, "tokenizer.chat_template")
    except _READ_ERRORS as exc:
        raise GgufConversionError(f"corrupt GGUF file {gguf_path}: {one_line(exc)}") from None
    if not isinstance(arch, str):
        raise GgufConversionError(f"GGUF file {gguf_path} has no general.architecture")
    return reader, arch, template if isinstance(template, str) else None


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rope permutation of q/k rows: per head, rows ``[0, 2, 4, .., 1, 3, ..]`` of
    the interleaved layout go back to HF's half-split layout. ``w [heads * head_dim, ...]``.

    Example (one head of 4 rows): GGUF rows ``[a0, b0, a1, b1]`` -> HF rows ``[a0, a1, b0, b1]``."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def gguf_tensors(reader: gguf.GGUFReader, arch: str, config: transformers.PretrainedConfig,
                 hf_names: list[str], blocks: dict[str, tuple[np.ndarray, str]] | None = None,
                 per_expert: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors as float32 under HF names (``hf_names``: the model class's state-dict keys),
    one at a time (the converter writes them out in shards: a 3B model is 12.8 GB in float32);
    tensors the model has no place for (llama 3's ``rope_freqs``) are left out, as transformers does.
    A mixture's experts (``blk.N.ffn_{gate,up,down}_exps``, [E, out, in] each) become transformers'
    ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I], or with
    ``per_expert`` a checkpoint's per-expert matrices (``mlp.experts.{e}.{gate,up,down}_proj.weight``,
    ``expert_names``), dequantized one layer at a time. ``blocks``, when given, receives every quantized
    matrix's raw blocks under its HF name: ``([out, bytes per row] uint8, GGML type name)``, rows in
    HF's order (what ``--quantization gguf`` runs); an expert's under its per-expert names."""
    arch_ids = {name: arch_id for arch_id, name in gguf.MODEL_ARCH_NAMES.items()}
    row = GGUF_ARCHITECTURES[arch]
    name_map = gguf.get_tensor_name_map(arch_ids[row.gguf_tensor_names], config.num_hidden_layers)
    to_hf: dict[str, str] = {}
    for hf_name in hf_names:
        base, dot, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(base) if suffix in ("weight", "bias") else None
        if gguf_name is not None:
            to_hf[f"{gguf_name}{dot}{suffix}"] = hf_name
        elif suffix == "sinks" and (sinks := name_map.get_name(hf_name)) is not None:  # gpt-oss: a parameter, no .weight
            to_hf[f"{sinks}.weight"] = hf_name
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    experts: dict[str, Any] = {}  # gguf name -> its ReaderTensor ([E, out, in]), dequantized when written
    for t in reader.tensors:
        if t.name.endswith("_exps.bias"):  # gpt-oss: [E, out]
            experts[t.name] = t
            continue
        if t.name.endswith("_exps.weight"):
            experts[t.name] = t
            if blocks is not None and t.tensor_type not in _FLOAT_TYPES:  # each expert's rows: a matrix
                layer, kind = t.name.split(".")[1], t.name.split(".")[2].removeprefix("ffn_").removesuffix("_exps")
                raw = np.asarray(t.data)  # [E, out, bytes per row]
                for e in range(raw.shape[0]):
                    blocks[f"model.layers.{layer}.mlp.experts.{e}.{kind}_proj.weight"] = (
                        raw[e], t.tensor_type.name)
            continue
        if t.name not in to_hf:
            continue
        w = gguf.dequantize(t.data, t.tensor_type)  # numpy, HF's [out, in] order
        raw = np.asarray(t.data) if blocks is not None and t.tensor_type not in _FLOAT_TYPES and w.ndim == 2 else None
        if row.gguf_permuted_qk and ".attn_q." in t.name:  # llama.cpp's permute, undone as transformers does
            w, raw = unpermute_qk(w, heads), None if raw is None else unpermute_qk(raw, heads)
        elif row.gguf_permuted_qk and ".attn_k." in t.name:
            w, raw = unpermute_qk(w, kv_heads), None if raw is None else unpermute_qk(raw, kv_heads)
        if raw is not None and blocks is not None:  # a row's blocks are that row's: the permutation moves rows
            blocks[to_hf[t.name]] = (raw, t.tensor_type.name)  # a view of the file where no permutation copied it
        if row.gguf_norm_shift and t.name.endswith("norm.weight"):  # llama.cpp stored Gemma's norms + 1
            w = w - row.gguf_norm_shift
        yield to_hf[t.name], torch.from_numpy(np.array(w, dtype=np.float32, copy=True))

    def dequantized(name: str) -> np.ndarray:  # [E, out, in] float32
        t = experts[name]
        return np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)

    for name in hf_names:
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        blk = f"blk.{layer}.ffn_{{}}_exps.weight"
        if rest == "mlp.experts.gate_up_proj" and blk.format("gate") in experts:
            gate, up = dequantized(blk.format("gate")), dequantized(blk.format("up"))
            if per_expert:
                for e in range(gate.shape[0]):
                    yield f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight", torch.from_numpy(gate[e].copy())
                    yield f"model.layers.{layer}.mlp.experts.{e}.up_proj.weight", torch.from_numpy(up[e].copy())
            else:
                yield name, torch.from_numpy(np.concatenate([gate, up], axis=1))
        elif rest == "mlp.experts.down_proj" and blk.format("down") in experts:
            down = dequantized(blk.format("down"))
            if per_expert:
                for e in range(down.shape[0]):
                    yield f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight", torch.from_numpy(down[e].copy())
            else:
                yield name, torch.from_numpy(np.array(down, copy=True))
        elif rest in ("mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"):  # gpt-oss: always per expert
            for kind in ("gate", "up") if rest.startswith("mlp.experts.gate_up") else ("down",):
                bias = dequantized(f"blk.{layer}.ffn_{kind}_exps.bias")  # [E, out]
                for e in range(bias.shape[0]):
                    yield f"model.layers.{layer}.mlp.experts.{e}.{kind}_proj.bias", torch.from_numpy(bias[e].copy())


def expert_names(hf_names: list[str], num_experts: int) -> list[str]:
    """``hf_names`` with a mixture's fused experts (transformers' ``mlp.experts.gate_up_proj`` /
    ``down_proj``) as the per-expert matrices ``gguf_tensors(per_expert=True)`` writes.

    Example: ``["model.layers.0.mlp.experts.down_proj"]``, 2 experts ->
    ``["model.layers.0.mlp.experts.0.down_proj.weight", "model.layers.0.mlp.experts.1.down_proj.weight"]``."""
    out: list[str] = []
    for name in hf_names:
        prefix, fused, kind = name.rpartition("mlp.experts.")[0], "mlp.experts." in name, name.rpartition(".")[2]
        if fused and kind.removesuffix("_bias") in ("gate_up_proj", "down_proj"):  # gpt-oss's biases too
            parts = ("gate_proj", "up_proj") if kind.startswith("gate_up_proj") else ("down_proj",)
            what = "bias" if kind.endswith("_bias") else "weight"
            out.extend(f"{prefix}mlp.experts.{e}.{part}.{what}" for e in range(num_experts) for part in parts)
        else:
            out.append(name)
    return out


SHARD_BYTES = 2 << 30  # the converted float32 weights are written in shards of at most 2 GiB (HF's default is 5 GB)
# types stored as floats (their matrices are the float32 weights already: no blocks to keep)
_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16,
                gguf.GGMLQuantizationType.F64)
# GGUF architectures whose config transformers' GGUF loader does not read: their HF model types
# (``config_from_metadata`` reads them with transformers' llama key mapping and their own keys)
# (gpt-oss: transformers 5.25 reads its rope scaling keys' first part, the key's length, and fails on every file)
OWN_CONFIGS = {"olmo2": "olmo2", "granite": "granite", "smollm3": "smollm3", "gpt-oss": "gpt_oss"}
# Granite's multipliers: GGUF key (after the architecture) -> HF config field
_GRANITE_SCALES = {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                   "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling"}


def config_from_metadata(reader: gguf.GGUFReader, arch: str) -> transformers.PretrainedConfig:
    """The HF config of a GGUF of an ``OWN_CONFIGS`` architecture: the shape under the keys
    transformers maps for llama (block count, widths, heads, rope base, norm epsilon), the head width,
    the vocabulary's size and special ids, a tied head when the file has no ``output`` tensor, and
    the family's own: Granite's four multipliers, SmolLM3's rope-less layer every 4th (llama.cpp's
    ``n_no_rope_layer_step``)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING  # the mapping transformers reads llama with

    fields: dict[str, object] = {}
    for key, name in GGUF_CONFIG_MAPPING["llama"].items():
        value = _field(reader, f"{arch}.{key}")
        if name is not None and value is not None:
            fields[name] = value
    tokens = _field(reader, "tokenizer.ggml.tokens")
    fields.setdefault("vocab_size", len(tokens) if isinstance(tokens, list) else None)
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim is not None:
        fields["head_dim"] = head_dim
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        fields[name] = _field(reader, f"tokenizer.ggml.{key}")
    fields["tie_word_embeddings"] = not any(t.name == "output.weight" for t in reader.tensors)
    if arch == "granite":
        for key, name in _GRANITE_SCALES.items():
            value = _field(reader, f"{arch}.{key}")
            if value is not None:
                fields[name] = value
    if arch == "smollm3":
        fields["no_rope_layer_interval"] = 4
    theta = fields.pop("rope_theta", None)
    if theta is not None:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    if arch == "gpt-oss":
        fields.update(_gpt_oss_fields(reader, arch, theta))
    return transformers.AutoConfig.for_model(OWN_CONFIGS[arch], **fields)


def _gpt_oss_fields(reader: gguf.GGUFReader, arch: str, theta: object) -> dict[str, object]:
    """A gpt-oss file's mixture, window and YaRN rope. What it does not say is what llama.cpp assumes
    and the released checkpoints' config.json says: layers alternate sliding and global from layer 0
    (transformers' default), SwiGLU clamped at 7 (the class's default), YaRN's betas 32 and 1 (unless
    the file has ``rope.scaling.yarn_beta_*``) and its ramp not truncated (``truncate: false``; llama.cpp
    rounds the ramp's ends, a difference in a few frequencies of each head)."""
    out: dict[str, object] = {}
    for key, name in (("expert_count", "num_local_experts"), ("expert_used_count", "num_experts_per_tok"),
                      ("expert_feed_forward_length", "intermediate_size"), ("attention.sliding_window", "sliding_window")):
        value = _field(reader, f"{arch}.{key}")
        if value is not None:
            out[name] = value
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if _field(reader, f"{arch}.rope.scaling.type") == "yarn" and factor is not None:
        out["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": theta if theta is not None else 150000.0, "factor": factor,
            "original_max_position_embeddings": _field(reader, f"{arch}.rope.scaling.original_context_length"),
            "beta_fast": float(_field(reader, f"{arch}.rope.scaling.yarn_beta_fast") or 32.0),  # type: ignore[arg-type]
            "beta_slow": float(_field(reader, f"{arch}.rope.scaling.yarn_beta_slow") or 1.0),  # type: ignore[arg-type]
            "truncate": False}
    return out


# the layers count of the 27B Gemma 2 / Gemma 3, whose attention llama.cpp scales by 1/sqrt(hidden / heads)
# (every other size by 1/sqrt(head_dim)); a GGUF carries no query_pre_attn_scalar
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def llama_cpp_conventions(config: transformers.PretrainedConfig, reader: gguf.GGUFReader,
                          arch: str) -> transformers.PretrainedConfig:
    """The config with what a GGUF file says (or llama.cpp assumes) but transformers' GGUF config
    mapping leaves at its class's defaults: a Mixtral (llama.cpp writes it as ``llama`` with experts)
    as a Mixtral, a Qwen3-MoE's expert width and its renormalized top k (llama.cpp's graph always
    renormalizes), Gemma 2's soft caps, Gemma 3's scaled global rope, both Gemmas' query scale, and
    the head width where it is not hidden / heads (transformers' mapping leaves Qwen3's at 128)."""
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is not None and getattr(config, "head_dim", None) is not None:
        config.head_dim = int(key_length)  # type: ignore[attr-defined, arg-type]
    experts = _field(reader, f"{arch}.expert_count")
    if arch in ("llama", "mistral") and experts:
        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        return transformers.MixtralConfig(**fields, num_local_experts=int(experts),  # type: ignore[arg-type]
                                          num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count") or 2))  # type: ignore[arg-type]
    if arch == "qwen3moe":
        width = _field(reader, f"{arch}.expert_feed_forward_length")
        if width is not None:
            config.moe_intermediate_size = int(width)  # type: ignore[attr-defined]
        config.norm_topk_prob = True  # type: ignore[attr-defined]
    if arch in _GEMMA_27B_LAYERS:
        large = config.num_hidden_layers == _GEMMA_27B_LAYERS[arch]  # type: ignore[attr-defined]
        config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads  # type: ignore[attr-defined]
                                        if large else config.head_dim)  # type: ignore[attr-defined]
    for key in ("attn_logit_softcapping", "final_logit_softcapping") if arch == "gemma2" else ():
        cap = _field(reader, f"{arch}.{key}")
        if cap is not None:
            setattr(config, key, float(cap))  # type: ignore[arg-type]
    kind, factor = _field(reader, f"{arch}.rope.scaling.type"), _field(reader, f"{arch}.rope.scaling.factor")
    if arch == "gemma3" and kind == "linear" and factor is not None:
        config.rope_parameters["full_attention"].update(rope_type="linear", factor=float(factor))  # type: ignore[attr-defined, arg-type]
    return config


def convert_gguf(gguf_path: Path, out: Path, floats: bool = True) -> Path:
    """Dequantize ``gguf_path`` into HF directory ``out`` (config.json, float32 model.safetensors,
    tokenizer, generation_config.json; the quantized matrices' raw blocks in ``gguf_blocks.safetensors``,
    for ``--quantization gguf``). Written to a temporary sibling and renamed into place,
    so a crash never leaves a half-written cache entry.

    ``floats=False`` (what ``--quantization gguf`` asks for): no float32 copy of a decoder layer's
    projection whose blocks are of a type the kernels run (``NATIVE_NAMES``), a mixture's experts
    included (written per expert, not fused as transformers holds them): the directory is then
    about the file's size plus the embedding's floats (a 3B Q4_K_M: 3.5 GB against 14 GB) and not an HF
    checkpoint; the loader dequantizes those blocks on the rare read (``loader.SafetensorsState``), bit
    for bit the floats this would have written."""
    reader, arch, template = read_gguf(gguf_path)
    if arch not in GGUF_ARCHITECTURES:
        raise GgufConversionError(
            f"unknown GGUF architecture {arch!r} in {gguf_path}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    parent, name = str(gguf_path.parent), gguf_path.name
    try:
        hf_config = (config_from_metadata(reader, arch) if arch in OWN_CONFIGS
                     else transformers.AutoConfig.from_pretrained(parent, gguf_file=name))
        hf_config = llama_cpp_conventions(hf_config, reader, arch)
        # the tokenizer class directly: AutoTokenizer would parse the file's config once more
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(parent, gguf_file=name)
        with torch.device("meta"):  # the class and its tensor names, no memory
            skeleton = transformers.AutoModelForCausalLM.from_config(hf_config)
        hf_names = list(skeleton.state_dict())
    except _READ_ERRORS as exc:
        raise GgufConversionError(f"cannot convert GGUF file {gguf_path}: {one_line(exc)}") from None
    if tokenizer.chat_template is None and template is not None:
        tokenizer.chat_template = template
    config = hf_config.to_dict()
    config.pop("quantization_config", None)  # the saved weights are plain float32
    config.pop("_name_or_path", None)
    config["architectures"] = [type(skeleton).__name__]
    config["dtype"] = "float32"
    tied = bool(config.get("tie_word_embeddings", False))
    blocks: dict[str, tuple[np.ndarray, str]] = {}
    # without floats, a mixture's experts are written per expert (as the checkpoints people download
    # hold them): each one's matrices then run on its own blocks, and none is written as floats
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    # (gpt-oss's experts, biased, always: transformers holds them transposed with gate and up interleaved)
    per_expert = num_experts > 0 and (not floats or any(n.endswith("_proj_bias") for n in hf_names))
    tensors = ((name, t) for name, t in gguf_tensors(reader, arch, hf_config, hf_names, blocks, per_expert)
               if not (tied and name == "lm_head.weight")  # HF loaders re-tie it
               and (floats or not _runs_on_blocks(name, blocks)))
    expected = (set(expert_names(hf_names, num_experts) if per_expert else hf_names)
                - ({"lm_head.weight"} if tied else set()))
    _write(out, gguf_path, tensors, expected, blocks, config, tokenizer,
           transformers.GenerationConfig.from_model_config(hf_config), floats)
    return out


def _runs_on_blocks(name: str, blocks: dict[str, tuple[np.ndarray, str]]) -> bool:
    """Whether HF tensor ``name`` is a decoder layer's projection held in blocks of a type the kernels
    run: what ``--quantization gguf`` never reads as floats (the embedding is looked up in floats and
    keeps them)."""
    return (name.startswith("model.layers.") and name.endswith("_proj.weight") and name in blocks
            and blocks[name][1] in NATIVE_NAMES)


def _write_shards(tmp: Path, tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Save ``tensors`` as it yields them: ``model.safetensors`` when they fit in one shard of
    ``SHARD_BYTES``, else ``model-0000i-of-0000n.safetensors`` and the ``model.safetensors.index.json``
    HF loaders read. Holds one shard at a time. Returns the names written."""
    names: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        save_file(shard, str(tmp / f"shard-{len(names)}.safetensors"), metadata={"format": "pt"})
        names.append(list(shard))
        shard.clear()

    for name, t in tensors:
        if shard and size + t.nbytes > SHARD_BYTES:
            flush()
            size = 0
        shard[name] = t
        size += t.nbytes
    if shard or not names:
        flush()
    if len(names) == 1:
        (tmp / "shard-0.safetensors").rename(tmp / "model.safetensors")
        return set(names[0])
    weight_map = {}
    for i, shard_names in enumerate(names):
        file = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        (tmp / f"shard-{i}.safetensors").rename(tmp / file)
        weight_map.update(dict.fromkeys(shard_names, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True), encoding="utf-8")
    return set(weight_map)


def _write(out: Path, gguf_path: Path, tensors: Iterable[tuple[str, torch.Tensor]], expected: set[str],
           blocks: dict[str, tuple[np.ndarray, str]], config: dict[str, object],
           tokenizer: transformers.PreTrainedTokenizerBase, generation: transformers.GenerationConfig,
           floats: bool = True) -> None:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as exc:
        raise GgufConversionError(f"cannot create cache directory {out.parent}: {one_line(exc)}") from None
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache entry is an ordinary directory
    try:
        try:
            written = _write_shards(tmp, tensors)  # reads the file's tensors as it writes them
        except _DATA_ERRORS as exc:  # an OSError is the writing's: the file is open and mapped
            raise GgufConversionError(f"cannot convert GGUF file {gguf_path}: {one_line(exc)}") from None
        missing = sorted(n for n in expected - written  # without floats: a native projection is in its blocks
                         if floats or not _runs_on_blocks(n, blocks))
        if missing:
            raise GgufConversionError(f"GGUF file {gguf_path} lacks {len(missing)} tensors, e.g. {missing[0]}")
        if blocks:  # the file's own blocks, for --quantization gguf (models/quant/gguf_blocks.py)
            types = json.dumps({name: kind for name, (_, kind) in blocks.items()}, sort_keys=True)
            # numpy's writer reads each array where it lies (safetensors >= 0.8: by pointer): the blocks
            # are views of the mapped file, so an 18 GB GGUF's are never copied into memory
            save_numpy({name: np.ascontiguousarray(raw) for name, (raw, _) in blocks.items()}, str(tmp / BLOCKS_FILE),
                       metadata={"format": "pt", TYPES_KEY: types})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
        tokenizer.save_pretrained(str(tmp))
        generation.save_pretrained(str(tmp))
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():  # not a concurrent converter winning the race
                raise
    except OSError as exc:
        raise GgufConversionError(f"cannot write converted model to {out}: {one_line(exc)}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
