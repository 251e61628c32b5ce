"""``tidespec bench shift``'s side measurements: capture overhead, and training from signals vs recomputing them.

Why this exists: TIDE's cost claims — capturing the target's hidden states costs the serving
engine almost nothing (Sec. 5), and training from stored signals beats recomputing them with a
target prefill every epoch (Table 2) — are measured here, apart from the trace runs: each is
optional (``--overhead-repeats 0``, ``--recompute-rows 0``) and can run alone (``--configs none``).

* capture overhead: the frozen drafter on the first phase's prompts with capture off and with
  capture on (collection forced, a real store), alternated ``overhead_repeats`` times;
  overhead = 1 - throughput(on) / throughput(off), median over the pairs.
* training sources: one epoch on a store's whole sequences, from the stored signals against
  from hidden states recomputed by a prefill; the same fresh head, segments, batches and seed.

Worked example: pairs (tok/s off/on) 40.0/39.2 and 39.0/38.6 -> ratios 0.980, 0.990 -> median
0.985 -> overhead 1.5 %.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tidespec.bench.shift.config import ShiftBenchConfig, TraceItem
from tidespec.bench.shift.runs import learned_engine, run_trace, trace_engine_config
from tidespec.config import CollectionConfig
from tidespec.models.eagle3.head import Eagle3Config
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.models.loading.loader import LoadedModel
from tidespec.models.target import TargetModel
from tidespec.online.serving.attach import OnlineConfig, OnlineTraining, attach_online_training
from tidespec.online.store import SignalShard, SignalStore


def measure_capture_overhead(target: LoadedModel, trace: list[TraceItem], cfg: ShiftBenchConfig, root: Path,
                             progress: bool = True) -> dict[str, Any]:
    """Throughput of the frozen drafter with capture off vs on (forced), alternated."""
    items = trace[:cfg.overhead_requests]
    ecfg = trace_engine_config(items, cfg, target.model, cfg.gamma)
    pairs: list[dict[str, float]] = []
    dropped = 0
    warm = learned_engine(target.model, target.tokenizer, ecfg, root, cfg.draft_vocab)
    run_trace(warm, items[:1], 1, min(8, cfg.max_tokens), "capture warm-up", False)
    for rep in range(cfg.overhead_repeats):
        pair: dict[str, float] = {}
        for mode in (("off", "on") if rep % 2 == 0 else ("on", "off")):  # alternate who goes first
            engine = learned_engine(target.model, target.tokenizer, ecfg, root, cfg.draft_vocab)
            online: OnlineTraining | None = None
            with tempfile.TemporaryDirectory(prefix="tidespec-capture-") as tmp:
                if mode == "on":
                    online = attach_online_training(engine, OnlineConfig(
                        publish_root=str(root), signal_dir=str(Path(tmp) / "signals"), poll_s=3600.0,
                        collection=CollectionConfig(force=True)), start=False)
                run = run_trace(engine, items, cfg.concurrency, cfg.max_tokens, f"capture {mode} ({rep + 1})",
                                progress, ignore_eos=cfg.ignore_eos)
                if online is not None:
                    online.close()
                    dropped += online.capture.stats()["num_dropped"]
            pair[mode] = sum(r["tokens"] for r in run.requests) / run.wall_s
        pairs.append(pair)
    ratios = [p["on"] / p["off"] for p in pairs]
    return {"pairs": pairs, "ratio_on_off": statistics.median(ratios), "overhead": 1 - statistics.median(ratios),
            "requests": len(items), "dropped_rows": dropped}


def recompute_taps(model: TargetModel, token_ids: list[int], tap_layers: tuple[int, ...]) -> torch.Tensor:
    """[len, 3H] the target's taps over one whole sequence, by one prefill (what a trainer without a
    signal store recomputes)."""
    kv = KVCache.for_model(model.cfg, 1, len(token_ids), model.dtype, model.device)
    ids = torch.tensor(token_ids, device=model.device)
    out = model(ids, BatchLayout.build([len(token_ids)], [0], [0], device=model.device), kv,
                logits_rows=torch.empty(0, dtype=torch.int64, device=model.device), tap_layers=tap_layers)
    assert out.taps is not None
    return out.taps


def measure_training_sources(target: LoadedModel, signal_dir: Path, cfg: ShiftBenchConfig,
                             progress: bool = True) -> dict[str, Any]:
    """One training epoch from stored signals vs from recomputed hidden states (TIDE Table 2).

    Only sequences captured from position 0 without gaps can be recomputed (a prefill needs the
    whole prefix); up to ``recompute_rows`` of their rows are used, cut into training segments.
    Both sides train a copy of the same fresh head with the same segments, batches and seed, so
    the difference is where the hidden states come from.
    """
    from tidespec.models.eagle3.checkpoint import fresh_head
    from tidespec.online.training.config import TrainerConfig
    from tidespec.online.training.data import cut_segment, segments_by_sequence
    from tidespec.online.training.eagle3_train import SignalSegment
    from tidespec.online.training.rounds import DraftTrainer

    store = SignalStore(signal_dir, 1 << 40)
    t0 = time.perf_counter()
    shards: list[SignalShard] = [shard for _, shard in store.iter_shards()]
    by_seq = segments_by_sequence(shards, 1 << 30)
    load_s = time.perf_counter() - t0
    whole: list[SignalSegment] = []
    rows = 0
    for segs in by_seq.values():
        if len(segs) == 1 and segs[0].start_position == 0 and rows < cfg.recompute_rows:
            whole.append(segs[0])
            rows += segs[0].num_positions
    if not whole:
        return {"error": f"no sequence in {signal_dir} was captured from position 0 without gaps (the online run "
                         "captures generated positions only unless --capture-prompt; point --signal-dir at a store "
                         "written with prompts, e.g. by train-drafter --from-workload)"}
    load_s *= rows / max(1, sum(s.num_positions for segs in by_seq.values() for s in segs))  # this share only
    tap_layers = Eagle3Config.for_target(target.config).tap_layers
    with tempfile.TemporaryDirectory(prefix="tidespec-train-src-") as tmp:
        tcfg = TrainerConfig(signal_dir=str(Path(tmp) / "s"), publish_root=str(Path(tmp) / "p"),
                             draft_vocab=cfg.draft_vocab, epochs=1.0, seed=cfg.seed, progress=progress)
        trainer = DraftTrainer(tcfg, target.config, target.model.embed_tokens)

        def train(segments: list[SignalSegment]) -> float:
            head = fresh_head(target.config, cfg.draft_vocab or None, trainer.dtype, trainer.device)
            pieces = [p for s in segments for p in cut_segment(s, tcfg.max_segment_len)]
            t = time.perf_counter()
            trainer.train_head(head, pieces, seed=cfg.seed)
            return time.perf_counter() - t

        train(whole[:1])  # warm-up (first autograd and optimizer calls), not timed
        train_stored_s = train(whole)
        t = time.perf_counter()
        recomputed = []
        for seg in tqdm(whole, desc="recompute taps", unit="seq", disable=not progress, leave=False):
            ids = seg.token_ids[:-1].tolist()
            taps = recompute_taps(target.model, ids, tap_layers).to(torch.float32)
            recomputed.append(SignalSegment(taps, seg.token_ids, None, 0))
        recompute_s = time.perf_counter() - t
        train_recomputed_s = train(recomputed)
    stored = load_s + train_stored_s
    again = recompute_s + train_recomputed_s
    return {"rows": rows, "sequences": len(whole), "load_s": load_s, "train_stored_s": train_stored_s,
            "recompute_s": recompute_s, "train_recomputed_s": train_recomputed_s,
            "epoch_from_signals_s": stored, "epoch_recomputing_s": again, "speedup": again / stored}
