"""``tidespec bench exactness``: is every path's greedy output exactly plain decoding's, alone?

Why this exists: the engine's first promise is that speculation and batching never change what
the model would have said (README, Guarantees). It holds only if every forward computes a row's
logits bit for bit the same whatever else the forward holds (``models/execution/invariance.py``), which
depends on the kernels, the dtype, the CPU and torch.compile. This benchmark checks the promise
where a user would: for every path it is asked for (dtype x weight quantization x ``--compile``)
and every drafter, on prompts of several domains and languages, with long outputs, it compares
each request's greedy tokens with the same path's plain decoding of that prompt alone:

* ``plain/batched``: plain decoding, all prompts at once (continuous batching, chunked prefill);
* ``<drafter>/alone`` and ``<drafter>/batched``: speculative decoding one prompt at a time, and
  all at once.

Each cell counts identical outputs; every difference is listed with the first differing position
and the gap between the target's two best logits there (``bench/common/divergence.py``). Per path it
also measures row invariance directly (``row_probe``): the logits of rows computed in 8-row
verifications, in a batch beside another sequence and in one prompt chunk, against the same
rows decoded one at a time, counting the rows whose logits have exactly the same bits.
``--no-row-invariant`` measures the engine as it was before row invariance (SDPA and the
fastest kernel per row count), for a before/after table from one command.

Worked example::

    cfg = ExactnessBenchConfig(paths="int4+compile", drafters="suffix", limit=2, max_tokens=64)
    doc = run_exactness_bench(cfg, out_dir=Path("runs/exact"))
    doc["paths"][0]["cells"]["suffix/batched"]   # {"identical": 8, "total": 8, "divergences": []}
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tidespec.bench.common.divergence import first_divergence
from tidespec.bench.common.report import command_line, machine_info, machine_line
from tidespec.config import (
    CUDA_INVARIANCE,
    QUANTIZATIONS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    PolicyConfig,
    SchedulerConfig,
    SpecConfig,
    opt,
)
from tidespec.engine.engine import LLMEngine
from tidespec.engine.scheduler import PrefillChunk, ScheduledBatch
from tidespec.engine.sequence import Sequence
from tidespec.llm import build_engine
from tidespec.models.eagle3.checkpoint import shipped_bootstrap
from tidespec.models.loading.loader import LoadedModel, load_model
from tidespec.models.quant.quantize import quantize_model
from tidespec.sampling import SamplingParams
from tidespec.speculative.api import DraftProposal, SeqDraft
from tidespec.speculative.drafters.draft_model import DraftModelOptions
from tidespec.speculative.drafters.eagle3_options import Eagle3Options
from tidespec.workloads.loader import Prompt, load_prompts

PATHS = ("float32", "float32+compile", "bfloat16", "bfloat16+compile", "int8", "int8+compile", "int4", "int4+compile",
         "bfloat16+int4", "w4a8", "w4a8+compile", "w8a8", "w8a8+compile", "gguf", "gguf+compile")
QUANT_PATHS = tuple(q for q in QUANTIZATIONS if q != "none")
DRAFTERS = ("ngram", "suffix", "draft-model", "eagle3", "eagle3-tree", "medusa", "suffix,eagle3+analytic",
            "suffix,eagle3+per-sequence")
# the configurations whose policy prices drafters from the target's profiled costs (the whole target's)
PROFILED = ("suffix,eagle3+analytic", "suffix,eagle3+per-sequence")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ExactnessBenchConfig:
    workloads: str = opt("code,chat,zh_chat,multilingual", "comma-separated workloads (built-in names or JSONL paths)")
    limit: int = opt(6, "prompts per workload", min=1)
    max_tokens: int = opt(256, "tokens generated per request (EOS ignored)", min=1)
    paths: str = opt(",".join(PATHS), "comma-separated target paths: [float32|bfloat16+][int8|int4|w4a8|w8a8|gguf][+compile] "
                                      "(float32, bfloat16+compile, int4+compile, bfloat16+int4, ...)")
    drafters: str = opt(";".join(DRAFTERS), "semicolon-separated drafter configurations: " + "; ".join(DRAFTERS))
    gamma: int = opt(4, "draft tokens per step", min=1)
    max_num_seqs: int = opt(32, "KV slots (the batched runs put every prompt in flight at once)", min=1)
    kv_cache_memory_mb: int = opt(0, "KV cache of the drafters' engines, MiB (0: room for every prompt at once; a "
                                     "small one preempts sequences in the batched cells)", min=0)
    model: str | None = opt(None, "target: HF checkpoint directory or .gguf file (default: the embedded SmolLM2-135M)")
    layers: int = opt(0, "run the target truncated to its first N layers (0: all of them): every kernel and compiled "
                         "graph a layer runs, at a fraction of the compile time; EAGLE-3 then drafts with a fresh head "
                         "(the trained one reads layers the truncated target lacks)", min=0)
    device: str = opt("cpu", "torch device of the target (cuda: CUDA graphs; int8/int4 paths need cpu)")
    cuda_invariance: str = opt("fixed-shape", "on CUDA: fixed-shape or row-attention (ModelConfig's --cuda-invariance)")

    def __post_init__(self) -> None:
        if self.cuda_invariance not in CUDA_INVARIANCE:
            raise ConfigError(f"cuda_invariance must be one of {', '.join(CUDA_INVARIANCE)}, got {self.cuda_invariance!r}")
        for p in self.path_list:
            if parse_path(p)[1] != "none" and not self.device.startswith("cpu"):
                raise ConfigError(f"path {p!r} quantizes with PyTorch's CPU kernels: it needs --device cpu, "
                                  f"got {self.device!r}")
        bad = [d for d in self.drafter_list if d not in DRAFTERS]
        if bad:
            raise ConfigError(f"unknown drafter configuration(s) {', '.join(bad)}; choose from {'; '.join(DRAFTERS)}")
        profiled = [d for d in self.drafter_list if d in PROFILED]
        if self.layers and profiled:
            raise ConfigError(f"--layers: the {' and '.join(profiled)} configuration needs the whole target (its "
                              "profiled costs and the trained head); leave it out or drop --layers")

    @property
    def workload_list(self) -> list[str]:
        return [w.strip() for w in self.workloads.split(",") if w.strip()]

    @property
    def path_list(self) -> list[str]:
        return [p.strip() for p in self.paths.split(",") if p.strip()]

    @property
    def drafter_list(self) -> list[str]:
        return [d.strip() for d in self.drafters.split(";") if d.strip()]


def parse_path(path: str) -> tuple[str, str, bool]:
    """A target path, ``[dtype+][int8|int4|w4a8|w8a8|gguf][+compile]`` -> (dtype, quantization, compile); a
    one-line error else.

    Examples: ``parse_path("int4+compile") == ("float32", "int4", True)``,
    ``parse_path("bfloat16+int4") == ("bfloat16", "int4", False)``,
    ``parse_path("bfloat16") == ("bfloat16", "none", False)``."""
    parts = path.split("+")
    dtype = parts.pop(0) if parts[0] in DTYPES else "float32"
    quant = parts.pop(0) if parts and parts[0] in QUANT_PATHS else "none"
    compile_ = parts == ["compile"]
    if (parts and not compile_) or (dtype == "float32" and quant == "none" and not path.startswith("float32")):
        raise ConfigError(f"unknown path {path!r}: [float32|bfloat16+][int8|int4|w4a8|w8a8|gguf][+compile], e.g. int4+compile, "
                          f"bfloat16+int4")
    return dtype, quant, compile_


def spec_for(name: str, gamma: int, layers: int = 0) -> tuple[SpecConfig, PolicyConfig]:
    """The engine sections of a drafter configuration of ``DRAFTERS`` for a target of ``layers`` layers
    (0: the whole embedded model, whose EAGLE-3 drafts with the shipped head and draft model is its
    first 6 layers; else a fresh head and the first half of the layers)."""
    eagle = {"eagle3": Eagle3Options(dir=None if layers else str(shipped_bootstrap()))}
    if name == "draft-model":
        return SpecConfig(drafter="draft-model", num_speculative_tokens=gamma,
                          options={"draft-model": DraftModelOptions(layers=max(1, layers // 2) if layers else 6)}), \
            PolicyConfig()
    if name in ("eagle3", "eagle3-tree"):
        return SpecConfig(drafter="eagle3", num_speculative_tokens=gamma, tree=name == "eagle3-tree",
                          options=eagle), PolicyConfig()
    if name in PROFILED:  # the controller, or each sequence its own drafter in one verification
        return SpecConfig(drafter="suffix,eagle3", num_speculative_tokens=gamma, options=eagle), \
            PolicyConfig(name="analytic", per_sequence=name.endswith("per-sequence"))
    return SpecConfig(drafter=name, num_speculative_tokens=gamma), PolicyConfig()


def target_model(dtype: str, quantization: str, cache: dict[tuple[str, str], LoadedModel], path: str | None = None,
                 device: str = "cpu", layers: int = 0) -> LoadedModel:
    """The model at ``path`` (None: the embedded one) on ``device`` in ``dtype`` with ``quantization``,
    truncated to its first ``layers`` layers (0: all; sharing the whole model's weights) (one copy per
    pair, kept for the run). A quantized model is a copy of the float one when that is loaded already,
    else loaded quantized layer by layer: a 5B GGUF's float32 copy would not fit beside it."""
    key = (dtype, quantization) if not layers else (dtype, f"{quantization}:{layers}")
    if key not in cache:
        base = cache.get((dtype, "none"))
        fresh = base is None and quantization != "none"
        if fresh:
            base = load_model(path, dtype=DTYPES[dtype], device=device, quantization=quantization)
        else:
            base = base or load_model(path, dtype=DTYPES[dtype], device=device)
            cache.setdefault((dtype, "none"), base)
        if layers:
            base = dataclasses.replace(base, model=base.model.truncated(min(layers, base.model.cfg.num_layers)))
        if quantization != "none" and not fresh:  # a quantized copy; the float model stays as it is
            base = dataclasses.replace(base, model=copy.deepcopy(base.model))
            quantize_model(base.model, quantization, checkpoint=Path(base.path))
        cache[key] = base
    return cache[key]


