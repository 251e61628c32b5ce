"""What the embedded model writes for the code_edit workload: whether it stops at the file's end, how
much of its output repeats its own earlier text, and what the prediction drafter replays to on it.

Why this exists: issue 78's target (Predicted Outputs >= 2.5x plain at batch 1 on code edits) needs a
model that performs the edits, i.e. writes the file back with one change. This measures whether the
embedded SmolLM2-135M-Instruct does: its greedy outputs up to each file's length in tokens, then

- ``reach_file_length``: outputs that have not stopped by then (an edit done stops there, give or take
  the edit's own tokens);
- ``self_repeat_share``: output tokens that close a 16-token run already in the output (a loop);
- ``drafter_tokens_per_step``: ``PredictionDraft``'s tokens a target step replayed on these outputs
  (greedy: the steps are exactly these), at 192 tokens and at the file's length.

Usage: ``PYTHONPATH=. .venv/bin/python docs/benchmarks/edit_outputs.py [QUANTIZATION]`` (default w4a8;
eager, batch 4, a few minutes on 2 cores).
"""
import json
import sys

from tidespec.bench.decode.run import resolve_target
from tidespec.config import CacheConfig, EngineConfig
from tidespec.engine.engine import LLMEngine
from tidespec.sampling import SamplingParams
from tidespec.speculative.prediction import PredictionDraft
from tidespec.workloads.loader import load_prompts

N, RUN, SHORT = 24, 16, 192
target = resolve_target(None, "float32", "cpu", sys.argv[1] if len(sys.argv) > 1 else "w4a8", 32)
tok = target.tokenizer
prompts = load_prompts("code_edit", tok, N)
preds = [tok.encode(p.record.prediction, add_special_tokens=False) for p in prompts]
engine = LLMEngine(target.model, tok, EngineConfig(cache=CacheConfig(max_model_len=4096, max_num_seqs=4)))
outs: dict[int, list[int]] = {}
for w in range(0, N, 4):
    ids = {engine.add_request(p.token_ids, SamplingParams(max_tokens=len(preds[i]))): i
           for i, p in enumerate(prompts[w:w + 4], w)}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[ids[o.request_id]] = list(o.token_ids)
    print(f"{min(w + 4, N)}/{N} edits", file=sys.stderr, flush=True)


def self_repeats(out: list[int]) -> int:
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for i in range(RUN - 1, len(out)):
        key = tuple(out[i - RUN + 1:i + 1])
        hits += key in seen
        seen.add(key)
    return hits


def replay(i: int, out: list[int]) -> int:
    """Target steps of greedy decoding with the prediction drafter (cap 16, the default) over ``out``."""
    pd, pos, steps = PredictionDraft(preds[i], 16, prompts[i].token_ids), 0, 0
    while pos < len(out):
        draft = pd.draft(len(out) - pos - 1) if len(out) - pos > 1 else []
        a = 0
        while a < len(draft) and draft[a] == out[pos + a]:
            a += 1
        pd.advance(out[pos:pos + a + 1])
        pos, steps = pos + a + 1, steps + 1
    return steps


doc = {"model": target.path, "edits": N, "reach_file_length": sum(len(outs[i]) >= len(preds[i]) for i in outs)}
for label, cut in (("first_192", lambda o: o[:SHORT]), ("file_length", lambda o: o)):
    cuts = {i: cut(o) for i, o in outs.items()}
    total = sum(len(o) for o in cuts.values())
    doc[label] = {"tokens": total,
                  "self_repeat_share": round(sum(self_repeats(o) for o in cuts.values()) / total, 3),
                  "drafter_tokens_per_step": round(total / sum(replay(i, o) for i, o in cuts.items()), 2)}
print(json.dumps(doc, indent=1))
print("sample:", repr(tok.decode(outs[5][:400])))
