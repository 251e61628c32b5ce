"""Plain, suffix alone, the per-sequence hybrid and the batch-level controller in one refilled wave, eager: a quick A/B.

A first look, not the verdict: it runs in about a minute per checkout and its greedy routes are the same
from run to run (the policies read the profile, not the clock), so a before/after shows in the route counts
and tokens per sequence-step as well as tok/s. But the target runs eager here, about a third slower than
compiled, while EAGLE-3's head runs eager on both paths, so a model drafter's steps weigh less here than on
the product's path: on 2026-12-06 a router change read +1.5 % here and -10 % in a compiled
``bench spec --hybrid --refill 4`` run of the same day (docs/benchmarks/policies.md). Confirm there. The first
``batch`` prompts warm the engine; then the next ``limit - batch`` are queued at once on ``batch`` slots
(continuous batching, as ``bench spec --refill``). w4a8 eager target, gamma 4, 128 tokens.

    PYTHONPATH=. .venv/bin/python docs/benchmarks/refilled_ab.py chat 16 --batch 4

Before / after a change: the same with ``PYTHONPATH`` at a ``git worktree`` of the older commit, run from
outside the checkout (``cd /tmp``: a script's own folder comes first on ``sys.path``), alternating.
"""
import argparse
import time

from tidespec.bench.decode.run import bench_engine_config
from tidespec.bench.spec.waves import wave_target
from tidespec.config import ModelConfig, PolicyConfig, SpecConfig
from tidespec.llm import build_engine
from tidespec.sampling import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("workload")
ap.add_argument("limit", type=int)
ap.add_argument("--batch", type=int, default=4)
ns = ap.parse_args()
mc = ModelConfig(quantization="w4a8", threads=2)
target, prompts = wave_target(mc, None, ns.workload, ns.limit)
configs = [("plain", "none", PolicyConfig()), ("suffix", "suffix", PolicyConfig()),
           ("per-sequence", "suffix,eagle3", PolicyConfig(name="analytic", per_sequence=True)),
           ("controller", "suffix,eagle3", PolicyConfig(name="analytic"))]
plain_tps = 0.0
for label, drafter, pc in configs:
    spec = SpecConfig(drafter=drafter, num_speculative_tokens=0 if drafter == "none" else 4)
    econf = bench_engine_config(prompts, 128, ns.batch, target.model.cfg.max_position_embeddings, mc, None, spec, pc)
    engine = build_engine(econf, model=target.model, tokenizer=target.tokenizer)
    params = SamplingParams(max_tokens=128)
    for p in prompts[:ns.batch]:
        engine.add_request(p.token_ids, params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.history.clear()
    t = time.perf_counter()
    for p in prompts[ns.batch:]:
        engine.add_request(p.token_ids, params)
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - t
    decode = [s for s in engine.history if s.num_decode_seqs and not s.num_prefill_tokens]
    tps = sum(s.num_emitted_tokens for s in engine.history) / wall
    plain_tps = plain_tps or tps
    per_seq_step = sum(s.num_emitted_tokens for s in decode) / sum(s.num_decode_seqs for s in decode)
    stats = engine.policy.stats() if engine.policy is not None else {}
    routes = {k: int(v) for k, v in stats.items() if k.startswith(("routed_", "probe_steps"))}
    print(f"{label:13s} {tps:6.1f} tok/s {tps / plain_tps:5.3f}x plain, {per_seq_step:.3f} tokens / sequence-step, "
          f"{1e3 * sum(s.total_time for s in decode) / len(decode):.2f} ms / decode step {routes}", flush=True)
