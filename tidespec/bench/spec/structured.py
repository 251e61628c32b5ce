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
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import torch
from tqdm import tqdm

from tidespec.bench.common import report
from tidespec.bench.decode.run import bench_engine_config, resolve_target, wave_indices
from tidespec.config import ConfigError, ModelConfig, PolicyConfig, SchedulerConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.llm import build_engine
from tidespec.models.loader import LoadedModel
from tidespec.sampling import SamplingParams, StructuredOutputs
from tidespec.structured.grammar import JSON_OPTIONS
from tidespec.structured.tool_calls import ToolCallParser, ToolSpec, parser_for
from tidespec.workloads.loader import Prompt, load_prompts

# label -> (drafters, forced tokens first, under the policy)
CONFIGS: dict[str, tuple[str, bool, bool]] = {
    "plain": ("none", False, False),
    "grammar": ("grammar", True, False),
    "suffix, no forced tokens": ("suffix", False, False),
    "suffix": ("suffix", True, False),
    "controller (grammar, suffix)": ("grammar,suffix", True, True),
}


@dataclass
class StructuredBenchConfig:
    workload: str = "extraction"
    limit: int = 48
    batch_sizes: tuple[int, ...] = (1, 8)
    gamma: int = 8
    max_tokens: int = 192

    def __post_init__(self) -> None:
        if self.limit < 1 or not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError(f"need limit >= 1 and batch sizes >= 1, got {self.limit}, {self.batch_sizes}")
        if not 1 <= self.gamma <= 64 or self.max_tokens < 2:
            raise ConfigError(f"need gamma in [1, 64] and max_tokens >= 2, got {self.gamma}, {self.max_tokens}")


@dataclass
class _Run:
    label: str
    batch: int
    engine: LLMEngine
    outputs: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    texts: dict[int, str] = dataclasses.field(default_factory=dict)
    tokens: int = 0
    wall: float = 0.0
    step_time: float = 0.0
    decode_steps: int = 0  # steps that decoded (no prompt chunk)
    decode_rows: int = 0  # sequences decoded over those steps
    decode_tokens: int = 0
    mask_seconds: float = 0.0


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


def _params(prompt: Prompt, max_tokens: int, constraints: _Constraints) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured=constraints.of(prompt))


def _wave(run: _Run, prompts: list[Prompt], idx: list[int], max_tokens: int, constraints: _Constraints) -> None:
    """Run prompts ``idx`` at once on ``run``'s engine to the end, adding to its counters."""
    e = run.engine
    clock0 = e.grammars.clock.seconds
    t0 = time.perf_counter()
    rids = {e.add_request(prompts[i].token_ids, _params(prompts[i], max_tokens, constraints)): i for i in idx}
    while e.has_unfinished_requests():
        before = e.last_stats
        outs = e.step()
        s = e.last_stats
        if s is not before:
            run.step_time += s.total_time
            if s.num_prefill_tokens == 0:
                run.decode_steps += 1
                run.decode_rows += s.num_decode_seqs
                run.decode_tokens += s.num_emitted_tokens
        for o in outs:
            if o.finished:
                i = rids[o.request_id]
                run.outputs[i], run.texts[i] = list(o.token_ids), o.text
                run.tokens += len(o.token_ids)
    run.wall += time.perf_counter() - t0
    run.mask_seconds += e.grammars.clock.seconds - clock0


