"""``tidespec bench spec --structured``: constrained decoding, plain vs the grammar's forced tokens vs
a drafter and the controller, on a JSON-extraction workload.

Why this exists: a constrained request is where speculation should pay most (a JSON key, its
quotes and separator, a closing bracket are forced by the grammar or copied from the prompt) and
where it could cost most (a grammar mask on every verification row). This puts the configurations
next to constrained plain decoding *of the same engine* on the same prompts and reports what each
costs and gains.

Method. Every request is a chat prompt of the workload with its record's ``schema`` as the
constraint (``response_format`` json_schema; the ``extraction`` workload) or, for a record with
``tools`` (the ``tool_use`` workload), its tools shown by the chat template and a call of one of them
forced (``tool_choice: required``, one call, in the template's format), greedy, ending at the
grammar's EOS (or ``max_tokens``). Configurations (``CONFIGS``): ``plain`` (constrained, no drafter), ``grammar`` (the
forced tokens alone), ``suffix`` without and with the forced tokens first, and the controller
(``--policy``, analytic by default) choosing per step between grammar and suffix. One engine per
configuration and batch size, sharing the target; the prompts run in waves of the batch size,
every configuration in turn on each wave (round-robin), after one warm-up wave each. Per
configuration: tokens/s and the speedup over constrained plain, tokens per target step per sequence
(emitted tokens / sequences decoded, over the steps without a prompt chunk), the mask's time as a share of the steps' time, the outputs that
differ from plain's (0: greedy constrained speculation is lossless) and the answers that validate
(``jsonschema``: against the record's schema, or the called tool's parameters).

Worked example::

    doc = run_structured_bench(StructuredBenchConfig(limit=8, batch_sizes=(1,)), resolve_target(None))
    doc["configs"][-1]["speedup"], doc["configs"][-1]["mask_share"]
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from tidespec.bench.common import report
from tidespec.bench.decode.run import bench_engine_config
from tidespec.bench.spec.waves import (
    WaveBenchConfig,
    WaveRun,
    controller_policy,
    plot_speedups,
    run_rounds,
    run_wave,
    speed_summary,
    warm_up,
    wave_target,
)
from tidespec.config import ConfigError, ModelConfig, PolicyConfig, SchedulerConfig, SpecConfig
from tidespec.llm import build_engine
from tidespec.models.loading.loader import LoadedModel
from tidespec.sampling import SamplingParams, StructuredOutputs
from tidespec.structured.grammar import JSON_OPTIONS
from tidespec.structured.tool_calls import ToolCallParser, ToolSpec, parser_for
from tidespec.workloads.loader import Prompt

# label -> (drafters, forced tokens first, under the policy)
CONFIGS: dict[str, tuple[str, bool, bool]] = {
    "plain": ("none", False, False),
    "grammar": ("grammar", True, False),
    "suffix, no forced tokens": ("suffix", False, False),
    "suffix": ("suffix", True, False),
    "controller (grammar, suffix)": ("grammar,suffix", True, True),
}


@dataclass
class StructuredBenchConfig(WaveBenchConfig):
    workload: str = "extraction"
    limit: int = 48
    batch_sizes: tuple[int, ...] = (1, 8)


@dataclass(frozen=True)
class _Constraints:
    """How a record's answer is constrained: its ``schema`` (response_format), or a call of one of its
    ``tools`` in the chat template's format (tool_choice required, one call)."""

    parser: ToolCallParser | None
    json_options: dict[str, Any]

    def of(self, prompt: Prompt) -> StructuredOutputs:
        rec = prompt.record
        if rec.schema is not None:
            return StructuredOutputs(json=rec.schema, field="response_format")
        if rec.tools is None:
            raise ConfigError(f"workload record {rec.id} has no schema and no tools: --structured needs one of them")
        if self.parser is None:
            raise ConfigError(f"record {rec.id} offers tools, but the model's chat template writes no tool-call "
                              "format tidespec knows")
        return StructuredOutputs(grammar=self.parser.grammar(_specs(rec.tools), False, self.json_options),
                                 field="tool_choice")

    def valid(self, prompt: Prompt, text: str) -> bool:
        """Whether ``text`` follows the record's schema, or is one call of its tools with valid arguments."""
        rec = prompt.record
        try:
            if rec.schema is not None:
                jsonschema.validate(json.loads(text), rec.schema)
                return True
            assert self.parser is not None
            calls = self.parser.parse(text).calls
            schemas = {t.name: t.parameters for t in _specs(rec.tools or [])}
            if len(calls) != 1 or calls[0].name not in schemas:
                return False
            jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])
            return True
        except (ValueError, jsonschema.ValidationError):
            return False


def _specs(tools: list[dict[str, Any]]) -> list[ToolSpec]:
    return [ToolSpec(t["function"]["name"], t["function"].get("parameters") or {"type": "object"}) for t in tools]


