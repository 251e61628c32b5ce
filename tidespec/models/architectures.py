"""The architectures tidespec runs: one row per HF architecture, shared by the config parser and the GGUF converter.

Why this exists: which checkpoints load, which family module runs them and how they differ was
kept in two lists (the model's and the GGUF loader's) and in booleans of the config parser
(``arch == "Qwen2ForCausalLM"``). One table now answers it for ``TargetConfig.from_hf`` (the
family differences a config does not spell out), ``models/loading/gguf_convert.py`` (which GGUF
``general.architecture`` values convert, under which gguf-py tensor names, whether llama.cpp
permuted q/k) and ``models/families`` (which module builds the model). Adding an architecture of
an existing family is one row here; a new family is a row plus its module (docs/architecture.md).

Worked example::

    ARCHITECTURES["Qwen2ForCausalLM"].attention_bias     # True: q/k/v biases by default
    ARCHITECTURES["Olmo2ForCausalLM"].norm_placement     # "post": norms on each block's output only
    GGUF_ARCHITECTURES["llama"].gguf_permuted_qk         # True: llama.cpp permuted q/k rows for its rope
"""

from __future__ import annotations

from dataclasses import dataclass

QK_NORMS = ("none", "head", "proj")  # no q/k norm; RMSNorm per head (Qwen3, Gemma 3); over the whole projection (OLMo 2)
NORM_PLACEMENTS = ("pre", "sandwich", "post")  # Llama; Gemma 2/3 (pre and post each block); OLMo 2 (post only)


@dataclass(frozen=True)
class Architecture:
    """One HF architecture: the family module that runs it and its differences within the family
    that its config.json does not spell out (what it does spell out, ``TargetConfig.from_hf`` reads)."""

    hf_class: str  # config.json's architectures[0]
    family: str = "decoder"  # the module under models/families/ that builds it
    attention_bias: bool = False  # q/k/v projections carry biases unless config.json says otherwise
    o_proj_bias: bool = True  # the output projection carries a bias too when attention_bias says so
    qk_norm: str = "none"  # one of QK_NORMS
    norm_placement: str = "pre"  # one of NORM_PLACEMENTS (families/decoder.py's DecoderLayer)
    norm_offset: bool = False  # Gemma's RMSNorm scales by (1 + weight), in float32 before the cast
    norm_cast_after: bool = False  # OLMo 2's RMSNorm multiplies by its weight in float32, then casts
    embed_scale_sqrt: bool = False  # Gemma: embeddings times sqrt(hidden_size) (rounded to float32, as HF does)
    mlp_bias: bool = False  # the MLP's (or the experts') projections carry biases unless config.json says otherwise
    attention_sinks: bool = False  # a learned logit per head joins each attention softmax (gpt-oss)
    router_topk_first: bool = False  # a biased router, softmax over its top k logits only (gpt-oss)
    gguf: tuple[str, ...] = ()  # GGUF general.architecture values converted to it
    gguf_tensor_names: str = "llama"  # the gguf-py architecture whose tensor names its GGUF files use
    gguf_permuted_qk: bool = False  # llama.cpp's converter permuted q/k rows (undone on conversion)
    gguf_norm_shift: float = 0.0  # llama.cpp stored every norm weight plus this (Gemma: 1; undone on conversion)


ARCHITECTURES: dict[str, Architecture] = {a.hf_class: a for a in (
    Architecture("LlamaForCausalLM", gguf=("llama",), gguf_permuted_qk=True),
    # llama.cpp writes Mistral models as "llama"; a "mistral" file names its tensors as llama does
    Architecture("MistralForCausalLM", o_proj_bias=False, gguf=("mistral",)),
    Architecture("Qwen2ForCausalLM", attention_bias=True, o_proj_bias=False, gguf=("qwen2",), gguf_tensor_names="qwen2"),
    Architecture("Qwen3ForCausalLM", qk_norm="head", gguf=("qwen3",), gguf_tensor_names="qwen3"),
    # NoPE layers (config.json's no_rope_layers)
    Architecture("SmolLM3ForCausalLM", gguf=("smollm3",), gguf_tensor_names="smollm3", gguf_permuted_qk=True),
    Architecture("Olmo2ForCausalLM", qk_norm="proj", norm_placement="post", norm_cast_after=True,
                 gguf=("olmo2",), gguf_tensor_names="olmo2"),
    # embedding, residual, attention and logits multipliers (config.json)
    Architecture("GraniteForCausalLM", gguf=("granite",), gguf_tensor_names="granite", gguf_permuted_qk=True),
    # fused qkv_proj / gate_up_proj in the checkpoint, partial rotary, LongRoPE
    Architecture("Phi3ForCausalLM", o_proj_bias=False, gguf=("phi3",), gguf_tensor_names="phi3"),
    # sliding and global layers (config.json's layer_types), each with its own rope; gelu-tanh MLP
    # a mixture of experts in place of the MLP (config.json's num_experts, decoder_sparse_step, ...)
    Architecture("Qwen3MoeForCausalLM", qk_norm="head", gguf=("qwen3moe",), gguf_tensor_names="qwen3moe"),
    Architecture("MixtralForCausalLM", o_proj_bias=False),
    # attention sinks, sliding and global layers, YaRN rope, biased router and experts, clamped SwiGLU
    Architecture("GptOssForCausalLM", attention_bias=True, norm_cast_after=True, mlp_bias=True,
                 attention_sinks=True, router_topk_first=True, gguf=("gpt-oss",), gguf_tensor_names="gpt-oss"),
    # Gemma 3 without q/k norms, with soft caps on the attention scores and the logits (config.json)
    Architecture("Gemma2ForCausalLM", norm_placement="sandwich", norm_offset=True, embed_scale_sqrt=True,
                 gguf=("gemma2",), gguf_tensor_names="gemma2", gguf_norm_shift=1.0),
    Architecture("Gemma3ForCausalLM", qk_norm="head", norm_placement="sandwich", norm_offset=True,
                 embed_scale_sqrt=True, gguf=("gemma3",), gguf_tensor_names="gemma3", gguf_norm_shift=1.0),
)}
GGUF_ARCHITECTURES: dict[str, Architecture] = {g: a for a in ARCHITECTURES.values() for g in a.gguf}
