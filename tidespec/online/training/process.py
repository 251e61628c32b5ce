"""The ``tidespec train-drafter`` process: workload bootstrap, entry point, export.

Why this exists: training must never stall serving, so it runs in its own process (or on another
machine sharing the directories, or on another device, or on several ranks with DDP). It watches
the signal store the engine writes and publishes better heads (``trainer.rounds.DraftTrainer``);
the serving engine polls the publish root and swaps them in
(``tidespec.online.serving.attach.DrafterUpdater``). Engine and trainer share only those two directories.

``capture_from_workload`` fills a signal store by generating a workload with the target (the
offline bootstrap), ``train_drafter`` is the command's entry point, ``export_latest`` writes the
newest published drafter as one checkpoint. A serving process starts this one as its child with
``tidespec.online.serving.launch.start_trainer_process``.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tidespec.config import CollectionConfig
from tidespec.models.eagle3.checkpoint import export_eagle3, head_from_published, load_latest_valid
from tidespec.models.eagle3.head import Eagle3Config
from tidespec.models.medusa.heads import latest_published
from tidespec.models.target import TargetConfig, TargetModel
from tidespec.online.capture import CaptureBuffer
from tidespec.online.collection import SelectiveCollector
from tidespec.online.signals import SignalCollector, TapCaptureDrafter
from tidespec.online.store import SignalStore
from tidespec.online.training.config import TrainerConfig, TrainerConfigError
from tidespec.online.training.dist import DistContext
from tidespec.online.training.distill import bootstrap_engine, generate_continuations, teacher_pass, training_prompts
from tidespec.online.training.medusa_rounds import MedusaTrainer
from tidespec.online.training.rounds import DraftTrainer, RoundResult

logger = logging.getLogger(__name__)



# ----------------------------------------------------------------------------------------------
# offline bootstrap
# ----------------------------------------------------------------------------------------------


def capture_from_workload(model: TargetModel, tokenizer: Any, workload: str, signal_dir: str | Path, *,
                          max_tokens: int = 128, limit: int = 0, budget_bytes: int = 2 << 30,
                          max_num_seqs: int = 8, progress: bool = True, exclude: str = "",
                          hidden: bool = False) -> dict[str, int]:
    """Greedy-generate every prompt of the comma-separated workloads with the target, capturing the
    taps (``hidden``: the final hidden states instead, what Medusa heads train on) of every final position
    into the store at ``signal_dir``. Returns the capture counters."""
    from tidespec.engine.engine import RequestError
    from tidespec.sampling import SamplingParams

    prompts = training_prompts(workload, tokenizer, exclude=exclude, limit=limit)
    taps = () if hidden else Eagle3Config.for_target(model.cfg).tap_layers
    engine = bootstrap_engine(model, tokenizer, prompts, max_tokens, max_num_seqs, TapCaptureDrafter(taps, hidden))
    store = SignalStore(signal_dir, budget_bytes)
    capacity = max(4096, 4 * max_num_seqs * engine.max_model_len)
    capture = CaptureBuffer(store, capacity, min(2048, capacity), taps_dim=len(taps) * model.cfg.hidden_size,
                            hidden_dim=model.cfg.hidden_size if hidden else 0)
    collector = SignalCollector(engine, capture, SelectiveCollector(CollectionConfig(force=True)), taps=not hidden)
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


def distill_from_workload(model: TargetModel, tokenizer: Any, cfg: TrainerConfig) -> int:
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
    from tidespec.models.kernels.linear import tune_linears
    from tidespec.models.loading.loader import DTYPES, load_model

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ctx = DistContext.from_env(cfg.backend, cfg.device)
    if ctx.enabled and cfg.drafter == "medusa":
        ctx.close()
        raise TrainerConfigError("--drafter medusa trains in one process (its heads are small): not under torchrun")
    try:
        device = cfg.device
        if ctx.enabled and device == "cuda":
            device = f"cuda:{ctx.local_rank}"
        loaded = load_model(cfg.model, dtype=DTYPES[cfg.dtype], device=device)
        if cfg.from_workload:
            # its capture and distillation forwards: the fastest kernel per row count (CPU). Not for online
            # rounds: they never run the target's layers (only its LM-head rows), and a trainer child that
            # yields the CPU to serving spent a fresh machine's idle gaps measuring them (all of make demo's
            # trainer time on a Zen 3 EPYC, 2026-12-07: no round reached)
            tune_linears(loaded.model)
            if ctx.is_main and cfg.topk:
                distill_from_workload(loaded.model, loaded.tokenizer, cfg)
            elif ctx.is_main:
                capture_from_workload(loaded.model, loaded.tokenizer, cfg.from_workload, cfg.signal_dir,
                                      max_tokens=cfg.max_tokens, limit=cfg.workload_limit,
                                      budget_bytes=cfg.budget_mb << 20, progress=cfg.progress,
                                      exclude=cfg.exclude_workload, hidden=cfg.drafter == "medusa")
            ctx.barrier()
            if cfg.capture_only:
                return []
        run_cfg = dataclasses.replace(cfg, device=device)
        trainer: DraftTrainer | MedusaTrainer = (
            MedusaTrainer(run_cfg, loaded.model) if cfg.drafter == "medusa"
            else DraftTrainer(run_cfg, loaded.config, loaded.model.embed_tokens, ctx, target=loaded.model))
        if cfg.from_workload:  # the bootstrap signals form one round now, whatever their count
            first = trainer.run_round(min_signals=1)
            results = [first] if first is not None else []
            if not (cfg.once or (cfg.max_rounds and len(results) >= cfg.max_rounds)):
                results += trainer.run(max_rounds=cfg.max_rounds - len(results) if cfg.max_rounds else 0)
        else:
            results = trainer.run()
        if cfg.export_dir and ctx.is_main and cfg.drafter == "medusa":
            export_latest_medusa(cfg.publish_root, cfg.export_dir, loaded.model)
        elif cfg.export_dir and ctx.is_main:
            export_latest(cfg.publish_root, cfg.export_dir, loaded.config, DTYPES[cfg.export_dtype])
        # leave together: a rank tearing its process group down while another is still publishing
        # aborted at exit under CPU contention ("terminate called without an active exception")
        ctx.barrier()
        return results
    finally:
        ctx.close()


def export_latest_medusa(root: str | Path, directory: str | Path, target: TargetModel) -> int:
    """``export_latest`` for Medusa heads: the newest valid version under ``root`` written to ``directory``
    (serve it with ``--medusa-dir``). Returns the version; ``TrainerConfigError`` when none is published."""
    found = latest_published(Path(root), target.cfg.hidden_size, target.cfg.vocab_size)
    if found is None:
        raise TrainerConfigError(f"no valid Medusa heads are published under {root}; nothing to export")
    found[1].save(Path(directory))
    logger.info("exported Medusa heads version %d from %s to %s", found[0], root, directory)
    return found[0]


def export_latest(root: str | Path, directory: str | Path, target_cfg: TargetConfig, dtype: torch.dtype) -> int:
    """Write the newest valid published version under ``root`` as one exported checkpoint in
    ``dtype`` (a bfloat16 copy halves the size; the engine casts to the target's dtype on load).
    Returns the version exported; ``TrainerConfigError`` when nothing valid is published."""
    pub = load_latest_valid(root, target_cfg)
    if pub is None:
        raise TrainerConfigError(f"nothing valid is published under {root}; nothing to export")
    export_eagle3(head_from_published(pub, dtype, "cpu"), directory)
    logger.info("exported drafter version %d from %s to %s (%s)", pub.version, root, directory, dtype)
    return pub.version
