"""``tidespec bench yield``: what online training costs serving on a shared CPU, and what serving
costs training when idle.

Why this exists: the trainer child yields to serving (``online.serving.governor``): stopped while
the engine steps, running flat out when it is idle. Two claims follow, and this measures both on
the same signal store:

* at saturation (a closed loop keeps the engine busy) training costs no throughput: the loop's
  tokens/s with no trainer, with a governed trainer (``--trainer-share``, default 0; ``--shares``
  adds one governed run per share, the price of training on a server that is never idle) and with
  an ungoverned one (the old behaviour), interleaved per repeat;
* at idle a training round takes as long as a standalone ``train-drafter --once`` run: the round's
  wall time as a child of an idle engine under the governor, against the same command alone,
  interleaved per repeat.

Worked example::

    tidespec bench yield --signal-dir runs/shift/online/signals --repeats 2
    # saturation: none 61.2 tok/s, governed 60.9 (0.995x), free 41.0 (0.67x); idle round: alone
    # 21.4 s, governed 21.6 s (1.01x)

Outputs: ``bench_yield.json``, ``README.md`` and ``yield.png`` in the output directory.
"""

from __future__ import annotations

import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tidespec.bench.common.report import default_out_dir, finish_run, new_figure, save_figure
from tidespec.bench.shift.config import ShiftBenchConfig, build_trace
from tidespec.bench.shift.runs import TraceLoop
from tidespec.config import CacheConfig, CollectionConfig, ConfigError, EngineConfig, opt
from tidespec.engine.engine import LLMEngine
from tidespec.models.loading.loader import LoadedModel
from tidespec.online.serving.attach import OnlineConfig
from tidespec.online.serving.governor import GovernorConfig, TrainingGovernor
from tidespec.online.serving.launch import start_trainer_process
from tidespec.online.serving.supervisor import TrainerSupervisor


@dataclass
class YieldBenchConfig:
    """Flags of ``tidespec bench yield`` (one field = one ``--flag``)."""

    signal_dir: str | None = opt(None, "signal store the trainer reads (e.g. a bench shift run's online/signals)")
    workload: str = opt("code", "prompts of the closed loop")
    requests: int = opt(8, "requests per saturation run")
    max_tokens: int = opt(64, "tokens generated per request")
    concurrency: int = opt(4, "requests in flight")
    repeats: int = opt(2, "rounds over the modes (saturation) and over alone/governed (idle)")
    trainer_threads: int = opt(1, "torch threads of the trainer child")
    epochs: float = opt(1.0, "idle part: passes over the store in the timed round")
    trainer_share: float = opt(0.0, "the governed trainer's share of busy time")
    shares: str = opt("", "saturation: also a governed trainer at each of these comma-separated shares of busy time "
                          "(e.g. 0.02,0.05,0.1: what a --trainer-share costs a server that is never idle)")
    free: bool = opt(True, "saturation: also an ungoverned trainer (on a 2-core CPU serving then runs at ~0.07x, so "
                           "this mode takes most of the time; --no-free leaves it out)")

    def __post_init__(self) -> None:
        if self.signal_dir is None or not Path(self.signal_dir).is_dir():
            raise ConfigError(f"--signal-dir must be a signal store directory, got {self.signal_dir}")
        if min(self.requests, self.max_tokens, self.concurrency, self.repeats, self.trainer_threads) < 1:
            raise ConfigError("requests, max_tokens, concurrency, repeats and trainer_threads must be >= 1")
        if self.epochs <= 0 or not all(0.0 <= s <= 1.0 for s in (self.trainer_share, *self.extra_shares)):
            raise ConfigError("epochs must be > 0 and every trainer share in [0, 1]")

    @property
    def extra_shares(self) -> list[float]:
        """``shares`` as numbers, in order, without ``trainer_share`` (the ``governed`` mode's)."""
        try:
            values = [float(x) for x in self.shares.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"shares must be comma-separated numbers, got {self.shares!r}") from None
        return [v for v in dict.fromkeys(values) if v != self.trainer_share]

    @property
    def modes(self) -> dict[str, float | None]:
        """Saturation modes and their trainer share: none (no trainer), governed (``trainer_share``),
        ``share S`` for each of ``shares``, free (never paused: no governor; unless ``free`` is off).

        Example: trainer_share 0, shares "0.05,0" -> {"none": None, "governed": 0.0, "share 0.05": 0.05,
        "free": None}."""
        modes: dict[str, float | None] = {"none": None, "governed": self.trainer_share,
                                          **{f"share {s:g}": s for s in self.extra_shares}}
        return modes | ({"free": None} if self.free else {})


def _trainer(cfg: YieldBenchConfig, target: LoadedModel, root: Path, epochs: float) -> TrainerSupervisor:
    """A supervised ``train-drafter --once`` child on the store (a fresh publish root each time)."""
    if root.exists():
        shutil.rmtree(root)
    online = OnlineConfig(publish_root=str(root), signal_dir=str(cfg.signal_dir),
                          collection=CollectionConfig(n_threshold=1))
    dtype = str(target.model.dtype).removeprefix("torch.")
    extra = ["--once", "--threads", str(cfg.trainer_threads), "--epochs", str(epochs), "--heldout-frac", "0.2"]
    return TrainerSupervisor(lambda: start_trainer_process(online, target.path, dtype=dtype, extra_args=extra,
                                                           log_path=root.parent / f"{root.name}.log")).start()


