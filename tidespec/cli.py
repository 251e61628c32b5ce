"""``tidespec`` command line: generate, serve, bench, profile, train-drafter.

Why this exists: one entry point whose flags come from the config dataclasses
(``tidespec.config.add_engine_args``), so every flag and default lives in one place. Errors a
user can fix (bad path, bad parameter) print one line ``error: ...`` and exit 2 — no traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from tidespec.config import ConfigError, add_engine_args, engine_config_from_args


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "the user asked for something impossible"."""
    from tidespec.engine.engine import RequestError
    from tidespec.engine.scheduler import QueueFullError
    from tidespec.models.llama import ModelConfigError
    from tidespec.models.loader import ModelLoadError
    from tidespec.sampling import SamplingParamsError
    from tidespec.adapt.cli import user_errors as adapt_errors
    return (ConfigError, ModelLoadError, ModelConfigError, SamplingParamsError, RequestError, QueueFullError,
            FileNotFoundError, *adapt_errors())


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
    from tidespec.engine.engine import LLM
    params = sampling_from_args(ns)
    config = engine_config_from_args(ns)
    llm = LLM(config)
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
    from tidespec.control.profiler import load_or_measure
    from tidespec.runtime import build_engine
    config = engine_config_from_args(ns)
    engine = build_engine(config)
    t0 = time.perf_counter()
    prof, path = load_or_measure(engine.model, engine.drafter, refresh=ns.refresh,
                                 progress=lambda m: print(m, file=sys.stderr))
    print(f"profile {prof.key} ({time.perf_counter() - t0:.1f} s; cached at {path})")
    qs = sorted({q for _, q in prof.verify_latency})
    print("| batch | " + " | ".join(f"T(b, q={q}) ms" for q in qs) + " |")
    print("|---" * (len(qs) + 1) + "|")
    for b in sorted({b for b, _ in prof.verify_latency}):
        print(f"| {b} | " + " | ".join(f"{prof.verify(b, q) * 1e3:.1f}" for q in qs) + " |")
    print("D0: " + ", ".join(f"{k}={v * 1e3:.2f} ms" for k, v in prof.draft_cost.items()))
    if prof.catchup:
        print("catch-up (tokens, batch) ms: " + ", ".join(
            f"({t},{b})={c * 1e3:.1f}" for (t, b), c in sorted(prof.catchup.items())))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidespec", description=__doc__.splitlines()[0])
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


def _registrars() -> list[Callable[[argparse._SubParsersAction], None]]:
    """Sub-command groups that live with the code they run."""
    regs: list[Callable[[argparse._SubParsersAction], None]] = []
    from tidespec.bench.cli import register as bench
    regs.append(bench)
    from tidespec.server.cli import register as serve
    regs.append(serve)
    from tidespec.adapt.cli import register as train_drafter
    regs.append(train_drafter)
    return regs


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)


def standalone_main(register: Callable[[argparse._SubParsersAction], None], argv: list[str] | None = None) -> int:
    """Entry of a sub-command module run on its own (``python -m tidespec.server.cli serve``),
    as child processes and ``bench serve --launch`` do."""
    parser = argparse.ArgumentParser(prog="tidespec")
    register(parser.add_subparsers(dest="command", required=True))
    return run_command(parser, argv)


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse and run; user errors become one line ``error: ...`` and exit code 2. Also the
    entry of the standalone sub-command modules (``python -m tidespec.server.cli serve``)."""
    ns = parser.parse_args(argv)
    try:
        return int(ns.func(ns) or 0)
    except _user_errors() as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
