"""``tidespec bench spec``: drafters x gamma vs plain decoding on one workload, with per-prompt spread.

Why this exists: a mean speedup hides the prompts where speculation loses (drafts rejected, so
every step pays for a bigger verification forward and gets one token). This benchmark puts
every drafter and speculation length next to plain decoding *of the same engine* on the same
prompts, reports the spread of the per-prompt speedup and lists the losers, and optionally
adds HF transformers' plain ``generate()`` and its prompt-lookup decoding
(``prompt_lookup_num_tokens``) as the outside reference.

Method. Greedy, every request generates exactly ``max_tokens`` tokens (EOS ignored; with
``ignore_eos=False`` a request ends at its EOS as a server's does — greedy speculation is lossless,
so every configuration still emits the same tokens, and no drafter is measured on the text a model
writes past its EOS, which serving never asks for and no drafter was trained on). One engine
per configuration (plain; drafter x gamma), all built up front and sharing the target weights.
The prompts run in waves of ``batch_size``; for each wave every configuration runs it in turn
(round-robin), so a shared machine's drift hits all configurations alike. Per configuration:

* tokens/s = output tokens / wall time of its waves; speedup = that / plain's tokens/s;
* mean acceptance length = (accepted + drafts) / drafts (tokens per speculating step);
* TTFT (first token, ms) and TPOT (ms per output token after the first, pooled over the
  requests: the decode phase alone, what speculation changes; vLLM's benchmarks report both);
  TPOT speedup = plain's TPOT / this TPOT (the prompt's prefill, which speculation does not
  touch, left out of it: on a GPU whose prefill runs eager it is ~7 % of a 128-token request);
* per-request speedup = plain latency / this latency for the same request: min, p10, median,
  p90, max, and every request below 1.0;
* ``mismatches``: requests whose tokens differ from plain's (greedy speculation is lossless, so
  this should be 0; a near-tie can flip one: bfloat16 on a GPU, the quantized CPU paths), and
  for each such request where it first differs and how close the target's two tokens were there
  (``bench/common/divergence.py``: ``divergence`` of a configuration in results.json).

Worked example::

    cfg = SpecBenchConfig(workload="code", limit=4, drafters=("ngram", "suffix"), gammas=(3, 5),
                          max_tokens=64)
    doc = run_spec_bench(cfg, resolve_target(None), out_dir=Path("runs/spec"))
    doc["configs"][1]["speedup"], doc["configs"][1]["per_request_speedup"]["p10"]
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from tidespec.bench.common import report
from tidespec.bench.common.divergence import divergence_report
from tidespec.bench.decode.run import (
    HFRunner,
    RequestRecord,
    bench_engine_config,
    reference_decode_split,
    resolve_target,
    run_wave,
    wave_indices,
    workload_doc,
)
from tidespec.bench.spec.turns import by_turn, conversations, longest_prompt, turn_prompts
from tidespec.config import HEAD_QUANTIZATIONS, ConfigError, ModelConfig, PolicyConfig, SchedulerConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.llm import build_engine
from tidespec.models.execution import placement
from tidespec.models.loading.loader import LoadedModel
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.eagle3_options import eagle3_options, head_quantization, with_eagle3
from tidespec.speculative.registry import kinds_for
from tidespec.workloads.loader import load_prompts, load_workload

PLAIN = "plain"
SHAPES = ("chain", "tree")  # EAGLE-3 proposal shapes --eagle3-shapes compares
VOCAB_DRAFTERS = ("eagle3", "draft-model")  # the drafters a --draft-vocab-mode applies to


@dataclass
class SpecBenchConfig:
    workload: str = "code"
    limit: int = 16
    drafters: tuple[str, ...] = ("none", "ngram", "suffix", "draft-model")
    gammas: tuple[int, ...] = (1, 3, 5, 8)
    batch_size: int = 1
    max_tokens: int = 128
    compare_hf: bool = False
    hf_pld_tokens: tuple[int, ...] = (10,)
    warmup: bool = True
    # EAGLE-3 heads to compare in one run, "NAME=DIR" or "DIR" each: one configuration per head x gamma
    # (empty: the one head of --eagle3-dir)
    eagle3_heads: tuple[str, ...] = ()
    # EAGLE-3 drafting weights to compare in one run (none, int8, int4): one configuration per head x
    # quantization x gamma (empty: the one of --eagle3-quantization)
    eagle3_quantizations: tuple[str, ...] = ()
    # EAGLE-3 chain confidence floors to compare in one run (--eagle3-min-draft-prob values): one
    # configuration per head x quantization x floor x gamma (empty: the one of the command line)
    eagle3_min_draft_probs: tuple[float, ...] = ()
    # EAGLE-3 proposal shapes to compare in one run (chain, tree: EAGLE-2's dynamic tree of gamma tokens):
    # one configuration per head x quantization x floor x shape x gamma (empty: --tree or not)
    eagle3_shapes: tuple[str, ...] = ()
    ignore_eos: bool = True  # every request generates max_tokens; False: a request ends at its EOS
    # turns per conversation (``bench/spec/turns.py``): turn k+1 resends the history with plain's
    # answer and the next chat record's question; ``limit`` then counts conversations
    turns: int = 1

    def __post_init__(self) -> None:
        if not self.drafters:
            raise ConfigError("need at least one drafter")
        if not self.gammas or any(g < 1 or g > 64 for g in self.gammas):
            raise ConfigError(f"gammas must be in [1, 64], got {self.gammas}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.limit < 1:
            raise ConfigError(f"limit must be >= 1, got {self.limit}")
        if self.turns < 1:
            raise ConfigError(f"turns must be >= 1, got {self.turns}")
        if self.max_tokens < 2:
            raise ConfigError(f"max_tokens must be >= 2, got {self.max_tokens}")
        if any(k < 1 for k in self.hf_pld_tokens):
            raise ConfigError(f"hf_pld_tokens must be >= 1, got {self.hf_pld_tokens}")
        if self._compared and "eagle3" not in self.drafters:
            raise ConfigError("--eagle3-heads / --eagle3-quantizations / --eagle3-min-draft-probs / --eagle3-shapes "
                              "compare EAGLE-3 variants: add eagle3 to --drafters")
        if any(x not in SHAPES for x in self.eagle3_shapes) or len(set(self.eagle3_shapes)) != len(self.eagle3_shapes):
            raise ConfigError(f"--eagle3-shapes: distinct values of {', '.join(SHAPES)}, "
                              f"got {','.join(self.eagle3_shapes)}")
        if any(not 0.0 <= f < 1.0 for f in self.eagle3_min_draft_probs) or \
                len(set(self.eagle3_min_draft_probs)) != len(self.eagle3_min_draft_probs):
            raise ConfigError(f"--eagle3-min-draft-probs: distinct values in [0, 1), got "
                              f"{','.join(map(str, self.eagle3_min_draft_probs))}")
        bad_q = [q for q in self.eagle3_quantizations if q not in HEAD_QUANTIZATIONS]
        if bad_q or len(set(self.eagle3_quantizations)) != len(self.eagle3_quantizations):
            raise ConfigError(f"--eagle3-quantizations: distinct values of {', '.join(HEAD_QUANTIZATIONS)}, "
                              f"got {','.join(self.eagle3_quantizations)}")
        heads = self.heads()
        names = [name for name, _ in heads]
        if len(set(names)) != len(names):
            raise ConfigError(f"--eagle3-heads names must differ, got {', '.join(names)}")
        for name, directory in heads:
            if not name or not Path(directory).is_dir():
                raise ConfigError(f"--eagle3-heads: {name or '(empty name)'}={directory} is not a directory "
                                  "(an exported head or a publish root)")

    def heads(self) -> list[tuple[str, str]]:
        """(name, directory) per ``eagle3_heads`` entry; a bare directory is its own name.

        Example: ``("d1=runs/a/head", "runs/b")`` -> ``[("d1", "runs/a/head"), ("runs/b", "runs/b")]``.
        """
        return [(e.split("=", 1)[0], e.split("=", 1)[1]) if "=" in e else (e, e) for e in self.eagle3_heads]

    @property
    def _compared(self) -> bool:
        return bool(self.eagle3_heads or self.eagle3_quantizations or self.eagle3_min_draft_probs or self.eagle3_shapes)

    def variants(self) -> list[HeadVariant]:
        """The compared EAGLE-3 variants: every head x every quantization x every confidence floor x
        every proposal shape (none compared: one).

        Example: heads ``("d1=a",)``, quantizations ``("none", "int8")`` -> ``d1 none`` and ``d1 int8``;
        floors ``(0.0, 0.3)`` alone -> ``p>=0`` and ``p>=0.3``; shapes ``("chain", "tree")`` alone ->
        ``chain`` and ``tree``.
        """
        heads: list[tuple[str, str] | None] = list(self.heads()) or [None]
        quants: list[str | None] = list(self.eagle3_quantizations) or [None]
        floors: list[float | None] = list(self.eagle3_min_draft_probs) or [None]
        shapes: list[str | None] = list(self.eagle3_shapes) or [None]
        return [HeadVariant(" ".join(x for x in (h[0] if h else None, q, f"p>={f:g}" if f is not None else None, t)
                                     if x),
                            h[1] if h else None, q, f, None if t is None else t == "tree")
                for h in heads for q in quants for f in floors for t in shapes]

    def grid(self) -> list[tuple[str, int, HeadVariant | None]]:
        """(drafter, gamma, EAGLE-3 variant or None) per configuration; plain first, always (``none``
        means plain); with ``eagle3_heads`` / ``eagle3_quantizations`` one eagle3 configuration per
        variant and gamma."""
        grid: list[tuple[str, int, HeadVariant | None]] = [(PLAIN, 0, None)]
        compared = self._compared
        for d in self.drafters:
            if d == "none":
                continue
            variants: list[HeadVariant | None] = list(self.variants()) if d == "eagle3" and compared else [None]
            grid += [(d, g, v) for v in variants for g in self.gammas]
        return grid


@dataclass(frozen=True)
class HeadVariant:
    """One compared EAGLE-3 configuration: a head directory, a drafting quantization, a chain
    confidence floor and/or a proposal shape (None: what the command line says)."""

    label: str
    directory: str | None = None
    quantization: str | None = None
    min_draft_prob: float | None = None
    tree: bool | None = None


def config_label(drafter: str, gamma: int, head: str | None = None) -> str:
    """``plain``, ``suffix g=4``, or ``eagle3[d2-gated int8] g=4`` for one of several compared variants."""
    if drafter == PLAIN:
        return PLAIN
    return f"{drafter}[{head}] g={gamma}" if head else f"{drafter} g={gamma}"


@dataclass
class _Run:
    """One configuration's engine (ours) or HF mode, and its records in request order."""

    label: str
    drafter: str
    gamma: int
    engine: LLMEngine | None = None
    pld: int | None = None  # HF prompt lookup tokens (None = HF plain)
    head: str | None = None  # EAGLE-3 head directory when several are compared
    quantization: str | None = None  # the EAGLE-3 head's drafting weights (none, int8, int4)
    records: list[RequestRecord] = dataclasses.field(default_factory=list)
    wall: float = 0.0
    draft_time: float = 0.0  # the engine's draft timer over the measured waves
    verify_time: float = 0.0
    steps: int = 0


