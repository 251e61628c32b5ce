"""``tidespec bench invariance-cost``: what the row-invariant kernels cost plain decoding, per path.

Why this exists: exactness (``models/execution/invariance.py``) must not cost speed, and the machines we
measure on are shared: the same engine's tok/s moves by 20-40 % between two runs a few minutes
apart (memory bandwidth taken by neighbours), so two benchmark runs, one per engine, cannot show a
5 % difference. Here both engines live in one process, each on its own copy of the target (own
weights, own KV cache): one with row invariance (the default), one with ``--no-row-invariant``
(SDPA and the fastest kernel per row count, what the engine ran before), and they decode the same
prompts **step by step in alternation** (A B, B A, ...), so a burst of load hits both. Only the
decode steps are timed (prefill runs first, untimed); the figure is the ratio of the total decode
time per step, off / on (above 1: the invariant path is faster). With ``--projection-rows`` it also
times each kernel the engine may choose for its float projections (``Linear.invariant_kernels``, and
the per-row-count plan it runs without row invariance) through the target's projections at those
row counts (``models/invariance.time_kernels``): why a path is as fast as it is.

Worked example::

    cfg = InvarianceCostConfig(paths="float32,bfloat16", batch_sizes="1,16", max_tokens=64)
    doc = run_invariance_cost(cfg)
    doc["rows"][0]   # {"path": "float32", "batch": 1, "ms_off": 41.8, "ms_on": 41.6, "speed_on_vs_off": 1.005, ...}
    # with projection_rows="1,16": doc["projections"]["bfloat16"] == {"exact": {"1": 9.4, "16": 16.4}, ...} (ms)
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tidespec.bench.common.report import command_line, machine_info, machine_line
from tidespec.bench.decode.run import parse_int_list
from tidespec.bench.exactness.run import parse_path, target_model
from tidespec.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, opt
from tidespec.engine.engine import LLMEngine
from tidespec.llm import build_engine
from tidespec.models.execution.invariance import time_kernels
from tidespec.models.kernels.linear import Linear, tune_linears
from tidespec.models.loading.loader import LoadedModel
from tidespec.sampling import SamplingParams
from tidespec.workloads.loader import load_prompts


@dataclass
class InvarianceCostConfig:
    paths: str = opt("float32,bfloat16,int8,int4,int4+compile", "comma-separated target paths: "
                     "[float32|bfloat16+][int8|int4|w4a8|w8a8|gguf][+compile]")
    batch_sizes: str = opt("1,16", "comma-separated numbers of sequences decoding together")
    workload: str = opt("code", "prompts (a built-in workload or a JSONL path)")
    max_tokens: int = opt(64, "tokens decoded per request (EOS ignored)", min=2)
    rounds: int = opt(2, "rounds per path and batch size, each on the next prompts", min=1)
    threads: int = opt(2, "intra-op threads", min=1)
    projection_rows: str = opt("", "also time every projection kernel through the target's projections at these "
                               "comma-separated row counts, e.g. 1,5,16,64,256 (float paths; empty: not)")
    model: str | None = opt(None, "target: HF checkpoint directory or .gguf file (default: the embedded SmolLM2-135M)")

    def __post_init__(self) -> None:
        for p in self.path_list:
            parse_path(p)
        parse_int_list(self.batch_sizes, "--batch-sizes")
        if self.projection_rows:
            parse_int_list(self.projection_rows, "--projection-rows")

    @property
    def path_list(self) -> list[str]:
        return [p.strip() for p in self.paths.split(",") if p.strip()]

    @property
    def batch_list(self) -> tuple[int, ...]:
        return parse_int_list(self.batch_sizes, "--batch-sizes")

    @property
    def projection_row_list(self) -> tuple[int, ...]:
        return parse_int_list(self.projection_rows, "--projection-rows") if self.projection_rows else ()


PLAN = "plan"  # the report's name for the per-row-count kernels of ``tune_linears`` (``set_invariant("")``)


def time_projections(target: LoadedModel, rows: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """ms through every CPU ``Linear`` of the target per kernel and row count (``time_kernels``,
    best of 7), keys as strings for JSON; {} when it has none (a quantized target). The target's
    layers are left on the per-row-count plan."""
    layers = [m for m in target.model.modules() if isinstance(m, Linear) and m.weight.device.type == "cpu"]
    if not layers:
        return {}
    tune_linears(target.model)  # the plan ("") to time beside the invariant kernels (measured once per machine)
    kernels = [*layers[0].invariant_kernels(), ""]
    seconds = time_kernels(layers, kernels, rows, repeats=7)
    for layer in layers:
        layer.set_invariant("", 0)
        layer.set_packing("mkl" in layer.choice)
    return {kernel or PLAN: {str(n): 1e3 * t for n, t in per_rows.items()} for kernel, per_rows in seconds.items()}


def _engine(target: LoadedModel, dtype: str, quant: str, compile_: bool, row_invariant: bool, batch: int,
            threads: int) -> LLMEngine:
    cfg = EngineConfig(model=ModelConfig(dtype=dtype, quantization=quant, compile=compile_, row_invariant=row_invariant,
                                         threads=threads),
                       cache=CacheConfig(max_model_len=1024, max_num_seqs=batch), scheduler=SchedulerConfig())
    return build_engine(cfg, model=target.model, tokenizer=target.tokenizer)


def _decode_ab(engines: dict[bool, LLMEngine], prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int]:
    """Both engines get ``prompts``; prefill untimed; then decode steps alternate (A B, B A, ...)
    while both have work. Returns (seconds off, seconds on, steps each)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for eng in engines.values():
        for p in prompts:
            eng.add_request(p, params)
        while eng.scheduler.waiting or any(s.in_prefill for s in eng.scheduler.running):
            eng.step()
    spent = {False: 0.0, True: 0.0}
    order, steps = [False, True], 0
    while all(e.has_unfinished_requests() for e in engines.values()):
        for ri in order:
            t0 = time.perf_counter()
            engines[ri].step()
            spent[ri] += time.perf_counter() - t0
        order.reverse()
        steps += 1
    for eng in engines.values():
        while eng.has_unfinished_requests():
            eng.step()
    return spent[False], spent[True], steps


