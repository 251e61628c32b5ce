"""What serving pays when a published EAGLE-3 head of a wider draft vocabulary is swapped in (issue 80).

Why this exists: an online round that widens the head's draft vocabulary (8,192 -> 8,228 tokens on
Arabic) publishes a head the compiled head step (``--compile`` on a CPU) was not traced for, and its
first drafts compile new graphs on the engine thread (3.1 s and 1.2 s in bench shift on a Xeon). This
script serves requests through one engine, publishes a widened copy of the served head after
``--swap-at`` requests, lets the updater load it on a thread of its own (as its poller does) while
serving goes on, and reports every request's time, the longest step, and the serving time lost against
the median request before the swap. Run it at two commits (``PYTHONPATH`` at each tree) to compare
ways of bringing the new head in (docs/benchmarks/learning.md, 2026-12-07: compiling on the updater's
thread and in a child process both lost more than the stall).

Each run widens by its own ``EXTRA`` tokens: inductor's cache on disk keeps the graphs of a vocabulary
size it has compiled, so a size already compiled by an earlier run would hide the compile.

With ``--bad-start`` it measures instead how soon the policy takes up a better head: the engine serves a
random head of the shipped head's configuration until the swap (the analytic policy parks it), then the
shipped head is published (``EXTRA`` 0: same configuration, nothing to compile); the table's last column
is the share of steps that drafted.

Usage (the repository root; a CPU; the embedded model)::

    PYTHONPATH=. .venv/bin/python docs/benchmarks/swap_stall.py 37 [--quantization none] [--requests 12]
    PYTHONPATH=. .venv/bin/python docs/benchmarks/swap_stall.py 0 --bad-start --policy analytic --no-compile \
        --workload code_unseen --requests 24 --swap-at 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import torch

from tidespec.config import CacheConfig, EngineConfig, ModelConfig, PolicyConfig, SpecConfig
from tidespec.llm import build_engine
from tidespec.models.eagle3.checkpoint import publish
from tidespec.models.eagle3.head import Eagle3Head
from tidespec.models.target import output_matrix
from tidespec.online.serving.attach import DrafterUpdater
from tidespec.online.training.data import widen_head
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.eagle3 import Eagle3Drafter
from tidespec.workloads.loader import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("extra", type=int, help="tokens the published head's draft vocabulary gains (a new size per run)")
    ap.add_argument("--quantization", default="none", help="the target's (w4a8 where AVX512-VNNI runs it)")
    ap.add_argument("--workload", default="ar_topics")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--swap-at", type=int, default=4, help="requests served before the widened head is published")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--policy", default="static")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--bad-start", action="store_true", help="serve a random head until the shipped one is published")
    ns = ap.parse_args()
    torch.set_num_threads(2)
    cfg = EngineConfig(model=ModelConfig(compile=ns.compile, quantization=ns.quantization, threads=2),
                       cache=CacheConfig(max_num_seqs=2, max_model_len=1024), policy=PolicyConfig(name=ns.policy),
                       spec=SpecConfig(drafter="eagle3", num_speculative_tokens=ns.gamma))
    t0 = time.perf_counter()
    engine = build_engine(cfg)
    drafter = engine.drafter
    assert isinstance(drafter, Eagle3Drafter)
    print(f"engine built and compiled in {time.perf_counter() - t0:.1f} s; head of {drafter.head.cfg.draft_vocab_size} "
          f"draft tokens, drafting with {type(drafter.served.lm_head).__name__}")
    wider = widen_head(drafter.head, drafter.head.cfg.draft_vocab_size + ns.extra, [], output_matrix(engine.model))
    if ns.bad_start:
        torch.manual_seed(0)
        drafter.load_state(0, Eagle3Head(drafter.head.cfg).state_dict())
    root = tempfile.mkdtemp(prefix="swap-stall-")
    updater = DrafterUpdater(drafter, root, engine.model.cfg, poll_s=1.0)
    engine.add_observer(updater)
    prompts = load_prompts(ns.workload, engine.tokenizer, ns.requests)
    params = SamplingParams(max_tokens=ns.max_tokens, ignore_eos=True)
    rows: list[tuple[int, float, float, int, int, float]] = []  # request, seconds, longest step, tokens, version, drafted
    loader: threading.Thread | None = None
    published = swapped = 0.0
    for i, prompt in enumerate(prompts):
        if i == ns.swap_at:
            publish(root, wider, {"note": f"widened by {ns.extra}"})
            published = time.perf_counter()
            loader = threading.Thread(target=updater.poll_once, name="updater")  # as the poller's thread does
            loader.start()
        engine.add_request(prompt.token_ids, params, request_id=str(i))
        start, longest, tokens, steps, drafted = time.perf_counter(), 0.0, 0, 0, 0
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            outs = engine.step()
            longest = max(longest, time.perf_counter() - t)
            tokens += sum(len(o.delta_token_ids) for o in outs)
            steps, drafted = steps + 1, drafted + (engine.history[-1].num_drafts > 0)
            if not swapped and drafter.version > 0:
                swapped = time.perf_counter()
        rows.append((i, time.perf_counter() - start, longest, tokens, drafter.version, drafted / steps))
    if loader is not None:
        loader.join()
    print("| request | version at its end | seconds | tok/s | longest step, ms | steps that drafted |")
    print("|---:|---:|---:|---:|---:|---:|")
    for i, sec, longest, tokens, version, share in rows:
        print(f"| {i} | v{version} | {sec:.2f} | {tokens / sec:.1f} | {1000 * longest:.0f} | {share:.2f} |")
    before = [r for r in rows if r[0] < ns.swap_at]
    after = [r for r in rows if r[0] >= ns.swap_at]
    print(f"published -> swapped in: {swapped - published:.1f} s" if swapped else "never swapped in")
    median = statistics.median(r[1] for r in before)
    print(f"longest step before the swap {1000 * max(r[2] for r in before):.0f} ms, from the swap on "
          f"{1000 * max(r[2] for r in after):.0f} ms; median request {median:.2f} s before, "
          f"{statistics.median(r[1] for r in after):.2f} s after; serving time lost from the swap on, against "
          f"that median: {sum(r[1] for r in after) - median * len(after):.1f} s")


if __name__ == "__main__":
    main()
