"""``tidespec bench learn``: how an EAGLE-3 head's acceptance grows with its training signals.

Why this exists: the goal was a mean acceptance length of 2.5 at gamma 4 from scratch on code,
and our bootstrap ends near 1.6 on held-out code. Whether more steps or more data would close the
gap is a measurement, not a guess: this benchmark trains fresh heads on nested shares of the same
captured signals for the same number of optimizer steps (or the same number of passes), scores
every one on one fixed held-out split with the trainer's own metric (simulated greedy
gamma-chains against the target's tokens), and fits the best score against log2(training rows).
Beside that per-row score it reports the same chains walked as a greedy server meets them (one step
per emitted run of tokens: ``eagle3_train.AcceptanceStats``), the figure a served acceptance length
is comparable with; the per-row score is higher (an easy stretch counts at each of its rows).
Curves that flatten over steps at levels rising with the share mean data-limited; curves still
rising at their last step mean step-limited. The fit's slope says what each doubling of signals
buys, and how many rows the target length would take if the trend held (an extrapolation,
labelled as one).

Protocol::

    signal stores (one or more; sequences re-keyed store by store, in store order)
      -> held out: every round(1/heldout_frac)-th sequence (the trainer's rule), fixed for all shares
      -> training sequences shuffled once (seed); share f = the first round(f * n) of them (nested)
      -> per share: a fresh head (draft vocabulary = that share's most frequent tokens; or, with
         ``init_from``, a trained checkpoint, its vocabulary widened to ``draft_vocab`` by
         ``trainer.data.widen_head``: fine-tuning), the same
         ``steps`` AdamW training-time-test steps as ``train-drafter`` (or, with ``per_share_epochs``,
         ``epochs`` passes over the share's own segments), held-out acceptance at step 0 and at
         ``evals`` evenly spaced steps
      -> fit best held-out acceptance = a + b * log2(rows) over the shares (least squares)
      -> the largest share's head per source: each store's own held-out sequences and every sequence
         of each ``eval_dirs`` store (scored, never trained on): acceptance, walked, and the share of
         the text's tokens inside the head's draft vocabulary (a token outside it cannot be drafted)

Worked example::

    cfg = LearnBenchConfig(signal_dirs="runs/boot/signals", fractions="0.25,0.5,1", steps=60)
    doc = run_learn_bench(cfg, resolve_target(None), Path("runs/learn"))
    doc["fit"]["per_doubling"]   # e.g. 0.08: each doubling of rows adds 0.08 to the acceptance length

Outputs: ``bench_learn.json`` (every evaluation), ``README.md`` (table, fit), ``learn.png``
(held-out acceptance over steps per share; best acceptance against rows with the fit);
``--replot DIR`` re-renders the last two from the first.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from tidespec.bench.common.report import (
    default_out_dir,
    finish_run,
    machine_line,
    markdown_table,
    new_figure,
    rerender_run,
    save_figure,
)
from tidespec.bench.decode.run import parse_float_list
from tidespec.bench.learn.calibration import calibration_report, judge_calibration, parse_windows, plot_calibration
from tidespec.config import ConfigError, opt
from tidespec.models.eagle3.checkpoint import PublishedDrafter, export_eagle3, head_from_published, load_drafter_source
from tidespec.models.eagle3.head import FUSIONS, INIT_FROM_TARGET, Eagle3Head, init_from_target
from tidespec.models.loading.loader import LoadedModel
from tidespec.online.store import SignalStore
from tidespec.online.training.config import TrainerConfig
from tidespec.online.training.data import (
    deepen_head,
    fresh_head_for,
    heldout_acceptance,
    heldout_keys,
    segments_by_sequence,
    widen_head,
)
from tidespec.online.training.eagle3_train import SignalSegment
from tidespec.online.training.judge import walk_head
from tidespec.online.training.rounds import DraftTrainer


def parse_fractions(text: str) -> tuple[float, ...]:
    """"0.5,0.125,1" -> (0.125, 0.5, 1.0); each in (0, 1], no repeats."""
    values = sorted(set(parse_float_list(text, "fractions")))
    if values[0] <= 0.0 or values[-1] > 1.0:
        raise ConfigError(f"fractions must be in (0, 1], got {text!r}")
    return tuple(values)


@dataclass
class LearnBenchConfig:
    """The training recipe's defaults are ``train-drafter``'s (``TrainerConfig``): by default
    ``bench learn`` measures the recipe the online trainer runs."""

    signal_dirs: str = opt("runs/boot/signals", "comma-separated signal stores to learn from (train-drafter "
                                                "--from-workload writes one; so does a serving engine)")
    fractions: str = opt("0.125,0.25,0.5,1", "shares of the training sequences, each a prefix of one seeded "
                                             "shuffle (nested)")
    steps: int = opt(0, "optimizer steps for every share (0 = --epochs passes over the full training split)")
    epochs: float = opt(2.0, "with --steps 0: passes over the full training split, which fixes the steps")
    per_share_epochs: bool = opt(False, "train every share for --epochs passes over its own segments instead "
                                        "(bigger shares get more steps)")
    evals: int = opt(6, "held-out evaluations per share, evenly spaced (plus one of the fresh head)")
    heldout_frac: float = opt(TrainerConfig.heldout_frac, "fraction of sequences held out (the trainer's rule), "
                                                          "the same for all shares")
    gamma: int = opt(TrainerConfig.gamma, "draft length of the simulated-acceptance evaluation")
    draft_vocab: int = opt(8192, "draft vocabulary of the fresh heads (0 = the target's); with --init-from, a "
                                 "size above the checkpoint's widens its vocabulary (its own tokens plus the "
                                 "most frequent others of the training split)")
    init_from: str | None = opt(None, "every share starts from this exported EAGLE-3 checkpoint instead of a "
                                      "fresh head (fine-tuning; a --head-layers above its depth deepens it with "
                                      "blocks that start as the identity; --fusion and --init-from-target do "
                                      "not apply)")
    batch_segments: int = opt(TrainerConfig.batch_segments, "segments per optimizer step")
    max_segment_len: int = opt(TrainerConfig.max_segment_len, "positions per training segment")
    lr: float = opt(0.0, "AdamW peak learning rate (0 = the trainer's: its --lr for fresh heads, its --finetune-lr "
                         "with --init-from)")
    lr_schedule: str = opt(TrainerConfig.lr_schedule, "constant or cosine (decay to 10 %% of --lr)",
                           choices=["constant", "cosine"])
    warmup_steps: int = opt(TrainerConfig.warmup_steps, "linear learning-rate warm-up steps")
    weight_decay: float = opt(TrainerConfig.weight_decay, "AdamW weight decay")
    autocast: str = opt(TrainerConfig.autocast, "none or bf16 (training matmuls in bfloat16)",
                        choices=["none", "bf16"])
    head_layers: int = opt(TrainerConfig.head_layers, "decoder layers of the fresh heads (with --init-from: "
                                                      "of the fine-tuned ones, when above the checkpoint's)")
    fusion: str = opt(TrainerConfig.fusion, "concat (EAGLE-3) or gated (a learned gate mixes the two, as Dovetail)", choices=list(FUSIONS))
    init_from_target: str = opt(TrainerConfig.init_from_target, "fresh heads start from the target's weights: "
                                "none, lm_head or layer (train-drafter's flag)", choices=["none", "lm_head", "layer"])
    distill: str = opt(TrainerConfig.distill, "with top-k signals: soft or top1 labels", choices=["soft", "top1"])
    ttt_steps: int = opt(TrainerConfig.ttt_steps, "training-time-test unroll steps")
    target_length: float = opt(2.5, "acceptance length whose row count the fit extrapolates to")
    domains: str = opt("", "comma-separated domain labels: only rows of these domains are learned from and scored "
                           "(a server's store tags each row with its request's X-Tidespec-Route label, bench "
                           "shift's with its workload; empty = all)")
    eval_dirs: str = opt("", "comma-separated signal stores the largest share's head is scored on but never "
                             "trained on, every sequence of each (e.g. a domain's captured traffic)")
    judge_windows: str = opt("", "comma-separated window sizes (held-out requests): check the trainer's judgement "
                                 "on random windows of that many held-out requests against the gain over all of "
                                 "them, resampling blocks vs requests (bench/learn/calibration.py; empty = no check)")
    judge_draws: int = opt(200, "random windows per --judge-windows size")
    export_dir: str | None = opt(None, "write the largest share's trained head here as an EAGLE-3 checkpoint "
                                       "(serve it with --eagle3-dir; bench shift --bootstrap)")
    seed: int = opt(TrainerConfig.seed, "seed of the shuffle, the heads and the batches")

    def __post_init__(self) -> None:
        if not self.dirs:
            raise ConfigError("signal_dirs must name at least one directory")
        for d in self.dirs + self.eval_stores:
            if not Path(d).is_dir():
                raise ConfigError(f"signal dir {d} is not a directory")
        parse_fractions(self.fractions)
        if (self.lr_schedule not in ("constant", "cosine") or self.init_from_target not in INIT_FROM_TARGET
                or self.distill not in ("soft", "top1") or self.fusion not in FUSIONS
                or self.autocast not in ("none", "bf16")):
            raise ConfigError(f"lr_schedule must be constant or cosine, distill soft or top1, autocast none or "
                              f"bf16, fusion one of "
                              f"{', '.join(FUSIONS)} and init_from_target one of {', '.join(INIT_FROM_TARGET)}")
        try:
            parse_windows(self.judge_windows)
        except ValueError as exc:
            raise ConfigError(f"judge_windows: {exc}") from None
        for name in ("evals", "gamma", "batch_segments", "max_segment_len", "ttt_steps", "head_layers", "judge_draws"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "draft_vocab", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if (self.steps == 0 or self.per_share_epochs) and self.epochs <= 0:
            raise ConfigError("epochs must be > 0 when steps is 0 or per_share_epochs is set")
        if self.steps and self.per_share_epochs:
            raise ConfigError("give either steps or per_share_epochs, not both")
        if not 0.0 < self.heldout_frac < 1.0:
            raise ConfigError(f"heldout_frac must be in (0, 1), got {self.heldout_frac}")
        if self.init_from is not None and self.init_from_target != "none":
            raise ConfigError("give either init_from (a trained head) or init_from_target, not both")
        if self.lr < 0 or self.target_length <= 1.0 or self.weight_decay < 0:
            raise ConfigError("lr must be >= 0, target_length > 1 and weight_decay >= 0")

    @property
    def dirs(self) -> list[str]:
        return [d.strip() for d in self.signal_dirs.split(",") if d.strip()]

    @property
    def peak_lr(self) -> float:
        """``lr``, or the trainer's rate for what the shares start from (a trained head or a fresh one)."""
        return self.lr or (TrainerConfig.finetune_lr if self.init_from is not None else TrainerConfig.lr)

    @property
    def domain_set(self) -> frozenset[str]:
        return frozenset(d.strip() for d in self.domains.split(",") if d.strip())

    @property
    def eval_stores(self) -> list[str]:
        return [d.strip() for d in self.eval_dirs.split(",") if d.strip()]

    @property
    def shares(self) -> tuple[float, ...]:
        return parse_fractions(self.fractions)


