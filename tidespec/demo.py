"""``make demo``: plain decoding vs speculative drafters on the embedded SmolLM2-135M-Instruct.

Why this exists: the shortest honest answer to "does speculation help here, and is it
lossless?" Each prompt (a few code and chat prompts from the shipped workloads) is decoded
greedily with plain decoding and with each drafter; the demo checks the outputs are identical,
and prints per-prompt speedup and mean acceptance length — per prompt, because a mean over
prompts hides the ones where speculation loses. The n-gram and suffix columns run the
``static`` policy (fixed gamma); the last column runs the suffix drafter under the ``hybrid``
policy (Nightjar's bandit with TIDE's profiled model as prior; the profile is measured once and
cached), one policy instance across all prompts as a server would, and the demo ends with what
that policy decided.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from tidespec.bench.workload import load_prompts
from tidespec.config import CacheConfig, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.models.loader import load_model
from tidespec.control.policy import SpeculationPolicy
from tidespec.runtime import build_drafter, build_policy
from tidespec.sampling import SamplingParams


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    mean_acceptance_length: float


def decode_one(model, tokenizer, spec: SpecConfig, prompt: list[int], max_tokens: int,
               policy: SpeculationPolicy | None = None) -> Run:
    cfg = EngineConfig(cache=CacheConfig(max_model_len=1024, max_num_seqs=1), spec=spec)
    engine = LLMEngine(model, tokenizer, cfg, drafter=build_drafter(spec, model, 1, 1024), policy=policy)
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    t0 = time.perf_counter()
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            final = o
    assert final is not None
    return Run(final.token_ids, time.perf_counter() - t0, final.stats.mean_acceptance_length)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts-per-domain", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args(argv)
    torch.set_num_threads(ns.threads)
    con = Console(width=max(Console().width, 176))  # the table needs ~170 columns; never wrap it
    con.print("[bold]tidespec demo[/bold] — embedded SmolLM2-135M-Instruct, float32, CPU, batch 1, greedy; "
              f"policies: static gamma={ns.gamma} (ngram, suffix), hybrid gamma<={ns.gamma} (suffix+hybrid)")
    t_load = time.perf_counter()
    loaded = load_model(None)
    con.print(f"model loaded in {time.perf_counter() - t_load:.1f} s from {loaded.path}")
    prompts = []
    for name in ("code", "chat"):
        prompts += [(name, p) for p in load_prompts(name, loaded.tokenizer, limit=ns.prompts_per_domain)]
    drafters = {
        "ngram": SpecConfig(drafter="ngram", num_speculative_tokens=ns.gamma, ngram_min=2, ngram_max=4),
        "suffix": SpecConfig(drafter="suffix", num_speculative_tokens=ns.gamma),
    }
    adaptive = SpecConfig(drafter="suffix", num_speculative_tokens=ns.gamma, policy="hybrid")
    policy = build_policy(adaptive, loaded.model, build_drafter(adaptive, loaded.model, 1, 1024),
                          progress=lambda m: con.print(f"  {m}"))
    assert policy is not None
    policies: dict[str, SpeculationPolicy | None] = {name: None for name in drafters}
    drafters["suffix+hybrid"] = adaptive
    policies["suffix+hybrid"] = policy
    decode_one(loaded.model, loaded.tokenizer, SpecConfig(), prompts[0][1].token_ids, 4)  # warm-up
    table = Table(title="plain vs speculative decoding (identical outputs checked)")
    for col in ("domain", "prompt", "tokens", "plain tok/s"):
        table.add_column(col, no_wrap=True)
    for name in drafters:
        table.add_column(f"{name} speedup")
        table.add_column(f"{name} accept len")
    totals = {name: [0.0, 0.0] for name in drafters}
    lossless = True
    for domain, p in prompts:
        base = decode_one(loaded.model, loaded.tokenizer, SpecConfig(), p.token_ids, ns.max_tokens)
        row = [domain, " ".join(p.record.prompt.split())[:28], str(len(base.tokens)),
               f"{len(base.tokens) / base.seconds:.1f}"]
        for name, spec in drafters.items():
            r = decode_one(loaded.model, loaded.tokenizer, spec, p.token_ids, ns.max_tokens, policies[name])
            same = r.tokens == base.tokens
            lossless &= same
            totals[name][0] += base.seconds
            totals[name][1] += r.seconds
            row += [f"{base.seconds / r.seconds:.2f}x" + ("" if same else " MISMATCH"),
                    f"{r.mean_acceptance_length:.2f}"]
        table.add_row(*row)
        con.print(f"  done: {domain} {p.record.id}")
    con.print(table)
    for name, (tb, ts) in totals.items():
        con.print(f"{name}: overall speedup {tb / ts:.2f}x over plain decoding")
    st = policy.stats()
    con.print(f"policy that ran in suffix+hybrid: {policy.name} — {st.get('explore_steps', 0):.0f} exploration / "
              f"{st.get('exploit_steps', 0):.0f} exploitation steps, gamma chosen at batch 1: "
              f"{st.get('gamma_b1', float('nan')):.0f}, model calibration {st.get('calibration', float('nan')):.2f}")
    con.print("outputs identical to plain decoding: " + ("[green]yes[/green]" if lossless else "[red]NO[/red]"))
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
