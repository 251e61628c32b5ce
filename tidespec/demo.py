"""``make demo``: the mission's showcase on the embedded SmolLM2-135M-Instruct, in two parts.

Why this exists: the shortest honest answer to "does speculation help here, is it lossless, and
does the drafter learn while it serves?"

It runs on the product's fastest exact path that starts within its 4 minutes (``--path auto``,
printed first): the target's projections as GGUF Q4_1 blocks times int8 activations (w4a8, ~1.8x
float32 plain decoding on the 2-core VM; float32 on a CPU without AVX512-VNNI, where w4a8 cannot run), eager: the compiled step decodes ~2x faster again per
token but its compiles cost more than they save in a demo this short (``choose_path``);
``--path w4a8+compile`` runs it anyway (every engine shares one KV cache shape, so the step compiles
once, and once more with taps).

Part 1 — drafters and policy. A few code and chat prompts, each decoded greedily with plain
decoding and with each model-free drafter; the demo checks the outputs are identical and prints
per-prompt speedup and mean acceptance length (per prompt, because a mean hides the prompts where
speculation loses). The n-gram and suffix columns run the ``static`` policy (fixed gamma); the
last column runs the suffix drafter under the ``hybrid`` policy (Nightjar's bandit with TIDE's
profiled model as prior; the profile is measured once and cached), and the demo reports what that
policy decided.

Part 2 — everything on: an EAGLE-3 drafter learning online (TIDE) beside the suffix drafter,
under the per-sequence hybrid (each sequence its own drafter and length every step, priced by the
analytic cost model); the demo prints each drafter's share of the sequence-steps and the learned
drafter's own gain (EAGLE-3's acceptance length learning against frozen, by quarter). A request trace
that shifts domain — code the drafter never saw, then everyday questions in Russian, a script the
shipped head never drafted (``ru_topics``; on English chat a round has little to teach it,
docs/benchmarks/learning.md) — runs through the
engine three ways, taking turns on slices of the trace: plain decoding, suffix + EAGLE-3 plus online
training, and the same drafters with nothing learning across requests (``no-learning``: the shipped
head, and suffix over each request's own tokens, without its tree of past outputs) — the control
that tells learning from the prompts' own difficulty, which moves a phase's acceptance from quarter
to quarter as much as learning does. The hybrid chooses per sequence and step which drafter drafts and
how far (or none: then the sequence decodes as plain decoding would), the engine captures the target's hidden states
(its taps, and its final hidden state, from which the trainer recovers the target's top-k
distribution), selective collection switches on at the shift,
``tidespec train-drafter`` runs as a child process that yields the CPU to serving (paused while
requests are decoded, ``--trainer-share``), and serving is idle for ``--idle-s`` seconds after every
turn of 4 requests, as between bursts of real traffic, which is when the trainer gets the CPU (both
cores: it never runs beside a step). LoRA first (EvoSpec's path B, ``--online-lora``): every few
hundred new rows the trainer updates small adapters on the head's draft layer and publishes them
only if they beat the served head on the rows served after the update; a full round retrains the
whole head once ``--min-signals`` rows arrived, publishes it only if it beats the current one on
held-out rows, and judges it again, paired with the one it replaced, on the rows captured after it.
The engine swaps each better drafter (``v2``) or adapter (``v2+a1``) in between steps. A live
progress line shows acceptance, the drafter served and tokens/s; the demo ends with a per-phase table
against plain decoding, the shifted phase by quarter (the drafter version served; acceptance served
and per drafter; tokens per target step against the same requests without learning, and what
learning gained), a plot, and the losslessness check (every output equal to plain's). The starting
drafter is the bootstrap shipped in ``tidespec/assets`` (trained by our own trainer on prompts
disjoint from the trace; recipe in its README), or a fresh head when it is missing.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tidespec.bench.shift.config import ShiftBenchConfig, served_label
from tidespec.bench.shift.report import drafter_shares, quarters_of
from tidespec.bench.shift.run import run_shift_bench
from tidespec.config import CacheConfig, EngineConfig, ModelConfig, PolicyConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.errors import UserError
from tidespec.llm import build_drafter, build_policy
from tidespec.models.eagle3.checkpoint import shipped_bootstrap
from tidespec.models.loading.loader import LoadedModel, load_model
from tidespec.models.quant.a8 import a8_error
from tidespec.online.training.judge import gain_interval
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.ngram import NgramOptions
from tidespec.speculative.policy.api import SpeculationPolicy
from tidespec.workloads.loader import load_prompts, load_workload

PATHS = ("auto", "float32", "w4a8", "w4a8+compile")
# one KV cache shape for both parts: the compiled step is compiled once per cache shape (and again for the
# graphs with taps), so every engine of the demo shares the first one's graphs
SLOTS, MAX_LEN = 2, 1024


def choose_path(asked: str) -> tuple[str, str]:
    """The exact path the demo runs and why: ``asked`` unless auto. auto is the fastest exact path that
    starts within the demo's 4 minutes, measured on the 2-core VM (docs/benchmarks/README.md, make demo):
    w4a8 eager (GGUF Q4_1 blocks times int8 activations, ~1.8x float32's plain decoding, loads in seconds),
    the whole demo in 129 s. w4a8 + compile decodes ~2x faster again per token, but its compiles (the step,
    then the graphs with taps and the profiler's) made the demo 240 s with inductor's cache warm and 370 s
    cold: more than they save in a demo this short."""
    if asked != "auto":
        return asked, "asked (--path)"
    error = a8_error()
    if error is not None:  # an AMD EPYC without AVX-512, 2026-12-07: float32 22.8 tok/s with prefill, int4 21.7, int8 19.9
        return "float32", (f"auto: w4a8 cannot run here ({error}); float32 is the fastest exact path on such a CPU, "
                           "measured with bench decode")
    return "w4a8", ("auto: the fastest exact path that starts within the demo's time; --path w4a8+compile "
                    "decodes ~2x faster per token but compiles for 1-4 minutes on 2 cores first")


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    mean_acceptance_length: float


def decode_one(model, tokenizer, spec: SpecConfig, prompt: list[int], max_tokens: int,
               policy: SpeculationPolicy | None = None, compile: bool = False) -> Run:
    cfg = EngineConfig(model=ModelConfig(compile=compile), cache=CacheConfig(max_model_len=MAX_LEN, max_num_seqs=SLOTS),
                       spec=spec)
    engine = LLMEngine(model, tokenizer, cfg, drafter=build_drafter(spec, model, SLOTS, MAX_LEN), policy=policy)
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    t0 = time.perf_counter()
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            final = o
    assert final is not None
    return Run(final.token_ids, time.perf_counter() - t0, final.stats.mean_acceptance_length)


def part_drafters(con: Console, loaded: LoadedModel, ns: argparse.Namespace) -> bool:
    """Part 1: plain vs n-gram, suffix and suffix+hybrid per prompt; True when all outputs matched."""
    prompts = []
    for name in ("code", "chat"):
        prompts += [(name, p) for p in load_prompts(name, loaded.tokenizer, limit=ns.prompts_per_domain)]
    drafters = {
        "ngram": SpecConfig(drafter="ngram", num_speculative_tokens=ns.gamma,
                            options={"ngram": NgramOptions(min=2, max=4)}),
        "suffix": SpecConfig(drafter="suffix", num_speculative_tokens=ns.gamma),
    }
    adaptive = SpecConfig(drafter="suffix", num_speculative_tokens=ns.gamma)
    t0 = time.perf_counter()  # warm-up: first calls of the kernels, and the compile of the compiled path
    decode_one(loaded.model, loaded.tokenizer, SpecConfig(), prompts[0][1].token_ids, 4, compile=ns.compiled)
    if ns.compiled:
        con.print(f"  compiled the decode step in {time.perf_counter() - t0:.0f} s "
                  "(every engine of the demo shares it)")
    policy = build_policy(EngineConfig(model=ModelConfig(compile=ns.compiled), spec=adaptive,
                                       policy=PolicyConfig(name="hybrid")),
                          loaded.model, build_drafter(adaptive, loaded.model, SLOTS, MAX_LEN),
                          progress=lambda m: con.print(f"  {m}"))
    assert policy is not None
    policies: dict[str, SpeculationPolicy | None] = {name: None for name in drafters}
    drafters["suffix+hybrid"] = adaptive
    policies["suffix+hybrid"] = policy
    table = Table(title="part 1: plain vs model-free drafters, batch 1 (identical outputs checked)")
    for col in ("domain", "prompt", "tokens", "plain tok/s"):
        table.add_column(col, no_wrap=True)
    for name in drafters:
        table.add_column(f"{name} speedup")
        table.add_column(f"{name} accept len")
    totals = {name: [0.0, 0.0] for name in drafters}
    lossless = True
    for domain, p in prompts:
        base = decode_one(loaded.model, loaded.tokenizer, SpecConfig(), p.token_ids, ns.max_tokens, compile=ns.compiled)
        row = [domain, " ".join(p.record.prompt.split())[:28], str(len(base.tokens)),
               f"{len(base.tokens) / base.seconds:.1f}"]
        for name, spec in drafters.items():
            r = decode_one(loaded.model, loaded.tokenizer, spec, p.token_ids, ns.max_tokens, policies[name],
                           compile=ns.compiled)
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
    return lossless


def _shown(value: float, unit: str = "") -> str:
    """A figure for the console: two decimals, "-" where there is none (NaN: nothing was measured)."""
    return "-" if math.isnan(value) else f"{value:.2f}{unit}"


def part_online(con: Console, loaded: LoadedModel, ns: argparse.Namespace) -> bool:
    """Part 2: the domain-shift trace, plain vs EAGLE-3 with online training; True when lossless."""
    boot = shipped_bootstrap()
    con.print(f"starting drafter: {boot if boot else 'fresh random head (no shipped bootstrap found)'}; "
              f"drafters suffix + EAGLE-3, the per-sequence hybrid (each sequence its own drafter and length every "
              f"step, gamma <= {ns.gamma}); trainer: a child "
              f"process with {ns.threads} threads, running {ns.trainer_share:.0%} of the busy time and whenever serving "
              f"is idle ({ns.idle_s:g} s after every 4 requests, off the clock): LoRA adapters every few hundred rows, "
              f"the whole head every {ns.min_signals} rows (lr {ns.trainer_lr:g})")
    cfg = ShiftBenchConfig(workloads=f"code_unseen:{ns.code_requests},{ns.shift_workload}:{ns.shift_requests}",
                           max_tokens=ns.max_tokens, gamma=ns.gamma, concurrency=2, configs="plain,no-learning,online",
                           drafter="suffix,eagle3", policy="analytic", per_sequence=True, turn=4,
                           trainer_share=ns.trainer_share, compile=ns.compiled, max_model_len=MAX_LEN,
                           bootstrap=str(boot) if boot else None, min_signals=ns.min_signals, collect_n_init=4,
                           window=4, bin_s=10.0, overhead_repeats=0, recompute_rows=0, online_lora=True,
                           trainer_threads=ns.threads, trainer_catchup_s=ns.idle_s, trainer_epochs=2.0,
                           trainer_args=f"--lr {ns.trainer_lr:g} --finetune-lr {ns.trainer_lr:g}")
    out = Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    doc = run_shift_bench(cfg, loaded, out, command="make demo", log=lambda _: None)
    plain, online, still = doc["configs"]["plain"], doc["configs"]["online"], doc["configs"]["no-learning"]
    table = Table(title="part 2: suffix + EAGLE-3 learning online, each sequence its own drafter, a domain shift "
                        "(vs plain decoding, 2 in flight, taking turns of 4 requests)")
    for col in ("phase", "requests", "plain tok/s", "online tok/s", "speedup", "accept len",
                "no-learning: speedup, accept len", "drafters served (version+adapter)"):
        table.add_column(col, no_wrap=True)
    for pp, po, ps in zip(plain["phases"], online["phases"], still["phases"]):
        table.add_row(f"{po['phase']}: {po['workload']}", str(po["requests"]), f"{pp['tok_s']:.1f}",
                      f"{po['tok_s']:.1f}", f"{po['speedup']:.2f}x", f"{po['mean_acceptance_length']:.2f}",
                      f"{ps['speedup']:.2f}x, {ps['mean_acceptance_length']:.2f}", ",".join(po["served"]))
    table.add_row("all", str(sum(p["requests"] for p in online["phases"])), f"{plain['tok_s']:.1f}",
                  f"{online['tok_s']:.1f}", f"{online['speedup']:.2f}x", f"{online['mean_acceptance_length']:.2f}",
                  f"{still['speedup']:.2f}x, {still['mean_acceptance_length']:.2f}", "")
    con.print(table)
    reqs = doc["runs"]["online"]["requests"]
    for po, ps in zip(online["phases"][1:], still["phases"][1:]):
        mine = [r for r in reqs if r["phase"] == po["phase"] - 1]
        served = [",".join(sorted({served_label(r["version"], r.get("adapter", 0)) for r in quarter}))
                  for quarter in quarters_of(mine)]
        quarters = po.get("quarters", {})
        con.print(f"phase {po['phase']} ({po['workload']}) by quarter of its requests: drafter served "
                  + " / ".join(served) + "; acceptance length "
                  + "; ".join(f"{who} " + " / ".join(_shown(q) for q in v) for who, v in quarters.items()))
        mine_steps, still_steps = po["quarter_tokens_per_step"], ps["quarter_tokens_per_step"]
        con.print("  tokens per target step (every step, drafted or not) by quarter: online "
                  + " / ".join(f"{q:.2f}" for q in mine_steps) + "; the same requests with nothing learning "
                  "across them (no-learning: the shipped head, suffix without its tree of past outputs) "
                  + " / ".join(f"{q:.2f}" for q in still_steps) + "; what learning gained "
                  + " / ".join(f"{a / b:.2f}x" for a, b in zip(mine_steps, still_steps)))
    for name in ("online", "no-learning"):
        con.print(f"the hybrid's share of sequence-steps, {name}: " + ", ".join(
            f"{d} {share:.0%}" for d, share in drafter_shares(doc["runs"][name]["steps"]).items()))
    for po, ps in zip(online["phases"][1:], still["phases"][1:]):
        mine, frozen = po.get("quarters", {}).get("eagle3", []), ps.get("quarters", {}).get("eagle3", [])
        if mine and frozen:
            con.print(f"the learned drafter's own gain, phase {po['phase']} ({po['workload']}): EAGLE-3's acceptance "
                      "length by quarter, learning " + " / ".join(_shown(q) for q in mine) + " vs frozen "
                      + " / ".join(_shown(q) for q in frozen) + ": "
                      + " / ".join(_shown(a / b, "x") if b > 0 else "-" for a, b in zip(mine, frozen))
                      + (" (-: no EAGLE-3 draft in that quarter)" if any(map(math.isnan, mine + frozen)) else ""))
    on = online["online"]
    for r in on.get("rounds", []):
        pub = f"published v{r['published_version']}" if r.get("published_version") else "not published"
        con.print(f"trainer round {r['round']}: {r['num_train_rows']} rows, held-out acceptance length (walked) "
                  f"{r['baseline_accept_len'] or float('nan'):.2f} -> {r['candidate_accept_len'] or float('nan'):.2f}"
                  f"{gain_interval(r.get('judgement'))}, {pub}")
    for j in on.get("judgements", []):
        verdict = f"reverted (v{j['replaced_version']} again as v{j['reverted_as']})" if j.get("reverted_as") else "kept"
        con.print(f"v{j['version']} judged on the {j['judged_rows']} rows captured after it: acceptance length "
                  f"(walked) {j['accept_len'] or float('nan'):.2f} vs {j['replaced_accept_len'] or float('nan'):.2f} "
                  f"for v{j['replaced_version']}{gain_interval(j)}, {verdict}")
    lora = on.get("lora") or {}
    for a in on.get("adapters", []):
        m = a.get("metrics", {})
        what = ("the base head published back (it beat the adapters)" if m.get("reset") else
                f"{m.get('baseline_accept_len', float('nan')):.3f} (served) -> "
                f"{m.get('adapted_accept_len', float('nan')):.3f} (adapted), published")
        con.print(f"LoRA adapter v{a.get('base_version')}+a{a.get('adapter')}, judged on the {m.get('judged_rows')} "
                  f"rows served after its update: acceptance length {what}")
    con.print(f"signals captured {on['captured']} (dropped {on['dropped']}), drafter swaps {on['swaps']} (full "
              f"rounds) + {lora.get('adapter_swaps', 0)} (LoRA adapters), collection "
              f"{'on' if on['collection_enabled'] else 'off'} at the end")
    con.print(f"plot: {out / 'shift.png'}  report: {out / 'README.md'}")
    mismatches = online["mismatches"]
    con.print(f"outputs identical to plain decoding: {len(doc['runs']['online']['requests']) - mismatches}/"
              f"{len(doc['runs']['online']['requests'])} requests")
    return mismatches == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0].replace("``", ""))
    ap.add_argument("--prompts-per-domain", type=int, default=2, help="part 1: prompts per domain")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--gamma", type=int, default=4, help="speculation length (gamma_max for hybrid)")
    ap.add_argument("--code-requests", type=int, default=8, help="part 2: requests of the code phase")
    ap.add_argument("--shift-workload", default="ru_topics", help="part 2: the workload the trace shifts to")
    ap.add_argument("--shift-requests", type=int, default=32, help="part 2: requests of the shifted phase")
    ap.add_argument("--min-signals", type=int, default=512, help="part 2: signal rows per training round")
    ap.add_argument("--trainer-share", type=float, default=0.0,
                    help="part 2: fraction of the busy time the trainer may run (it always runs when idle)")
    ap.add_argument("--idle-s", type=float, default=4.0,
                    help="part 2: seconds without requests after every turn of 4, as between bursts of real traffic; "
                         "the trainer runs then (excluded from both configurations' tok/s)")
    ap.add_argument("--trainer-lr", type=float, default=1e-4,
                    help="part 2: the trainer's learning rate (a trained head fine-tuned on a few hundred rows)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--part", choices=["all", "drafters", "online"], default="all", help="which part to run")
    ap.add_argument("--path", choices=PATHS, default="auto",
                    help="the target's precision and execution, all exact: float32 eager; w4a8 (GGUF Q4_1 blocks "
                         "times int8 activations) eager; w4a8 + compile; auto = the fastest that starts within the "
                         "demo's time (w4a8 eager on 2 cores, measured)")
    ns = ap.parse_args(argv)
    if not (ns.idle_s >= 0 and ns.trainer_lr > 0):  # also rejects nan
        ap.error(f"need --idle-s >= 0 and --trainer-lr > 0, got {ns.idle_s:g} and {ns.trainer_lr:g}")
    if ns.part in ("all", "online"):  # part 2's trace is checked before part 1 runs, not a minute later
        if min(ns.code_requests, ns.shift_requests) < 1:
            ap.error(f"need --code-requests and --shift-requests >= 1, got {ns.code_requests} and {ns.shift_requests}")
        want = Counter({"code_unseen": ns.code_requests})
        want[ns.shift_workload] += ns.shift_requests
        for name, n in want.items():
            try:
                have = len(load_workload(name))
            except UserError as exc:
                ap.error(str(exc))
            if n > have:
                ap.error(f"part 2 asks {n} requests of workload {name}, which has {have}")
    torch.set_num_threads(ns.threads)
    con = Console(width=max(Console().width, 176))  # the tables need ~170 columns; never wrap them
    path, why = choose_path(ns.path)
    ns.compiled = path == "w4a8+compile"
    con.print(f"[bold]tidespec demo[/bold] — embedded SmolLM2-135M-Instruct, {path}, CPU, greedy ({why})")
    t_start = time.perf_counter()
    try:
        loaded = load_model(None, quantization="none" if path == "float32" else "w4a8")
    except UserError as exc:  # e.g. --path w4a8 on a CPU without AVX512-VNNI: one line, not a traceback
        ap.error(str(exc))
    con.print(f"model loaded in {time.perf_counter() - t_start:.1f} s from {loaded.path}")
    lossless = True
    if ns.part in ("all", "drafters"):
        con.print(f"[bold]part 1[/bold]: drafters and policy — static gamma={ns.gamma} (ngram, suffix), "
                  f"hybrid gamma<={ns.gamma} (suffix+hybrid)")
        lossless &= part_drafters(con, loaded, ns)
    if ns.part in ("all", "online"):
        con.print("[bold]part 2[/bold]: everything on (suffix + EAGLE-3 learning online, the per-sequence "
                  "hybrid) — code "
                  f"the drafter never saw, then {ns.shift_workload}")
        lossless &= part_online(con, loaded, ns)
    con.print(f"demo took {time.perf_counter() - t_start:.0f} s; outputs identical to plain decoding: "
              + ("[green]yes[/green]" if lossless else "[red]NO[/red]"))
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
