"""Write a K-quant GGUF of a model with llama.cpp's own quantizer (llama-cpp-python's
``llama_model_quantize``), for the ``--quantization gguf`` benchmarks: no model hub here, so the files
people download are made from the GGUF at hand.

Usage: ``python docs/benchmarks/requantize_gguf.py [SRC.gguf] OUT.gguf {Q4_K_M,Q5_K_M,Q6_K,Q8_0}``
(SRC defaults to the embedded SmolLM2-135M-Instruct Q4_1 file; a quantized source is re-quantized,
llama.cpp's ``--allow-requantize``). llama-cpp-python is the benchmark's own dependency (README,
"Compare with llama.cpp"), not tidespec's. llama.cpp falls back to Q5_0 / Q8_0 for matrices whose
rows are not whole 256-input super-blocks (SmolLM2-135M's hidden size is 576): it prints which.
"""

import ctypes
import sys
from collections import Counter

import gguf
import llama_cpp

from tidespec.models.loading.loader import resolve_embedded_gguf

FTYPES = {"Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "Q5_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
          "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}

args = sys.argv[1:]
if len(args) not in (2, 3) or args[-1] not in FTYPES:
    sys.exit(__doc__)
src = args[0] if len(args) == 3 else str(resolve_embedded_gguf())
out, kind = args[-2], args[-1]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = FTYPES[kind]
params.allow_requantize = True
if llama_cpp.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params)) != 0:
    sys.exit(f"llama.cpp could not quantize {src}")
types = Counter(gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(out).tensors)
print(f"{out}: {', '.join(f'{t} x{c}' for t, c in types.most_common())}")
