"""The ``tidespec train-drafter`` process: workload bootstrap, entry point, export, child start.

Why this exists: training must never stall serving, so it runs in its own process (or on another
machine sharing the directories, or on another device, or on several ranks with DDP). It watches
the signal store the engine writes and publishes better heads (``trainer.rounds.DraftTrainer``);
the serving engine polls the publish root and swaps them in
(``tidespec.online.attach.DrafterUpdater``). Engine and trainer share only those two directories.

``capture_from_workload`` fills a signal store by generating a workload with the target (the
offline bootstrap), ``train_drafter`` is the command's entry point, ``export_latest`` writes the
newest published drafter as one checkpoint, and ``start_trainer_process`` starts the trainer as a
child of a serving process (which runs it under ``trainer.supervisor.TrainerSupervisor``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tidespec.config import CollectionConfig
from tidespec.models.eagle3_checkpoint import export_eagle3, head_from_published, load_latest_valid
from tidespec.models.eagle3_head import Eagle3Config
from tidespec.models.llama import LlamaConfig, LlamaModel
from tidespec.online.attach import OnlineConfig, SignalCollector, TapCaptureDrafter
from tidespec.online.capture import CaptureBuffer
from tidespec.online.collection import SelectiveCollector
from tidespec.online.store import SignalStore
from tidespec.online.trainer.config import TrainerConfig, TrainerConfigError
from tidespec.online.trainer.dist import DistContext
from tidespec.online.trainer.distill import bootstrap_engine, generate_continuations, teacher_pass, training_prompts
from tidespec.online.trainer.rounds import DraftTrainer, RoundResult

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h


# ----------------------------------------------------------------------------------------------
# offline bootstrap
# ----------------------------------------------------------------------------------------------


def capture_from_workload(model: LlamaModel, tokenizer: Any, workload: str, signal_dir: str | Path, *,
                          max_tokens: int = 128, limit: int = 0, budget_bytes: int = 2 << 30,
                          max_num_seqs: int = 8, progress: bool = True, exclude: str = "") -> dict[str, int]:
    """Greedy-generate every prompt of the comma-separated workloads with the target, capturing the
    taps of every final position into the store at ``signal_dir``. Returns the capture counters."""
    from tidespec.engine.engine import RequestError
    from tidespec.sampling import SamplingParams

    prompts = training_prompts(workload, tokenizer, exclude=exclude, limit=limit)
    taps = Eagle3Config.for_target(model.cfg).tap_layers
    engine = bootstrap_engine(model, tokenizer, prompts, max_tokens, max_num_seqs, TapCaptureDrafter(taps))
    store = SignalStore(signal_dir, budget_bytes)
    capacity = max(4096, 4 * max_num_seqs * engine.max_model_len)
    capture = CaptureBuffer(store, capacity, min(2048, capacity), taps_dim=len(taps) * model.cfg.hidden_size)
    collector = SignalCollector(engine, capture, SelectiveCollector(CollectionConfig(force=True)))
    collector.hook_into(engine)
    params = SamplingParams(max_tokens=max_tokens)
    added = 0
    for p in prompts:
        try:
            engine.add_request(p.token_ids, params, label=p.record.domain)
            added += 1
        except RequestError as exc:
            logger.warning("skipping workload record %s: %s", p.record.id, exc)
    with tqdm(total=added, desc="bootstrap generate", unit="req", disable=not progress, leave=False) as bar:
        while engine.has_unfinished_requests():
            bar.update(sum(1 for o in engine.step() if o.finished))
    capture.close()
    stats = capture.stats()
    logger.info("bootstrap: %d prompts, %d rows captured, %d dropped", added, stats["num_captured"],
                stats["num_dropped"])
    return stats


def distill_from_workload(model: LlamaModel, tokenizer: Any, cfg: TrainerConfig) -> int:
    """``--from-workload`` with ``--topk``: sampled continuations, then a teacher pass storing the
    target's top-k logits of every position (``trainer.distill``). Returns the rows written."""
    prompts = training_prompts(cfg.from_workload or "", tokenizer, exclude=cfg.exclude_workload,
                               limit=cfg.workload_limit)
    seqs = generate_continuations(model, tokenizer, prompts, samples=cfg.samples, temperature=cfg.temperature,
                                  max_tokens=cfg.max_tokens, seed=cfg.seed, progress=cfg.progress)
    store = SignalStore(cfg.signal_dir, cfg.budget_mb << 20)
    rows = teacher_pass(model, seqs, Eagle3Config.for_target(model.cfg).tap_layers, cfg.topk, store,
                        progress=cfg.progress)
    logger.info("distill bootstrap: %d prompts, %d sequences, %d rows", len(prompts), len(seqs), rows)
    return rows