def _generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, batched: bool) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if not batched:
        return [_generate(engine, [p], max_tokens, True)[0] for p in prompts]
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


def _compare(target: LoadedModel, prompts: list[Prompt], plain: list[list[int]],
             got: list[list[int]]) -> dict[str, Any]:
    divergences = []
    for p, ref, out in zip(prompts, plain, got):
        if ref != out:
            d = first_divergence(target.model, p.token_ids, ref, out, p.record.id)
            divergences.append(dataclasses.asdict(d) if d is not None else {"prompt_id": p.record.id})
    return {"identical": len(plain) - len(divergences), "total": len(plain), "divergences": divergences}


def _cell(target: LoadedModel, prompts: list[Prompt], plain: list[list[int]], engine: LLMEngine, max_tokens: int,
          batched: bool) -> dict[str, Any]:
    """One cell: ``engine``'s outputs against ``plain``, the prompt tokens it reused from its prefix
    cache (``prefix_hit_tokens``; prompts hit what earlier cells and requests cached) and the
    sequences it preempted for lack of KV blocks (``preempted``)."""
    pc = engine.prefix_cache
    before = pc.hit_tokens if pc is not None else 0
    preempted = engine.scheduler.num_preemptions
    got = _generate(engine, [p.token_ids for p in prompts], max_tokens, batched)
    return {**_compare(target, prompts, plain, got), "prefix_hit_tokens": (pc.hit_tokens - before) if pc else 0,
            "preempted": engine.scheduler.num_preemptions - preempted}