def run_spec_bench(cfg: SpecBenchConfig, target: LoadedModel | str | None = None, *,
                   model_config: ModelConfig | None = None, scheduler: SchedulerConfig | None = None,
                   spec_base: SpecConfig | None = None, policy: PolicyConfig | None = None,
                   out_dir: Path | None = None, command: str = "",
                   echo: bool = True) -> dict[str, Any]:
    """Run the grid, write ``results.json``, ``plot.png``, ``table.md`` into ``out_dir`` (default
    ``runs/bench-spec-<timestamp>``), print the report when ``echo``, return the JSON document.
    ``spec_base`` carries drafter options (n-gram sizes, suffix budget, draft model, tree), ``policy``
    the speculation-length policy every speculating configuration runs (default: static)."""
    mc = model_config or ModelConfig()
    if mc.threads:
        torch.set_num_threads(mc.threads)
    base = spec_base or SpecConfig()
    kinds_for(dataclasses.replace(base, drafter=",".join(d for d in cfg.drafters if d != "none") or "none"))
    target = resolve_target(target if target is not None else mc.model, mc.dtype, mc.device, mc.quantization,
                            mc.quant_group_size)
    chats = (conversations(load_workload(cfg.workload), cfg.workload, cfg.limit, cfg.turns) if cfg.turns > 1
             else None)
    prompts = (turn_prompts(chats, [None] * len(chats), 0, target.tokenizer) if chats is not None
               else load_prompts(cfg.workload, target.tokenizer, cfg.limit))
    longest = longest_prompt(chats, cfg.max_tokens, target.tokenizer) if chats is not None else None
    runs: list[_Run] = []
    for drafter, gamma, head in cfg.grid():
        spec = dataclasses.replace(base, drafter="none" if drafter == PLAIN else drafter,
                                   num_speculative_tokens=gamma)
        if drafter not in VOCAB_DRAFTERS:  # --draft-vocab-mode shapes the drafters that have an output layer only
            spec = dataclasses.replace(spec, vocab=dataclasses.replace(base.vocab, mode="off"))
        if head is not None:
            eagle = eagle3_options(base)
            spec = dataclasses.replace(with_eagle3(
                spec, dir=head.directory or eagle.dir, quantization=head.quantization or eagle.quantization,
                min_draft_prob=eagle.min_draft_prob if head.min_draft_prob is None else head.min_draft_prob),
                tree=base.tree if head.tree is None else head.tree)
        econf = bench_engine_config(prompts, cfg.max_tokens, cfg.batch_size,
                                    target.model.cfg.max_position_embeddings, mc, scheduler, spec, policy, longest)
        engine = build_engine(econf, model=target.model, tokenizer=target.tokenizer)
        runs.append(_Run(config_label(drafter, gamma, head.label if head else None), drafter, gamma, engine=engine,
                         head=head.directory if head else None,
                         quantization=head_quantization(eagle3_options(spec).quantization, placement.resolve_device(
                             spec.drafter_device, target.model.device))
                         if drafter == "eagle3" else None))
    hf_runs: list[_Run] = []
    hf: HFRunner | None = None
    if cfg.compare_hf:
        hf = HFRunner(target.path, mc.dtype, mc.device)
        hf_runs = [_Run("hf plain", "hf", 0)] + [_Run(f"hf prompt-lookup k={k}", "hf-pld", k, pld=k)
                                                 for k in cfg.hf_pld_tokens]
    params = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=cfg.ignore_eos)
    if cfg.warmup:
        warm = SamplingParams(max_tokens=min(8, cfg.max_tokens), ignore_eos=True)
        for r in runs:
            assert r.engine is not None
            run_wave(r.engine, prompts, [0], warm)
            r.engine.reset_prefix_cache()  # the first measured prompt is prefilled from a cold cache
        if hf is not None:
            hf.generate(prompts[0], 0, min(8, cfg.max_tokens))

    per_turn = len(prompts)
    waves = wave_indices(per_turn, cfg.batch_size)
    turn_of = [1] * per_turn  # the 1-based turn of every prompt run, in order
    total = cfg.turns * len(waves) * (len(runs) + len(hf_runs) * cfg.batch_size)
    with tqdm(total=total, desc="bench spec", unit="run", disable=not echo, file=sys.stderr) as bar:
        for turn in range(cfg.turns):
            if turn:  # the next turn: plain's answers and the next questions appended to every chat
                assert chats is not None
                last = {rec.prompt_index: rec for rec in runs[0].records}  # a cycled last wave repeats one
                answers = [target.tokenizer.decode(last[(turn - 1) * per_turn + c].token_ids, skip_special_tokens=True)
                           for c in range(per_turn)]
                prompts += turn_prompts(chats, answers, turn, target.tokenizer)
                turn_of += [turn + 1] * per_turn
            start = turn * per_turn
            for wi, wave in enumerate(waves):  # round-robin: every configuration runs this wave before the next
                idx = [start + i for i in wave]
                where = f"turn {turn + 1}/{cfg.turns} " if cfg.turns > 1 else ""
                for r in runs:
                    assert r.engine is not None
                    bar.set_postfix_str(f"{where}wave {wi + 1}/{len(waves)} {r.label}")
                    if cfg.turns == 1:  # a cold prefix cache: the warm-up and a cycled last wave repeat prompts
                        r.engine.reset_prefix_cache()
                    w = run_wave(r.engine, prompts, idx, params)
                    r.records.extend(w.requests)
                    r.wall += w.wall_time
                    r.draft_time += w.draft_time
                    r.verify_time += w.verify_time
                    r.steps += w.steps
                    bar.update()
                if hf is not None:
                    for i in idx:
                        for h in hf_runs:
                            bar.set_postfix_str(f"{where}wave {wi + 1}/{len(waves)} {h.label}")
                            rec = hf.generate(prompts[i], i, cfg.max_tokens, h.pld, cfg.ignore_eos)
                            h.records.append(rec)
                            h.wall += rec.latency
                            bar.update()

    plain = runs[0]
    configs = [_summarize_run(r, plain) for r in runs]
    for c, r in zip(configs, runs):  # where each differing output left plain's, and whether at a near-tie
        if c["mismatches"]:
            c["divergence"] = divergence_report(
                target.model, [prompts[x.prompt_index].token_ids for x in r.records],
                [x.token_ids for x in plain.records], [x.token_ids for x in r.records],
                [x.prompt_id for x in r.records])
    if cfg.turns > 1:
        for c, r in zip(configs, runs):
            c["by_turn"] = by_turn(turn_of, r.records, plain.records)
    hf_summary = [_summarize_run(h, hf_runs[0]) for h in hf_runs]
    for h in hf_summary:  # HF figures relative to our plain decoding too
        h["tokens_per_s_vs_tidespec_plain"] = h["tokens_per_s"] / configs[0]["tokens_per_s"]
    doc = {
        **workload_doc(target, cfg.workload, prompts, cfg),
        "spec_options": dataclasses.asdict(base),
        "configs": configs,
        "hf": hf_summary,
        "headline": _spec_headline(configs, hf_summary),
    }
    return report.write_results("spec", doc, out_dir, command, mc.precision, format_spec_report,
                         lambda out: _plot_spec(configs, hf_summary, out), echo)


