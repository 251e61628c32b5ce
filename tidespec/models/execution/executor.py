"""``ForwardExecutor``: how one target forward runs — a CUDA graph, else the compiled step, else eager.

Why this exists: the engine and the start-up profiler must run the same forward, or the profiler
prices speculation on a forward the engine never runs (a hand-kept copy of this dispatch once
did). The executor owns everything a forward depends on: the target's kernels made row-invariant
or not, the KV cache laid out for them (transposed keys for the exact attention kernel, a spare
slot that padded graph rows write into, a margin for the compiled step's bucketed lengths), and
the compiled step or the captured graphs. The engine's runner lays a batch out and calls it; the
profiler builds one with the same ``ExecutorOptions`` and times its calls; ``key()`` names what it
runs (with a digest of the kernel code), and the profile cache is keyed by it.

Dispatch, per forward:

- CUDA graphs (on a GPU unless ``enforce_eager``): every batch of chains, trees and prompt chunks
  that fits a block (with row invariance on, of one fixed shape per batch size: ``models/execution/graphs.py``);
- else the compiled step (``compile``): every forward of a row-invariant target, else the decode
  batches of chains (every row needs logits);
- else the eager model.

Worked example::

    ex = ForwardExecutor(model, ExecutorOptions(compile=True), max_num_seqs=4, max_len=512, rows_per_seq=5)
    out = ex([5, 9], q_lens=[1, 1], ctx_lens=[10, 3], slots=[0, 1], logits_rows=[0, 1])  # the compiled step
    ex.key()["executor"]   # "compiled-every-forward" on a row-invariant CPU target, else "compiled"
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tidespec.config import ModelConfig
from tidespec.errors import check_at_least
from tidespec.models.execution.compiled import KV_MARGIN, CompiledStep, inductor_cache_dir
from tidespec.models.execution.graphs import FIXED_ROWS, GraphStep, uses_graphs
from tidespec.models.execution.invariance import (
    FIXED_SHAPE,
    ROW_ATTENTION,
    InvarianceReport,
    clear_row_invariance,
    make_row_invariant,
)
from tidespec.models.target import ModelConfigError, TargetConfig, TargetModel
from tidespec.models.kernels import row_attention
from tidespec.models.kernels.ops import HEADERS, SOURCES, exact_attention_error
from tidespec.models.kv.cache import KVCache
from tidespec.models.kv.paged import kernel_block_size, paged_kv_cache
from tidespec.models.layout import BatchLayout, ModelOutput

log = logging.getLogger(__name__)

# the code a forward's cost depends on: a change to any of it makes cached costs stale
# (paths under tidespec/models)
KERNEL_SOURCES = ("families/decoder.py", "families/attention.py", "families/mlp.py", "families/moe.py",
                  "families/norms.py", "families/rope.py", "kernels/linear.py", "kernels/ops.py", "kernels/attention.py",
                  "quant/quantize.py", "quant/base.py", "quant/a8.py", "quant/gguf_blocks.py", "execution/invariance.py",
                  "execution/compiled.py", "execution/graphs.py", "kv/cache.py", "kernels/rows.py", "execution/executor.py",
                  "kernels/row_attention.py") + tuple(  # the C++ sources and headers the kernel library builds from
    f"kernels/csrc/{path.name}" for path in SOURCES + HEADERS)


def check_compilable(cfg: TargetConfig, graphed: bool, compiled: bool) -> None:
    """The CUDA graphs build one attention mask for every layer (and their row kernel assumes the
    default softmax scale and no cap); the graphs and the compiled step take no data-dependent shape.
    A model whose layers attend over different windows (Gemma 2/3's sliding and global layers) runs
    compiled (one mask per window) or eager, one that routes rows to experts (``families/moe.py``)
    eager: said here rather than computed otherwise."""
    what = "CUDA graphs" if graphed else "--compile"
    fix = "--enforce-eager" if graphed else "without --compile"
    if graphed and not cfg.uniform_attention:
        raise ModelConfigError(f"{cfg.architecture}: {what} do not yet run layers with different sliding "
                               f"windows; run {fix}")
    if (graphed or compiled) and cfg.num_experts:
        raise ModelConfigError(f"{cfg.architecture}: {what} does not yet run a mixture of experts; run {fix}")
    if graphed and (cfg.attention_scale is not None or cfg.attn_logit_softcap is not None or cfg.attention_sinks):
        raise ModelConfigError(f"{cfg.architecture}: CUDA graphs do not yet take a non-default attention "
                               "scale, soft cap or sinks; run --enforce-eager")


@dataclass(frozen=True)
class ExecutorOptions:
    """How forwards run: ``--compile``, ``--enforce-eager``, ``--row-invariant``, and ``budget``, the
    most rows one forward holds (the engine's token budget: row invariance holds up to it, and the
    graphs take prompt chunks up to it)."""

    compile: bool = False
    enforce_eager: bool = False
    row_invariant: bool = True
    budget: int = 512
    cuda_invariance: str = "fixed-shape"  # "row-attention": the fixed-order attention kernel instead

    def __post_init__(self) -> None:
        check_at_least(1, budget=self.budget)

    @classmethod
    def of(cls, mc: ModelConfig, budget: int) -> ExecutorOptions:
        """The options an engine with model section ``mc`` and token budget ``budget`` runs with."""
        return cls(compile=mc.compile, enforce_eager=mc.enforce_eager, row_invariant=mc.row_invariant, budget=budget,
                   cuda_invariance=mc.cuda_invariance)


def kernel_digest() -> str:
    """A digest of the kernel code (``KERNEL_SOURCES``): 12 hex characters."""
    root = Path(__file__).parent.parent
    h = hashlib.sha256()
    for name in KERNEL_SOURCES:
        h.update(name.encode())
        h.update((root / name).read_bytes())
    return h.hexdigest()[:12]


def prepare_target(model: TargetModel, options: ExecutorOptions) -> InvarianceReport:
    """Row-invariant kernels for the target (``models/execution/invariance.py``) on the CPU unless turned off;
    the outcome is logged, and it is a warning when it is not exact. Measurements are cached per
    machine, so preparing a target again costs little."""
    budget = options.budget
    if model.device.type != "cpu":
        clear_row_invariance(model)
        if not options.row_invariant:
            report = InvarianceReport(budget, "turned off (--no-row-invariant)")
        elif uses_graphs(model.device, options.enforce_eager) and options.cuda_invariance == "row-attention":
            report = InvarianceReport(budget, ROW_ATTENTION if row_attention.available() else
                                      "--cuda-invariance row-attention needs Triton, which is not installed")
        elif uses_graphs(model.device, options.enforce_eager):
            report = InvarianceReport(budget, FIXED_SHAPE)
        else:
            report = InvarianceReport(budget, f"eager {model.device.type} forwards (--enforce-eager) choose kernels "
                                              f"by row count")
    elif not options.row_invariant:
        report = InvarianceReport(budget, "turned off (--no-row-invariant)")
        clear_row_invariance(model)
    else:
        report = make_row_invariant(model, budget)
    (log.info if report.exact else log.warning)("%s", report.summary())
    return report


def exact_attention(model: TargetModel, options: ExecutorOptions) -> bool:
    """Whether attention runs tidespec's row-invariant kernel (over transposed keys)."""
    return model.device.type == "cpu" and options.row_invariant and exact_attention_error() is None


def execution_mode(model: TargetModel, options: ExecutorOptions) -> str:
    """What runs a decode batch: "graphs", "graphs+compiled", "compiled-every-forward", "compiled" or "eager"."""
    if uses_graphs(model.device, options.enforce_eager):
        return "graphs+compiled" if options.compile else "graphs"
    if options.compile:
        return "compiled-every-forward" if exact_attention(model, options) else "compiled"
    return "eager"


def executor_key(model: TargetModel, options: ExecutorOptions, report: InvarianceReport) -> dict[str, str]:
    """What a forward's cost depends on, as strings (the profile cache key reads them): the mode,
    the row-invariant kernels chosen and a digest of the kernel code. Cheap: builds no executor.

    Example: an eager float32 target on a CPU -> ``{"executor": "eager", "row_invariance":
    "row invariance: exact (up to 512 rows a forward): ...", "kernels": "3f1c0a9e2b7d"}``.
    """
    return {"executor": execution_mode(model, options), "row_invariance": report.summary(), "kernels": kernel_digest()}


class ForwardExecutor:
    """Runs target forwards over its own KV cache the way serving runs them (module docstring)."""

    def __init__(self, model: TargetModel, options: ExecutorOptions, max_num_seqs: int, max_len: int,
                 tap_layers: tuple[int, ...] = (), rows_per_seq: int = 1, overcommit: bool = False,
                 kv_memory: int = 0, block_size: int = 16) -> None:
        """``max_len``: the longest sequence a slot holds; ``rows_per_seq``: the most rows a decode
        sequence brings (1 + gamma), which the graphs are captured for and the compiled step warmed
        up with; ``tap_layers``: the taps the graphs and the compiled step return. A row-invariant
        CPU target gets a paged cache (``models/kv/paged.py``) of ``kv_memory`` bytes (0: every
        slot's full length, within the memory available) in blocks of ``block_size`` (rounded up
        to the kernel's multiple); every other target a slot of ``max_len`` per sequence."""
        self.model = model
        self.options = options
        self.device = model.device
        self.graphed = uses_graphs(self.device, options.enforce_eager)
        check_compilable(model.cfg, self.graphed, options.compile)
        exact = exact_attention(model, options)
        margin = KV_MARGIN if options.compile and not self.graphed else 0
        self.kv: KVCache  # first: a cache that does not fit fails at once, not after the kernels were measured
        if exact and not self.graphed:
            self.kv = paged_kv_cache(model.cfg, max_num_seqs, max_len + margin, model.dtype,
                                     kernel_block_size(block_size), kv_memory, overcommit)
        else:
            self.kv = KVCache.for_model(model.cfg, max_num_seqs, max_len + margin, model.dtype, self.device,
                                        spare_slot=self.graphed, transposed_keys=exact, overcommit=overcommit)
        self.invariance = prepare_target(model, options)
        self.compiled: CompiledStep | None = None
        self.graphs: GraphStep | None = None
        self.warm_up_seconds = 0.0  # compiling the step or capturing the graphs, once here
        if self.graphed:
            fixed = self.invariance.attention == FIXED_SHAPE
            if fixed and rows_per_seq > FIXED_ROWS:
                log.warning("row invariance on %s holds for 1 + gamma <= %d rows a sequence; %d rows verify in "
                            "another block than a decode step", self.device.type, FIXED_ROWS, rows_per_seq)
            self.graphs = GraphStep(model, self.kv, tap_layers, rows_per_seq, capture=self.device.type == "cuda",
                                    compile=options.compile, prompt_rows=options.budget, fixed_shape=fixed,
                                    row_kernel=self.invariance.attention == ROW_ATTENTION)
            self.warm_up_seconds = self.graphs.warm_up()
            log.info("captured %d CUDA graphs in %.1f s", len(self.graphs.graphs), self.warm_up_seconds)
        elif options.compile:
            self.compiled = CompiledStep(model, self.kv, tap_layers)
            self.warm_up_seconds = self.compiled.warm_up(rows_per_seq)
            log.info("compiled the decode step in %.1f s (cached in %s)", self.warm_up_seconds, inductor_cache_dir())

    def key(self) -> dict[str, str]:
        """``executor_key`` of this executor."""
        return executor_key(self.model, self.options, self.invariance)

    def __call__(self, tokens: list[int], q_lens: list[int], ctx_lens: list[int], slots: list[int],
                 logits_rows: list[int], depths: list[list[int] | None] | None = None,
                 masks: list[torch.Tensor | None] | None = None, tap_layers: tuple[int, ...] = (),
                 prefill: bool = False) -> ModelOutput:
        """ONE forward: ``tokens`` [T] flattened, ``q_lens`` / ``ctx_lens`` / ``slots`` per sequence,
        logits at ``logits_rows`` [R]; ``depths`` / ``masks`` per sequence for trees (None = chains);
        ``prefill``: the batch holds prompt chunks. K/V of every row is written into its slot."""
        n = len(q_lens)
        depths = depths if depths is not None else [None] * n
        masks = masks if masks is not None else [None] * n
        no_trees = all(m is None for m in masks)
        out = None
        if self.graphs is not None:
            out = self.graphs(tokens, q_lens, ctx_lens, slots, tap_layers, logits_rows if prefill else None,
                              None if no_trees else depths, None if no_trees else masks)
        if out is None:
            layout = BatchLayout.build(q_lens, ctx_lens, slots, depths, masks, device=self.device)
            ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)  # [T]
            rows = torch.tensor(logits_rows, dtype=torch.int64, device=self.device)  # [R]
            if self.compiled is not None and self.compiled.exact:  # every forward: models/execution/compiled.py
                out = self.compiled(ids, layout, tap_layers, rows)
            elif self.compiled is not None and not prefill and no_trees:
                out = self.compiled(ids, layout, tap_layers)
            if out is None:
                out = self.model(ids, layout, self.kv, logits_rows=rows, tap_layers=tap_layers)
        return out
