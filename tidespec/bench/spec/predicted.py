"""``tidespec bench spec --predicted``: Predicted Outputs on a code-edit workload, plain vs suffix vs the
prediction vs the prediction beside the controller.

Why this exists: a code editor sends the file it wants edited and expects almost all of it back. The
prediction (the file) drafts the unchanged parts many tokens at once; this puts that next to plain
decoding *of the same engine* and to the best model-free drafter on the same prompts.

Method. Every request is a chat prompt of the workload (``code_edit``: an instruction and a file)
with its record's ``prediction`` (the file as given) or without, greedy, up to ``max_tokens``.
Configurations (``CONFIGS``): ``plain`` (no drafter, no prediction), ``suffix`` (suffix decoding, no
prediction), ``prediction`` (the prediction alone) and ``prediction + controller`` (the prediction, and
where it drafts nothing the controller (``--policy``, analytic by default) over suffix and EAGLE-3).
One engine per configuration and batch size sharing the target; the prompts run in waves of the
batch size, every configuration in turn on each wave (round-robin), after a warm-up of one wave each
(compiled: every wave, at 8 tokens, so that no compile of a new prompt length lands in a timed wave).
Per configuration: tokens/s and the speedup over plain, tokens per target step per sequence
(emitted tokens / sequences decoded, over the steps without a prompt chunk), the share of output
tokens that were accepted prediction tokens, a decode step's time, and the outputs that differ from
plain's (0: lossless). ``--logprobs K`` adds plain and the prediction with every token's top-K
log-probabilities: what they cost per step.

Worked example::

    doc = run_predicted_bench(PredictedBenchConfig(limit=4, batch_sizes=(1,)), resolve_target(None))
    doc["configs"][2]["speedup"], doc["configs"][2]["prediction_share"]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidespec.bench.common import report
from tidespec.bench.decode.run import bench_engine_config
from tidespec.bench.spec.waves import (
    WaveBenchConfig,
    WaveRun,
    controller_policy,
    plot_speedups,
    run_rounds,
    run_wave,
    schedule,
    speed_summary,
    warm_up,
    wave_target,
)
from tidespec.config import ConfigError, ModelConfig, PolicyConfig, SchedulerConfig, SpecConfig
from tidespec.llm import build_engine
from tidespec.models.loading.loader import LoadedModel
from tidespec.sampling import MAX_LOGPROBS, SamplingParams
from tidespec.workloads.loader import Prompt

# label -> (drafters, send the prediction, under the policy)
CONFIGS: dict[str, tuple[str, bool, bool]] = {
    "plain": ("none", False, False),
    "suffix": ("suffix", False, False),
    "prediction": ("none", True, False),
    "prediction + controller (suffix, eagle3)": ("suffix,eagle3", True, True),
}
# with --logprobs K: plain and the prediction again, every token with its top-K log-probabilities
LOGPROB_CONFIGS = ("plain", "prediction")


@dataclass
class PredictedBenchConfig(WaveBenchConfig):
    """``gamma`` is the drafters' (suffix, EAGLE-3); the prediction's cap is ``--prediction-tokens``."""

    workload: str = "code_edit"
    max_tokens: int = 256
    logprobs: int | None = None  # also run plain and the prediction with top-K log-probabilities (their cost)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ConfigError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")


@dataclass
class _Predicted:
    """A configuration's run and the prediction tokens its requests had accepted."""

    run: WaveRun
    predicted: bool
    logprobs: int | None = None
    accepted: int = 0


