"""``tidespec`` command line: generate, serve, bench, profile, train-drafter.

Why this exists: one entry point whose flags come from the config dataclasses
(``tidespec.speculative.registry.add_engine_args``), so every flag and default lives in one place. Errors a
user can fix (bad path, bad parameter) print one line ``error: ...`` and exit 2 — no traceback.
"""

from __future__ import annotations

import argparse
import sys
import time

from tidespec.commands import Registrar, run_command
from tidespec.speculative.registry import add_engine_args, check_config, engine_config_from_args


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default: 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1)")
    g.add_argument("--top-k", type=int, default=0, help="top-k sampling, 0 = off (default: 0)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")


def sampling_from_args(ns: argparse.Namespace):  # -> SamplingParams
    from tidespec.sampling import SamplingParams
    return SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, seed=ns.seed,
                          max_tokens=ns.max_tokens, stop=list(ns.stop), ignore_eos=ns.ignore_eos)


def cmd_generate(ns: argparse.Namespace) -> int:
    from tidespec.llm import LLM
    params = sampling_from_args(ns)
    config = engine_config_from_args(ns)
    check_config(config)  # an unknown drafter or options it cannot run are refused before the model loads
    llm = LLM(config)
    if config.model.compile:
        print(f"[compiled the decode step in {llm.engine.compile_seconds:.1f} s]", file=sys.stderr)
    prompts = ns.prompt or [sys.stdin.read()]
    inputs = [llm.chat_prompt(p) if ns.chat else p for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    for o in outs:
        print(o.text)
        s = o.stats
        if s.num_drafts:
            print(f"[{o.request_id}: {len(o.token_ids)} tokens, drafts {s.num_drafts}, draft tokens "
                  f"{s.num_draft_tokens}, accepted {s.num_accepted_tokens} "
                  f"({s.num_accepted_tokens / max(1, s.num_draft_tokens):.0%}), mean acceptance length "
                  f"{s.mean_acceptance_length:.2f}]", file=sys.stderr)
    print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tok/s, drafter {config.spec.drafter}]", file=sys.stderr)
    return 0


def cmd_profile(ns: argparse.Namespace) -> int:
    from tidespec.llm import build_engine, load_profile
    config = engine_config_from_args(ns)
    engine = build_engine(config)
    t0 = time.perf_counter()
    prof, path = load_profile(config, engine.model, engine.drafter, refresh=ns.refresh,
                              progress=lambda m: print(m, file=sys.stderr))
    print(f"profile {prof.key} ({time.perf_counter() - t0:.1f} s; cached at {path})")
    qs = sorted({q for _, q in prof.verify_latency})
    print("| batch | " + " | ".join(f"T(b, q={q}) ms" for q in qs) + " |")
    print("|---" * (len(qs) + 1) + "|")
    for b in sorted({b for b, _ in prof.verify_latency}):
        print(f"| {b} | " + " | ".join(f"{prof.verify(b, q) * 1e3:.1f}" for q in qs) + " |")
    print("D0: " + ", ".join(f"{k}={v * 1e3:.2f} ms" for k, v in prof.draft_cost.items()))
    if prof.draft_batch_cost:
        print("D0(b) ms: " + ", ".join(f"{k}(b={b})={v * 1e3:.2f}" for (k, b), v in sorted(prof.draft_batch_cost.items())
                                       if k != "default"))
    if prof.catchup:
        print("catch-up (tokens, batch) ms: " + ", ".join(
            f"({t},{b})={c * 1e3:.1f}" for (t, b), c in sorted(prof.catchup.items())))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tidespec",
        description="tidespec: an inference engine and OpenAI-compatible server whose speculative decoding "
                    "is lossless. Run `tidespec COMMAND --help` for a command's flags.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for prompts",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("prompt", nargs="*", help="prompt(s); read from stdin when none")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    pr = sub.add_parser("profile", help="measure (or show the cached) costs the adaptive policies use",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    pr.add_argument("--refresh", action="store_true", help="measure again even if a cached profile exists")
    add_engine_args(pr)
    pr.set_defaults(func=cmd_profile)
    for register in _registrars():
        register(sub)
    return parser


def _registrars() -> list[Registrar]:
    """Sub-command groups that live with the code they run (imported when the parser is built)."""
    from tidespec.bench.cli import register as bench
    from tidespec.fleet.cli import register as fleet
    from tidespec.online.training.cli import register as train_drafter
    from tidespec.server.cli import register as serve

    return [bench, fleet, serve, train_drafter]


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
