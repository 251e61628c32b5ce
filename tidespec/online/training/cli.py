"""``tidespec train-drafter``, ``synth-prompts`` and ``mine-prompts``: the command lines of the decoupled
EAGLE-3 trainer and of the training prompts it can make for itself (self-instructed chat, mined code).

Why this exists: the trainer runs as its own process — a child of ``tidespec serve
--online-training``, a standalone job on another machine sharing the directories, or several
ranks under ``torchrun`` — so it needs an entry point that works both as a ``tidespec``
sub-command (``register``) and as ``python -m tidespec.online.training.cli train-drafter`` (``main``,
which is what ``torchrun -m`` and ``start_trainer_process`` launch).

Worked examples::

    tidespec train-drafter --signal-dir runs/signals --publish-root runs/drafter --min-signals 8192
    tidespec train-drafter --from-workload code.jsonl --signal-dir runs/sig --publish-root runs/drafter --once
    tidespec synth-prompts --out runs/q.jsonl --count 1000 --exclude-workload chat,code_unseen
    tidespec mine-prompts --out runs/code.jsonl --count 1000 --exclude-workload code_unseen
    torchrun --nproc_per_node 2 -m tidespec.online.training.cli train-drafter --signal-dir ... --publish-root ... --once
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from tidespec.commands import standalone_main
from tidespec.config import output_dir
from tidespec.flags import add_dataclass_args, dataclass_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train-drafter``, ``synth-prompts`` and ``mine-prompts`` to the top-level parser's sub-parsers."""
    from tidespec.config import ModelConfig
    from tidespec.online.training.config import MinePromptsConfig, SynthPromptsConfig, TrainerConfig
    from tidespec.online.training.medusa import MedusaTrainConfig

    _command(subparsers, "train-drafter", "train and publish EAGLE-3 drafters from captured signals", TrainerConfig,
             cmd_train_drafter)
    _command(subparsers, "synth-prompts", "write training prompts sampled from the target itself (Magpie "
             "self-instruct) as a workload JSONL", SynthPromptsConfig, cmd_synth_prompts)
    medusa = _command(subparsers, "train-medusa", "train Medusa heads on the target's own continuations of workload "
                      "prompts (its final hidden states, self-distilled)", MedusaTrainConfig, cmd_train_medusa)
    add_dataclass_args(medusa, ModelConfig)
    _command(subparsers, "mine-prompts", "write code-completion training prompts (a documented function's "
             "signature and docstring) mined from Python sources as a workload JSONL", MinePromptsConfig,
             cmd_mine_prompts)