def run_structured_bench(cfg: StructuredBenchConfig, target: LoadedModel | str | None = None, *,
                         model_config: ModelConfig | None = None, scheduler: SchedulerConfig | None = None,
                         spec_base: SpecConfig | None = None, policy: PolicyConfig | None = None,
                         out_dir: Path | None = None, command: str = "", echo: bool = True) -> dict[str, Any]:
    """Run every configuration at every batch size; write ``results.json``, ``table.md``, ``plot.png``."""
    mc = model_config or ModelConfig()
    if mc.threads:
        torch.set_num_threads(mc.threads)
    target = resolve_target(target if target is not None else mc.model, mc.dtype, mc.device, mc.quantization,
                            mc.quant_group_size)
    prompts = load_prompts(cfg.workload, target.tokenizer, cfg.limit)
    constraints = _Constraints(parser_for("auto", target.tokenizer.chat_template),
                               JSON_OPTIONS["compact"])
    for p in prompts:  # every record constrained, or a one-line error before any engine is built
        constraints.of(p)
    base = spec_base or SpecConfig()
    controller = policy if policy is not None and policy.name != "static" else PolicyConfig(name="analytic")
    runs: list[_Run] = []
    for batch in cfg.batch_sizes:
        for label, (drafter, forced, policed) in CONFIGS.items():
            spec = dataclasses.replace(base, drafter=drafter, num_speculative_tokens=cfg.gamma if drafter != "none" else 0,
                                       grammar_drafts=forced)
            econf = bench_engine_config(prompts, cfg.max_tokens, batch, target.model.cfg.max_position_embeddings,
                                        mc, scheduler, spec, controller if policed else PolicyConfig())
            engine = build_engine(econf, model=target.model, tokenizer=target.tokenizer)
            runs.append(_Run(label, batch, engine))
    for r in runs:  # warm-up: every constraint compiled before timing, the first kernels run
        for p in prompts:
            r.engine.grammars.compile(constraints.of(p))
        _wave(dataclasses.replace(r, outputs={}, texts={}), prompts, [0], 8, constraints)
        r.engine.reset_prefix_cache()
    total = sum(len(wave_indices(len(prompts), b)) for b in cfg.batch_sizes) * len(CONFIGS)
    with tqdm(total=total, desc="bench spec --structured", unit="run", disable=not echo, file=sys.stderr) as bar:
        for batch in cfg.batch_sizes:
            group = [r for r in runs if r.batch == batch]
            for wave in wave_indices(len(prompts), batch):
                for r in group:
                    bar.set_postfix_str(f"batch {batch} {r.label}")
                    r.engine.reset_prefix_cache()
                    _wave(r, prompts, wave, cfg.max_tokens, constraints)
                    bar.update()
    configs = [_summary(r, next(p for p in runs if p.batch == r.batch), prompts, constraints) for r in runs]
    doc = {"workload": cfg.workload, "prompts": len(prompts), "model": str(target.path), "gamma": cfg.gamma,
           "max_tokens": cfg.max_tokens, "batch_sizes": list(cfg.batch_sizes), "policy": controller.name,
           "configs": configs, "headline": _headline(configs)}
    return report.write_results("spec-structured", doc, out_dir, command, mc.precision, format_report,
                                lambda out: _plot(configs, out), echo)


def _summary(run: _Run, plain: _Run, prompts: list[Prompt], constraints: _Constraints) -> dict[str, Any]:
    tps = run.tokens / run.wall if run.wall > 0 else float("nan")
    plain_tps = plain.tokens / plain.wall if plain.wall > 0 else float("nan")
    valid = sum(constraints.valid(prompts[i], text) for i, text in run.texts.items())
    return {"config": run.label, "batch_size": run.batch, "tokens": run.tokens, "tokens_per_s": tps,
            "speedup": tps / plain_tps, "tokens_per_step": run.decode_tokens / max(run.decode_rows, 1),
            "mask_share": run.mask_seconds / run.step_time if run.step_time > 0 else 0.0,
            "mismatches": sum(run.outputs[i] != plain.outputs[i] for i in plain.outputs),
            "schema_valid": valid, "requests": len(run.texts)}


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


def _plot(configs: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({c["batch_size"] for c in configs})
    labels = list(CONFIGS)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(batches)
    for k, b in enumerate(batches):
        ys = [next(c["speedup"] for c in configs if c["batch_size"] == b and c["config"] == lab) for lab in labels]
        ax.bar([i + k * width for i in range(len(labels))], ys, width, label=f"batch {b}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([i + width * (len(batches) - 1) / 2 for i in range(len(labels))], labels, rotation=15, fontsize=8)
    ax.set_ylabel("tokens/s vs constrained plain")
    ax.set_title("constrained decoding on the extraction workload")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "plot.png", dpi=120)
    plt.close(fig)
