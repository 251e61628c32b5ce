"""What EAGLE-3's drafting calls cost under the per-sequence hybrid, against the profile's D0.

The profile times a drafting call on a context the head has caught up with (1-2 new rows a sequence); under
per-sequence drafting a sequence comes back to EAGLE-3 after steps on the suffix drafter or none, and the
call first catches the head up on every row it missed (``_sync``). Per number of sequences in the call: the
calls, their mean time and the part in ``_sync``, the rows caught up per sequence, and the profile's
``D0(eagle3, k)`` that eq. 5 charges per gamma. w4a8 eager target, the shipped head, gamma 4, the
workload's first N prompts queued at once on B slots (refilled), 128 tokens.

    PYTHONPATH=. .venv/bin/python docs/benchmarks/eagle3_routed_calls.py chat 16 4   # workload, prompts, batch
"""
import statistics
import sys
import time
from collections import defaultdict

from tidespec.bench.decode.run import bench_engine_config
from tidespec.bench.spec.waves import wave_target
from tidespec.config import ModelConfig, PolicyConfig, SpecConfig
from tidespec.llm import build_engine
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.multi import find_member

workload, limit, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 4
model_config = ModelConfig(quantization="w4a8", threads=2)
target, prompts = wave_target(model_config, None, workload, limit)
spec = SpecConfig(drafter="suffix,eagle3", num_speculative_tokens=4)
econf = bench_engine_config(prompts, 128, batch, target.model.cfg.max_position_embeddings, model_config, None, spec,
                            PolicyConfig(name="analytic", per_sequence=True))
engine = build_engine(econf, model=target.model, tokenizer=target.tokenizer)
head = find_member(engine.drafter, "eagle3")
profile = engine.policy.inner.profile  # the analytic policy, inside its guards
calls: list[tuple[int, float, float, int]] = []  # (sequences, seconds, seconds in _sync, rows caught up)
in_sync: list[tuple[float, int]] = []
real_propose, real_sync = head.propose, head._sync


def sync(states, vocab=None):
    rows = sum(max(0, min(st.taps.end, len(st.tokens) - 1 - st.base, head.cfg.max_model_len) - st.kv_len)
               for st in states if not st.lost)
    t = time.perf_counter()
    out = real_sync(states, vocab)
    in_sync.append((time.perf_counter() - t, rows))
    return out


def propose(inputs):
    in_sync.clear()
    t = time.perf_counter()
    out = real_propose(inputs)
    seconds, rows = in_sync[0] if in_sync else (0.0, 0)
    calls.append((len(inputs), time.perf_counter() - t, seconds, rows))
    return out


head._sync, head.propose = sync, propose
params = SamplingParams(max_tokens=128)
for p in prompts:
    engine.add_request(p.token_ids, params)
while engine.has_unfinished_requests():
    engine.step()
by_size: dict[int, list[tuple[int, float, float, int]]] = defaultdict(list)
for c in calls:
    by_size[c[0]].append(c)
print("| sequences in the call | calls | ms per call | in _sync | rows caught up per sequence | profile D0 (ms) |")
print("|---:|---:|---:|---:|---:|---:|")
for k, cs in sorted(by_size.items()):
    print(f"| {k} | {len(cs)} | {statistics.mean(c[1] for c in cs) * 1e3:.2f} | {statistics.mean(c[2] for c in cs) * 1e3:.2f} | "
          f"{statistics.mean(c[3] for c in cs) / k:.1f} | {profile.d0('eagle3', k) * 1e3:.2f} |")
