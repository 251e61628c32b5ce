"""``tidespec bench quality``: how far a quantized (or bfloat16) target is from the float32 model.

Why this exists: ``--quantization int8|int4`` changes the target, so speculation stays lossless
with respect to the *quantized* model, not the float32 one; a user choosing it needs to know what
the quantization itself costs in output quality, measured on our workloads, next to its speed.

Method, per workload (prompts as every benchmark reads them) and per variant (``int8``, ``int4``
with ``--quant-group-size``, and ``bfloat16`` unquantized as a reference point), against the
reference model (``--dtype``, float32 by default, unquantized):

1. The reference's greedy continuation of each prompt: up to ``--max-tokens`` tokens, stopping at
   EOS (the engine, all prompts of a workload in one batch).
2. **Teacher-forced top-1 agreement**: one forward of the variant over prompt + reference
   continuation; the share of continuation positions where the variant's argmax is the
   reference's next token (the reference itself scores ~100 %: its full-sequence forward and its
   token-by-token decoding differ only in summation order).
3. **Free-running greedy prefix**: the variant's own greedy continuation; how many leading tokens
   equal the reference's (mean over prompts), and the share of prompts identical throughout.
4. **Perplexity** of the whole text (prompt + reference continuation, every token after the
   first) under each model, token-weighted over the workload, its difference from the reference,
   and the mean KL(reference || variant) of the next-token distributions at those positions.

Worked example::

    cfg = QualityBenchConfig(workloads=("code",), limit=2, max_tokens=16)
    doc = run_quality_bench(cfg, resolve_target(None), out_dir=Path("runs/q"))
    [(r["variant"], r["top1_agreement"], r["ppl_delta_pct"]) for r in doc["rows"]]
    # [('float32', 1.0, 0.0), ('int8', 0.98, 0.4), ('int4-g32', 0.9, 3.1), ('bfloat16', 0.97, 0.2)]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tidespec.bench.common.report import (
    command_line,
    identical_prefix,
    machine_line,
    markdown_table,
    new_figure,
    save_figure,
    write_results,
)
from tidespec.bench.decode.run import bench_engine_config, resolve_target, run_wave, workload_doc
from tidespec.config import QUANTIZATIONS, ConfigError, ModelConfig, output_dir
from tidespec.flags import add_dataclass_args, dataclass_from_args
from tidespec.llm import DTYPES, build_engine
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.models.loading.loader import LoadedModel
from tidespec.models.quant.quantize import quantize_model
from tidespec.models.target import TargetModel
from tidespec.sampling import SamplingParams
from tidespec.workloads.loader import Prompt, load_prompts

VARIANT_QUANTIZATIONS = tuple(q for q in QUANTIZATIONS if q != "none")


@dataclass
class QualityBenchConfig:
    workloads: tuple[str, ...] = ("code", "chat")
    quantizations: tuple[str, ...] = ("int8", "int4")  # the CLI default; w4a8, w8a8 on request
    limit: int = 8  # prompts per workload
    max_tokens: int = 64  # reference continuation length (fewer when EOS comes first)
    bf16_reference: bool = True  # also score the unquantized model in bfloat16
    group_size: int = 32  # int4 group size

    def __post_init__(self) -> None:
        if not self.workloads:
            raise ConfigError("give at least one workload")
        bad = [q for q in self.quantizations if q not in VARIANT_QUANTIZATIONS]
        if bad:
            raise ConfigError(f"unknown quantization {bad[0]!r}; choose from {', '.join(VARIANT_QUANTIZATIONS)}")
        if self.limit < 1 or self.max_tokens < 1:
            raise ConfigError(f"limit and max_tokens must be >= 1, got {self.limit}, {self.max_tokens}")
        ModelConfig(quant_group_size=self.group_size)  # validates the group size


def variant_label(variant: str, group_size: int) -> str:
    """``"int4"`` -> ``"int4-g32"``; other names as they are."""
    return f"int4-g{group_size}" if variant == "int4" else variant


def build_variants(ref: TargetModel, cfg: QualityBenchConfig, ref_dtype: str,
                   checkpoint: Path | None = None) -> dict[str, TargetModel]:
    """Label -> model: the quantized copies of ``ref`` (activations keep ``ref``'s dtype, as
    ``--quantization`` serves them) and, when asked and ``ref`` is not bfloat16 already, ``ref``
    in bfloat16. ``ref`` itself is not changed."""
    out: dict[str, TargetModel] = {}
    for q in cfg.quantizations:
        model = copy.deepcopy(ref)
        quantize_model(model, q, cfg.group_size, checkpoint=checkpoint)  # gguf: the blocks of the file it came from
        out[variant_label(q, cfg.group_size)] = model
    if cfg.bf16_reference and ref_dtype != "bfloat16":
        out["bfloat16"] = copy.deepcopy(ref).to(torch.bfloat16)
    return out


def weight_bytes(model: TargetModel) -> int:
    """Bytes of every unique parameter and buffer (quantized weights, scales, the embedding)."""
    tensors = {t.data_ptr(): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@torch.inference_mode()
def sequence_logprobs(model: TargetModel, ids: list[int]) -> torch.Tensor:
    """Next-token log-probabilities ``[L, V]`` float32 of one sequence, one prefill forward."""
    ids_t = torch.tensor(ids, dtype=torch.int64, device=model.device)
    kv = KVCache.for_model(model.cfg, 1, len(ids), model.dtype, model.device)
    out = model(ids_t, BatchLayout.build([len(ids)], [0], [0], device=model.device), kv)
    assert out.logits is not None
    return F.log_softmax(out.logits.float(), dim=-1).cpu()


def greedy_continuations(model: TargetModel, tokenizer: Any, prompts: list[Prompt], max_tokens: int,
                         mc: ModelConfig) -> list[list[int]]:
    """Each prompt's greedy continuation (up to ``max_tokens``, EOS included when it comes), all
    prompts in one engine batch."""
    econf = bench_engine_config(prompts, max_tokens, len(prompts), model.cfg.max_position_embeddings, mc)
    engine = build_engine(econf, model=model, tokenizer=tokenizer)
    wave = run_wave(engine, prompts, list(range(len(prompts))), SamplingParams(max_tokens=max_tokens))
    return [r.token_ids for r in wave.requests]


@dataclass
class _Tally:
    """Sums over one workload's prompts for one model."""

    nll: float = 0.0  # summed over every scored token
    kl: float = 0.0
    scored: int = 0  # tokens after the first of prompt + continuation
    agree: int = 0  # continuation positions whose argmax is the reference's token
    cont: int = 0
    prefixes: list[int] = dataclasses.field(default_factory=list)
    identical: int = 0

    def add_scores(self, logp: torch.Tensor, ref_logp: torch.Tensor, ids: list[int], prompt_len: int) -> None:
        # logp, ref_logp: [L, V]; position t predicts ids[t + 1]
        target = torch.tensor(ids[1:], dtype=torch.int64)  # [L-1]
        lp = logp[:-1]
        self.nll -= float(lp.gather(1, target.unsqueeze(1)).sum())
        rl = ref_logp[:-1]
        self.kl += float((rl.exp() * (rl - lp)).sum())
        self.scored += len(ids) - 1
        cont = slice(prompt_len - 1, len(ids) - 1)  # positions predicting the continuation
        self.agree += int((lp[cont].argmax(dim=-1) == target[cont]).sum())
        self.cont += len(ids) - prompt_len

    def row(self, ref: _Tally) -> dict[str, Any]:
        ppl, ref_ppl = math.exp(self.nll / self.scored), math.exp(ref.nll / ref.scored)
        return {"tokens_scored": self.scored, "continuation_tokens": self.cont,
                "top1_agreement": self.agree / self.cont if self.cont else float("nan"),
                "identical_prefix_mean": sum(self.prefixes) / len(self.prefixes) if self.prefixes else float("nan"),
                "identical_fraction": self.identical / len(self.prefixes) if self.prefixes else float("nan"),
                "ppl": ppl, "ppl_ref": ref_ppl, "ppl_delta": ppl - ref_ppl, "ppl_delta_pct": 100 * (ppl / ref_ppl - 1),
                "kl_mean": self.kl / self.scored}