def load_store_sequences(directory: str, max_segment_len: int, domains: frozenset[str] = frozenset()
                         ) -> tuple[list[list[SignalSegment]], int]:
    """One store's sequences (segments each, in sequence-id order) and its row count; with
    ``domains``, only the rows of those domains."""
    shards = [shard for _, shard in SignalStore(directory, 1 << 40).iter_shards()]
    if domains:
        shards = [kept for shard in shards if (kept := shard.in_domains(domains)).num_signals]
    by_seq = segments_by_sequence(shards, max_segment_len)
    return [by_seq[sid] for sid in sorted(by_seq)], sum(int(shard.positions.numel()) for shard in shards)


def load_sequences(dirs: list[str], max_segment_len: int, domains: frozenset[str] = frozenset()
                   ) -> tuple[dict[int, list[SignalSegment]], list[int], list[int]]:
    """Every sequence of every store, re-keyed 0, 1, ... store by store (sequence ids of different
    stores may collide). Returns (segments per key, rows per store, the store index of each key)."""
    by_key: dict[int, list[SignalSegment]] = {}
    rows: list[int] = []
    store_of: list[int] = []
    for i, d in enumerate(dirs):
        sequences, n = load_store_sequences(d, max_segment_len, domains)
        for segs in sequences:
            by_key[len(by_key)] = segs
            store_of.append(i)
        rows.append(n)
    if not by_key:
        raise ConfigError(f"no signals in {', '.join(dirs)}" + (f" of domains {', '.join(sorted(domains))}"
                                                               if domains else ""))
    return by_key, rows, store_of