# ----------------------------------------------------------------------------------------------
# entry points
# ----------------------------------------------------------------------------------------------


def train_drafter(cfg: TrainerConfig) -> list[RoundResult]:
    """``tidespec train-drafter``: join torchrun's group if any, load the target, (bootstrap,) train."""
    from tidespec.models.loader import DTYPES, load_model

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ctx = DistContext.from_env(cfg.backend, cfg.device)
    try:
        device = cfg.device
        if ctx.enabled and device == "cuda":
            device = f"cuda:{ctx.local_rank}"
        loaded = load_model(cfg.model, dtype=DTYPES[cfg.dtype], device=device)
        if cfg.from_workload:
            if ctx.is_main and cfg.topk:
                distill_from_workload(loaded.model, loaded.tokenizer, cfg)
            elif ctx.is_main:
                capture_from_workload(loaded.model, loaded.tokenizer, cfg.from_workload, cfg.signal_dir,
                                      max_tokens=cfg.max_tokens, limit=cfg.workload_limit,
                                      budget_bytes=cfg.budget_mb << 20, progress=cfg.progress,
                                      exclude=cfg.exclude_workload)
            ctx.barrier()
            if cfg.capture_only:
                return []
        run_cfg = dataclasses.replace(cfg, device=device)
        trainer = DraftTrainer(run_cfg, loaded.config, loaded.model.embed_tokens, ctx, target=loaded.model)
        if cfg.from_workload:  # the bootstrap signals form one round now, whatever their count
            first = trainer.run_round(min_signals=1)
            results = [first] if first is not None else []
            if not (cfg.once or (cfg.max_rounds and len(results) >= cfg.max_rounds)):
                results += trainer.run(max_rounds=cfg.max_rounds - len(results) if cfg.max_rounds else 0)
        else:
            results = trainer.run()
        if cfg.export_dir and ctx.is_main:
            export_latest(cfg.publish_root, cfg.export_dir, loaded.config, DTYPES[cfg.export_dtype])
        # leave together: a rank tearing its process group down while another is still publishing
        # aborted at exit under CPU contention ("terminate called without an active exception")
        ctx.barrier()
        return results
    finally:
        ctx.close()


def export_latest(root: str | Path, directory: str | Path, target_cfg: LlamaConfig, dtype: torch.dtype) -> int:
    """Write the newest valid published version under ``root`` as one exported checkpoint in
    ``dtype`` (a bfloat16 copy halves the size; the engine casts to the target's dtype on load).
    Returns the version exported; ``TrainerConfigError`` when nothing valid is published."""
    pub = load_latest_valid(root, target_cfg)
    if pub is None:
        raise TrainerConfigError(f"nothing valid is published under {root}; nothing to export")
    export_eagle3(head_from_published(pub, dtype, "cpu"), directory)
    logger.info("exported drafter version %d from %s to %s (%s)", pub.version, root, directory, dtype)
    return pub.version


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
    cmd = [sys.executable, "-m", "tidespec.online.trainer.cli", "train-drafter",
           "--signal-dir", online.signal_dir, "--publish-root", online.publish_root,
           "--min-signals", str(online.collection.n_threshold), "--dtype", dtype, "--device", device,
           "--draft-vocab", str(draft_vocab), "--budget-mb", str(max(1, online.signal_budget_bytes >> 20)),
           "--no-progress"]
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
        raise TrainerConfigError(f"nice must be >= 0 (an unprivileged process cannot lower it), got {nice}")
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
    if prctl is None and nice == 0:
        return None

    def setup() -> None:
        if nice:
            os.nice(nice)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return setup
