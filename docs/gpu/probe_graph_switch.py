"""GPU probe (docs/benchmarks/gpu.md): does switching between graphs of different row counts
from one forward to the next cost more than replaying one graph? One ``GraphStep`` call with the
argmax read per forward (random 135M shape, bf16, compiled layer, batch 1), rows per sequence fixed
or cycling. ``PYTHONPATH=$PWD python3 docs/gpu/probe_graph_switch.py``
"""
import time

import torch

from tidespec.bench.anchor.run import SHAPES, random_model
from tidespec.models.execution.graphs import GraphStep
from tidespec.models.kv.cache import KVCache

model = random_model(SHAPES["smollm2-135m"], torch.bfloat16, "cuda", 0)
cfg = model.cfg
kv = KVCache(cfg.num_layers, 1, 512, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda", spare_slot=True)
g = GraphStep(model, kv, (), 6, capture=True, compile=True)
g.warm_up()
patterns = {"6 fixed": (6,), "2 fixed": (2,), "2..6 cycling": (2, 6, 3, 5, 4, 6), "1/6 alternating": (1, 6),
            "1 fixed": (1,), "6 fixed again": (6,)}
for name, qs in patterns.items():
    for rep in range(2):
        per_q: dict[int, list[float]] = {}
        for i in range(300):
            q = qs[i % len(qs)]
            t = time.perf_counter()
            g(list(range(5, 5 + q)), [q], [150], [0]).logits.argmax(-1).tolist()
            per_q.setdefault(q, []).append(time.perf_counter() - t)
        if rep:
            each = ", ".join(f"q={q} {1e3 * sum(v) / len(v):.3f}" for q, v in sorted(per_q.items()))
            total = sum(sum(v) for v in per_q.values()) / 300
            print(f"{name:16s}: mean call {1e3 * total:.3f} ms ({each})", flush=True)