def _command(subparsers: argparse._SubParsersAction, name: str, help_text: str, cls: type,
             func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """One sub-command: a flag per field of ``cls``, plus ``--log-level``."""
    p = subparsers.add_parser(name, help=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_dataclass_args(p, cls)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="log level")
    p.set_defaults(func=func)
    return p


def _logging(ns: argparse.Namespace) -> None:
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _prompt_source(cls: type, ns: argparse.Namespace) -> Any:
    """The validated config of a prompt-writing command; refuses to overwrite its ``--out``."""
    from tidespec.online.training.config import TrainerConfigError

    _logging(ns)
    cfg = dataclass_from_args(cls, ns)
    if os.path.exists(cfg.out):
        raise TrainerConfigError(f"{cfg.out} exists; remove it or choose another --out")
    _writable("--out", os.path.dirname(cfg.out) or ".")
    return cfg


def cmd_train_medusa(ns: argparse.Namespace) -> int:
    """The target continues the workloads' prompts (greedy, batched), then the heads train on those
    sequences' hidden states; writes the heads and ``report.json`` (held-out top-1 accuracy per head)."""
    import json
    from pathlib import Path

    from tqdm import tqdm

    from tidespec.config import CacheConfig, EngineConfig, ModelConfig
    from tidespec.llm import LLM
    from tidespec.online.training.medusa import MedusaTrainConfig, train_medusa
    from tidespec.sampling import SamplingParams
    from tidespec.workloads.loader import load_prompts, load_workload

    _logging(ns)
    cfg, mc = dataclass_from_args(MedusaTrainConfig, ns), dataclass_from_args(ModelConfig, ns)
    _writable("--out", cfg.out)
    excluded = {r.prompt for name in cfg.exclude.split(",") if name.strip() for r in load_workload(name.strip())}
    llm = LLM(EngineConfig(model=mc, cache=CacheConfig(max_model_len=2048, max_num_seqs=16)))
    prompts = [p for name in cfg.workloads.split(",") if name.strip()
               for p in load_prompts(name.strip(), llm.tokenizer, cfg.limit or None) if p.record.prompt not in excluded]
    bar = tqdm(total=len(prompts), desc="continuations", unit="prompt")
    outs = llm.generate([p.token_ids for p in prompts], SamplingParams(max_tokens=cfg.max_tokens),
                        progress=lambda o: bar.update(1) if o.finished else None)
    bar.close()
    sequences = [(p.token_ids + o.token_ids, len(p.token_ids)) for p, o in zip(prompts, outs)]
    heads, report = train_medusa(llm.engine.model, sequences, cfg, progress=lambda m: print(m, file=sys.stderr))
    out = Path(cfg.out)
    heads.save(out)
    doc = {"sequences": len(sequences), "rows": sum(len(ids) - start for ids, start in sequences),
           "top1_accuracy_held_out": report, "config": dataclasses.asdict(cfg), "model": dataclasses.asdict(mc)}
    (out / "report.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    for when, acc in report.items():
        print(f"held-out top-1 accuracy per head, {when}: " + " / ".join(f"{a:.3f}" for a in acc))
    print(f"wrote {out} (serve with --drafter medusa --medusa-dir {out})")
    return 0


def _writable(flag: str, directory: str) -> None:
    """Refuse, before minutes of work, an output the command could not write at the end."""
    from tidespec.online.training.config import TrainerConfigError

    try:
        output_dir(directory)
    except argparse.ArgumentTypeError as exc:
        raise TrainerConfigError(f"{flag}: {exc}") from None


def _write_prompts(records: list[Any], out: str) -> int:
    from tidespec.workloads.loader import write_workload

    write_workload(records, out)
    print(f"wrote {len(records)} prompts to {out}")
    return 0


def cmd_train_drafter(ns: argparse.Namespace) -> int:
    from tidespec.online.training.config import TrainerConfig
    from tidespec.online.training.process import train_drafter

    _logging(ns)
    cfg = dataclass_from_args(TrainerConfig, ns)
    if cfg.export_dir:
        _writable("--export-dir", cfg.export_dir)
    results = train_drafter(cfg)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun, rank 0 reports
    for r in results:
        status = f"published v{r.published_version}" if r.published_version else "not published"
        print(f"round {r.round}: {r.num_train_rows} train / {r.num_heldout_rows} held-out rows, loss "
              f"{r.train_loss:.3f}, mean acceptance length {r.baseline_accept_len:.3f} -> "
              f"{r.candidate_accept_len:.3f} ({status}, {r.train_time_s:.1f} s)")
    return 0


def cmd_synth_prompts(ns: argparse.Namespace) -> int:
    import torch

    from tidespec.models.loading.loader import DTYPES, load_model
    from tidespec.online.prompts.selfinstruct import synth_prompts
    from tidespec.online.training.config import SynthPromptsConfig

    cfg = _prompt_source(SynthPromptsConfig, ns)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    loaded = load_model(cfg.model, dtype=DTYPES[cfg.dtype], device=cfg.device)
    return _write_prompts(synth_prompts(loaded.model, loaded.tokenizer, cfg), cfg.out)


def cmd_mine_prompts(ns: argparse.Namespace) -> int:
    from tidespec.online.prompts.codemine import mine_functions
    from tidespec.online.training.config import MinePromptsConfig

    cfg = _prompt_source(MinePromptsConfig, ns)
    return _write_prompts(mine_functions(cfg), cfg.out)


def main(argv: list[str] | None = None) -> int:
    return standalone_main(register, argv)


if __name__ == "__main__":
    sys.exit(main())
