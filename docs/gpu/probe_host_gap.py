"""GPU probe (docs/benchmarks/gpu.md): does host time between forwards slow the next forward?
One ``GraphStep`` call with the argmax read, after a busy host gap of 0-1 ms, per rows per sequence.
``PYTHONPATH=$PWD python3 docs/gpu/probe_host_gap.py``
"""
import time

import torch

from tidespec.bench.anchor.run import SHAPES, random_model
from tidespec.models.execution.graphs import GraphStep
from tidespec.models.kv.cache import KVCache

model = random_model(SHAPES["smollm2-135m"], torch.bfloat16, "cuda", 0)
cfg = model.cfg
kv = KVCache(cfg.num_layers, 1, 512, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda", spare_slot=True)
g = GraphStep(model, kv, (), 6, capture=True, compile=False)
g.warm_up()
for q in (1, 6):
    toks = list(range(5, 5 + q))
    for gap_ms in (0.0, 0.1, 0.3, 1.0, 0.0):
        for _ in range(20):
            g(toks, [q], [150], [0]).logits.argmax(-1).tolist()
        total = 0.0
        for _ in range(200):
            t = time.perf_counter()
            while time.perf_counter() - t < gap_ms / 1e3:
                pass
            t = time.perf_counter()
            g(toks, [q], [150], [0]).logits.argmax(-1).tolist()
            total += time.perf_counter() - t
        print(f"q={q} host gap {gap_ms:.1f} ms before each call: call {total / 200 * 1e3:.3f} ms", flush=True)
