"""Write a random-weight GGUF of a real model's shape, and llama.cpp's K-quants of it, for decode
benchmarks at the sizes people run (issue 79 item 4; no model hub here).

Usage (from the repository root, llama-cpp-python installed as for ``bench decode --compare llamacpp``)::

    PYTHONPATH=. .venv/bin/python docs/benchmarks/scale_checkpoint.py llama-3.2-1b /data/scale Q4_K_M,Q8_0

writes ``/data/scale/llama-3.2-1b.F16.gguf`` and ``llama-3.2-1b.{Q4_K_M,Q8_0}.gguf`` (llama.cpp's
``llama_model_quantize``; also Q5_K_M, Q6_K), and with ``HF`` in the list the HF directory
``llama-3.2-1b-hf`` (config.json, float32 safetensors shards, tokenizer: tidespec's conversion of the
F16 file, loadable by transformers and by ``--model``). The architecture is the named model's (llama,
qwen3 with its q/k norms, qwen3moe with its experts, gpt-oss with its sinks, biases and MXFP4 experts
(``MXFP4_MOE``); random q/k rows need no rope permutation) with
the shape of the named model, its LM head tied to the token embedding where the real one is, and the
embedded SmolLM2-135M-Instruct's tokenizer (copied from the embedded GGUF, so the workloads' prompts
tokenize) padded with unused tokens to the real vocabulary's size (128,256 for Llama 3.2, 151,936 for
Qwen3): the LM head, 10-20 % of a 1-3B model's bytes, has the real model's rows.
Weights: float16, N(0, 0.02) matrices (transformers' initialisation), norms 1, one seeded generator:
the text is noise, the speed is the shape's.
"""

import ctypes
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import llama_cpp
import numpy as np

from tidespec.models.loading.gguf_convert import convert_gguf
from tidespec.models.loading.loader import resolve_embedded_gguf


@dataclass(frozen=True)
class Shape:
    """A real model's shape: its GGUF architecture and widths (``experts`` > 0: every layer a mixture of
    ``experts`` experts of width ``expert_width``, ``used`` per token, routed by an F32 gate)."""

    arch: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rope: float
    vocab: int
    tied: bool = True
    experts: int = 0
    used: int = 0
    expert_width: int = 0

    @property
    def qk_norm(self) -> bool:
        return self.arch.startswith("qwen3")

    @property
    def oss(self) -> bool:
        """gpt-oss: biases on q/k/v/o, the router and the experts, attention sinks, the norm before the
        mixture named post_attention_norm."""
        return self.arch == "gpt-oss"


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 8192, 32, 8, 64, 500000.0, 128256),
    "llama-3.2-3b": Shape("llama", 3072, 28, 8192, 24, 8, 128, 500000.0, 128256),
    "qwen3-1.7b": Shape("qwen3", 2048, 28, 6144, 16, 8, 128, 1000000.0, 151936),
    # Qwen3-30B-A3B's layers (48, hidden 2048, 32/4 heads of 128, experts of width 768, 8 used a token,
    # untied head) with 16 of its 128 experts: a token reads what it reads in the real model (3.3B
    # parameters), the file holds 5.1B (10 GB in F16, 3 GB in Q4_K_M) instead of 30.5B
    "qwen3-30b-a3b-16e": Shape("qwen3moe", 2048, 48, 6144, 32, 4, 128, 1000000.0, 151936, tied=False,
                               experts=16, used=8, expert_width=768),
    # gpt-oss-20b's layers (24, hidden 2880, 64/8 heads of 64, attention sinks, every other layer a window of
    # 128, YaRN, biased router and experts of width 2880, 4 used a token, untied head) with 8 of its 32
    # experts: a token reads what it reads in the real model (3.6B parameters), the file holds 6.6B
    "gpt-oss-20b-8e": Shape("gpt-oss", 2880, 24, 2880, 64, 8, 64, 150000.0, 201088, tied=False,
                            experts=8, used=4, expert_width=2880),
    # its first 2 layers: an F16 file small enough for both engines' float logits (llamacpp_logits.py)
    "gpt-oss-20b-2l": Shape("gpt-oss", 2880, 2, 2880, 64, 8, 64, 150000.0, 201088, tied=False,
                            experts=8, used=4, expert_width=2880),
}
UNUSED = 5  # gguf's token type of a token the tokenizer never produces (llama.cpp's LLAMA_TOKEN_TYPE_UNUSED)
FTYPES = {"Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "Q5_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
          "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
          "MXFP4_MOE": llama_cpp.LLAMA_FTYPE_MOSTLY_MXFP4_MOE}  # gpt-oss's: experts MXFP4, the rest Q8_0
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template")