def run_structured_bench(cfg: StructuredBenchConfig, target: LoadedModel | str | None = None, *,
                         model_config: ModelConfig | None = None, scheduler: SchedulerConfig | None = None,
                         spec_base: SpecConfig | None = None, policy: PolicyConfig | None = None,
                         out_dir: Path | None = None, command: str = "", echo: bool = True) -> dict[str, Any]:
    """Run every configuration at every batch size; write ``results.json``, ``table.md``, ``plot.png``."""
    mc = model_config or ModelConfig()
    target, prompts = wave_target(mc, target, cfg.workload, cfg.limit)
    constraints = _Constraints(parser_for("auto", target.tokenizer.chat_template),
                               JSON_OPTIONS["compact"])
    for p in prompts:  # every record constrained, or a one-line error before any engine is built
        constraints.of(p)
    base = spec_base or SpecConfig()
    controller = controller_policy(policy)
    runs: list[WaveRun] = []
    for batch in cfg.batch_sizes:
        for label, (drafter, forced, policed) in CONFIGS.items():
            spec = dataclasses.replace(base, drafter=drafter, num_speculative_tokens=cfg.gamma if drafter != "none" else 0,
                                       grammar_drafts=forced)
            econf = bench_engine_config(prompts, cfg.max_tokens, batch, target.model.cfg.max_position_embeddings,
                                        mc, scheduler, spec, controller if policed else PolicyConfig())
            engine = build_engine(econf, model=target.model, tokenizer=target.tokenizer)
            runs.append(WaveRun(label, batch, engine))
    for r in runs:  # warm-up: every constraint compiled before timing, the first kernels run
        for p in prompts:
            r.engine.grammars.compile(constraints.of(p))
        warm_up(r, prompts, lambda p: SamplingParams(max_tokens=8, structured=constraints.of(p)))
    run_rounds(runs, len(prompts), cfg.batch_sizes, "bench spec --structured",
               lambda r, wave: run_wave(r, prompts, wave, lambda p: SamplingParams(max_tokens=cfg.max_tokens,
                                                                                  structured=constraints.of(p))),
               echo, cfg.refill)
    configs = [_summary(r, next(p for p in runs if p.batch == r.batch), prompts, constraints) for r in runs]
    doc = {"workload": cfg.workload, "prompts": len(prompts), "model": str(target.path), "gamma": cfg.gamma,
           "max_tokens": cfg.max_tokens, "batch_sizes": list(cfg.batch_sizes), "policy": controller.name,
           "configs": configs, "headline": _headline(configs)}
    return report.write_results("spec-structured", doc, out_dir, command, mc.precision, format_report,
                                lambda out: plot_speedups(configs, list(CONFIGS), "constrained decoding on the "
                                                          "extraction workload", "tokens/s vs constrained plain", out),
                                echo)


def _summary(run: WaveRun, plain: WaveRun, prompts: list[Prompt], constraints: _Constraints) -> dict[str, Any]:
    valid = sum(constraints.valid(prompts[i], text) for i, text in run.texts.items())
    return {**speed_summary(run, plain), "schema_valid": valid,
            "mask_share": run.mask_seconds / run.step_time if run.step_time > 0 else 0.0}


def _headline(configs: list[dict[str, Any]]) -> dict[str, Any]:
    best = {b: max((c for c in configs if c["batch_size"] == b), key=lambda c: c["speedup"])
            for b in sorted({c["batch_size"] for c in configs})}
    return {f"batch {b}": {"config": c["config"], "speedup": round(c["speedup"], 3)} for b, c in best.items()}


def format_report(doc: dict[str, Any], command: str, machine: dict[str, Any]) -> str:
    title = (f"# bench spec --structured: {doc['workload']} ({doc['prompts']} prompts), gamma {doc['gamma']}, "
             f"up to {doc['max_tokens']} tokens, controller policy {doc['policy']}")
    where = (f"machine: {machine.get('cpu', '')}, {machine.get('usable_cores', '')} cores, "
             f"{machine.get('torch_threads', '')} torch threads, torch {machine.get('torch', '')}")
    header = ("| batch | configuration | tok/s | x constrained plain | tokens / step | mask share of step | "
              "outputs = plain | valid (schema / tool call) |")
    lines = [title, "", f"`{command}`", "", where, "", header, "|---|---|---|---|---|---|---|---|"]
    for c in doc["configs"]:
        lines.append(f"| {c['batch_size']} | {c['config']} | {c['tokens_per_s']:.1f} | {c['speedup']:.2f}x | "
                     f"{c['tokens_per_step']:.2f} | {100 * c['mask_share']:.1f} % | "
                     f"{c['requests'] - c['mismatches']}/{c['requests']} | {c['schema_valid']}/{c['requests']} |")
    return "\n".join(lines) + "\n"
