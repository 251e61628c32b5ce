"""How much of plain decoding's output on code_edit a prediction could draft at best: an oracle that
knows where the output stands (longest match of the rest of the output anywhere in the source, free
re-alignment), drafting up to CAP tokens a step, each step emitting the accepted run + 1 token."""
import json

from tidespec.bench.decode.run import resolve_target
from tidespec.config import CacheConfig, EngineConfig
from tidespec.engine.engine import LLMEngine
from tidespec.sampling import SamplingParams
from tidespec.workloads.loader import load_prompts

N, MAX, CAP = 24, 192, 16
t = resolve_target(None, "float32", "cpu", "none", 32)
tok = t.tokenizer
prompts = load_prompts("code_edit", tok, N)
e = LLMEngine(t.model, tok, EngineConfig(cache=CacheConfig(max_model_len=4096, max_num_seqs=4)))
outs = {}
for w in range(0, N, 4):
    ids = {e.add_request(p.token_ids, SamplingParams(max_tokens=MAX)): i for i, p in enumerate(prompts[w:w + 4], w)}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                outs[ids[o.request_id]] = list(o.token_ids)

def longest(src, out, i):
    best = 0
    for j in range(len(src)):
        k = 0
        while i + k < len(out) and j + k < len(src) and src[j + k] == out[i + k]:
            k += 1
        best = max(best, k)
    return best

def oracle_steps(src_of, out, cap):
    i = steps = covered = 0
    while i < len(out):
        L = min(longest(src_of(i), out, i), cap, len(out) - i - 1)
        L = max(L, 0)
        covered += L
        i += L + 1
        steps += 1
    return steps, covered

rows = []
for i, p in enumerate(prompts):
    out = outs[i]
    pred = tok.encode(p.record.prediction, add_special_tokens=False)
    sp, cp = oracle_steps(lambda k, pred=pred: pred, out, CAP)
    ss, cs = oracle_steps(lambda k, p=p, out=out: p.token_ids + out[:k], out, CAP)
    rows.append((len(out), sp, cp, ss, cs))
T = sum(r[0] for r in rows)
print(json.dumps({"tokens": T,
                  "prediction_oracle_tokens_per_step": T / sum(r[1] for r in rows),
                  "prediction_oracle_share": sum(r[2] for r in rows) / T,
                  "prompt+output_oracle_tokens_per_step": T / sum(r[3] for r in rows),
                  "prompt+output_oracle_share": sum(r[4] for r in rows) / T}, indent=1))
print("sample output 0:", repr(tok.decode(outs[0])[:600]))
