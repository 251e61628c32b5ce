"""``tidespec train-drafter``: the command line of the decoupled EAGLE-3 trainer.

Why this exists: the trainer runs as its own process — a child of ``tidespec serve
--online-training``, a standalone job on another machine sharing the directories, or several
ranks under ``torchrun`` — so it needs an entry point that works both as a ``tidespec``
sub-command (``register``) and as ``python -m tidespec.online.trainer.cli train-drafter`` (``main``,
which is what ``torchrun -m`` and ``start_trainer_process`` launch).

Worked examples::

    tidespec train-drafter --signal-dir runs/signals --publish-root runs/drafter --min-signals 8192
    tidespec train-drafter --from-workload code.jsonl --signal-dir runs/sig --publish-root runs/drafter --once
    torchrun --nproc_per_node 2 -m tidespec.online.trainer.cli train-drafter --signal-dir ... --publish-root ... --once
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tidespec.commands import standalone_main
from tidespec.config import add_dataclass_args, dataclass_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train-drafter`` to the top-level parser's sub-parsers."""
    from tidespec.online.trainer.config import TrainerConfig

    p = subparsers.add_parser("train-drafter", help="train and publish EAGLE-3 drafters from captured signals",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_dataclass_args(p, TrainerConfig)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="log level")
    p.set_defaults(func=cmd_train_drafter)


def cmd_train_drafter(ns: argparse.Namespace) -> int:
    from tidespec.online.trainer.config import TrainerConfig
    from tidespec.online.trainer.process import train_drafter

    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = dataclass_from_args(TrainerConfig, ns)
    results = train_drafter(cfg)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun, rank 0 reports
    for r in results:
        status = f"published v{r.published_version}" if r.published_version else "not published"
        print(f"round {r.round}: {r.num_train_rows} train / {r.num_heldout_rows} held-out rows, loss "
              f"{r.train_loss:.3f}, mean acceptance length {r.baseline_accept_len:.3f} -> "
              f"{r.candidate_accept_len:.3f} ({status}, {r.train_time_s:.1f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    return standalone_main(register, argv)


if __name__ == "__main__":
    sys.exit(main())