def write_f16(name: str, path: Path) -> None:
    shape = SHAPES[name]
    hidden, layers, inter, heads, kv_heads, head_dim, vocab = (shape.hidden, shape.layers, shape.intermediate,
                                                               shape.heads, shape.kv_heads, shape.head_dim, shape.vocab)
    src = gguf.GGUFReader(str(resolve_embedded_gguf()))
    pad = vocab - len(src.fields["tokenizer.ggml.tokens"].data)  # the real vocabulary's size, unused tokens
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(f"random {name}")
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(shape.rope)
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.used)
        w.add_expert_feed_forward_length(shape.expert_width)
    if shape.oss:
        w.add_sliding_window(128)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key in TOKENIZER_KEYS:  # the embedded model's tokenizer, field by field
        field = src.fields.get(key)
        if field is not None:
            value, kind = field.contents(), field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            if key == "tokenizer.ggml.tokens":
                value = value + [f"<|unused_{i}|>" for i in range(pad)]
            elif key == "tokenizer.ggml.token_type":
                value = value + [UNUSED] * pad
            w.add_key_value(key, value, kind, sub_type=sub)
    rng = np.random.default_rng(0)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", matrix(vocab, hidden))  # also the LM head when tied (no output.weight)
    if not shape.tied:
        w.add_tensor("output.weight", matrix(vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    def bias(*shape_: int) -> np.ndarray:
        return (rng.standard_normal(shape_, dtype=np.float32) * 0.02).astype(np.float32)

    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.{'post_attention_norm' if shape.oss else 'ffn_norm'}.weight", np.ones(hidden, np.float32))
        if shape.oss:
            w.add_tensor(f"blk.{i}.attn_sinks.weight", bias(heads))
            for part, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim),
                               ("output", hidden)):
                w.add_tensor(f"blk.{i}.attn_{part}.bias", bias(rows))
        w.add_tensor(f"blk.{i}.attn_q.weight", matrix(heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_k.weight", matrix(kv_heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_v.weight", matrix(kv_heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", matrix(hidden, heads * head_dim))
        if shape.qk_norm:
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, np.float32))
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, np.float32))
        if shape.experts:  # [E, out, in] per projection; the router stays F32, as llama.cpp keeps it
            e, width = shape.experts, shape.expert_width
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", matrix(e, hidden).astype(np.float32))
            w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", matrix(e * width, hidden).reshape(e, width, hidden))
            w.add_tensor(f"blk.{i}.ffn_up_exps.weight", matrix(e * width, hidden).reshape(e, width, hidden))
            w.add_tensor(f"blk.{i}.ffn_down_exps.weight", matrix(e * hidden, width).reshape(e, hidden, width))
            if shape.oss:
                w.add_tensor(f"blk.{i}.ffn_gate_inp.bias", bias(e))
                for part, rows in (("gate", width), ("up", width), ("down", hidden)):
                    w.add_tensor(f"blk.{i}.ffn_{part}_exps.bias", bias(e, rows))
            continue
        w.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(inter, hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", matrix(inter, hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", matrix(hidden, inter))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()


if len(sys.argv) not in (3, 4) or sys.argv[1] not in SHAPES:
    sys.exit(__doc__ + f"\nshapes: {', '.join(SHAPES)}")
shape, out = sys.argv[1], Path(sys.argv[2])
kinds = sys.argv[3].split(",") if len(sys.argv) == 4 else ["Q4_K_M", "Q8_0"]
if unknown := [k for k in kinds if k not in FTYPES and k != "HF"]:
    sys.exit(f"unknown kind {unknown[0]!r}; choose from {', '.join(FTYPES)}, HF")
out.mkdir(parents=True, exist_ok=True)
f16 = out / f"{shape}.F16.gguf"
if not f16.exists():
    write_f16(shape, f16)
for kind in kinds:
    if kind == "HF":  # the HF directory: tidespec's conversion of the F16 file (float32 safetensors shards)
        print(convert_gguf(f16, out / f"{shape}-hf"))
        continue
    dst = out / f"{shape}.{kind}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    if llama_cpp.llama_model_quantize(str(f16).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        sys.exit(f"llama.cpp could not quantize {f16}")
    print(dst)