def vocab_coverage(head: Eagle3Head, segments: list[SignalSegment]) -> float:
    """Share of the tokens the segments' text continues with that lie inside ``head``'s draft
    vocabulary (NaN for no rows). Example: labels [5, 7, 9] and a vocabulary {5, 9} -> 2/3."""
    labels = torch.cat([s.token_ids[1:] for s in segments]) if segments else torch.zeros(0, dtype=torch.int64)
    return float(head.t2d.cpu()[labels].float().mean()) if labels.numel() else float("nan")


Source = tuple[str, str, int, list[SignalSegment]]  # (store, split, sequences, their segments)


def score_sources(head: Eagle3Head, embed: nn.Embedding, sources: list[Source], gamma: int) -> list[dict[str, Any]]:
    """Per source: its sequences and rows, acceptance per row and walked as served
    (``heldout_acceptance``), and ``vocab_coverage``."""
    out = []
    for name, split, sequences, segs in sources:
        acc, walk = heldout_acceptance(head, embed, segs, gamma)
        out.append({"source": name, "split": split, "sequences": sequences, "rows": sum(s.num_positions for s in segs),
                    "accept_len": acc, "walk_len": walk, "coverage": vocab_coverage(head, segs)})
    return out


def fit_log2(rows: list[int], lengths: list[float], target: float) -> dict[str, Any]:
    """Least-squares ``length = a + b * log2(rows)``; ``rows_for_target`` = where the line reaches
    ``target`` (None unless b > 0). Needs two distinct row counts.

    Example: rows [1000, 2000, 4000], lengths [1.3, 1.4, 1.5] -> b = 0.1 per doubling,
    rows_for_target(2.5) = 4000 * 2**10 = 4,096,000.
    """
    ok = [(r, v) for r, v in zip(rows, lengths) if r > 0 and math.isfinite(v)]
    if len({r for r, _ in ok}) < 2:
        return {"per_doubling": None, "intercept": None, "rows_for_target": None, "target": target}
    x = np.log2([r for r, _ in ok])
    b, a = np.polyfit(x, [v for _, v in ok], 1)
    need = float(2.0 ** ((target - a) / b)) if b > 0 else None
    return {"per_doubling": float(b), "intercept": float(a), "rows_for_target": need, "target": target}