def run_invariance_cost(cfg: InvarianceCostConfig, out_dir: Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Every path x batch size: decode time per step with and without row invariance, interleaved."""
    torch.set_num_threads(cfg.threads)
    rows: list[dict[str, Any]] = []
    projections: dict[str, dict[str, dict[str, float]]] = {}
    doc = {"config": asdict(cfg), "command": command_line(), "machine": machine_info(), "rows": rows,
           "projections": projections}
    runs = [(p, b) for p in cfg.path_list for b in cfg.batch_list]
    bar = tqdm(total=len(runs) * cfg.rounds, desc="invariance cost", unit="round", disable=not progress)
    for path in cfg.path_list:
        dtype, quant, compile_ = parse_path(path)
        targets = {ri: target_model(dtype, quant, {}, cfg.model) for ri in (False, True)}  # a copy each: own weights
        if cfg.projection_row_list and quant == "none":
            projections[path] = time_projections(targets[False], cfg.projection_row_list)
        prompts = [p.token_ids for p in load_prompts(cfg.workload, targets[True].tokenizer)]
        for batch in cfg.batch_list:
            engines = {ri: _engine(targets[ri], dtype, quant, compile_, ri, batch, cfg.threads) for ri in (False, True)}
            off = on = 0.0
            steps = 0
            for r in range(cfg.rounds):
                chosen = [prompts[(r * batch + i) % len(prompts)] for i in range(batch)]
                s_off, s_on, n = _decode_ab(engines, chosen, cfg.max_tokens)
                off, on, steps = off + s_off, on + s_on, steps + n
                bar.update()
            rows.append({"path": path, "batch": batch, "steps": steps, "ms_off": 1e3 * off / steps,
                         "ms_on": 1e3 * on / steps, "speed_on_vs_off": off / on,
                         "exact": engines[True].invariance.exact})
            del engines
            bar.write(f"{path} batch {batch}: {rows[-1]['ms_off']:.1f} ms/step without row invariance, "
                      f"{rows[-1]['ms_on']:.1f} with: {rows[-1]['speed_on_vs_off']:.3f}x")
            if out_dir is not None:  # after every row: a long run cut short keeps what it measured
                _save(doc, out_dir, plot=False)
    bar.close()
    if out_dir is not None:
        _save(doc, out_dir, plot=True)
    return doc


def _save(doc: dict[str, Any], out_dir: Path, plot: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1))
    if plot and doc["rows"]:
        _plot(doc["rows"], out_dir / "plot.png")


def table(doc: dict[str, Any]) -> str:
    """The markdown report: one row per path and batch size."""
    lines = ["### What row invariance costs plain decoding (decode steps interleaved with --no-row-invariant)", "",
             f"Command: `{doc['command']}`", "", f"Machine: {machine_line(doc['machine'])}", "",
             "| path | batch | decode steps | ms/step, --no-row-invariant | ms/step, row-invariant | speed, invariant "
             "/ not | exact |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['path']} | {r['batch']} | {r['steps']} | {r['ms_off']:.1f} | {r['ms_on']:.1f} | "
                     f"{r['speed_on_vs_off']:.3f}x | {'yes' if r['exact'] else 'no'} |")
    for path, kernels in doc.get("projections", {}).items():
        counts = list(next(iter(kernels.values())))
        lines += ["", (f"{path}: ms through the target's projections, per kernel (best of 7, interleaved; "
                       f"\"{PLAN}\": the per-row-count kernels run without row invariance)"), "",
                  "| rows | " + " | ".join(kernels) + " |", "|---:|" + "---:|" * len(kernels)]
        lines += [f"| {n} | " + " | ".join(f"{kernels[k][n]:.1f}" for k in kernels) + " |" for n in counts]
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(rows) + 2), 3.5))
    labels = [f"{r['path']}\nbatch {r['batch']}" for r in rows]
    ax.bar(labels, [r["speed_on_vs_off"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(0.95, color="tab:red", lw=0.8, ls="--", label="-5 %")
    ax.set_ylabel("decode speed, invariant / not")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