def _routes(engine: LLMEngine) -> dict[str, float]:
    """Per-sequence drafting's counts so far (``AnalyticPolicy.stats``): the sequence-steps routed to each
    drafter ("none": to no draft) and the steps that verified more than one route at once, which a
    per-sequence cell must hold for its exactness to say something about mixed verifications; {} for
    any other policy."""
    stats = engine.policy.stats() if engine.policy is not None else {}
    return {k: v for k, v in stats.items() if k.startswith("routed_") or k == "mixed_steps"}


def _shadow(engine: LLMEngine, tokens: list[int]) -> Sequence:
    """A sequence outside the scheduler, in a free slot of the engine's cache, with ``tokens``
    prefilled the way the engine prefills a prompt alone (chunks of its token budget)."""
    slot = engine.kv.allocate()
    if slot is None:
        raise RuntimeError("row probe: no free KV slot")
    seq = Sequence(-1 - slot, f"probe{slot}", list(tokens), SamplingParams(), torch.Generator(), None)  # type: ignore[arg-type]
    seq.slot = slot
    done = 0
    while done < len(tokens):
        n = min(len(tokens) - done, engine.scheduler.budget)
        seq.num_cached = done
        engine.runner.forward(ScheduledBatch(prefill=[PrefillChunk(seq, done, n)]), DraftProposal(), ())
        done += n
    seq.num_cached = len(tokens)
    return seq