def load_start(path: str, target: LoadedModel) -> PublishedDrafter:
    """The exported checkpoint (or publish root's newest version) at ``path``, validated; read once,
    before the stores, so a bad path fails at once rather than after minutes of loading."""
    published = load_drafter_source(path, target.config)
    if published is None:
        raise ConfigError(f"init_from {path} holds no valid EAGLE-3 checkpoint")
    return published


def start_from(published: PublishedDrafter, draft_vocab: int, train: list[SignalSegment], target: LoadedModel,
               dtype: torch.dtype, device: torch.device, num_layers: int = 1) -> Eagle3Head:
    """``published`` as a trainable head, its vocabulary widened to ``draft_vocab`` from ``train``
    when that is larger (``widen_head``), deepened to ``num_layers`` when that is larger
    (``deepen_head``: the new blocks start as the identity)."""
    head = head_from_published(published, dtype, device)
    if draft_vocab > head.cfg.draft_vocab_size:
        head = widen_head(head, draft_vocab, train, target.model.lm_head.weight)
    if num_layers > head.cfg.num_layers:
        head = deepen_head(head, num_layers, list(target.model.layers))
    return head.train()


def run_learn_bench(cfg: LearnBenchConfig, target: LoadedModel, out_dir: Path | None = None, command: str = "",
                    progress: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train one fresh head per share and evaluate it on the fixed held-out split (module docstring)."""
    out_dir = out_dir or default_out_dir("learn")
    start = load_start(cfg.init_from, target) if cfg.init_from is not None else None
    by_key, store_rows, store_of = load_sequences(cfg.dirs, cfg.max_segment_len, cfg.domain_set)
    held = heldout_keys(list(by_key), cfg.heldout_frac)
    sources: list[Source] = [(d, "held out", sum(store_of[k] == i for k in held),
                              [s for k in sorted(held) if store_of[k] == i for s in by_key[k]])
                             for i, d in enumerate(cfg.dirs)]
    for d in cfg.eval_stores:
        sequences = load_store_sequences(d, cfg.max_segment_len, cfg.domain_set)[0]
        sources.append((d, "scored only", len(sequences), [s for segs in sequences for s in segs]))
    by_source: list[dict[str, Any]] = []
    calibration: dict[str, Any] | None = None
    # seq_id = the key: ids of different stores may collide, and a judgement's samples are whole sequences
    heldout = [dataclasses.replace(s, seq_id=k) for k in sorted(held) for s in by_key[k]]
    windows = parse_windows(cfg.judge_windows)
    train_keys = [k for k in sorted(by_key) if k not in held]
    order = [train_keys[int(i)] for i in torch.randperm(len(train_keys),
                                                        generator=torch.Generator().manual_seed(cfg.seed))]
    full = [s for k in train_keys for s in by_key[k] if s.num_positions >= 2]

    def steps_for(num_segments: int) -> int:
        return cfg.steps or max(1, math.ceil(cfg.epochs * num_segments / cfg.batch_segments))

    heldout_rows = sum(s.num_positions for s in heldout)
    log(f"{sum(store_rows):,} rows in {len(by_key)} sequences from {len(cfg.dirs)} store(s); held out "
        f"{len(held)} sequences ({heldout_rows:,} rows); "
        + (f"{cfg.epochs:g} epochs per share" if cfg.per_share_epochs else f"{steps_for(len(full))} steps per share"))
    curves: list[dict[str, Any]] = []
    embed = target.model.embed_tokens
    with tempfile.TemporaryDirectory(prefix="tidespec-learn-") as tmp:
        base = TrainerConfig(signal_dir=str(Path(tmp) / "s"), publish_root=str(Path(tmp) / "p"),
                             batch_segments=cfg.batch_segments, max_segment_len=cfg.max_segment_len, lr=cfg.peak_lr,
                             ttt_steps=cfg.ttt_steps, gamma=cfg.gamma, seed=cfg.seed, progress=progress,
                             lr_schedule=cfg.lr_schedule,  # type: ignore[arg-type]
                             warmup_steps=cfg.warmup_steps, weight_decay=cfg.weight_decay,
                             distill=cfg.distill, autocast=cfg.autocast)  # type: ignore[arg-type]
        trainer = DraftTrainer(base, target.config, embed)
        for share in cfg.shares:
            n = max(1, round(share * len(order)))
            segs = [s for k in order[:n] for s in by_key[k] if s.num_positions >= 2]
            rows = sum(s.num_positions for s in segs)
            steps = steps_for(len(segs) if cfg.per_share_epochs else len(full))
            marks = sorted({max(1, round(steps * j / cfg.evals)) for j in range(1, cfg.evals + 1)})
            trainer.cfg = dataclasses.replace(base, max_steps=steps)
            if start is not None:
                head = start_from(start, cfg.draft_vocab, segs, target, trainer.dtype, trainer.device, cfg.head_layers)
            else:
                head = fresh_head_for(target.config, cfg.draft_vocab, segs, trainer.dtype, trainer.device, cfg.seed,
                                      cfg.head_layers, cfg.fusion)
                init_from_target(head, target.model, cfg.init_from_target)
            acc0, walk0 = heldout_acceptance(head, embed, heldout, cfg.gamma)
            last = share == cfg.shares[-1]
            start_walk = walk_head(head, embed, heldout, cfg.gamma, base.judge_block_rows) if last and windows else None
            points = [{"step": 0, "heldout_accept_len": acc0, "heldout_walk_len": walk0, "train_loss": None}]
            window: list[float] = []
            t0 = time.perf_counter()
            eval_s = 0.0

            def on_step(step: int, loss: float) -> None:
                nonlocal eval_s
                window.append(loss)
                if step not in marks:
                    return
                t = time.perf_counter()
                head.eval()
                acc, walk = heldout_acceptance(head, embed, heldout, cfg.gamma)
                head.train()
                eval_s += time.perf_counter() - t
                points.append({"step": step, "heldout_accept_len": acc, "heldout_walk_len": walk,
                               "train_loss": sum(window) / len(window)})
                window.clear()
                log(f"  share {share:g} ({rows:,} rows): step {step}/{steps}  train loss {points[-1]['train_loss']:.3f}"
                    f"  held-out accept len {acc:.3f} (walked as served: {walk:.3f})")

            trainer.train_head(head, segs, seed=cfg.seed, on_step=on_step)
            if last:
                if cfg.export_dir:
                    export_eagle3(head, cfg.export_dir)
                head.eval()
                by_source = score_sources(head, embed, sources, cfg.gamma)
                if start_walk is not None:
                    calibration = judge_calibration(start_walk, walk_head(head, embed, heldout, cfg.gamma,
                                                                          base.judge_block_rows),
                                                    windows, cfg.judge_draws, base.judge_confidence, cfg.seed)
            best = max(points, key=lambda p: p["heldout_accept_len"])
            best_walk = max((p["heldout_walk_len"] for p in points if math.isfinite(p["heldout_walk_len"])),
                            default=float("nan"))
            curves.append({"fraction": share, "sequences": n, "rows": rows, "steps": steps, "points": points,
                           "final_accept_len": points[-1]["heldout_accept_len"],
                           "final_walk_len": points[-1]["heldout_walk_len"],
                           "best_accept_len": best["heldout_accept_len"], "best_step": best["step"],
                           "best_walk_len": best_walk,
                           "train_s": time.perf_counter() - t0 - eval_s})
    fit = fit_log2([c["rows"] for c in curves], [c["best_accept_len"] for c in curves], cfg.target_length)
    fit_walk = fit_log2([c["rows"] for c in curves], [c["best_walk_len"] for c in curves], cfg.target_length)
    doc: dict[str, Any] = {"config": asdict(cfg), "lr": cfg.peak_lr, "store_rows": store_rows, "sequences": len(by_key),
                           "heldout_sequences": len(held), "heldout_rows": heldout_rows, "curves": curves,
                           "fit": fit, "fit_walk": fit_walk, "sources": by_source, "judge": calibration}
    return finish_run(out_dir, "learn", doc, command, str(target.model.dtype).removeprefix("torch."), report,
                      plot_learn, log)


def replot(out_dir: Path) -> dict[str, Any]:
    """Re-render README.md and learn.png of an earlier run from its ``bench_learn.json``."""
    return rerender_run(out_dir, "learn", report, plot_learn)


def report(doc: dict[str, Any]) -> str:
    """Markdown: the command, the machine, one row per share, the fit."""
    cfg = doc["config"]
    stores = ", ".join(cfg["signal_dirs"].split(",")) + (f" (rows of {cfg['domains']})" if cfg.get("domains") else "")
    steps = (f"{cfg['epochs']:g} passes over each share's own segments" if cfg.get("per_share_epochs")
             else "the same count for every share")
    lines = ["# bench learn", "", "```", doc.get("command", ""), "```", "", machine_line(doc["machine"]), "",
             f"{doc['sequences']} sequences ({sum(doc['store_rows']):,} rows) from {stores}; held out "
             f"{doc['heldout_sequences']} sequences ({doc['heldout_rows']:,} rows), the same for every share; "
             f"optimizer steps of {cfg['batch_segments']} segments ({steps}) at peak lr {doc.get('lr', cfg['lr']):g}; "
             f"simulated greedy gamma-{cfg['gamma']} "
             "chains, mean acceptance length including the bonus token.", ""]
    rows = []
    for c in doc["curves"]:
        p = c["points"]
        last_gain = p[-1]["heldout_accept_len"] - p[-2]["heldout_accept_len"] if len(p) > 1 else float("nan")
        rows.append([f"{c['fraction']:g}", c["sequences"], f"{c['rows']:,}", c["steps"],
                     f"{p[0]['heldout_accept_len']:.3f}", f"{c['final_accept_len']:.3f}", f"{last_gain:+.3f}",
                     f"{c['best_accept_len']:.3f} (step {c['best_step']})", _fmt(p[0].get("heldout_walk_len")),
                     _fmt(c.get("final_walk_len")),
                     f"{p[-1]['train_loss']:.3f}" if p[-1]["train_loss"] is not None else "-", f"{c['train_s']:.0f}"])
    start = "start (fine-tuned from its checkpoint)" if doc["config"].get("init_from") else "fresh"
    lines.append(markdown_table(["share", "sequences", "train rows", "steps", start, "final",
                                 "last gain", "best", "start, walked as served", "final, walked as served",
                                 "final train loss", "train s"], rows))
    lines += ["", "(last gain: held-out change over the last evaluation interval; clearly positive means "
              "that share was still learning when its steps ran out, i.e. step-limited there. Walked as served: "
              "the same chains counted as a greedy server meets them, one step per emitted run of tokens instead "
              "of one per row, which is what a served acceptance length measures; lower, since easy stretches "
              "are drafted from once per step, not at each of their rows.)"]
    if doc.get("sources"):  # runs written before the per-source scores have none
        lines += ["", ("The largest share's head at its last step, per source (vocabulary coverage: the share of "
                       "the text's tokens inside the head's draft vocabulary; a token outside it cannot be drafted):"),
                  ""]
        lines.append(markdown_table(
            ["source", "split", "sequences", "rows", "accept len", "walked as served", "vocabulary coverage"],
            [[src["source"], src["split"], src["sequences"], f"{src['rows']:,}", f"{src['accept_len']:.3f}",
              f"{src['walk_len']:.3f}", f"{100 * src['coverage']:.1f} %"] for src in doc["sources"]]))
    for name, fit in (("the best held-out acceptance", doc["fit"]),
                      ("the best held-out acceptance walked as served", doc.get("fit_walk"))):
        if fit is None:  # a run written before the walked estimate existed
            continue
        lines.append("")
        lines.append(_fit_line(name, fit, max(c["rows"] for c in doc["curves"])))
    if doc.get("judge"):
        lines += [""] + calibration_report(doc["judge"])
    lines.append("")
    return "\n".join(lines)


def _fit_line(name: str, fit: dict[str, Any], largest: int) -> str:
    """One sentence on a ``fit_log2`` result."""
    if fit["per_doubling"] is None:
        return f"Fit of {name}: needs at least two shares with different row counts."
    need = fit["rows_for_target"]
    reach = (f"it reaches {fit['target']:g} at about {need:.2g} rows if the trend held (an extrapolation "
             f"{need / largest:.2g}x beyond the largest share)"
             if need is not None else f"it does not rise, so it never reaches {fit['target']:g}")
    return (f"Fit of {name}: {fit['intercept']:.3f} + {fit['per_doubling']:.3f} x log2(rows), i.e. "
            f"{fit['per_doubling']:+.3f} per doubling of the training rows; {reach}.")


def _fmt(x: float | None) -> str:
    """3 decimals, "-" for a run written before the walked estimate existed."""
    return "-" if x is None else f"{x:.3f}"


def plot_learn(doc: dict[str, Any], out_dir: Path) -> Path:
    """Left: held-out acceptance over optimizer steps, one line per share (dashed: the same chains walked
    as a server meets them). Right: best held-out acceptance against training rows (log2 axis) with
    the fit, extended to the target length. With ``--judge-windows``, a third panel: how often the
    judgement's interval covers the gain on windows of each size (``calibration.plot_calibration``)."""
    fig, axes = new_figure(3 if doc.get("judge") else 2)
    ax_s, ax_r = axes[0], axes[1]
    if doc.get("judge"):
        plot_calibration(axes[2], doc["judge"])
    for c in doc["curves"]:
        line, = ax_s.plot([p["step"] for p in c["points"]], [p["heldout_accept_len"] for p in c["points"]],
                          marker="o", label=f"{c['fraction']:g} ({c['rows']:,} rows)")
        walked = [(p["step"], p["heldout_walk_len"]) for p in c["points"] if p.get("heldout_walk_len") is not None]
        if walked:
            ax_s.plot(*zip(*walked), ls="--", marker=".", color=line.get_color(),
                      label=f"{c['fraction']:g}, walked as served")
    ax_s.set_xlabel("optimizer step")
    ax_s.set_ylabel(f"held-out mean acceptance length (gamma {doc['config']['gamma']})")
    start = "fine-tuned heads" if doc["config"].get("init_from") else "fresh heads"
    ax_s.set_title(f"{start}, nested shares" + (", same epochs" if doc["config"].get("per_share_epochs")
                                                else ", same steps"))
    ax_s.legend(fontsize=8)
    ax_s.grid(alpha=0.3)
    rows = [c["rows"] for c in doc["curves"]]
    fit = doc["fit"]
    for key, fit_key, what in (("best_accept_len", "fit", "best held-out"),
                               ("best_walk_len", "fit_walk", "best held-out, walked as served")):
        if fit_key not in doc:  # a run written before the walked estimate existed
            continue
        dots, = ax_r.plot(rows, [c[key] for c in doc["curves"]], "o", label=what)
        f = doc[fit_key]
        if f["per_doubling"] is not None:
            hi = max(rows) * 4.0
            if f["rows_for_target"] is not None:
                hi = max(hi, min(f["rows_for_target"], max(rows) * 2.0 ** 12))
            xs = np.geomspace(min(rows), hi, 50)
            ax_r.plot(xs, f["intercept"] + f["per_doubling"] * np.log2(xs), "--", color=dots.get_color(),
                      label=f"fit: {f['per_doubling']:+.3f} per doubling")
    ax_r.axhline(fit["target"], color="grey", lw=0.8, ls=":", label=f"target {fit['target']:g}")
    ax_r.set_xscale("log", base=2)
    ax_r.set_xlabel("training rows (log2)")
    ax_r.set_ylabel("best held-out mean acceptance length")
    ax_r.set_title("acceptance against signals")
    ax_r.legend(fontsize=8)
    ax_r.grid(alpha=0.3)
    return save_figure(fig, out_dir, "learn.png")
