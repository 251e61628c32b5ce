"""``make lm-eval``: lm-evaluation-harness's ``local-completions`` model against a live ``tidespec serve``
on a 50-question loglikelihood task, compared with the same task run in-process by lm-eval's ``hf``
model (transformers) on the same weights.

Why this exists: evaluation harnesses score a served model through ``echo`` + ``logprobs`` (the
prompt's log-probabilities), and a server whose numbers drift from the model's own gives wrong
scores. The embedded model is served in float32 from its GGUF file; transformers loads the same
dequantized float32 weights (tidespec's converted checkpoint). Both must give every answer's
loglikelihood to within float32 rounding and the same accuracy.

Tolerance: ``TOL`` = 2e-3 nats on a continuation's summed log-probability. Two float32 forwards
whose matrix products add in different orders (tidespec's row-invariant kernels, PyTorch's BLAS in
transformers) differ by a few units in the last place of each logit (~1e-6 relative at logits of
~10-30); a log-softmax over 49,152 tokens and a sum over a continuation's few tokens keep that well
under 1e-3. A server that reported raw logits, another position's values or bfloat16 numbers
would be off by 1e-1 or more.

The task is written here (no dataset hub on the machine): 50 multiple-choice questions of
arithmetic, capitals, opposites and sequences, each answer one of four continuations. Not part of
``make test`` (it installs lm-eval and runs two evaluations, ~2-4 minutes).
"""

from __future__ import annotations

import json
import math
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

TOL = 2e-3
MODEL = "smollm2"
CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Egypt", "Cairo"),
            ("Canada", "Ottawa"), ("Germany", "Berlin"), ("Russia", "Moscow"), ("Greece", "Athens"),
            ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo")]
OPPOSITES = [("hot", "cold"), ("up", "down"), ("early", "late"), ("big", "small"), ("light", "dark"),
             ("open", "closed"), ("fast", "slow"), ("happy", "sad"), ("full", "empty"), ("old", "new"),
             ("wet", "dry"), ("hard", "soft")]


def questions(n: int = 50, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` questions, each ``{"question", "choices" (4), "answer" (index)}``, seeded."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    while len(out) < n:
        kind = len(out) % 4
        if kind == 0:
            a, b = rng.randint(2, 40), rng.randint(2, 40)
            right, wrong = str(a + b), [str(a + b + d) for d in rng.sample([-10, -2, -1, 1, 2, 10], 3)]
            q = f"What is {a} plus {b}?"
        elif kind == 1:
            country, right = CAPITALS[len(out) // 4 % len(CAPITALS)]
            wrong = rng.sample([c for _, c in CAPITALS if c != right], 3)
            q = f"What is the capital of {country}?"
        elif kind == 2:
            word, right = OPPOSITES[len(out) // 4 % len(OPPOSITES)]
            wrong = rng.sample([o for w, o in OPPOSITES if o != right], 3)
            q = f"What is the opposite of {word}?"
        else:
            start, step = rng.randint(1, 9), rng.randint(2, 6)
            seq = [start + step * i for i in range(4)]
            right = str(seq[-1] + step)
            wrong = [str(seq[-1] + step + d) for d in rng.sample([-3, -1, 1, 2, 3], 3)]
            q = f"What comes next: {', '.join(map(str, seq))}?"
        choices = [right, *wrong]
        rng.shuffle(choices)
        out.append({"question": q, "choices": choices, "answer": choices.index(right)})
    return out


def write_task(directory: Path) -> str:
    """The task's data and YAML in ``directory``; returns the task name."""
    data = directory / "tidespec_mc.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in questions()))
    (directory / "tidespec_mc.yaml").write_text(f"""task: tidespec_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
    return "tidespec_mc"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(port: int) -> subprocess.Popen[bytes]:
    """``tidespec serve`` of the embedded model in float32 (what transformers loads), until /health answers."""
    proc = subprocess.Popen([sys.executable, "-m", "tidespec.cli", "serve", "--port", str(port), "--dtype", "float32",
                             "--served-model-name", MODEL])
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"tidespec serve exited with {proc.returncode}")
        time.sleep(1)
    proc.kill()
    raise RuntimeError("tidespec serve did not answer /health in 300 s")


def loglikelihoods(result: dict[str, Any], task: str) -> list[list[float]]:
    """Per question, each choice's summed log-probability as lm-eval logged it."""
    return [[float(r[0]) for r in s["filtered_resps"]] for s in sorted(result["samples"][task],
                                                                        key=lambda s: s["doc_id"])]


def main() -> int:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from tidespec.models.loading.loader import hf_checkpoint_dir

    hf_dir = hf_checkpoint_dir(None)  # the embedded GGUF dequantized to float32, as tidespec loads it
    with tempfile.TemporaryDirectory() as tmp:
        task = write_task(Path(tmp))
        tasks = TaskManager(include_path=tmp)
        port = free_port()
        proc = serve(port)
        try:
            t0 = time.perf_counter()
            served = lm_eval.simple_evaluate(
                model="local-completions", tasks=[task], task_manager=tasks, log_samples=True,
                model_args=(f"base_url=http://127.0.0.1:{port}/v1/completions,model={MODEL},tokenizer={hf_dir},"
                            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"))
            t_served = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        t0 = time.perf_counter()
        local = lm_eval.simple_evaluate(model="hf", tasks=[task], task_manager=tasks, log_samples=True,
                                        model_args=f"pretrained={hf_dir},dtype=float32,device=cpu", batch_size=1)
        t_local = time.perf_counter() - t0
    a, b = loglikelihoods(served, task), loglikelihoods(local, task)
    worst = max(abs(x - y) for qa, qb in zip(a, b) for x, y in zip(qa, qb))
    acc = {name: (r["results"][task]["acc,none"], r["results"][task]["acc_norm,none"])
           for name, r in (("tidespec serve", served), ("transformers", local))}
    for name, (ac, an) in acc.items():
        print(f"{name}: acc {ac:.3f}, acc_norm {an:.3f}")
    print(f"{sum(map(len, a))} loglikelihoods over {len(a)} questions; largest |served - transformers| "
          f"{worst:.2e} nats (tolerance {TOL:g}); {t_served:.0f} s served, {t_local:.0f} s in-process")
    ok = len(a) == len(b) == 50 and worst <= TOL and acc["tidespec serve"] == acc["transformers"]
    ok = ok and all(math.isfinite(x) for q in a for x in q)
    print("OK: the served scores equal transformers' to float32 rounding" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