def _forward(engine: LLMEngine, batch: ScheduledBatch, drafts: dict[int, SeqDraft] | None = None) -> Any:
    out = engine.runner.forward(batch, DraftProposal(drafts or {}), ())
    assert out.logits is not None
    return out


def row_probe(engine: LLMEngine, prompts: list[list[int]], k: int = 8) -> dict[str, int]:
    """Rows whose logits have exactly the bits of the same rows decoded one at a time, through the
    engine's own forward path (eager, compiled or CUDA graphs, as it runs). Per prompt: its last
    token and the next ``k - 1`` tokens of its plain continuation decoded one row a forward (the
    reference), then verified as one k-row chain, as a 3-row chain beside another prompt's k-row
    chain, and fed as one prompt chunk (its last row). Frees every slot it took."""
    counts = {"rows": 0, "identical": 0}
    for i, prompt in enumerate(prompts):
        a = _shadow(engine, prompt[:-1])
        a.token_ids = list(prompt)
        ones: list[torch.Tensor] = []
        for _ in range(k):  # plain decoding: one row a forward
            ones.append(_forward(engine, ScheduledBatch(decode=[a])).logits[0].clone())
            a.num_cached += 1
            a.token_ids = a.token_ids + [int(ones[-1].argmax())]
        engine.kv.free(a.slot)  # type: ignore[arg-type]
        cont = a.token_ids[len(prompt):]  # [k] the continuation
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for partner in (False, True):
            b = _shadow(engine, prompt[:-1])
            b.token_ids = list(prompt)
            seqs, drafts = [b], {b.seq_id: SeqDraft(cont[:2] if partner else cont[:k - 1])}
            if partner:
                other = prompts[(i + 1) % len(prompts)]
                c = _shadow(engine, other[:-1])
                c.token_ids = list(other)
                seqs.append(c)
                drafts[c.seq_id] = SeqDraft([other[-1]] * (k - 1))
            out = _forward(engine, ScheduledBatch(decode=seqs), drafts)
            row = out.rows[b.seq_id]
            pairs += [(out.logits[row.logits_start + j], ones[j]) for j in range(row.num)]
            for s in seqs:
                engine.kv.free(s.slot)  # type: ignore[arg-type]
        chunk = _shadow(engine, prompt[:-1])
        chunk.prompt_ids = prompt + cont[:k - 1]
        out = _forward(engine, ScheduledBatch(prefill=[PrefillChunk(chunk, len(prompt) - 1, k)]))
        engine.kv.free(chunk.slot)  # type: ignore[arg-type]
        pairs.append((out.logits[-1], ones[k - 1]))
        counts["rows"] += len(pairs)
        counts["identical"] += sum(int(torch.equal(got, ref)) for got, ref in pairs)
    return counts