def _score_workload(ref: TargetModel, variants: dict[str, TargetModel], tokenizer: Any, prompts: list[Prompt],
                    cfg: QualityBenchConfig, mc: ModelConfig, bar: Any) -> dict[str, _Tally]:
    refs = greedy_continuations(ref, tokenizer, prompts, cfg.max_tokens, mc)
    tallies = {label: _Tally() for label in [mc.dtype, *variants]}
    for label, model in variants.items():
        bar.set_postfix_str(f"greedy {label}")
        for got, want in zip(greedy_continuations(model, tokenizer, prompts, cfg.max_tokens, mc), refs):
            n = identical_prefix(got, want)
            tallies[label].prefixes.append(n)
            tallies[label].identical += int(n == len(want) == len(got))
    tallies[mc.dtype].prefixes = [len(r) for r in refs]
    tallies[mc.dtype].identical = len(refs)
    for prompt, cont in zip(prompts, refs):
        bar.set_postfix_str(f"scoring {prompt.record.id}")
        ids = list(prompt.token_ids) + list(cont)
        ref_logp = sequence_logprobs(ref, ids)
        tallies[mc.dtype].add_scores(ref_logp, ref_logp, ids, len(prompt.token_ids))
        for label, model in variants.items():
            tallies[label].add_scores(sequence_logprobs(model, ids), ref_logp, ids, len(prompt.token_ids))
        bar.update(1)
    return tallies


