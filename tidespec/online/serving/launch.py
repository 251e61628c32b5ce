"""Starting the trainer child from a serving process: the command line, its log, its niceness.

Why this exists: the server starts ``tidespec train-drafter`` as a child (under
``supervisor.TrainerSupervisor``) watching its signal store and publish root; the child's code
(``tidespec.online.training``) is never imported here, only its command line is built.

Worked example::

    proc = start_trainer_process(OnlineConfig(publish_root="runs/d", signal_dir="runs/s"), None, nice=10)
    # python -m tidespec.online.training.cli train-drafter --signal-dir runs/s --publish-root runs/d ...
    # output appended to runs/d/trainer.log
"""

from __future__ import annotations

import ctypes
import functools
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tidespec.config import EngineConfig
from tidespec.errors import ConfigError
from tidespec.online.serving.attach import OnlineConfig
from tidespec.online.serving.supervisor import RestartPolicy
from tidespec.speculative.drafters.eagle3_options import eagle3_options

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def start_trainer_process(online: OnlineConfig, model: str | None, dtype: str = "float32", device: str = "cpu",
                          draft_vocab: int = 0, extra_args: Sequence[str] = (),
                          log_path: Path | str | None = None, nice: int = 0) -> subprocess.Popen[bytes]:
    """Start ``train-drafter`` as a child process watching ``online``'s store and publish root.

    ``device``: where it trains (another GPU keeps training off the serving device). ``nice``:
    added to the child's niceness, so on a CPU shared with serving the scheduler runs the
    engine's threads first and training takes what serving leaves (0 keeps the parent's; Linux's
    scheduler weighs a nice-10 thread at about a tenth of a nice-0 one).
    ``draft_vocab`` must equal the engine's fresh-head draft vocabulary. Output goes to
    ``log_path`` (default: ``trainer_log_path(online)``). Stop it with ``terminate()``.
    """
    cmd = [sys.executable, "-m", "tidespec.online.training.cli", "train-drafter",
           "--signal-dir", online.signal_dir, "--publish-root", online.publish_root,
           "--min-signals", str(online.collection.n_threshold), "--dtype", dtype, "--device", device,
           "--draft-vocab", str(draft_vocab), "--budget-mb", str(max(1, online.signal_budget_bytes >> 20)),
           "--no-progress", "--drafter", online.drafter]
    if model:
        cmd += ["--model", model]
    if online.lora:
        cmd += ["--lora", "--lora-extra-vocab", str(online.lora_extra_vocab)]
    cmd += list(extra_args)
    log = Path(log_path) if log_path is not None else trainer_log_path(online)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_child_setup(nice))


def trainer_log_path(online: OnlineConfig) -> Path:
    """Where the trainer child's output goes by default: ``<publish_root>/trainer.log``."""
    return Path(online.publish_root) / "trainer.log"


def _child_setup(nice: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` for the trainer child: raise its niceness by ``nice`` and, on Linux, ask
    the kernel to SIGTERM it when its parent dies, so a serving process that is killed (SIGKILL,
    a crash) never leaves its trainer running. ``prctl`` has no wrapper in the standard library;
    libc's is looked up here, before the fork, so the child only makes the one foreign call."""
    if nice < 0:
        raise ConfigError(f"nice must be >= 0 (an unprivileged process cannot lower it), got {nice}")
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
    if prctl is None and nice == 0:
        return None

    def setup() -> None:
        if nice:
            os.nice(nice)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return setup


def trainer_starter(config: EngineConfig, online: OnlineConfig) -> Callable[[], subprocess.Popen[bytes]]:
    """``start_trainer_process`` with the trainer flags of ``config`` bound (``--trainer-device``,
    ``--trainer-args``, ``--trainer-nice``): what ``TrainerSupervisor`` calls to start, and restart,
    the child of ``tidespec serve --online-training`` or of a fleet's trainer."""
    oc = config.online
    return functools.partial(
        start_trainer_process, online, config.model.model, dtype=config.model.dtype,
        device=oc.trainer_device or config.model.device, draft_vocab=eagle3_options(config.spec).draft_vocab,
        extra_args=shlex.split(oc.trainer_args), log_path=trainer_log_path(online), nice=oc.trainer_nice)


def restart_policy(config: EngineConfig) -> RestartPolicy:
    """The trainer child's restart policy from ``--trainer-max-restarts`` / ``--trainer-backoff-max-s``."""
    return RestartPolicy(max_restarts=config.online.trainer_max_restarts,
                         backoff_max_s=config.online.trainer_backoff_max_s)
