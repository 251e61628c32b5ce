"""GPU probe (docs/benchmarks/gpu.md): the verification graph's cost per attention variant
inside the compiled layer: cuDNN (SDPA's own choice, ``base``), cuDNN excluded (``notcudnn``), K/V
expanded to every head for the efficient kernel (``expand``), the math path (``math``). Prints
back-to-back replay ms / one call with the argmax read, per rows per sequence; saves the q=6 logits
to compare the variants. One variant per process (each compiles its layer):
``for v in base notcudnn expand math; do PYTHONPATH=$PWD python3 docs/gpu/probe_attention.py $v; done``
"""
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tidespec.models.execution.graphs as graphs_mod
from tidespec.bench.anchor.run import SHAPES, random_model
from tidespec.models.execution.graphs import GraphStep
from tidespec.models.kv.cache import KVCache

variant = sys.argv[1]

def patched(q, q_index, mask, keys, values, causal=False):
    _, n_h, hd = q.shape
    rows, _, q_max, _ = mask.shape
    qb = q.view(rows, q_max, n_h, hd).transpose(1, 2)
    if variant == "expand":
        rep = n_h // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask)
    elif variant == "math":
        with sdpa_kernel([SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask, enable_gqa=True)
    else:  # notcudnn
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(rows * q_max, n_h, hd)

if variant != "base":
    graphs_mod.attend_padded = patched
model = random_model(SHAPES["smollm2-135m"], torch.bfloat16, "cuda", 0)
cfg = model.cfg
kv = KVCache(cfg.num_layers, 1, 512, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda", spare_slot=True)
t = time.perf_counter()
g = GraphStep(model, kv, (), 6, capture=True, compile=True)
g.warm_up()
res = []
ref = None
for q in (1, 2, 4, 6):
    toks = list(range(5, 5 + q))
    o = g(toks, [q], [150], [0])
    if q == 6:
        ref = o.logits.float()
    gr = g.graphs[(1, q, 256)].graph
    for _ in range(20):
        gr.replay()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(300):
        gr.replay()
    torch.cuda.synchronize(); t1 = time.perf_counter()
    for _ in range(200):
        g(toks, [q], [150], [0]).logits.argmax(-1).tolist()
    t2 = time.perf_counter()
    res.append(f"q={q} {1e3 * (t1 - t0) / 300:.3f}/{1e3 * (t2 - t1) / 200:.3f}")
torch.save(ref.cpu(), f"/tmp/ref_{variant}.pt")
print(f"{variant:9s} build {time.perf_counter() - t:5.1f}s  replay/call ms: " + "  ".join(res), flush=True)
