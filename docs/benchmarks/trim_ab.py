"""The draft trim's effect alone (``speculative/policy/trim.py``): suffix under the analytic policy with and
without ``--trim-drafts``, beside plain decoding and suffix at a static gamma, on several workloads.

The controllers of ``bench spec --hybrid --untrimmed`` mix the trim's effect with EAGLE-3's routing; here
the only drafter is suffix, so the two analytic configurations differ by the trim alone. Every
configuration runs each wave of each workload in turn (``bench/spec/waves.py``), so a prompt is seen once
per engine (the suffix drafter's global tree of past outputs would otherwise flatter a second run).

    PYTHONPATH=. .venv/bin/python docs/benchmarks/trim_ab.py chat,sql_help,cooking,home_repair 16 --batch 4 --compile

Prints per workload and in all: tok/s, x plain, tokens per target step per sequence, ms per decode step,
the share of drafted tokens the trim cut, and outputs equal to plain decoding's.
"""
import argparse
import dataclasses

from tidespec.bench.decode.run import bench_engine_config, wave_indices
from tidespec.bench.spec.waves import WaveRun, run_rounds, run_wave, speed_summary, warm_up, wave_target
from tidespec.config import ModelConfig, PolicyConfig, SpecConfig
from tidespec.llm import build_engine
from tidespec.sampling import SamplingParams
from tidespec.workloads.loader import load_prompts

ap = argparse.ArgumentParser()
ap.add_argument("workloads")
ap.add_argument("limit", type=int)
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--max-tokens", type=int, default=128)
ap.add_argument("--compile", action="store_true")
ns = ap.parse_args()
mc = ModelConfig(quantization="w4a8", threads=2, compile=ns.compile)
names = ns.workloads.split(",")
target, _ = wave_target(mc, None, names[0], ns.limit)
prompts = {w: load_prompts(w, target.tokenizer, ns.limit) for w in names}
everything = [p for w in names for p in prompts[w]]
configs = {"plain": ("none", None), "suffix static": ("suffix", None),
           "suffix analytic, untrimmed": ("suffix", False), "suffix analytic, trimmed": ("suffix", True)}
runs: dict[str, dict[str, WaveRun]] = {w: {} for w in names}
engines = {}
for label, (drafter, trim) in configs.items():
    spec = dataclasses.replace(SpecConfig(), drafter=drafter, num_speculative_tokens=4 if drafter != "none" else 0)
    pc = PolicyConfig() if trim is None else PolicyConfig(name="analytic", trim_drafts=trim)
    econf = bench_engine_config(everything, ns.max_tokens, ns.batch, target.model.cfg.max_position_embeddings, mc,
                                None, spec, pc)
    engines[label] = build_engine(econf, model=target.model, tokenizer=target.tokenizer)
    for w in names:  # one engine per configuration; its counters per workload
        runs[w][label] = WaveRun(label, ns.batch, engines[label])
params = lambda _p: SamplingParams(max_tokens=ns.max_tokens)
for label, engine in engines.items():
    first = runs[names[0]][label]
    warm_up(first, everything, lambda _p: SamplingParams(max_tokens=8),
            wave_indices(len(everything), ns.batch) if ns.compile else ([0],))
    engine.history.clear()
trimmed = {label: [0, 0] for label in configs}  # tokens cut, tokens verified


def each_of(w: str):
    def each(run: WaveRun, wave: list[int]) -> None:
        run_wave(run, prompts[w], wave, params)
        for s in run.engine.history:
            trimmed[run.label][0] += s.num_trimmed
            trimmed[run.label][1] += s.num_draft_tokens
        run.engine.history.clear()
    return each


for w in names:
    run_rounds(list(runs[w].values()), len(prompts[w]), (ns.batch,), f"trim a/b {w}", each_of(w), True)
print(f"batch {ns.batch}, {ns.limit} prompts a workload, up to {ns.max_tokens} tokens, w4a8"
      f"{' + compile' if ns.compile else ''}")
print("| workload | configuration | tok/s | x plain | tokens / step | ms / decode step | s: decode steps / other steps "
      "/ outside steps | outputs = plain |")
print("|---|---|---:|---:|---:|---:|---|---:|")
for w in names:
    plain = runs[w]["plain"]
    for label, run in runs[w].items():
        s = speed_summary(run, plain)
        print(f"| {w} | {label} | {s['tokens_per_s']:.1f} | {s['speedup']:.3f}x | {s['tokens_per_step']:.2f} | "
              f"{s['decode_step_ms']:.1f} | {run.decode_time:.2f} / {run.step_time - run.decode_time:.2f} / "
              f"{run.wall - run.step_time:.2f} | {s['requests'] - s['mismatches']}/{s['requests']} |")
for label, (cut, verified) in trimmed.items():
    if cut or verified:
        print(f"{label}: {cut} drafted tokens cut, {verified} verified ({100 * cut / max(cut + verified, 1):.0f} % cut)")
