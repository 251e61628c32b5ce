"""Running ``tidespec bench shift``'s trace: the closed loop, and the engine of each configuration.

Why this exists: the three configurations (plain, frozen, online) and the capture-overhead runs
of ``bench.shift_measure`` must drive the engine the same way — the same closed loop, greedy
sampling with EOS ignored, the same record of every step and request — or their tokens/s and
acceptance would not compare; ``run_trace`` is that one loop, and the engine builders here give
every configuration the same cache sizing and the same starting drafter (``seed_publish_root``).

Worked example::

    engine = eagle3_engine(model, tokenizer, trace_engine_config(trace, cfg, model, cfg.gamma), root, 8192)
    run = run_trace(engine, trace, concurrency=4, max_tokens=128, desc="frozen")
    run.requests[0]["accepted"], run.steps[-1]["version"]
"""

from __future__ import annotations

import functools
import shlex
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from tidespec.bench.shift_config import ShiftBenchConfig, TraceItem
from tidespec.config import CacheConfig, CollectionConfig, ConfigError, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.llm import build_eagle3_drafter
from tidespec.models.eagle3_checkpoint import head_from_published, load_drafter_source, publish
from tidespec.models.llama import LlamaModel
from tidespec.models.loader import LoadedModel
from tidespec.online.attach import OnlineConfig, OnlineTraining, attach_online_training, read_trainer_rounds
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.eagle3 import Eagle3DrafterConfig
from tidespec.stats import StepStats


@dataclass
class TraceRun:
    config: str
    wall_s: float = 0.0
    steps: list[dict[str, float]] = field(default_factory=list)  # t, emitted, drafts, accepted, version
    requests: list[dict[str, Any]] = field(default_factory=list)  # in trace order
    outputs: list[list[int]] = field(default_factory=list)  # in trace order
    online: dict[str, Any] = field(default_factory=dict)


