"""K-quant files written by llama.cpp's own quantizer, per family, through tidespec's two GGUF paths.

For a tiny random Llama, Qwen3-MoE and Gemma 3 (hidden 256: whole K-quant super-blocks), an F32 GGUF in
llama.cpp's layout (the tests' writers) is quantized by llama-cpp-python's ``llama_model_quantize`` to
Q4_K_M, Q5_K_M, Q6_K and Q8_0; each file is loaded dequantized to float32 (``--quantization none``) and
as its own blocks (``--quantization gguf``), and their greedy top-1 over 35 positions is compared with
the F32 model's. Run from the repository root (it imports the tests' writers), with llama-cpp-python
installed: ``PYTHONPATH=. .venv/bin/python docs/benchmarks/kquant_families.py [OUT_DIR]``.
"""

import ctypes
import os
import sys
import tempfile
from pathlib import Path

import gguf
import llama_cpp
import torch

out = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="kquant-"))
out.mkdir(parents=True, exist_ok=True)
os.environ.setdefault("TIDESPEC_CACHE", str(out / "cache"))

from tests.helpers import full_logits, tiny_hf_model  # after the cache is chosen
from tests.models.test_gguf_families import CONFIGS, write_family_gguf
from tests.models.test_loader import write_tiny_gguf
from tidespec.models.loading.loader import load_model

FTYPES = {"Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "Q5_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
          "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 261}
ids = list(range(5, 40))
for arch in ("llama", "qwen3-moe", "gemma3"):
    if arch == "llama":
        hf, ours = tiny_hf_model("llama", torch.float32, seed=3, tie_word_embeddings=True, **SHAPE)
        src = write_tiny_gguf(hf, out / f"{arch}.F32.gguf")
    else:
        extra = {**CONFIGS[arch], **SHAPE}
        extra.update({"moe_intermediate_size": 256} if arch == "qwen3-moe" else {"head_dim": 64, "query_pre_attn_scalar": 64})
        hf, ours = tiny_hf_model(arch, torch.float32, seed=3, **extra)
        src = write_family_gguf(hf, arch, out / f"{arch}.F32.gguf")
    ref = full_logits(ours, ids).argmax(-1)
    for name, ftype in FTYPES.items():
        dst = out / f"{arch}.{name}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
            sys.exit(f"llama.cpp could not quantize {src}")
        types = sorted({gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(str(dst)).tensors})
        agree = {q: (full_logits(load_model(str(dst), quantization=q).model, ids).argmax(-1) == ref).float().mean().item()
                 for q in ("none", "gguf")}
        print(f"{arch:9s} {name:6s} {'/'.join(types):22s} top-1 vs F32: dequantized {agree['none']:.2f}, "
              f"own blocks {agree['gguf']:.2f}", flush=True)