def _pooled_tpot(records: list[RequestRecord]) -> float:
    """Seconds per output token after each request's first, pooled: sum(latency - TTFT) / sum(tokens - 1).

    Example: requests (TTFT 0.1 s, latency 1.1 s, 11 tokens) and (0.2 s, 0.7 s, 6 tokens) -> 1.5 / 15 = 0.1 s."""
    tokens, seconds = reference_decode_split(records)
    return seconds / tokens if tokens else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def _summarize_run(run: _Run, plain: _Run) -> dict[str, Any]:
    tokens = sum(r.output_tokens for r in run.records)
    plain_tokens = sum(r.output_tokens for r in plain.records)
    tps = tokens / run.wall if run.wall > 0 else float("nan")
    plain_tps = plain_tokens / plain.wall if plain.wall > 0 else float("nan")
    drafts = sum(r.num_drafts for r in run.records)
    draft_tokens = sum(r.num_draft_tokens for r in run.records)
    accepted = sum(r.num_accepted_tokens for r in run.records)
    per_req = [{"request": k, "prompt_id": r.prompt_id, "latency_s": r.latency, "output_tokens": r.output_tokens,
                "speedup": p.latency / r.latency if r.latency > 0 else float("nan"),
                "mean_acceptance_length": (r.num_accepted_tokens + r.num_drafts) / r.num_drafts
                if r.num_drafts else float("nan")}
               for k, (r, p) in enumerate(zip(run.records, plain.records))]
    speedups = [x["speedup"] for x in per_req]
    spread = report.summarize(speedups)
    return {
        "label": run.label,
        "drafter": run.drafter,
        "gamma": run.gamma,
        "requests": len(run.records),
        "output_tokens": tokens,
        "wall_time_s": run.wall,
        "tokens_per_s": tps,
        "speedup": tps / plain_tps,
        "mean_ttft_ms": 1e3 * float(np.mean([r.ttft for r in run.records])) if run.records else float("nan"),
        "tpot_ms": 1e3 * _pooled_tpot(run.records),
        "tpot_speedup": _ratio(_pooled_tpot(plain.records), _pooled_tpot(run.records)),
        "mean_acceptance_length": (accepted + drafts) / drafts if drafts else float("nan"),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else float("nan"),
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "eagle3_head": run.head,
        "eagle3_quantization": run.quantization,
        "steps": run.steps,
        "draft_ms_per_step": 1e3 * run.draft_time / run.steps if run.steps else float("nan"),
        "draft_ms_per_draft_token": 1e3 * run.draft_time / draft_tokens if draft_tokens else float("nan"),
        "verify_ms_per_step": 1e3 * run.verify_time / run.steps if run.steps else float("nan"),
        "per_request_speedup": {k: spread[k] for k in ("min", "p10", "p50", "p90", "max")},
        "losses": [{"prompt_id": x["prompt_id"], "speedup": x["speedup"]} for x in per_req if x["speedup"] < 1.0],
        "mismatches": sum(1 for r, p in zip(run.records, plain.records) if r.token_ids != p.token_ids),
        "per_request": per_req,
    }