def run_quality_bench(cfg: QualityBenchConfig, target: LoadedModel | str | None = None, *,
                      model_config: ModelConfig | None = None, out_dir: Path | None = None, command: str = "",
                      echo: bool = True) -> dict[str, Any]:
    """Score every variant on every workload; write ``results.json``, ``table.md``, ``plot.png``
    into ``out_dir`` (default ``runs/bench-quality-<timestamp>``), print the table when ``echo``,
    return the JSON document. ``target`` (or ``model_config.model``) is the unquantized reference."""
    mc = model_config or ModelConfig()
    if mc.quantization != "none":
        raise ConfigError("bench quality quantizes copies of the unquantized model itself: "
                          "choose them with --quantizations, not --quantization")
    if mc.threads:
        torch.set_num_threads(mc.threads)
    target = resolve_target(target if target is not None else mc.model, mc.dtype, mc.device)
    ref_dtype = str(target.model.dtype).removeprefix("torch.")
    mc = dataclasses.replace(mc, dtype=ref_dtype if ref_dtype in DTYPES else mc.dtype)
    variants = build_variants(target.model, cfg, mc.dtype, Path(target.path))
    sets = {w: load_prompts(w, target.tokenizer, cfg.limit) for w in cfg.workloads}
    rows: list[dict[str, Any]] = []
    with tqdm(total=sum(len(p) for p in sets.values()), desc="bench quality", unit="prompt", disable=not echo,
              file=sys.stderr) as bar:
        for workload, prompts in sets.items():
            tallies = _score_workload(target.model, variants, target.tokenizer, prompts, cfg, mc, bar)
            models = {mc.dtype: target.model, **variants}
            for label, tally in tallies.items():
                rows.append({"workload": workload, "variant": label, "reference": label == mc.dtype,
                             "weight_mb": weight_bytes(models[label]) / 2**20, **tally.row(tallies[mc.dtype])})
    doc = {**workload_doc(target, ",".join(cfg.workloads), [p for ps in sets.values() for p in ps], cfg),
           "reference": mc.dtype, "rows": rows}
    return write_results("quality", doc, out_dir, command, mc.dtype, format_quality_report,
                         lambda out: _plot_quality(rows, out), echo)