class PathRun:
    """One path of the matrix: its target, its plain engine, the row probe, plain decoding of every
    prompt alone (the reference) and the cells, each drafter's on an engine of its own over the same
    target. Built once per path and shared by its cells (``make test``'s subset builds one per path
    and runs its cells as separate tests). ``batched_reference``: the reference decodes every prompt
    at once (faster; the same outputs when the path is exact, which the cells then do not test).
    ``probe_prompts``: the row probe's prompts (default: the first four; it prefills each five times,
    so short ones keep it cheap).

    Example::

        run = PathRun(ExactnessBenchConfig(limit=1, max_tokens=32), "int8", prompts, targets={})
        run.plain_cells()                 # entry["cells"]["plain/batched"], ["plain+prefix/batched"]
        run.drafter_cells("suffix")       # {"suffix/alone": {...}, "suffix/batched": {...}}
        run.entry["row_probe"]            # {"rows": 48, "identical": 48}
    """

    def __init__(self, cfg: ExactnessBenchConfig, path: str, prompts: list[Prompt],
                 targets: dict[tuple[str, str], LoadedModel], row_invariant: bool = True,
                 batched_reference: bool = False, probe_prompts: list[list[int]] | None = None) -> None:
        dtype, quant, compile_ = parse_path(path)
        self.cfg = cfg
        self.prompts = prompts
        self.target = target_model(dtype, quant, targets, cfg.model, cfg.device, cfg.layers)
        self.model_cfg = ModelConfig(dtype=dtype, quantization=quant, compile=compile_, row_invariant=row_invariant,
                                     threads=torch.get_num_threads(), device=cfg.device,
                                     cuda_invariance=cfg.cuda_invariance)
        longest = max([len(p.token_ids) for p in prompts] + [len(p) for p in probe_prompts or []])
        self.cache = CacheConfig(max_model_len=longest + cfg.max_tokens + cfg.gamma + 2, max_num_seqs=cfg.max_num_seqs)
        self.t0 = time.perf_counter()
        self.engine = build_engine(EngineConfig(model=self.model_cfg, cache=self.cache), model=self.target.model,
                                   tokenizer=self.target.tokenizer)
        self.ids = [p.token_ids for p in prompts]
        self.entry: dict[str, Any] = {"path": path, "invariance": self.engine.invariance.to_json(), "cells": {}}
        self.entry["row_probe"] = row_probe(self.engine, probe_prompts or self.ids[:4])
        # the reference computes every prompt in full: prefix caching off (the engine's cache, set aside)
        self._prefix_cache, self.engine.prefix_cache = self.engine.prefix_cache, None
        self.plain = _generate(self.engine, self.ids, cfg.max_tokens, batched=batched_reference)

    def plain_cells(self) -> dict[str, Any]:
        """Plain decoding of every prompt at once, and (where prefix caching is on) again after each
        prompt was prefilled alone, so that every prompt starts on prefix hits."""
        cells = self.entry["cells"]
        cells["plain/batched"] = _compare(self.target, self.prompts, self.plain,
                                          _generate(self.engine, self.ids, self.cfg.max_tokens, batched=True))
        if self._prefix_cache is not None:
            self.engine.prefix_cache = self._prefix_cache
            _generate(self.engine, self.ids, 1, batched=False)  # caches each prompt's blocks: all a later one hits
            cells["plain+prefix/batched"] = _cell(self.target, self.prompts, self.plain, self.engine,
                                                  self.cfg.max_tokens, True)
        self.entry["seconds"] = round(time.perf_counter() - self.t0, 1)
        return cells

    def drafter_cells(self, name: str) -> dict[str, Any]:
        """Drafter configuration ``name`` on an engine of its own, one prompt at a time and all at
        once (prompts hit what earlier cells cached)."""
        spec, policy = spec_for(name, self.cfg.gamma, self.target.model.cfg.num_layers if self.cfg.layers else 0)
        econf = EngineConfig(model=self.model_cfg, cache=dataclasses.replace(
            self.cache, kv_cache_memory_mb=self.cfg.kv_cache_memory_mb), spec=spec, policy=policy,
                             scheduler=SchedulerConfig())
        engine = build_engine(econf, model=self.target.model, tokenizer=self.target.tokenizer)
        out = {}
        for batched in (False, True):
            before = _routes(engine)
            cell = _cell(self.target, self.prompts, self.plain, engine, self.cfg.max_tokens, batched)
            routes = {k: v - before.get(k, 0.0) for k, v in _routes(engine).items()}
            out[f"{name}/{'batched' if batched else 'alone'}"] = {**cell, "routes": routes} if routes else cell
        self.entry["cells"].update(out)
        self.entry["seconds"] = round(time.perf_counter() - self.t0, 1)
        return out

    def eager_cell(self) -> dict[str, Any]:
        """A compiled path's plain decoding against eager code's: every prompt alone on an eager engine
        over the same target (cell ``eager/alone``; the graphs change no greedy token)."""
        econf = EngineConfig(model=dataclasses.replace(self.model_cfg, compile=False), cache=self.cache)
        engine = build_engine(econf, model=self.target.model, tokenizer=self.target.tokenizer)
        cell = _compare(self.target, self.prompts, self.plain, _generate(engine, self.ids, self.cfg.max_tokens, False))
        self.entry["cells"]["eager/alone"] = cell
        return cell