def _spec_headline(configs: list[dict[str, Any]], hf: list[dict[str, Any]]) -> dict[str, Any]:
    spec_cfgs = [c for c in configs if c["drafter"] != PLAIN]
    head: dict[str, Any] = {"plain_tokens_per_s": configs[0]["tokens_per_s"]}
    if spec_cfgs:
        best = max(spec_cfgs, key=lambda c: c["tokens_per_s"])
        head.update(best_config=best["label"], best_speedup=best["speedup"],
                    best_mean_acceptance_length=best["mean_acceptance_length"],
                    best_losses=len(best["losses"]), total_mismatches=sum(c["mismatches"] for c in spec_cfgs))
    pld = [h for h in hf if h["drafter"] == "hf-pld"]
    if hf:
        head["hf_plain_tokens_per_s"] = hf[0]["tokens_per_s"]
        head["tidespec_plain_vs_hf_plain"] = configs[0]["tokens_per_s"] / hf[0]["tokens_per_s"]
    if pld:
        best_pld = max(pld, key=lambda h: h["speedup"])
        head.update(hf_pld_best=best_pld["label"], hf_pld_speedup=best_pld["speedup"])
        if spec_cfgs:
            head["best_speedup_minus_hf_pld_speedup"] = head["best_speedup"] - best_pld["speedup"]
    return head