def format_quality_report(doc: dict[str, Any], command: str, info: dict[str, Any]) -> str:
    """Markdown: command, machine, one row per workload x model."""
    table = markdown_table(
        ["workload", "model", "weights MiB", "top-1 agreement %", "identical greedy prefix (mean tokens)",
         "identical prompts %", "perplexity", "ppl delta", "ppl delta %", "mean KL (millinats)"],
        [[r["workload"], r["variant"] + (" (reference)" if r["reference"] else ""), r["weight_mb"],
          100 * r["top1_agreement"], r["identical_prefix_mean"], 100 * r["identical_fraction"], r["ppl"],
          r["ppl_delta"], r["ppl_delta_pct"], 1e3 * r["kl_mean"]] for r in doc["rows"]], digits=2)
    cfg = doc["config"]
    return "\n".join([
        f"### Quality against {doc['reference']} ({doc['workload']}, {cfg['limit']} prompts each, greedy "
        f"continuations of up to {cfg['max_tokens']} tokens)", "", f"Command: `{command}`", "",
        f"Machine: {machine_line(info)}", "", table, "",
        "- top-1 agreement: teacher-forced on the reference's greedy continuation; identical prefix: the model's "
        "own greedy continuation against the reference's (the reference row: its continuation's length); "
        "perplexity and KL(reference || model): every token of prompt + reference continuation; weights: every "
        "parameter and buffer (the token embedding stays in the reference dtype)."])


def _plot_quality(rows: list[dict[str, Any]], out_dir: Path) -> Path:
    fig, (ax, ax2) = new_figure(2)
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    labels = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        xs = [i + j * width for i in range(len(workloads))]
        pick = [next(r for r in rows if r["workload"] == w and r["variant"] == label) for w in workloads]
        ax.bar(xs, [100 * r["top1_agreement"] for r in pick], width, label=label)
        ax2.bar(xs, [r["ppl_delta_pct"] for r in pick], width, label=label)
    low = min(100 * r["top1_agreement"] for r in rows if not math.isnan(r["top1_agreement"]))
    ax.set_ylim(max(0.0, math.floor(low) - 5), 100.5)  # the differences are a few points
    for a, title, ylabel in ((ax, "Teacher-forced top-1 agreement", "%"), (ax2, "Perplexity vs reference", "delta %")):
        a.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads)
        a.set_title(title)
        a.set_ylabel(ylabel)
        a.grid(True, axis="y", alpha=0.3)
        a.legend(fontsize=7, loc="lower left")
    return save_figure(fig, out_dir, "plot.png")


# --------------------------------------------------------------------------- the command


def add_args(p: argparse.ArgumentParser) -> None:
    """``tidespec bench quality`` flags: workloads, variants, sizes, output, and the model flags
    (without ``--quantization``: the variants are chosen with ``--quantizations``)."""
    p.add_argument("--workload", default="code,chat", help="comma-separated JSONL paths or built-in names")
    p.add_argument("--quantizations", default="int8,int4", help="comma-separated variants: int8, int4, w4a8, w8a8, gguf "
                                                              "(a GGUF model's own blocks)")
    p.add_argument("--limit", type=int, default=8, help="prompts per workload (the first N records)")
    p.add_argument("--max-tokens", type=int, default=64, help="reference greedy continuation length (EOS stops it)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="also score the unquantized model in bfloat16")
    p.add_argument("--out", type=output_dir, default=None, help="output directory (default: runs/bench-quality-<time>)")
    add_dataclass_args(p, ModelConfig, skip=("quantization",))


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def run(ns: argparse.Namespace) -> int:
    mc = dataclass_from_args(ModelConfig, ns)
    cfg = QualityBenchConfig(workloads=_names(ns.workload), quantizations=_names(ns.quantizations), limit=ns.limit,
                             max_tokens=ns.max_tokens, bf16_reference=ns.bf16, group_size=mc.quant_group_size)
    run_quality_bench(cfg, model_config=mc, out_dir=ns.out, command=command_line())
    return 0

