"""GPU probe (docs/benchmarks/gpu.md): per engine step, graph replay ms per rows (prompt
blocks' too), the prefill steps' forward apart, host time per phase (perf_counter wrappers around the engine's methods) and where the host waits for the GPU
(torch.cuda.set_sync_debug_mode). Random weights of the 135M shape, bf16, compiled layer, batch 1.

Usage on the device machine: ``PYTHONPATH=$PWD python3 docs/gpu/probe_host_phases.py cuda``
(``cpu`` runs the same phases on the CPU, without the replay and sync parts).
"""
import collections
import sys
import time
import traceback
import warnings

import torch

from tidespec.bench.anchor.run import SHAPES, random_model, synthetic_tokenizer
from tidespec.bench.decode.run import run_wave
from tidespec.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from tidespec.engine import engine as engmod
from tidespec.engine.observer import Hooks
from tidespec.llm import build_engine
from tidespec.sampling import SamplingParams
from tidespec.workloads.loader import Prompt, WorkloadRecord

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
cuda = dev == "cuda"
model = random_model(SHAPES["smollm2-135m"], torch.bfloat16 if cuda else torch.float32, dev, 0)
tok = synthetic_tokenizer(model.cfg.vocab_size)
mc = ModelConfig(device=dev, dtype="bfloat16" if cuda else "float32", compile=cuda)
gen = torch.Generator().manual_seed(0)
# a repeating prompt: the suffix drafter finds matches on a random model too
base = torch.randint(1, 49152, (16,), generator=gen).tolist()
prompts = [Prompt(WorkloadRecord(f"r{i}", "random", "completion", ""), (base * 6)[i:i + 80]) for i in range(4)]
acc = collections.defaultdict(float)

def wrap(obj, name, label):
    f = getattr(obj, name)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t
    setattr(obj, name, w)

def sync():
    if cuda:
        torch.cuda.synchronize()

for name, spec in (("plain", SpecConfig()), ("suffix5", SpecConfig(drafter="suffix", num_speculative_tokens=5)),
                   ("eagle3-3", SpecConfig(drafter="eagle3", num_speculative_tokens=3))):
    t0 = time.perf_counter()
    e = build_engine(EngineConfig(model=mc, cache=CacheConfig(max_model_len=512, max_num_seqs=1), spec=spec), model, tok)
    print(f"== {name}: built in {time.perf_counter() - t0:.1f}s", flush=True)
    p = SamplingParams(max_tokens=128, ignore_eos=True)
    run_wave(e, prompts, [0], p)
    g = e.executor.graphs if cuda else None
    if g is not None:
        for key in sorted(g.graphs):
            if key[2] != 256:
                continue
            gr = g.graphs[key].graph
            g._fill_padding(key[0], key[1])
            for _ in range(20):
                gr.replay()
            sync(); t = time.perf_counter()
            for _ in range(200):
                gr.replay()
            sync()
            print(f"  replay {key} taps={g.tap_layers}: {(time.perf_counter() - t) / 200 * 1e3:.3f} ms", flush=True)
    acc.clear()
    for m in ("_plan", "_observe", "_record", "_verify", "_commit_decode", "_want_taps", "_propose"):
        wrap(e, m, m)
    wrap(e.scheduler, "schedule", "schedule")
    wrap(e.runner, "forward", "runner.forward")
    if e.drafter is not None:
        wrap(e.drafter, "propose", "drafter.propose"); wrap(e.drafter, "observe", "drafter.observe")
    orig_emit = engmod.emit
    def emit(*a, orig_emit=orig_emit, **k):
        t = time.perf_counter()
        try:
            return orig_emit(*a, **k)
        finally:
            acc["emit"] += time.perf_counter() - t
    engmod.emit = emit
    tot, toks, prefill = [], [], []
    e.add_observer(Hooks(step_end=lambda s, tot=tot, toks=toks, prefill=prefill: (
        tot.append(s.total_time), toks.append(s.num_emitted_tokens),
        prefill.append(s.verify_time) if s.num_prefill_tokens else None)))
    t = time.perf_counter()
    for i in range(1, 4):
        run_wave(e, prompts, [i], p)
    wall = time.perf_counter() - t
    engmod.emit = orig_emit
    n = len(tot)
    print(f"  {name}: {sum(toks) / wall:.0f} tok/s, steps {n}, tokens/step {sum(toks) / n:.2f}, step {1e3 * sum(tot) / n:.3f} ms, "
          f"prefill forward {1e3 * sum(prefill) / max(len(prefill), 1):.2f} ms x {len(prefill)}; "
          + ", ".join(f"{k} {1e3 * v / n:.3f}" for k, v in sorted(acc.items(), key=lambda kv: -kv[1])), flush=True)
    if cuda:  # where the host waits for the GPU
        seen = collections.Counter()
        def show(message, category, filename, lineno, file=None, line=None, seen=seen):
            frames = [f for f in traceback.extract_stack() if "tidespec" in f.filename and "diag.py" not in f.filename]
            seen[" <- ".join(f"{f.filename.split('tidespec/')[-1]}:{f.lineno}" for f in frames[-3:][::-1])] += 1
        old = warnings.showwarning
        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        run_wave(e, prompts, [1], SamplingParams(max_tokens=24, ignore_eos=True))
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
        for where, count in seen.most_common(12):
            print(f"  sync x{count}: {where}", flush=True)
    del e