def format_spec_report(doc: dict[str, Any], command: str, info: dict[str, Any]) -> str:
    """Markdown: command, machine, the configuration table, the spread table, headline, losers."""
    rows = doc["configs"] + doc["hf"]
    main = report.markdown_table(
        ["configuration", "tok/s", "speedup", "TTFT ms", "TPOT ms", "TPOT speedup", "mean acc. len", "acc. rate",
         "draft ms/step", "draft ms/draft token", "forward ms/step", "mismatches"],
        [[c["label"], c["tokens_per_s"], c["speedup"], c.get("mean_ttft_ms"), c.get("tpot_ms"), c.get("tpot_speedup"),
          c["mean_acceptance_length"], c["acceptance_rate"],
          c.get("draft_ms_per_step"), c.get("draft_ms_per_draft_token"), c.get("verify_ms_per_step"),
          c["mismatches"] if c["drafter"] not in ("hf", "hf-pld") else None] for c in rows], digits=2)
    spread = report.markdown_table(
        ["configuration", "min", "p10", "median", "p90", "max", "prompts slower than plain"],
        [[c["label"], *[c["per_request_speedup"][k] for k in ("min", "p10", "p50", "p90", "max")],
          f"{len(c['losses'])}/{c['requests']}"] for c in rows if c["drafter"] != PLAIN and c["drafter"] != "hf"],
        digits=2)
    cfg = doc["config"]
    turns = f" in {cfg['turns']}-turn chats" if cfg.get("turns", 1) > 1 else ""
    lines = [f"### Speculative decoding ({doc['workload']}, {len(doc['prompt_ids'])} prompts{turns}, batch "
             f"{cfg['batch_size']}, {report.eos_words(cfg.get('ignore_eos', True), cfg['max_tokens'])}, greedy)", "",
             f"Command: `{command}`", "", f"Machine: {report.machine_line(info)}", "",
             ("Speedup = tokens/s over the same engine's plain decoding (HF rows: over HF plain generate()); "
              "TPOT speedup = plain's time per output token after the first over this one's (the decode phase "
              "alone, the prompt's prefill left out)."), "",
             main, "", "Per-prompt speedup (plain latency / configuration latency, same prompt):", "", spread, ""]
    if doc["configs"][0].get("by_turn"):
        lines += [("Per turn (each turn resends the chat so far; prompt tokens and the prefix cache's share of "
                   "them in plain decoding's engine; median TTFT per configuration; outputs differing from plain's, "
                   "all speculating configurations together):"), "", _turn_table(doc["configs"]), ""]
    h = doc["headline"]
    if "best_config" in h:
        lines.append(f"- best: {h['best_config']} at {h['best_speedup']:.2f}x plain, mean acceptance length "
                     f"{h['best_mean_acceptance_length']:.2f}, slower than plain on {h['best_losses']} prompt(s); "
                     f"outputs differing from plain: {h['total_mismatches']}")
    if "hf_pld_speedup" in h:
        lines.append(f"- HF prompt lookup ({h['hf_pld_best']}): {h['hf_pld_speedup']:.2f}x HF plain; "
                     f"tidespec plain / HF plain: {h['tidespec_plain_vs_hf_plain']:.2f}x")
    for c in doc["configs"]:
        if "divergence" in c:
            d = c["divergence"]
            lines.append(f"- {c['label']}: {d['count']} output(s) differ from plain; the first divergence is at a "
                         f"near-tie in {d['near_ties']} (largest logit gap {d['max_relative_gap']:.2g} of the top "
                         "logit)")
    for c in doc["configs"]:
        if c["losses"]:
            worst = sorted(c["losses"], key=lambda x: x["speedup"])[:5]
            lines.append(f"- {c['label']} loses on: " + ", ".join(f"{x['prompt_id']} ({x['speedup']:.2f}x)"
                                                                 for x in worst)
                         + (" ..." if len(c["losses"]) > 5 else ""))
    return "\n".join(lines)


