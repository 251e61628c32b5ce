"""tidespec's float logits against llama.cpp's on one GGUF file: is a family's model the same model?

Greedy tokens of two engines on random-weight checkpoints (``scale_checkpoint.py``) part early, because
near-flat logits over a large vocabulary make near-ties. This separates that from a real difference
in the architecture: both engines prefill the same 24 random token ids from the file's own weights
(an F16 file: no quantization on either side) and the script prints the relative error of the
logits, their correlation and how many argmaxes agree.

Usage (llama-cpp-python installed as for ``bench decode --compare llamacpp``)::

    PYTHONPATH=. .venv/bin/python docs/benchmarks/llamacpp_logits.py /tmp/scale/qwen3-1.7b.F16.gguf

On 2026-12-06, tiny qwen3 and qwen3moe F16 files (hidden 256, 2 layers) gave relative errors of
3.7e-4 and 4.1e-4 (llama.cpp's float16 arithmetic), Qwen3-1.7B's full F16 file 1.1e-3, gpt-oss-20b's
first 2 layers (``scale_checkpoint.py gpt-oss-20b-2l``: sinks, YaRN, its mixture) 1.6e-3, each with 24/24
argmaxes equal.
"""

import sys

import llama_cpp
import numpy as np
import torch

from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.models.loading.loader import load_model

if len(sys.argv) != 2:
    sys.exit(__doc__)
path = sys.argv[1]
ids = [int(x) for x in np.random.default_rng(0).integers(100, 40000, 24)]
model = load_model(path).model
kv = KVCache.for_model(model.cfg, num_slots=1, max_len=len(ids), dtype=model.dtype)
with torch.inference_mode():
    out = model(torch.tensor(ids), BatchLayout.build(q_lens=[len(ids)], ctx_lens=[0], slots=[0]), kv)
ours = out.logits.double().numpy()  # [T, V]
llm = llama_cpp.Llama(model_path=path, n_ctx=64, logits_all=True, verbose=False, n_threads=2)
llm.eval(ids)
theirs = np.array(llm.scores[:len(ids)], dtype=np.float64)  # [T, V]
rel = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
corr = np.corrcoef(ours.ravel(), theirs.ravel())[0, 1]
same = int((ours.argmax(1) == theirs.argmax(1)).sum())
print(f"{path}: relative error {rel:.2e}, correlation {corr:.6f}, argmax equal {same}/{len(ids)}")