def run_exactness_bench(cfg: ExactnessBenchConfig, row_invariant: bool = True, out_dir: Path | None = None,
                        progress: bool = True) -> dict[str, Any]:
    """Every path x cell of ``cfg``; writes ``results.json`` and ``table.md`` into ``out_dir``.
    ``row_invariant``: False runs the engine as before row invariance (``--no-row-invariant``)."""
    targets: dict[tuple[str, str], LoadedModel] = {}
    doc: dict[str, Any] = {"config": {**dataclasses.asdict(cfg), "row_invariant": row_invariant}, "paths": [],
                           "machine": machine_info("per path"), "command": command_line()}
    dtype, quant, _ = parse_path(cfg.path_list[0])  # the first path's target: its tokenizer, and loaded once
    first = target_model(dtype, quant, targets, cfg.model, cfg.device, cfg.layers)
    prompts = [p for w in cfg.workload_list for p in load_prompts(w, first.tokenizer, limit=cfg.limit)]
    bar = tqdm(total=len(cfg.path_list) * (2 + 2 * len(cfg.drafter_list)), desc="exactness", disable=not progress)
    for path in cfg.path_list:
        run = PathRun(cfg, path, prompts, targets, row_invariant)
        doc["paths"].append(run.entry)
        bar.update()
        run.plain_cells()
        bar.update()
        for name in cfg.drafter_list:
            run.drafter_cells(name)
            bar.update(2)
            if out_dir is not None:  # after every configuration: a run cut short keeps what it measured
                write_report(doc, out_dir)
    bar.close()
    if out_dir is not None:
        write_report(doc, out_dir)
    return doc


def exact(doc: dict[str, Any]) -> bool:
    """Whether every cell of every path was identical to plain decoding alone."""
    return all(c["identical"] == c["total"] for p in doc["paths"] for c in p["cells"].values())


def table(doc: dict[str, Any]) -> str:
    """Markdown: one row per path, one column per cell (identical/total; per-sequence cells: with the steps
    that verified more than one route), the row probe last."""
    cells = list(dict.fromkeys(c for p in doc["paths"] for c in p["cells"]))  # a cut-short path has fewer
    lines = ["| path | " + " | ".join(cells) + " | rows bit-identical (probe) |",
             "|---|" + "---:|" * (len(cells) + 1)]
    for p in doc["paths"]:
        vals = []
        for c in cells:
            cell = p["cells"].get(c)
            if cell is None:
                vals.append("-")
                continue
            text = f"{cell['identical']}/{cell['total']}"
            text = text if cell["identical"] == cell["total"] else f"**{text}**"
            mixed = cell.get("routes", {}).get("mixed_steps")
            vals.append(text if mixed is None else f"{text} ({mixed:.0f} mixed steps)")
        probe = p["row_probe"]
        vals.append(f"{probe['identical']}/{probe['rows']}")
        lines.append(f"| {p['path']} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def write_report(doc: dict[str, Any], out_dir: Path) -> None:
    """``results.json`` (every cell, every divergence) and ``table.md`` (command, machine, table)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1))
    c = doc["config"]
    setting = (f"row invariance: {'on' if c['row_invariant'] else 'off (--no-row-invariant)'}; {c['limit']} prompts "
               f"per workload of {c['workloads']}, {c['max_tokens']} tokens, greedy, EOS ignored, gamma {c['gamma']}; "
               "each cell: outputs identical to the path's plain decoding of the prompt alone")
    if c.get("kv_cache_memory_mb"):
        preempted = sum(cell.get("preempted", 0) for p in doc["paths"] for cell in p["cells"].values())
        setting += f"; drafter cells in a {c['kv_cache_memory_mb']} MiB KV cache: {preempted} preemptions in all"
    head = [f"`{doc.get('command', '')}`", "", machine_line(doc["machine"]), "", setting, ""]
    (out_dir / "table.md").write_text("\n".join(head) + table(doc) + "\n")
