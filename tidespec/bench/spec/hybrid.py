"""``tidespec bench spec --hybrid``: per-sequence drafting against its members alone and the batch-level
controller, on one workload.

Why this exists: the controller the README recommends (``--drafter suffix,eagle3 --policy analytic``)
gives one drafter to the whole batch each step, and measured on held-out chat it could lose two
thirds of suffix's speed on a prompt where suffix alone flew (issue 80). ``--per-sequence``
(``speculative/policy/routing.py``) routes each sequence on its own; this measures whether that
holds "never slower than the better member" on a domain, next to each member alone.

Method. Configurations (``configs_for``): ``plain``, ``suffix`` and the model drafter alone (static
gamma; ``--model-drafter``, EAGLE-3 by default, or Medusa, the draft model), the ``controller``
(``--policy``, analytic by default, over suffix and the model drafter) and ``per-sequence`` (the same
with ``--per-sequence``; with ``--untrimmed`` both once more with ``--no-trim-drafts``, the draft trim's
effect in the same run). One engine per configuration and batch size sharing the target;
the workload's prompts in waves of the batch size, every configuration in turn on each wave
(round-robin) after a warm-up (``waves.py``). Per configuration: tokens/s and the speedup over plain,
tokens per target step per sequence, a decode step's time, outputs that differ from plain's (0:
lossless), and for the two over several drafters the share of sequence-steps each drafter drafted
(``none``: decoded without a draft).

Worked example::

    doc = run_hybrid_bench(HybridBenchConfig(workload="zh_chat", limit=4, batch_sizes=(1,)), resolve_target(None))
    [(c["config"], round(c["speedup"], 2), c["shares"]) for c in doc["configs"]]
    # e.g. ("per-sequence (suffix, eagle3)", 1.31, {"eagle3": 0.42, "none": 0.21, "suffix": 0.37})
"""

from __future__ import annotations

import dataclasses
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
from tidespec.config import ModelConfig, PolicyConfig, SchedulerConfig, SpecConfig
from tidespec.llm import build_engine
from tidespec.models.loading.loader import LoadedModel
from tidespec.sampling import SamplingParams


def configs_for(model_drafter: str = "eagle3", untrimmed: bool = False) -> dict[str, tuple[str, bool | None, bool]]:
    """label -> (drafters, policy: None = static, else per-sequence or not, drafts trimmed), around
    ``model_drafter``; with ``untrimmed`` the two controllers once more with ``--no-trim-drafts``.

    Example: ``list(configs_for("medusa"))`` -> ["plain", "suffix", "medusa", "controller (suffix, medusa)",
    "per-sequence (suffix, medusa)"]."""
    pair = f"suffix,{model_drafter}"
    out = {"plain": ("none", None, False), "suffix": ("suffix", None, False),
           model_drafter: (model_drafter, None, False),
           f"controller (suffix, {model_drafter})": (pair, False, True),
           f"per-sequence (suffix, {model_drafter})": (pair, True, True)}
    if untrimmed:
        out[f"controller (suffix, {model_drafter}), untrimmed"] = (pair, False, False)
        out[f"per-sequence (suffix, {model_drafter}), untrimmed"] = (pair, True, False)
    return out


CONFIGS = configs_for()  # the default: EAGLE-3 as the model drafter


@dataclass
class HybridBenchConfig(WaveBenchConfig):
    """``gamma``: every drafter's speculation length (the controllers' largest)."""

    workload: str = "chat"
    gamma: int = 4
    max_tokens: int = 128
    model_drafter: str = "eagle3"  # the drafter with a model beside suffix (eagle3, medusa, draft-model)
    untrimmed: bool = False  # the controllers once more without the draft trim (``policy/trim.py``)


def count_drafters(run: WaveRun, counts: dict[str, int]) -> None:
    """Add the sequence-steps (decode steps without a prompt chunk) of the engine's history since the
    last call to ``counts`` per drafter (``none``: decoded without a draft), then clear the history.
    Example: 2 steps of 2 sequences, suffix drafting twice and eagle3 once -> suffix 2, eagle3 1, none 1."""
    for step in run.engine.history:
        if step.num_prefill_tokens or not step.num_decode_seqs:
            continue
        for name in step.seq_drafters.values():
            counts[name] = counts.get(name, 0) + 1
        counts["none"] = counts.get("none", 0) + step.num_decode_seqs - len(step.seq_drafters)
    run.engine.history.clear()


def shares(counts: dict[str, int]) -> dict[str, float]:
    """``count_drafters``' counts as shares: {suffix: 2, eagle3: 1, none: 1} -> 0.5, 0.25, 0.25."""
    total = sum(counts.values())
    return {name: n / total for name, n in sorted(counts.items())} if total else {}


