"""``tidespec bench profile``: the cost model speculation lives on — T(n) per batch size, memory
bandwidth, and the bandwidth-bound ceiling of batch-1 decoding.

Why this exists: speculative decoding pays off only while verifying n tokens costs about as
much as decoding one, i.e. while T(n)/T(1) stays near 1. That ratio depends on the machine
(memory bandwidth vs compute) and on the batch size, so the adaptive controllers and the
benchmark write-up need it measured, not assumed. The bandwidth ceiling says how far plain
batch-1 decoding is from the hardware limit (every weight byte read once per token).

Method. T(n, B) = wall time of one target forward of n new tokens for each of B sequences on a
``context``-token KV cache (default 200), logits for every new row (as verification needs), over a
cache whose context is filled with random values (the contents do not change the cost). On a CPU
the forwards are serving's (``ForwardExecutor``: the row-invariant kernels over a paged cache, the
compiled step with ``--compile``); on a GPU, or with ``--no-row-invariant``, ``TargetModel.forward``
and the CUDA graphs / compiled step over one slot per sequence. One warm-up forward per shape, then
``repeats`` timed forwards — fewer on big shapes, so each shape costs about ``target_s`` — and
the median is kept. Bandwidth = 2 x bytes / time of a large ``Tensor.copy_`` (read + write),
median of 5 after a warm-up. Ceiling (tokens/s) = bandwidth / bytes read per batch-1 token,
where bytes = the weights (each unique matrix once; an untied input embedding table is not
read, only one row) + the K/V of a ``context``-token cache.

Worked example (numbers illustrative)::

    doc = run_profile(ProfileConfig(ns=(1, 4), batch_sizes=(1, 2)), resolve_target(None))
    doc["bandwidth_gb_s"]          # e.g. 9.8
    doc["ceiling_tokens_per_s"]    # e.g. 9.8e9 / 0.55e9 = 17.8
    doc["rows"][1]                 # {"batch_size": 1, "n": 4, "t_ms": 61.0, "ratio_to_n1": 1.3, ...}
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tidespec.bench.common.report import (
    log2_panel,
    machine_line,
    markdown_table,
    new_figure,
    save_figure,
    write_results,
)
from tidespec.bench.decode.run import resolve_target
from tidespec.config import ConfigError, ModelConfig
from tidespec.errors import check_at_least
from tidespec.models.execution.compiled import KV_MARGIN, CompiledStep
from tidespec.models.execution.executor import ExecutorOptions, ForwardExecutor, exact_attention
from tidespec.models.execution.graphs import GraphStep, uses_graphs
from tidespec.models.kernels.linear import tune_linears, untuned
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.models.loading.loader import LoadedModel
from tidespec.models.quant.quantize import quantization_of
from tidespec.models.target import TargetModel
from tidespec.speculative.policy.profiler import Forward, executor_forward, time_forward
from tidespec.speculative.policy.profiler import sync_device as _sync


@dataclass
class ProfileConfig:
    ns: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    context: int = 200
    repeats: int = 5  # most timed forwards per shape
    target_s: float = 0.4  # timed seconds aimed at per shape (fewer repeats on big shapes)
    bandwidth_mib: int = 256  # size of each buffer of the copy test
    seed: int = 0
    compare_untuned: bool = False  # also time each shape with F.linear for every projection, right after

    def __post_init__(self) -> None:
        if not self.ns or any(n < 1 for n in self.ns):
            raise ConfigError(f"ns must be >= 1, got {self.ns}")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ConfigError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        check_at_least(1, context=self.context, repeats=self.repeats)
        if self.target_s <= 0:
            raise ConfigError(f"target_s must be > 0, got {self.target_s}")
        check_at_least(1, bandwidth_mib=self.bandwidth_mib)


def weight_bytes_per_token(model: TargetModel) -> int:
    """Bytes of parameters one batch-1 decode step reads: every unique parameter once, except an
    untied input-embedding table, of which only one row is read.

    Example: tied SmolLM2-135M in float32: all ~134.5M parameters x 4 B ~ 538 MB.
    """
    unique = {id(p): p for p in [*model.parameters(), *model.buffers()]}  # buffers: quantized weights, scales
    total = sum(p.numel() * p.element_size() for p in unique.values())
    emb = model.embed_tokens.weight
    if getattr(model.lm_head, "weight", None) is not emb:  # untied, or a quantized head (its own copy)
        total -= emb.numel() * emb.element_size() - emb.shape[1] * emb.element_size()
    return total


def kv_bytes_per_token(model: TargetModel, context: int) -> int:
    """Bytes of K and V read by one decode step over a ``context``-token cache."""
    c = model.cfg
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * context * model.embed_tokens.weight.element_size()


def memory_bandwidth(mib: int = 256, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """GB/s of a large tensor copy on ``device`` (read + write counted), median of ``repeats``
    after a warm-up."""
    dev = torch.device(device)
    n = mib * 1024 * 1024 // 4
    src = torch.ones(n, dtype=torch.float32, device=dev)  # touched, so pages are committed
    dst = torch.zeros(n, dtype=torch.float32, device=dev)
    dst.copy_(src)
    _sync(dev)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        times.append(time.perf_counter() - t)
    return 2 * n * 4 / statistics.median(times) / 1e9


def run_profile(cfg: ProfileConfig, target: LoadedModel | TargetModel | str | None = None, *,
                model_config: ModelConfig | None = None, out_dir: Path | None = None, command: str = "",
                echo: bool = True) -> dict[str, Any]:
    """Measure T(n) over the grid plus bandwidth; write ``results.json``, ``plot.png``,
    ``table.md`` into ``out_dir`` (default ``runs/bench-profile-<timestamp>``); return the JSON."""
    mc = model_config or ModelConfig()
    if mc.threads:
        torch.set_num_threads(mc.threads)
    if isinstance(target, torch.nn.Module):  # a TargetModel already built
        model, name = target, type(target).__name__
    else:
        loaded = resolve_target(target if target is not None else mc.model, mc.dtype, mc.device, mc.quantization,
                                mc.quant_group_size)
        model, name = loaded.model, loaded.path or type(loaded.model).__name__
        tune_linears(model)  # its eager forwards: the fastest kernel per row count (CPU; measured once per machine)
    if cfg.context + max(cfg.ns) > model.cfg.max_position_embeddings:
        raise ConfigError(f"context + largest n ({cfg.context + max(cfg.ns)}) exceeds the model's context "
                          f"({model.cfg.max_position_embeddings})")
    gen = torch.Generator().manual_seed(cfg.seed)
    graphs = uses_graphs(model.device, mc.enforce_eager)
    max_len = cfg.context + max(cfg.ns) + 1
    budget = max(ExecutorOptions().budget, max(cfg.batch_sizes) * max(cfg.ns))
    invariant = ExecutorOptions(row_invariant=mc.row_invariant, budget=budget)
    step: CompiledStep | GraphStep | ForwardExecutor | None = None
    compile_s = 0.0
    if exact_attention(model, invariant) and not graphs:
        if cfg.compare_untuned:
            raise ConfigError("--compare-untuned times the kernels measured per row count, which run only without "
                              "row invariance: add --no-row-invariant")
        # what serving runs on a CPU: the row-invariant kernels over a paged cache (models/execution/executor.py),
        # eager and, with --compile, the compiled step every forward goes through
        executors = [ForwardExecutor(model, invariant, max(cfg.batch_sizes), max_len, rows_per_seq=max(cfg.ns))]
        if mc.compile:
            executors.append(ForwardExecutor(model, dataclasses.replace(invariant, compile=True), max(cfg.batch_sizes),
                                             max_len, rows_per_seq=max(cfg.ns)))
            step, compile_s = executors[1], executors[1].warm_up_seconds
        for ex in executors:  # the pool's blocks are handed out as the forwards write
            _random_kv(ex.kv, gen)
        eager = executor_forward(executors[0])
        stepped = executor_forward(executors[-1])
        forwards = "serving's: row-invariant kernels over a paged cache"
    else:
        eager, stepped, step, compile_s = _unpaged_forwards(model, cfg, mc, graphs, gen)
        forwards = "one cache slot per sequence" + ("" if model.device.type != "cpu" else " (no row invariance)")

    def timed(forward: Forward, b: int, n: int) -> tuple[float, int]:
        return time_forward(forward, model.device, model.cfg.vocab_size, b, n, cfg.context, cfg.repeats,
                            cfg.target_s, gen)

    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for b in cfg.batch_sizes:
        t1 = c1 = None
        for n in sorted(cfg.ns):
            t, reps = timed(eager, b, n)
            t1 = t if n == min(cfg.ns) else t1
            row = {"batch_size": b, "n": n, "t_ms": t * 1e3, "repeats": reps,
                   "ratio_to_n1": t / t1 if t1 else float("nan"), "tokens_per_s": b * n / t}
            if step is not None:
                c, _ = timed(stepped, b, n)
                c1 = c if n == min(cfg.ns) else c1
                row.update(t_compiled_ms=c * 1e3, compiled_ratio_to_n1=c / c1 if c1 else float("nan"),
                           compiled_speedup=t / c)
            if cfg.compare_untuned:
                with untuned(model):
                    u, _ = timed(eager, b, n)
                row.update(t_untuned_ms=u * 1e3, kernel_speedup=u / t)
            rows.append(row)
    grid_s = time.perf_counter() - t_start
    bw = memory_bandwidth(cfg.bandwidth_mib, device=model.device)
    wbytes = weight_bytes_per_token(model)
    kvbytes = kv_bytes_per_token(model, cfg.context)
    ceiling = bw * 1e9 / (wbytes + kvbytes)
    b1 = [r for r in rows if r["batch_size"] == 1 and r["n"] == 1]
    measured = 1e3 / b1[0]["t_ms"] if b1 else float("nan")
    doc = {
        "model": name,
        "config": dataclasses.asdict(cfg),
        "rows": rows,
        "forwards": forwards,
        "grid_seconds": grid_s,
        "bandwidth_gb_s": bw,
        "weight_bytes_per_token": wbytes,
        "kv_bytes_per_token": kvbytes,
        "ceiling_tokens_per_s": ceiling,
        "ceiling_weights_only_tokens_per_s": bw * 1e9 / wbytes,
        "batch1_forward_tokens_per_s": measured,
        "batch1_fraction_of_ceiling": measured / ceiling,
    }
    if step is not None and b1:
        doc.update(step="CUDA graphs" if graphs else "compiled", compile_seconds=compile_s, batch1_compiled_tokens_per_s=1e3 / b1[0]["t_compiled_ms"],
                   batch1_compiled_fraction_of_ceiling=1e3 / b1[0]["t_compiled_ms"] / ceiling)
    precision, quant = str(model.dtype).replace("torch.", ""), quantization_of(model)
    if quant != "none":
        precision += f" + {quant} weights"
    return write_results("profile", doc, out_dir, command, precision,
                         format_profile_report, lambda out: _plot_profile(rows, cfg, out), echo)


def _random_kv(kv: KVCache, gen: torch.Generator) -> None:
    """Plausible K/V values everywhere in ``kv`` (attention's cost does not depend on them)."""
    fill_gen = gen if kv.k[0].device.type == "cpu" else None  # a CPU generator cannot fill device tensors
    for k, v in zip(kv.k, kv.v):
        k.normal_(generator=fill_gen)
        v.normal_(generator=fill_gen)


def _unpaged_forwards(model: TargetModel, cfg: ProfileConfig, mc: ModelConfig, graphs: bool, gen: torch.Generator
                      ) -> tuple[Forward, Forward, CompiledStep | GraphStep | None, float]:
    """The eager and the stepped forward over a cache of one slot per sequence: a GPU's (its CUDA graphs) and
    a CPU's without row invariance (``--no-row-invariant``); the step (None without one) and its warm-up seconds."""
    kv = KVCache.for_model(model.cfg, num_slots=max(cfg.batch_sizes), max_len=cfg.context + max(cfg.ns) + KV_MARGIN,
                           dtype=model.dtype, device=model.device, spare_slot=graphs)
    _random_kv(kv, gen)
    step: CompiledStep | GraphStep | None = None
    compile_s = 0.0
    if graphs:  # on a GPU what decode steps run: the CUDA graphs (each captured by its shape's untimed warm-up)
        t0 = time.perf_counter()
        step = GraphStep(model, kv, (), max(cfg.ns), capture=model.device.type == "cuda", compile=mc.compile)
        compile_s = time.perf_counter() - t0
    elif mc.compile:  # the compiled decode step, timed right after the eager forward of each shape
        t0 = time.perf_counter()
        step = CompiledStep(model, kv)
        step.warm_up(max(cfg.ns))
        compile_s = time.perf_counter() - t0

    def eager(tokens: list[int], q_lens: list[int], ctx_lens: list[int], slots: list[int]) -> object:
        layout = BatchLayout.build(q_lens=q_lens, ctx_lens=ctx_lens, slots=slots, device=model.device)
        return model(torch.tensor(tokens, device=model.device), layout, kv, logits_rows=None)

    def stepped(tokens: list[int], q_lens: list[int], ctx_lens: list[int], slots: list[int]) -> object:
        """The compiled step or the CUDA graphs where they take the shape, else eager."""
        if isinstance(step, GraphStep):
            out = step(tokens, q_lens, ctx_lens, slots)
        else:
            layout = BatchLayout.build(q_lens=q_lens, ctx_lens=ctx_lens, slots=slots, device=model.device)
            out = step(torch.tensor(tokens, device=model.device), layout) if step is not None else None
        return out if out is not None else eager(tokens, q_lens, ctx_lens, slots)

    return eager, stepped, step, compile_s


def format_profile_report(doc: dict[str, Any], command: str, info: dict[str, Any]) -> str:
    cfg = doc["config"]
    bs = list(cfg["batch_sizes"])
    ns = sorted(cfg["ns"])
    cell = {(r["batch_size"], r["n"]): r for r in doc["rows"]}
    t_table = markdown_table(["n"] + [f"B={b} ms" for b in bs],
                             [[n] + [cell[(b, n)]["t_ms"] for b in bs] for n in ns], digits=1)
    r_table = markdown_table(["n"] + [f"B={b}" for b in bs],
                             [[n] + [cell[(b, n)]["ratio_to_n1"] for b in bs] for n in ns], digits=2)
    lines = [f"### T(n): one target forward of n new tokens per sequence on a {cfg['context']}-token cache", "",
             f"Command: `{command}`", "", f"Machine: {machine_line(info)}", "",
             f"Forwards: {doc.get('forwards', 'one cache slot per sequence')}", "",
             "Median wall time per forward (ms):", "", t_table, "", "T(n) / T(1):", "", r_table, "",
             f"- memory bandwidth (tensor copy, read + write): {doc['bandwidth_gb_s']:.1f} GB/s",
             f"- bytes per batch-1 token: weights {doc['weight_bytes_per_token'] / 1e6:.1f} MB + KV at "
             f"{cfg['context']} tokens {doc['kv_bytes_per_token'] / 1e6:.1f} MB",
             f"- bandwidth-bound ceiling, batch-1 decode: {doc['ceiling_tokens_per_s']:.1f} tokens/s "
             f"(weights only: {doc['ceiling_weights_only_tokens_per_s']:.1f})",
             f"- measured batch-1 forward 1/T(1): {doc['batch1_forward_tokens_per_s']:.1f} tokens/s = "
             f"{doc['batch1_fraction_of_ceiling']:.0%} of the ceiling (engine overhead not included)"]
    if "t_compiled_ms" in doc["rows"][0]:
        c_table = markdown_table(["n"] + [f"B={b} ms" for b in bs] + [f"B={b} eager/compiled" for b in bs],
                                 [[n] + [cell[(b, n)]["t_compiled_ms"] for b in bs]
                                  + [cell[(b, n)]["compiled_speedup"] for b in bs] for n in ns], digits=2)
        what = ("CUDA graphs (each captured at its shape's first forward" if doc.get("step") == "CUDA graphs"
                else f"Compiled decode step (`--compile`; warm-up {doc['compile_seconds']:.1f} s")
        lines += ["", f"{what}; each shape timed right after its eager forward):", "", c_table, "",
                  f"- {doc.get('step', 'compiled')} batch-1 forward: {doc['batch1_compiled_tokens_per_s']:.1f} tokens/s = "
                  f"{doc['batch1_compiled_fraction_of_ceiling']:.0%} of the ceiling"]
    if "t_untuned_ms" in doc["rows"][0]:
        u_table = markdown_table(["n"] + [f"B={b} ms" for b in bs] + [f"B={b} F.linear/tuned" for b in bs],
                                 [[n] + [cell[(b, n)]["t_untuned_ms"] for b in bs]
                                  + [cell[(b, n)]["kernel_speedup"] for b in bs] for n in ns], digits=2)
        lines += ["", "Every projection on `F.linear` instead of the kernels measured per row count "
                      "(`--compare-untuned`; each shape timed right after the tuned forward):", "", u_table]
    return "\n".join(lines)


def _plot_profile(rows: list[dict[str, Any]], cfg: ProfileConfig, out_dir: Path) -> Path:
    fig, (ax, ax2) = new_figure(2)
    for b in cfg.batch_sizes:
        rs = sorted((r for r in rows if r["batch_size"] == b), key=lambda r: r["n"])
        ax.plot([r["n"] for r in rs], [r["ratio_to_n1"] for r in rs], "o-", label=f"B={b}")
        ax2.plot([r["n"] for r in rs], [r["tokens_per_s"] for r in rs], "o-", label=f"B={b}")
    ns = sorted(cfg.ns)
    log2_panel(ax, ns, "new tokens per sequence n", "T(n) / T(1)", f"Forward cost vs n ({cfg.context}-token cache)")
    log2_panel(ax2, ns, "new tokens per sequence n", "tokens processed / s", "Forward throughput", log_y=True)
    return save_figure(fig, out_dir, "plot.png")