def run_predicted_bench(cfg: PredictedBenchConfig, target: LoadedModel | str | None = None, *,
                        model_config: ModelConfig | None = None, scheduler: SchedulerConfig | None = None,
                        spec_base: SpecConfig | None = None, policy: PolicyConfig | None = None,
                        out_dir: Path | None = None, command: str = "", echo: bool = True) -> dict[str, Any]:
    """Run every configuration at every batch size; write ``results.json``, ``table.md``, ``plot.png``."""
    mc = model_config or ModelConfig()
    target, prompts = wave_target(mc, target, cfg.workload, cfg.limit)
    missing = [p.record.id for p in prompts if not p.record.prediction]
    if missing:
        raise ConfigError(f"workload {cfg.workload}: records without a 'prediction': {', '.join(missing[:3])}")
    predictions = {p.record.id: target.tokenizer.encode(p.record.prediction, add_special_tokens=False)
                   for p in prompts}
    base = spec_base or SpecConfig()
    controller = controller_policy(policy)
    runs: list[_Predicted] = []
    labels = _labels(cfg)
    for batch in cfg.batch_sizes:
        for label, (drafter, predicted, policed), logprobs in labels:
            spec = dataclasses.replace(base, drafter=drafter,
                                       num_speculative_tokens=cfg.gamma if drafter != "none" else 0)
            econf = bench_engine_config(prompts, cfg.max_tokens, batch, target.model.cfg.max_position_embeddings,
                                        mc, scheduler, spec, controller if policed else PolicyConfig())
            engine = build_engine(econf, model=target.model, tokenizer=target.tokenizer)
            runs.append(_Predicted(WaveRun(label, batch, engine), predicted, logprobs))

    def params(r: _Predicted, max_tokens: int) -> Callable[[Prompt], SamplingParams]:
        return lambda p: SamplingParams(max_tokens=max_tokens, logprobs=r.logprobs,
                                        prediction=predictions[p.record.id] if r.predicted else None)

    for r in runs:  # warm-up, nothing counted: the first kernels run; compiled, every wave's prompt lengths
        # (measured 2026-12-03: with the first prompt alone, w4a8 + compile's plain runs, first in each
        # wave, paid ~55 s of compiles inside their timed waves and every ratio over plain read 1.5x high)
        warm_up(r.run, prompts, params(r, 8), schedule(len(prompts), r.run.batch, cfg.refill) if mc.compile
                else ([0],))

    def each(r: _Predicted, wave: list[int]) -> None:
        before = _accepted(r)
        run_wave(r.run, prompts, wave, params(r, cfg.max_tokens))
        r.accepted += _accepted(r) - before

    by_run = {id(r.run): r for r in runs}
    run_rounds([r.run for r in runs], len(prompts), cfg.batch_sizes, "bench spec --predicted",
               lambda run, wave: each(by_run[id(run)], wave), echo, cfg.refill)
    configs = [_summary(r, next(p.run for p in runs if p.run.batch == r.run.batch)) for r in runs]
    doc = {"workload": cfg.workload, "prompts": len(prompts), "model": str(target.path), "gamma": cfg.gamma,
           "prediction_tokens": base.prediction_tokens, "max_tokens": cfg.max_tokens,
           "batch_sizes": list(cfg.batch_sizes), "policy": controller.name, "logprobs": cfg.logprobs,
           "configs": configs,
           "headline": {f"batch {c['batch_size']}": {"config": c["config"], "speedup": round(c["speedup"], 3)}
                        for c in configs if c["config"] == "prediction"}}
    return report.write_results("spec-predicted", doc, out_dir, command, mc.precision, format_report,
                                lambda out: plot_speedups(configs, [lab for lab, _, _ in labels], "Predicted Outputs on the code-edit "
                                                          "workload", "tokens/s vs plain", out), echo)


def _labels(cfg: PredictedBenchConfig) -> list[tuple[str, tuple[str, bool, bool], int | None]]:
    """(label, configuration, top log-probabilities) of every configuration run, in run order."""
    out = [(label, c, None) for label, c in CONFIGS.items()]
    if cfg.logprobs is not None:
        out += [(f"{label}, logprobs {cfg.logprobs}", CONFIGS[label], cfg.logprobs) for label in LOGPROB_CONFIGS]
    return out


def _accepted(r: _Predicted) -> int:
    """Prediction tokens accepted so far over the engine's history (its steps' counters)."""
    return sum(s.num_accepted_prediction_tokens for s in r.run.engine.history)


def _summary(r: _Predicted, plain: WaveRun) -> dict[str, Any]:
    return {**speed_summary(r.run, plain), "prediction_share": r.accepted / r.run.tokens if r.run.tokens else 0.0}


def format_report(doc: dict[str, Any], command: str, machine: dict[str, Any]) -> str:
    title = (f"# bench spec --predicted: {doc['workload']} ({doc['prompts']} prompts), up to {doc['max_tokens']} "
             f"tokens, prediction up to {doc['prediction_tokens']} tokens a step, drafters' gamma {doc['gamma']}, "
             f"controller policy {doc['policy']}")
    where = (f"machine: {machine.get('cpu', '')}, {machine.get('usable_cores', '')} cores, "
             f"{machine.get('torch_threads', '')} torch threads, torch {machine.get('torch', '')}")
    header = ("| batch | configuration | tok/s | x plain | tokens / step | ms / decode step | accepted prediction "
              "share | outputs = plain |")
    lines = [title, "", f"`{command}`", "", where, "", header, "|---|---|---|---|---|---|---|---|"]
    for c in doc["configs"]:
        lines.append(f"| {c['batch_size']} | {c['config']} | {c['tokens_per_s']:.1f} | {c['speedup']:.2f}x | "
                     f"{c['tokens_per_step']:.2f} | {c.get('decode_step_ms', float('nan')):.1f} | "
                     f"{100 * c['prediction_share']:.0f} % | "
                     f"{c['requests'] - c['mismatches']}/{c['requests']} |")
    return "\n".join(lines) + "\n"
