"""``tidespec bench {decode,spec,profile,anchor,shift,learn,yield,serve,load,quality,prefix,...}``: the benchmark sub-commands.

Why this exists: the benchmarks are part of the product (their numbers go into
docs/benchmarks/), so they are run from the same CLI with the same model flags as
``tidespec generate``; this module only turns flags into the benchmark configs and calls
``run_decode_bench`` / ``run_spec_bench`` / ``run_profile``. Each run prints a markdown report
(command, machine, table) and writes ``results.json``, ``plot.png`` and ``table.md``.

Worked example::

    tidespec bench decode --workload code --batch-sizes 1,4,16 --max-tokens 128 --threads 2 --compare hf,llamacpp
    tidespec bench spec --workload code --drafters none,ngram,suffix,draft-model --gammas 1,3,5,8 --compare hf
    tidespec bench profile --threads 2
    tidespec bench anchor --device cuda --dtype bfloat16 --shapes smollm2-135m,tinyllama-1.1b --batch-sizes 1,16
    tidespec bench shift --workloads code,chat,code --bootstrap runs/boot/drafter --threads 2
    tidespec bench learn --signal-dirs runs/boot/signals --fractions 0.25,0.5,1 --threads 2
    tidespec bench quality --workload code,chat --quantizations int8,int4 --threads 2
    tidespec bench prefix --path int4 --prefix-tokens 1024 --concurrency 8
    tidespec bench kv --path int4 --slots 4 --max-model-len 2048 --requests 32
    tidespec bench fleet --engine-args "--drafter eagle3 --threads 1" --workload code_unseen --requests-per-replica 32
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tidespec.bench.anchor.run import SHAPES, AnchorBenchConfig, run_anchor_bench
from tidespec.bench.common.report import command_line
from tidespec.bench.decode.run import (
    DecodeBenchConfig,
    parse_compare,
    parse_float_list,
    parse_int_list,
    parse_str_list,
    resolve_target,
    run_decode_bench,
)
from tidespec.bench.exactness.run import ExactnessBenchConfig, exact, run_exactness_bench
from tidespec.bench.fleet.run import FleetBenchConfig, run_fleet_bench
from tidespec.bench.invariance_cost.run import InvarianceCostConfig, run_invariance_cost
from tidespec.bench.invariance_cost.run import table as invariance_cost_table
from tidespec.bench.kv.run import KVBenchConfig, run_kv_bench
from tidespec.bench.learn.run import LearnBenchConfig, run_learn_bench
from tidespec.bench.learn.run import replot as replot_learn
from tidespec.bench.memory.run import MemoryBenchConfig, run_memory_bench
from tidespec.bench.prefix.run import PrefixBenchConfig, run_prefix_bench
from tidespec.bench.profile.run import ProfileConfig, run_profile
from tidespec.bench.quality import run as quality
from tidespec.bench.shift.config import ShiftBenchConfig
from tidespec.bench.shift.run import replot as replot_shift
from tidespec.bench.shift.run import run_shift_bench
from tidespec.bench.spec.hybrid import HybridBenchConfig, run_hybrid_bench
from tidespec.bench.spec.predicted import PredictedBenchConfig, run_predicted_bench
from tidespec.bench.spec.run import SpecBenchConfig, run_spec_bench
from tidespec.bench.spec.structured import StructuredBenchConfig, run_structured_bench
from tidespec.bench.yield_bench.run import YieldBenchConfig, run_yield_bench
from tidespec.config import ModelConfig, PolicyConfig, SchedulerConfig, finite_float, output_dir
from tidespec.flags import add_dataclass_args, dataclass_from_args
from tidespec.speculative.registry import add_spec_args, spec_config_from_args
from tidespec.workloads.loader import BUILTIN_WORKLOADS

# SpecConfig fields the spec bench sweeps itself (so they are not flags there).
_SWEPT_SPEC_FIELDS = ("drafter", "num_speculative_tokens")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` with its sub-commands to the top-level parser's sub-parsers."""
    bench = subparsers.add_parser("bench", help="benchmarks: decode throughput, speculation, T(n) profile, serving")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter

    d = sub.add_parser("decode", help="plain decoding tokens/s, TTFT, TPOT per batch size (optionally vs HF)",
                       formatter_class=fmt)
    _add_workload_args(d, limit=16)
    d.add_argument("--batch-sizes", default="1,4,16", help="comma-separated batch sizes")
    d.add_argument("--compare", default=None, metavar="ENGINES",
                   help="comma-separated reference engines run interleaved with ours: hf (transformers generate(), "
                        "batch 1), llamacpp (llama-cpp-python on the same GGUF, every batch size: the wave's prompts "
                        "as parallel sequences; optional, see README)")
    d.add_argument("--prompt-tokens", type=int, default=0,
                   help="make every prompt exactly this many tokens (the workload's other prompts before it as "
                        "context); 0: the workload's own lengths")
    add_dataclass_args(d, ModelConfig)
    add_dataclass_args(d, SchedulerConfig)
    d.set_defaults(func=cmd_decode)

    s = sub.add_parser("spec", help="drafters x gamma vs plain decoding, per-prompt spread (optionally vs HF)",
                       formatter_class=fmt)
    _add_workload_args(s, limit=16)
    s.add_argument("--drafters", default="none,ngram,suffix,draft-model",
                   help="comma-separated drafters (none = plain, always included)")
    s.add_argument("--gammas", default="1,3,5,8", help="comma-separated speculation lengths")
    s.add_argument("--batch-size", type=int, default=1, help="requests per wave")
    s.add_argument("--compare", choices=["hf"], default=None,
                   help="also run HF generate() plain and with prompt lookup")
    s.add_argument("--hf-pld-tokens", default="10", help="HF prompt_lookup_num_tokens value(s), comma-separated")
    s.add_argument("--eagle3-heads", default="",
                   help="EAGLE-3 heads compared in one interleaved run, comma-separated NAME=DIR (or DIR): one "
                        "eagle3 configuration per head and gamma (needs eagle3 in --drafters; default: the one "
                        "head of --eagle3-dir)")
    s.add_argument("--eagle3-quantizations", default="",
                   help="EAGLE-3 drafting weights compared in one interleaved run, comma-separated none,int8,int4: "
                        "one eagle3 configuration per head, quantization and gamma (default: --eagle3-quantization)")
    s.add_argument("--eagle3-min-draft-probs", default="",
                   help="EAGLE-3 chain confidence floors compared in one interleaved run, comma-separated values in "
                        "[0, 1): one eagle3 configuration per floor (and head, quantization) and gamma (default: "
                        "--eagle3-min-draft-prob)")
    s.add_argument("--eagle3-shapes", default="",
                   help="EAGLE-3 proposal shapes compared in one interleaved run, comma-separated chain,tree (tree: "
                        "EAGLE-2's dynamic tree of gamma tokens, --eagle3-tree-depth/--eagle3-tree-top-k): one eagle3 "
                        "configuration per shape (and head, quantization, floor) and gamma (default: --tree or not)")
    s.add_argument("--turns", type=int, default=1,
                   help="turns per conversation (chat records): turn k+1 resends the history with plain decoding's "
                        "answer and the next record's question, so later turns hit the prefix cache; --limit then "
                        "counts conversations")
    s.add_argument("--structured", action="store_true",
                   help="constrained decoding instead: every request's answer follows its record's schema (default "
                        "workload: extraction) or calls one of its tools (workload tool_use: tool_choice required); constrained plain vs the grammar's forced tokens vs suffix without and "
                        "with them vs the controller (--policy, default analytic) over grammar and suffix, at each of "
                        "--batch-sizes, gamma = the largest of --gammas; reports the mask's share of a step")
    s.add_argument("--predicted", action="store_true",
                   help="Predicted Outputs instead: every request sends its record's prediction (default workload: "
                        "code_edit, the file an edit starts from); plain vs suffix vs the prediction vs the prediction "
                        "beside the controller (--policy, default analytic) over suffix and EAGLE-3, at each of "
                        "--batch-sizes, the drafters' gamma = the largest of --gammas, the prediction's cap "
                        "--prediction-tokens")
    s.add_argument("--model-drafter", default="eagle3",
                   help="--hybrid: the drafter with a model beside suffix (eagle3, medusa, draft-model, a plug-in's)")
    s.add_argument("--untrimmed", action="store_true",
                   help="--hybrid: run the two controllers once more with --no-trim-drafts (the draft trim's effect, "
                        "same run)")
    s.add_argument("--hybrid", action="store_true",
                   help="per-sequence drafting instead: plain, suffix and eagle3 alone, the controller (--policy, "
                        "default analytic) over suffix and EAGLE-3 and the same with --per-sequence, at each of "
                        "--batch-sizes, gamma = the largest of --gammas; reports each drafter's share of steps")
    s.add_argument("--logprobs", type=int, default=None,
                   help="--predicted: also run plain and the prediction with each token's top-K log-probabilities "
                        "(what they cost per step)")
    s.add_argument("--batch-sizes", default="1,8",
                   help="--structured, --predicted, --hybrid: requests per wave, comma-separated")
    s.add_argument("--refill", type=int, default=1,
                   help="--structured, --predicted, --hybrid: prompts per wave = REFILL x the batch size, on batch-size "
                        "KV slots, so the engine admits a queued prompt as a sequence finishes (continuous batching, "
                        "as a server does); 1: waves of exactly the batch, which last as long as their slowest sequence")
    s.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="every request generates --max-tokens tokens; --no-ignore-eos ends each at its EOS as a "
                        "server does (acceptance then leaves out text past EOS, which serving never drafts)")
    add_dataclass_args(s, ModelConfig)
    add_dataclass_args(s, SchedulerConfig)
    add_spec_args(s, skip=_SWEPT_SPEC_FIELDS)
    add_dataclass_args(s, PolicyConfig)
    s.set_defaults(func=cmd_spec)

    p = sub.add_parser("profile", help="T(n) per batch size, memory bandwidth, batch-1 ceiling",
                       formatter_class=fmt)
    p.add_argument("--ns", default="1,2,4,8,16,32,64", help="new tokens per sequence, comma-separated")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=200, help="tokens already in each sequence's cache")
    p.add_argument("--repeats", type=int, default=5, help="most timed forwards per shape (median kept)")
    p.add_argument("--target-seconds", type=finite_float, default=0.4,
                   help="timed seconds aimed at per shape; big shapes get fewer repeats")
    p.add_argument("--bandwidth-mib", type=int, default=256, help="buffer size of the copy bandwidth test")
    p.add_argument("--compare-untuned", action="store_true",
                   help="also time every shape with F.linear for all projections (the per-row-count kernels' "
                        "gain; with --no-row-invariant, where those kernels run)")
    p.add_argument("--out", type=output_dir, default=None, help="output directory (default: runs/bench-profile-<time>)")
    add_dataclass_args(p, ModelConfig)
    p.set_defaults(func=cmd_profile)

    a = sub.add_parser("anchor", help="plain decode of real model shapes (random weights) vs the compiled "
                                      "static-shape anchor (gpt-fast's recipe), same run", formatter_class=fmt)
    a.add_argument("--shapes", default="smollm2-135m,tinyllama-1.1b", help="comma-separated: " + ", ".join(SHAPES))
    a.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes")
    a.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens per request")
    a.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    a.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    a.add_argument("--out", type=output_dir, default=None, help="output directory (default: runs/bench-anchor-<time>)")
    add_dataclass_args(a, ModelConfig)
    a.set_defaults(func=cmd_anchor)

    for name, help_, config_cls, func in [
            ("shift", "EAGLE-3 under a domain shift: plain vs frozen vs online training", ShiftBenchConfig, cmd_shift),
            ("learn", "EAGLE-3 held-out acceptance against training signals (learning curve)", LearnBenchConfig,
             cmd_learn)]:
        b = sub.add_parser(name, help=help_, formatter_class=fmt)
        add_dataclass_args(b, config_cls)
        add_dataclass_args(b, ModelConfig)
        b.add_argument("--out", type=output_dir, default=None,
                       help=f"output directory (default: runs/bench-{name}-<time>)")
        b.add_argument("--replot", type=Path, default=None, metavar="DIR",
                       help=f"only re-render README.md and {name}.png of an earlier run in DIR")
        b.set_defaults(func=func)

    y = sub.add_parser("yield", help="online training vs serving on a shared CPU: cost at saturation, round at idle",
                       formatter_class=fmt)
    add_dataclass_args(y, YieldBenchConfig)
    add_dataclass_args(y, ModelConfig)
    y.add_argument("--out", type=output_dir, default=None, help="output directory (default: runs/bench-yield-<time>)")
    y.set_defaults(func=cmd_yield)

    x = sub.add_parser("exactness", help="greedy outputs of every path and drafter, alone and batched, against "
                                         "plain decoding alone (bit-exactness matrix)", formatter_class=fmt)
    add_dataclass_args(x, ExactnessBenchConfig)
    x.add_argument("--row-invariant", action=argparse.BooleanOptionalAction, default=True,
                   help="--no-row-invariant: measure the engine without row-invariant kernels (before/after)")
    x.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    x.add_argument("--out", type=output_dir, default=None, help="output directory (default: runs/bench-exactness-<time>)")
    x.set_defaults(func=cmd_exactness)

    c = sub.add_parser("invariance-cost", help="plain decode speed with and without row-invariant kernels, decode "
                                              "steps interleaved in one process", formatter_class=fmt)
    add_dataclass_args(c, InvarianceCostConfig)
    c.add_argument("--out", type=output_dir, default=None,
                   help="output directory (default: runs/bench-invariance-cost-<time>)")
    c.set_defaults(func=cmd_invariance_cost)

    pf = sub.add_parser("prefix", help="prefix caching: TTFT on a shared prefix and a chat's next turn, throughput "
                                       "where nothing is shared; cache on and off interleaved", formatter_class=fmt)
    add_dataclass_args(pf, PrefixBenchConfig)
    pf.add_argument("--out", type=output_dir, default=None, help="output directory (default: runs/bench-prefix-<time>)")
    pf.set_defaults(func=cmd_prefix)

    kv = sub.add_parser("kv", help="paged KV cache vs slots of --max-model-len in the same memory: sequences at "
                                   "once, tokens/s, preemptions; steps interleaved", formatter_class=fmt)
    add_dataclass_args(kv, KVBenchConfig)
    kv.add_argument("--out", type=output_dir, default=None, help="output directory (default: runs/bench-kv-<time>)")
    kv.set_defaults(func=cmd_kv)

    fl = sub.add_parser("fleet", help="a fleet's one trainer vs one trainer per server, same trainer compute: "
                                      "acceptance over a trace, requests per replica to the recovered level "
                                      "(needs the fleet extra)", formatter_class=fmt)
    add_dataclass_args(fl, FleetBenchConfig)
    fl.add_argument("--out", type=output_dir, default=None, help="output directory (default: runs/bench-fleet-<time>)")
    fl.set_defaults(func=cmd_fleet)

    m = sub.add_parser("memory", help="server RSS after a burst of large refused requests, with and without "
                                      "--trim-memory", formatter_class=fmt)
    add_dataclass_args(m, MemoryBenchConfig)
    m.add_argument("--out", type=output_dir, default=None, help="output directory (default: runs/bench-memory-<time>)")
    m.set_defaults(func=cmd_memory)

    _register_serve(sub)
    q = sub.add_parser("quality", help="quantized / bfloat16 target against float32: greedy agreement, perplexity",
                       formatter_class=fmt)
    quality.add_args(q)
    q.set_defaults(func=quality.run)


