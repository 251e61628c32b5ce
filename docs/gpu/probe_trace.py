"""GPU probe (docs/benchmarks/gpu.md): torch.profiler traces of 12 engine steps, plain and the
suffix drafter (random 135M shape, bf16, compiled), and the graph's replay vs one call with real
inputs. ``PYTHONPATH=$PWD python3 docs/gpu/probe_trace.py OUT_DIR`` writes OUT_DIR/{plain,suffix5}.json.
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tidespec.bench.anchor.run import SHAPES, random_model, synthetic_tokenizer
from tidespec.bench.decode.run import run_wave
from tidespec.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from tidespec.llm import build_engine
from tidespec.sampling import SamplingParams
from tidespec.workloads.loader import Prompt, WorkloadRecord

out = sys.argv[1]
model = random_model(SHAPES["smollm2-135m"], torch.bfloat16, "cuda", 0)
tok = synthetic_tokenizer(model.cfg.vocab_size)
mc = ModelConfig(device="cuda", dtype="bfloat16", compile=True)
gen = torch.Generator().manual_seed(0)
base = torch.randint(1, 49152, (16,), generator=gen).tolist()
prompts = [Prompt(WorkloadRecord(f"r{i}", "random", "completion", ""), (base * 6)[i:i + 80]) for i in range(4)]
for name, spec in (("plain", SpecConfig()), ("suffix5", SpecConfig(drafter="suffix", num_speculative_tokens=5))):
    e = build_engine(EngineConfig(model=mc, cache=CacheConfig(max_model_len=512, max_num_seqs=1), spec=spec), model, tok)
    run_wave(e, prompts, [0], SamplingParams(max_tokens=64, ignore_eos=True))
    g = e.executor.graphs
    for q in ((1,) if name == "plain" else (1, 6)):
        o = g(list(range(5, 5 + q)), [q], [150], [0])  # real inputs, then replay that graph
        gr = g.graphs[(1, q, 256)].graph
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(200):
            gr.replay()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for _ in range(100):
            gr.replay(); torch.cuda.synchronize()
        t2 = time.perf_counter()
        for _ in range(100):
            g(list(range(5, 5 + q)), [q], [150], [0]).logits.argmax(-1).tolist()
        t3 = time.perf_counter()
        print(f"{name} q={q}: replay back-to-back {(t1 - t) / 200 * 1e3:.3f} ms, replay+sync {(t2 - t1) / 100 * 1e3:.3f} ms, "
              f"GraphStep call+argmax+tolist {(t3 - t2) / 100 * 1e3:.3f} ms", flush=True)
    e.add_request(prompts[1].token_ids, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(30):
        e.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(12):
            e.step()
    prof.export_chrome_trace(f"{out}/{name}.json")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14), flush=True)
    while e.has_unfinished_requests():
        e.step()
    del e