def saturation_run(cfg: YieldBenchConfig, target: LoadedModel, mode: str, work: Path) -> float:
    """Tokens/s of the closed loop with no trainer, a governed one (at the mode's share), or a free one."""
    trace = build_trace(ShiftBenchConfig(workloads=f"{cfg.workload}:{cfg.requests}", max_tokens=cfg.max_tokens),
                        target.tokenizer)
    longest = max(len(t.prompt.token_ids) for t in trace) + cfg.max_tokens + 2
    engine = LLMEngine(target.model, target.tokenizer,
                       EngineConfig(cache=CacheConfig(max_model_len=longest, max_num_seqs=cfg.concurrency)))
    trainer = governor = None
    if mode != "none":
        trainer = _trainer(cfg, target, work / f"root-{mode.replace(' ', '-')}", epochs=1000.0)  # trains all along
        time.sleep(3.0)  # past its start-up (imports, loading the store)
        share = cfg.modes[mode]
        if share is not None:
            governor = TrainingGovernor(trainer, GovernorConfig(share=share))
            governor.attach(engine)
            governor.start()
    try:
        loop = TraceLoop(engine, trace, cfg.concurrency, cfg.max_tokens, mode, progress=False)
        loop.run_turn(len(trace))
        run = loop.finish()
    finally:
        if governor is not None:
            governor.close()
        if trainer is not None:
            trainer.close()
    return sum(r["tokens"] for r in run.requests) / run.wall_s


def idle_round(cfg: YieldBenchConfig, target: LoadedModel, governed: bool, work: Path) -> float:
    """Wall seconds of one ``--once`` round, alone or as the governed child of an idle engine."""
    engine = LLMEngine(target.model, target.tokenizer, EngineConfig()) if governed else None
    t0 = time.perf_counter()
    trainer = _trainer(cfg, target, work / ("root-idle-governed" if governed else "root-idle-alone"), cfg.epochs)
    governor = None
    if engine is not None:
        governor = TrainingGovernor(trainer, GovernorConfig(share=cfg.trainer_share))
        governor.attach(engine)  # never called: the engine is idle
        governor.start()
    while trainer.state()["state"] in ("starting", "running"):
        time.sleep(0.05)
    seconds = time.perf_counter() - t0
    if governor is not None:
        governor.close()
    trainer.close()
    return seconds


def run_yield_bench(cfg: YieldBenchConfig, target: LoadedModel, out_dir: Path | None = None, command: str = "",
                    log: Any = print) -> dict[str, Any]:
    out_dir = out_dir or default_out_dir("yield")
    work = out_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    sat: dict[str, list[float]] = {m: [] for m in cfg.modes}
    idle: dict[str, list[float]] = {"alone": [], "governed": []}
    for rep in range(cfg.repeats):
        for mode in cfg.modes:
            sat[mode].append(saturation_run(cfg, target, mode, work))
            log(f"[{rep + 1}/{cfg.repeats}] saturation, trainer {mode}: {sat[mode][-1]:.1f} tok/s")
        for name in ("alone", "governed"):
            idle[name].append(idle_round(cfg, target, name == "governed", work))
            log(f"[{rep + 1}/{cfg.repeats}] idle round, {name}: {idle[name][-1]:.1f} s")
    base = statistics.mean(sat["none"])
    doc = {"config": asdict(cfg), "saturation_tok_s": sat, "idle_round_s": idle,
           "saturation_ratio": {m: statistics.mean(v) / base for m, v in sat.items()},
           "idle_ratio": statistics.mean(idle["governed"]) / statistics.mean(idle["alone"])}
    return finish_run(out_dir, "yield", doc, command, str(target.model.dtype).removeprefix("torch."), report,
                      plot_yield, log)


def plot_yield(doc: dict[str, Any], out_dir: Path) -> Path:
    """Saturation tokens/s per trainer mode and idle round seconds, one dot per repeat."""
    fig, (ax_s, ax_i) = new_figure(2, width_per_col=4.5)
    for ax, data, unit in ((ax_s, doc["saturation_tok_s"], "tokens/s (closed loop)"),
                           (ax_i, doc["idle_round_s"], "seconds per training round (idle)")):
        names = list(data)
        ax.bar(names, [statistics.mean(v) for v in data.values()], color="tab:blue", alpha=0.5)
        for i, values in enumerate(data.values()):
            ax.plot([i] * len(values), values, "ko", markersize=4)
        ax.set_ylabel(unit)
    ax_s.set_title("serving while training")
    ax_i.set_title("training while serving is idle")
    return save_figure(fig, out_dir, "yield.png")


def report(doc: dict[str, Any]) -> str:
    sat, idle = doc["saturation_tok_s"], doc["idle_round_s"]
    lines = ["| trainer at saturation | tok/s per repeat | mean vs no trainer |", "|---|---|---|"]
    for mode, values in sat.items():
        lines.append(f"| {mode} | {', '.join(f'{v:.1f}' for v in values)} | {doc['saturation_ratio'][mode]:.3f}x |")
    lines += ["", "| idle round | seconds per repeat |", "|---|---|"]
    lines += [f"| {name} | {', '.join(f'{v:.1f}' for v in values)} |" for name, values in idle.items()]
    lines += ["", f"Governed round / standalone round: {doc['idle_ratio']:.3f}x."]
    return "\n".join(lines) + "\n"