def run_trace(engine: LLMEngine, trace: list[TraceItem], concurrency: int, max_tokens: int, desc: str,
              progress: bool = True, status: Callable[[], str] | None = None) -> TraceRun:
    """Closed loop over ``trace`` with ``concurrency`` requests in flight; a progress line shows
    finished requests, recent acceptance length, tokens/s and the drafter version."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    run = TraceRun(desc)
    t0 = time.perf_counter()

    def on_step(st: StepStats) -> None:
        run.steps.append({"t": time.perf_counter() - t0, "emitted": st.num_emitted_tokens, "drafts": st.num_drafts,
                          "accepted": st.num_accepted_tokens, "version": float(getattr(engine.drafter, "version", 0)),
                          "batch": st.batch_size})

    engine.step_listeners.append(on_step)
    pending = deque(enumerate(trace))
    live: dict[str, tuple[int, float]] = {}
    results: dict[int, dict[str, Any]] = {}
    outputs: dict[int, list[int]] = {}
    try:
        with tqdm(total=len(trace), desc=desc, unit="req", disable=not progress, leave=True,
                  dynamic_ncols=True) as bar:
            while pending or engine.has_unfinished_requests():
                while pending and len(live) < concurrency:
                    idx, item = pending.popleft()
                    rid = engine.add_request(item.prompt.token_ids, params, label=item.prompt.record.domain)
                    live[rid] = (idx, time.perf_counter() - t0)
                for out in engine.step():
                    if not out.finished:
                        continue
                    idx, t_in = live.pop(out.request_id)
                    item = trace[idx]
                    st = out.stats
                    results[idx] = {"index": idx, "phase": item.phase, "workload": item.workload,
                                    "id": item.prompt.record.id, "t_start": t_in,
                                    "t_end": time.perf_counter() - t0, "tokens": len(out.token_ids),
                                    "drafts": st.num_drafts, "draft_tokens": st.num_draft_tokens,
                                    "accepted": st.num_accepted_tokens,
                                    "version": int(getattr(engine.drafter, "version", 0))}
                    outputs[idx] = list(out.token_ids)
                    bar.update(1)
                    bar.set_postfix_str(_progress_line(run, status), refresh=False)
    finally:
        engine.step_listeners.remove(on_step)
    run.wall_s = time.perf_counter() - t0
    run.requests = [results[i] for i in range(len(trace))]
    run.outputs = [outputs[i] for i in range(len(trace))]
    return run


def _progress_line(run: TraceRun, status: Callable[[], str] | None) -> str:
    recent = run.steps[-200:]
    span = recent[-1]["t"] - recent[0]["t"] if len(recent) > 1 else 0.0
    tok_s = sum(s["emitted"] for s in recent[1:]) / span if span > 0 else 0.0
    drafts = sum(s["drafts"] for s in recent)
    accept = (sum(s["accepted"] for s in recent) + drafts) / drafts if drafts else float("nan")
    version = int(recent[-1]["version"]) if recent else 0
    line = f"accept len {accept:.2f}, drafter v{version}, {tok_s:.1f} tok/s" if drafts else f"{tok_s:.1f} tok/s"
    return line + (f", {status()}" if status is not None else "")


# ----------------------------------------------------------------------------------------------
# engines per configuration
# ----------------------------------------------------------------------------------------------


def trace_engine_config(trace: list[TraceItem], cfg: ShiftBenchConfig, model: LlamaModel,
                        gamma: int) -> EngineConfig:
    """The engine settings of every configuration: ``concurrency`` KV slots just long enough for
    the trace's longest prompt plus ``max_tokens`` and speculation slack; EAGLE-3 at ``gamma``
    (0 = plain decoding)."""
    longest = max(len(t.prompt.token_ids) for t in trace) + cfg.max_tokens + cfg.gamma + 2
    max_len = min(model.cfg.max_position_embeddings, longest)
    return EngineConfig(cache=CacheConfig(max_model_len=max_len, max_num_seqs=cfg.concurrency),
                        spec=SpecConfig(drafter="eagle3" if gamma else "none", num_speculative_tokens=gamma))


def seed_publish_root(root: Path, bootstrap: str | None, target: LlamaModel) -> int | None:
    """Publish the bootstrap drafter as the first version of a new root (so frozen and online
    start from the same weights); None without a bootstrap. Returns the version published."""
    if bootstrap is None:
        return None
    pub = load_drafter_source(bootstrap, target.cfg)
    if pub is None:
        raise ConfigError(f"bootstrap {bootstrap} holds no valid EAGLE-3 drafter for this target")
    head = head_from_published(pub, target.dtype, target.device)
    return publish(root, head, {"bootstrap": str(bootstrap), "bootstrap_version": pub.version})


def eagle3_engine(model: LlamaModel, tokenizer: Any, ecfg: EngineConfig, root: Path, draft_vocab: int) -> LLMEngine:
    """An engine with the EAGLE-3 drafter of publish root ``root``: its newest published version,
    or a fresh head of ``draft_vocab`` tokens (0 = the target's) when there is none."""
    drafter = build_eagle3_drafter(model, root, draft_vocab, Eagle3DrafterConfig(
        max_num_seqs=ecfg.cache.max_num_seqs, max_model_len=ecfg.cache.max_model_len))
    return LLMEngine(model, tokenizer, ecfg, drafter=drafter)


def run_online(target: LoadedModel, trace: list[TraceItem], cfg: ShiftBenchConfig, work: Path,
               progress: bool = True) -> TraceRun:
    """The ``online`` configuration: capture + selective collection + a trainer child process."""
    from tidespec.online.trainer.process import start_trainer_process

    root, signals = work / "drafter", work / "signals"
    seeded = seed_publish_root(root, cfg.bootstrap, target.model)
    ecfg = trace_engine_config(trace, cfg, target.model, cfg.gamma)
    engine = eagle3_engine(target.model, target.tokenizer, ecfg, root, cfg.draft_vocab)
    online = attach_online_training(engine, OnlineConfig(
        publish_root=str(root), signal_dir=str(signals), poll_s=1.0, capture_prompt=cfg.capture_prompt,
        collection=CollectionConfig(n_init=cfg.collect_n_init, epsilon=cfg.collect_epsilon,
                                    n_threshold=cfg.min_signals, force=cfg.collect_force,
                                    bootstrap=seeded is None)))
    extra = ["--threads", str(cfg.trainer_threads), "--epochs", str(cfg.trainer_epochs), "--poll-s", "2",
             "--seed", str(cfg.seed), "--heldout-frac", "0.2", "--batch-segments", "4"] + shlex.split(cfg.trainer_args)
    dtype = str(target.model.dtype).removeprefix("torch.")
    log = work / "trainer.log"
    online.supervise_trainer(functools.partial(start_trainer_process, online.config, target.path, dtype=dtype,
                                               draft_vocab=cfg.draft_vocab, extra_args=extra, log_path=log),
                             log_path=log)
    try:
        run = run_trace(engine, trace, cfg.concurrency, cfg.max_tokens, "online", progress,
                        status=lambda: _online_status(online))
    finally:
        online.close()
    run.online = {k: v for k, v in online.state().items() if k != "collector"}
    run.online["collector"] = online.selective.state()
    run.online["rounds"] = read_trainer_rounds(root)
    run.online["signal_dir"] = str(signals)
    return run


def _online_status(online: OnlineTraining) -> str:
    st = online.capture.stats()
    on = "on" if online.selective.collection_enabled else "off"
    return f"collect {on}, {st['num_captured']} signals"