def _turn_table(configs: list[dict[str, Any]]) -> str:
    """One row per turn: prompt tokens per request, the prefix cache's share, each configuration's
    median TTFT, and the outputs differing from plain's."""
    rows = []
    for k, t in enumerate(configs[0]["by_turn"]):
        cached = t["cached_tokens"] / t["prompt_tokens"] if t["prompt_tokens"] else float("nan")
        rows.append([t["turn"], t["prompt_tokens"] / max(1, t["requests"]), f"{100 * cached:.0f} %",
                     *[c["by_turn"][k]["ttft_p50_ms"] for c in configs],
                     sum(c["by_turn"][k]["mismatches"] for c in configs[1:])])
    return report.markdown_table(["turn", "prompt tokens / request", "cached"]
                                 + [f"{c['label']} TTFT ms" for c in configs] + ["differing outputs"], rows)


def _plot_spec(configs: list[dict[str, Any]], hf: list[dict[str, Any]], out_dir: Path) -> Path:
    rows = configs + hf
    labels = [c["label"] for c in rows]
    fig, (ax1, ax2, ax3) = report.new_figure(3, width_per_col=max(5.0, 0.45 * len(rows)), height=4.5)
    colors = ["tab:gray" if c["drafter"] in (PLAIN, "hf") else
              "tab:orange" if c["drafter"] == "hf-pld" else "tab:blue" for c in rows]
    x = np.arange(len(rows))
    ax1.bar(x, [c["tokens_per_s"] for c in rows], color=colors)
    ax1.axhline(configs[0]["tokens_per_s"], color="k", lw=0.8, ls="--")
    ax1.set_ylabel("output tokens / s")
    ax1.set_title("Throughput per configuration")
    spec_rows = [c for c in configs if c["drafter"] != PLAIN]
    xs = np.arange(len(spec_rows))
    ax2.bar(xs, [c["mean_acceptance_length"] for c in spec_rows], color="tab:blue")
    ax2.set_xticks(xs, [c["label"] for c in spec_rows], rotation=60, ha="right", fontsize=8)
    ax2.set_ylabel("tokens per speculating step")
    ax2.set_title("Mean acceptance length")
    box_rows = [c for c in rows if c["drafter"] not in (PLAIN, "hf")]
    data = [[p["speedup"] for p in c["per_request"]] for c in box_rows]
    if data:
        ax3.boxplot(data, positions=range(len(data)), widths=0.6, showfliers=False)
        jitter = np.random.default_rng(0)
        for i, d in enumerate(data):
            ax3.plot(i + jitter.uniform(-0.18, 0.18, len(d)), d, ".", alpha=0.6, color="tab:blue")
        ax3.set_xticks(range(len(data)), [c["label"] for c in box_rows], rotation=60, ha="right", fontsize=8)
    ax3.axhline(1.0, color="r", lw=0.8, ls="--")
    ax3.set_ylabel("per-prompt speedup vs plain")
    ax3.set_title("Per-prompt spread")
    ax1.set_xticks(x, labels, rotation=60, ha="right", fontsize=8)
    for ax in (ax1, ax2, ax3):
        ax.grid(True, axis="y", alpha=0.3)
    return report.save_figure(fig, out_dir, "plot.png")