def run_hybrid_bench(cfg: HybridBenchConfig, target: LoadedModel | str | None = None, *,
                     model_config: ModelConfig | None = None, scheduler: SchedulerConfig | None = None,
                     spec_base: SpecConfig | None = None, policy: PolicyConfig | None = None,
                     out_dir: Path | None = None, command: str = "", echo: bool = True) -> dict[str, Any]:
    """Run every configuration at every batch size; write ``results.json``, ``table.md``, ``plot.png``."""
    mc = model_config or ModelConfig()
    target, prompts = wave_target(mc, target, cfg.workload, cfg.limit)
    base = spec_base or SpecConfig()
    controller = controller_policy(policy)
    runs: list[WaveRun] = []
    for batch in cfg.batch_sizes:
        for label, (drafter, per_sequence, trim) in configs_for(cfg.model_drafter, cfg.untrimmed).items():
            spec = dataclasses.replace(base, drafter=drafter, num_speculative_tokens=cfg.gamma if drafter != "none" else 0)
            pc = PolicyConfig() if per_sequence is None else dataclasses.replace(controller, per_sequence=per_sequence,
                                                                                  trim_drafts=trim)
            econf = bench_engine_config(prompts, cfg.max_tokens, batch, target.model.cfg.max_position_embeddings,
                                        mc, scheduler, spec, pc)
            runs.append(WaveRun(label, batch, build_engine(econf, model=target.model, tokenizer=target.tokenizer)))

    def params(max_tokens: int) -> Any:
        return lambda _p: SamplingParams(max_tokens=max_tokens)

    for r in runs:  # warm-up, nothing counted (compiled: every wave's prompt lengths, as waves.py explains)
        warm_up(r, prompts, params(8), schedule(len(prompts), r.batch, cfg.refill) if mc.compile else ([0],))
        r.engine.history.clear()
    counts: dict[int, dict[str, int]] = {id(r): {} for r in runs}

    def each(run: WaveRun, wave: list[int]) -> None:
        run_wave(run, prompts, wave, params(cfg.max_tokens))
        count_drafters(run, counts[id(run)])  # per wave: the history keeps only the last 4,096 steps

    run_rounds(runs, len(prompts), cfg.batch_sizes, "bench spec --hybrid", each, echo, cfg.refill)
    configs = [{**speed_summary(r, next(p for p in runs if p.batch == r.batch)), "shares": shares(counts[id(r)])}
               for r in runs]
    doc = {"workload": cfg.workload, "prompts": len(prompts), "model": str(target.path), "gamma": cfg.gamma,
           "max_tokens": cfg.max_tokens, "batch_sizes": list(cfg.batch_sizes), "policy": controller.name,
           "refill": cfg.refill,
           "configs": configs,
           "headline": {f"batch {c['batch_size']}": round(c["speedup"], 3) for c in configs
                        if c["config"].startswith("per-sequence")}}
    return report.write_results("spec-hybrid", doc, out_dir, command, mc.precision, format_report,
                                lambda out: plot_speedups(configs, list(configs_for(cfg.model_drafter, cfg.untrimmed)),
                                                          f"Per-sequence drafting on "
                                                          f"{cfg.workload}", "tokens/s vs plain", out), echo)


def format_report(doc: dict[str, Any], command: str, machine: dict[str, Any]) -> str:
    refill = doc.get("refill", 1)
    waves = (f"waves of {refill} x the batch, the batch refilled as sequences finish" if refill > 1
             else "waves of the batch size")
    title = (f"# bench spec --hybrid: {doc['workload']} ({doc['prompts']} prompts), up to {doc['max_tokens']} tokens, "
             f"gamma {doc['gamma']}, controller policy {doc['policy']}, {waves}")
    where = (f"machine: {machine.get('cpu', '')}, {machine.get('usable_cores', '')} cores, "
             f"{machine.get('torch_threads', '')} torch threads, torch {machine.get('torch', '')}")
    header = ("| batch | configuration | tok/s | x plain | tokens / step | ms / decode step | drafted by (sequence-steps) "
              "| outputs = plain |")
    lines = [title, "", f"`{command}`", "", where, "", header, "|---|---|---|---|---|---|---|---|"]
    for c in doc["configs"]:
        drafted = ", ".join(f"{name} {100 * share:.0f} %" for name, share in c["shares"].items()) if (
            "," in c["config"]) else ""
        lines.append(f"| {c['batch_size']} | {c['config']} | {c['tokens_per_s']:.1f} | {c['speedup']:.2f}x | "
                     f"{c['tokens_per_step']:.2f} | {c['decode_step_ms']:.1f} | {drafted} | "
                     f"{c['requests'] - c['mismatches']}/{c['requests']} |")
    return "\n".join(lines) + "\n"