def _register_serve(sub: argparse._SubParsersAction) -> None:
    """``bench serve`` (a load generator for the server) and ``bench load`` (policies under load)."""
    from tidespec.bench.serve.run import add_args, run
    sv = sub.add_parser("serve", help="load test of the OpenAI-compatible server",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_args(sv)
    sv.set_defaults(func=run)
    from tidespec.bench.load import run as load
    ld = sub.add_parser("load", help="policies under a rate sweep and a dynamic trace, through the server",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    load.add_args(ld)
    ld.set_defaults(func=load.run)


def _add_workload_args(p: argparse.ArgumentParser, limit: int) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="code",
                   help="JSONL path, or a built-in name (" + ", ".join(BUILTIN_WORKLOADS) + ")")
    g.add_argument("--limit", type=int, default=limit, help="use the first N records")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request (EOS ignored)")
    g.add_argument("--no-warmup", action="store_true", help="skip the short warm-up run")
    g.add_argument("--out", type=output_dir, default=None, help="output directory (default: runs/bench-<kind>-<time>)")


def cmd_decode(ns: argparse.Namespace) -> int:
    cfg = DecodeBenchConfig(workload=ns.workload, limit=ns.limit, batch_sizes=parse_int_list(ns.batch_sizes, "--batch-sizes"),
                            max_tokens=ns.max_tokens, compare=parse_compare(ns.compare), warmup=not ns.no_warmup,
                            prompt_tokens=ns.prompt_tokens)
    run_decode_bench(cfg, model_config=dataclass_from_args(ModelConfig, ns),
                     scheduler=dataclass_from_args(SchedulerConfig, ns), out_dir=ns.out, command=command_line())
    return 0


def cmd_spec(ns: argparse.Namespace) -> int:
    if ns.predicted:
        pcfg = PredictedBenchConfig(workload="code_edit" if ns.workload == "code" else ns.workload, limit=ns.limit,
                                    batch_sizes=parse_int_list(ns.batch_sizes, "--batch-sizes"),
                                    gamma=max(parse_int_list(ns.gammas, "--gammas")), max_tokens=ns.max_tokens,
                                    logprobs=ns.logprobs, refill=ns.refill)
        run_predicted_bench(pcfg, model_config=dataclass_from_args(ModelConfig, ns),
                            scheduler=dataclass_from_args(SchedulerConfig, ns),
                            spec_base=spec_config_from_args(ns), policy=dataclass_from_args(PolicyConfig, ns),
                            out_dir=ns.out, command=command_line())
        return 0
    if ns.hybrid:
        hcfg = HybridBenchConfig(workload=ns.workload, limit=ns.limit,
                                 batch_sizes=parse_int_list(ns.batch_sizes, "--batch-sizes"),
                                 gamma=max(parse_int_list(ns.gammas, "--gammas")), max_tokens=ns.max_tokens,
                                 model_drafter=ns.model_drafter, untrimmed=ns.untrimmed, refill=ns.refill)
        run_hybrid_bench(hcfg, model_config=dataclass_from_args(ModelConfig, ns),
                         scheduler=dataclass_from_args(SchedulerConfig, ns), spec_base=spec_config_from_args(ns),
                         policy=dataclass_from_args(PolicyConfig, ns), out_dir=ns.out, command=command_line())
        return 0
    if ns.structured:
        scfg = StructuredBenchConfig(workload="extraction" if ns.workload == "code" else ns.workload, limit=ns.limit,
                                     batch_sizes=parse_int_list(ns.batch_sizes, "--batch-sizes"),
                                     gamma=max(parse_int_list(ns.gammas, "--gammas")), max_tokens=ns.max_tokens,
                                     refill=ns.refill)
        run_structured_bench(scfg, model_config=dataclass_from_args(ModelConfig, ns),
                             scheduler=dataclass_from_args(SchedulerConfig, ns),
                             spec_base=spec_config_from_args(ns), policy=dataclass_from_args(PolicyConfig, ns),
                             out_dir=ns.out, command=command_line())
        return 0
    cfg = SpecBenchConfig(workload=ns.workload, limit=ns.limit, drafters=parse_str_list(ns.drafters, "--drafters"),
                          gammas=parse_int_list(ns.gammas, "--gammas"), batch_size=ns.batch_size,
                          max_tokens=ns.max_tokens, compare_hf=ns.compare == "hf",
                          hf_pld_tokens=parse_int_list(ns.hf_pld_tokens, "--hf-pld-tokens"),
                          warmup=not ns.no_warmup,
                          eagle3_heads=parse_str_list(ns.eagle3_heads, "--eagle3-heads") if ns.eagle3_heads else (),
                          eagle3_quantizations=parse_str_list(ns.eagle3_quantizations, "--eagle3-quantizations")
                          if ns.eagle3_quantizations else (),
                          eagle3_min_draft_probs=parse_float_list(ns.eagle3_min_draft_probs, "--eagle3-min-draft-probs")
                          if ns.eagle3_min_draft_probs else (),
                          eagle3_shapes=parse_str_list(ns.eagle3_shapes, "--eagle3-shapes") if ns.eagle3_shapes else (),
                          ignore_eos=ns.ignore_eos, turns=ns.turns)
    run_spec_bench(cfg, model_config=dataclass_from_args(ModelConfig, ns),
                   scheduler=dataclass_from_args(SchedulerConfig, ns), spec_base=spec_config_from_args(ns),
                   policy=dataclass_from_args(PolicyConfig, ns), out_dir=ns.out, command=command_line())
    return 0


def cmd_anchor(ns: argparse.Namespace) -> int:
    cfg = AnchorBenchConfig(shapes=parse_str_list(ns.shapes, "--shapes"),
                            batch_sizes=parse_int_list(ns.batch_sizes, "--batch-sizes"), prompt_len=ns.prompt_len,
                            max_tokens=ns.max_tokens, rounds=ns.rounds)
    run_anchor_bench(cfg, dataclass_from_args(ModelConfig, ns), out_dir=ns.out, command=command_line())
    return 0


def cmd_profile(ns: argparse.Namespace) -> int:
    cfg = ProfileConfig(ns=parse_int_list(ns.ns, "--ns"), batch_sizes=parse_int_list(ns.batch_sizes, "--batch-sizes"),
                        context=ns.context, repeats=ns.repeats, target_s=ns.target_seconds,
                        bandwidth_mib=ns.bandwidth_mib, compare_untuned=ns.compare_untuned)
    run_profile(cfg, model_config=dataclass_from_args(ModelConfig, ns), out_dir=ns.out, command=command_line())
    return 0


def _replot_or_run(ns: argparse.Namespace, config_cls: type, run: Callable[..., Any],
                   replot: Callable[[Path], Any], plot_name: str,
                   engine_flags: Callable[[Any, ModelConfig], Any] | None = None) -> int:
    """``--replot DIR``: re-render an earlier run's report; else build the config (``engine_flags``: with
    what it takes of the target's flags, e.g. ``--compile``) and run on the target."""
    if ns.replot is not None:
        replot(ns.replot)
        print(f"re-rendered {ns.replot}/README.md and {plot_name}")
        return 0
    mc = dataclass_from_args(ModelConfig, ns)
    cfg = dataclass_from_args(config_cls, ns)
    if engine_flags is not None:
        cfg = engine_flags(cfg, mc)
    if mc.threads:
        torch.set_num_threads(mc.threads)
    run(cfg, resolve_target(mc.model, mc.dtype, mc.device, mc.quantization, mc.quant_group_size), ns.out,
        command=command_line())
    return 0


def cmd_exactness(ns: argparse.Namespace) -> int:
    if ns.threads:
        torch.set_num_threads(ns.threads)
    out = ns.out or Path("runs") / f"bench-exactness-{time.strftime('%Y%m%d-%H%M%S')}"
    doc = run_exactness_bench(dataclass_from_args(ExactnessBenchConfig, ns), row_invariant=ns.row_invariant,
                              out_dir=out)
    print((out / "table.md").read_text())
    return 0 if exact(doc) else 1


def cmd_invariance_cost(ns: argparse.Namespace) -> int:
    out = ns.out or Path("runs") / f"bench-invariance-cost-{time.strftime('%Y%m%d-%H%M%S')}"
    doc = run_invariance_cost(dataclass_from_args(InvarianceCostConfig, ns), out_dir=out)
    text = invariance_cost_table(doc)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


def cmd_fleet(ns: argparse.Namespace) -> int:
    out = ns.out or Path("runs") / f"bench-fleet-{time.strftime('%Y%m%d-%H%M%S')}"
    doc = run_fleet_bench(dataclass_from_args(FleetBenchConfig, ns), out_dir=out)
    print((out / "table.md").read_text())
    return 0 if all(r["errors"] == 0 for r in doc["summary"]["configs"].values()) else 1


def cmd_kv(ns: argparse.Namespace) -> int:
    out = ns.out or Path("runs") / f"bench-kv-{time.strftime('%Y%m%d-%H%M%S')}"
    doc = run_kv_bench(dataclass_from_args(KVBenchConfig, ns), out_dir=out)
    print((out / "table.md").read_text())
    return 0 if doc["summary"]["identical"] else 1


def cmd_prefix(ns: argparse.Namespace) -> int:
    out = ns.out or Path("runs") / f"bench-prefix-{time.strftime('%Y%m%d-%H%M%S')}"
    doc = run_prefix_bench(dataclass_from_args(PrefixBenchConfig, ns), out_dir=out)
    print((out / "table.md").read_text())
    return 0 if doc["summary"]["identical"] else 1


def cmd_memory(ns: argparse.Namespace) -> int:
    out = ns.out or Path("runs") / f"bench-memory-{time.strftime('%Y%m%d-%H%M%S')}"
    run_memory_bench(dataclass_from_args(MemoryBenchConfig, ns), out_dir=out)
    print((out / "table.md").read_text())
    return 0


def cmd_shift(ns: argparse.Namespace) -> int:
    return _replot_or_run(ns, ShiftBenchConfig, run_shift_bench, replot_shift, "shift.png",
                          lambda cfg, mc: dataclasses.replace(cfg, compile=mc.compile))


def cmd_yield(ns: argparse.Namespace) -> int:
    mc = dataclass_from_args(ModelConfig, ns)
    if mc.threads:
        torch.set_num_threads(mc.threads)
    run_yield_bench(dataclass_from_args(YieldBenchConfig, ns),
                    resolve_target(mc.model, mc.dtype, mc.device, mc.quantization, mc.quant_group_size), ns.out,
                    command=command_line())
    return 0


def cmd_learn(ns: argparse.Namespace) -> int:
    return _replot_or_run(ns, LearnBenchConfig, run_learn_bench, replot_learn, "learn.png")
