"""What one EAGLE-3 drafting call costs inside the engine, by batch size and speculation length.

The start-up profile times one drafting step with gamma = 1 per batch size (``Profile.d0(drafter, b)``) and
eq. 5 prices gamma of them; this measures what the engine's calls actually take. EAGLE-3 alone (static
gamma), w4a8 eager target, the shipped head with its default drafting quantization; for gamma in 1, 2, 4 and
batch 1 and 4, the workload's first N prompts in waves of the batch, twice (the first round uncounted).
Per configuration: the mean ``propose`` call over the steps where every sequence of a full batch drafted,
the share of it in ``_sync`` (the head's forward over the positions observed since the last call, which
yields the first draft token's logits), and the draft tokens per sequence.

    PYTHONPATH=. .venv/bin/python docs/benchmarks/eagle3_draft_cost.py chat 8
"""
import statistics
import sys
import time

import torch

from tidespec.bench.decode.run import bench_engine_config
from tidespec.bench.spec.waves import wave_target
from tidespec.config import ModelConfig, PolicyConfig, SpecConfig
from tidespec.llm import build_engine
from tidespec.sampling import SamplingParams

workload, limit = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(2)
mc = ModelConfig(quantization="w4a8", threads=2)
target, prompts = wave_target(mc, None, workload, limit)
params = SamplingParams(max_tokens=64, temperature=0.0)
for gamma in (1, 2, 4):
    for b in (1, 4):
        cfg = bench_engine_config(prompts, 64, b, target.model.cfg.max_position_embeddings, mc, None,
                                  SpecConfig(drafter="eagle3", num_speculative_tokens=gamma), PolicyConfig())
        engine = build_engine(cfg, model=target.model, tokenizer=target.tokenizer)
        drafter = engine.drafter
        calls: list[tuple[int, float, float, int]] = []  # (sequences, seconds, seconds in _sync, draft tokens)
        in_sync = [0.0]
        real_propose, real_sync = drafter.propose, drafter._sync

        def sync(states, vocab=None, real_sync=real_sync, in_sync=in_sync):
            t = time.perf_counter()
            out = real_sync(states, vocab)
            in_sync[0] += time.perf_counter() - t
            return out

        def propose(inputs, real_propose=real_propose, calls=calls, in_sync=in_sync):
            in_sync[0] = 0.0
            t = time.perf_counter()
            proposal = real_propose(inputs)
            calls.append((len(inputs), time.perf_counter() - t, in_sync[0], proposal.num_draft_tokens))
            return proposal

        drafter._sync, drafter.propose = sync, propose
        for round_ in range(2):
            for i in range(0, len(prompts), b):
                for p in prompts[i:i + b]:
                    engine.add_request(p.token_ids, params)
                while engine.has_unfinished_requests():
                    engine.step()
            if round_ == 0:
                calls.clear()
        full = [c for c in calls if c[0] == b]
        print(f"gamma {gamma} batch {b}: {len(full)} calls, {statistics.mean(c[1] for c in full) * 1e3:.2f} ms each "
              f"(in _sync {statistics.mean(c[2] for c in full) * 1e3:.2f}), "
              f"{statistics.mean(c[3] for c in full) / b:.2f} draft tokens per sequence", flush=True)
