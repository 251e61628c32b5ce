"""The EAGLE-3 head's step compiled by inductor for a CPU (``--compile`` without CUDA graphs).

Why this exists: at one row the head's step (fuse, one decoder layer, the rows where drafting starts,
the draft-vocabulary output layer) is ~45 small ATen calls around six int8 matrix products, and on a
2-core CPU the calls' dispatch costs more than the products: 0.80 ms eager against 0.66 ms compiled
for the shipped head at one row (w8a8, warm, docs/benchmarks/drafters.md). The per-sequence hybrid
pays it in every step it routes to EAGLE-3 (a catch-up, then one step per further draft), so a
step of the head is what decides whether EAGLE-3 pays beside the suffix drafter at batch 1.
``HeadGraphs`` (``models/eagle3/graphs.py``) compiles the same body for CUDA graphs, over a padded
static block of slots x rows x key buckets: on a CPU that padding costs more than the compile saves
(docs/benchmarks/policies.md, 2026-12-06), so this step runs over the batch's own rows and key
range, laid out as the target's compiled step lays out its padded attention (``StepLayout``).

Shapes: ``dynamic=True``: a few graphs (one or several rows, one or several sequences) serve every
batch, draft position and context length. Guards on the head's modules are skipped, as the target's
compiled step skips them (``models/execution/compiled.py``): the head is an argument of the compiled
function, its weights are read from the module passed at each call, so a head swapped in by online
training runs through the same graphs as long as it has the same configuration and quantization
(``serves``); another one gets a step of its own. Drafts never change the output (the target
verifies each), and the compiled step's rounding differs from eager's by float32 reassociation only.

Worked example::

    step = CompiledHeadStep(head, kv)          # head: the drafting copy (e.g. w8a8), kv: its KVCache
    layout = BatchLayout.build([2, 1], [40, 17], [0, 2])
    found = step(head, taps, embeds, layout, last=torch.tensor([1, 2]))
    hidden, logits = found                     # [2, H] pre-norm outputs at rows 1 and 2, [2, Vd] logits
"""

from __future__ import annotations

import time

import torch

from tidespec.models.eagle3.head import Eagle3Config, Eagle3Head
from tidespec.models.execution.compiled import LO_BIAS, RECOMPILE_LIMIT, StepLayout, inductor_cache_dir, own_code
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout


class CompiledHeadStep:
    """The head's step over a ragged batch, compiled once per configuration; ``__call__`` returns None
    for a batch it does not take (slots far apart, the cache's full length): run the eager step then."""

    def __init__(self, head: Eagle3Head, kv: KVCache) -> None:
        inductor_cache_dir()
        self.cfg: Eagle3Config = head.cfg
        self.kind = _kind(head)
        self._fits = head  # the last head ``serves`` found to fit
        self.kv = kv
        self.window = head.cfg.layer_config().sliding_window
        self.num_compiled = 0  # steps run compiled
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "size_asserts": False}
        self._fn = torch.compile(own_code(self._body), dynamic=True, fullgraph=True, options=options)

    def serves(self, head: Eagle3Head, kv: KVCache) -> bool:
        """Whether ``head`` can run through these graphs: the same configuration and kind of layers
        (weights may differ: they are read at each call), over the same cache. Asked every proposal: the
        head last found to fit is remembered, so the layers are walked once per swap."""
        if kv is not self.kv:
            return False
        if head is not self._fits:
            if not self.fits(head):
                return False
            self._fits = head
        return True

    def fits(self, head: Eagle3Head) -> bool:
        """Whether ``head`` has the configuration and kind of layers these graphs were traced through."""
        return head.cfg == self.cfg and _kind(head) == self.kind

    def _body(self, head: Eagle3Head, taps: torch.Tensor | None, hidden: torch.Tensor | None,
              embeds: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
              write_offsets: torch.Tensor, q_index: torch.Tensor, mask: torch.Tensor, lo_biased: int,
              last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layout = StepLayout(positions, write_slots, write_offsets, q_index, (mask,), lo_biased, (self.window,))
        fused = head.fuse(taps) if taps is not None else hidden
        assert fused is not None
        out = head.run(fused, embeds, layout, self.kv.k, self.kv.v)  # [T, H]
        root = out.index_select(0, last)  # [J, H]
        return root, head.logits(root)

    def __call__(self, head: Eagle3Head, taps: torch.Tensor | None, embeds: torch.Tensor, layout: BatchLayout,
                 last: torch.Tensor, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The head over ``taps`` [T, 3H] (a catch-up; or ``hidden`` [T, H], a chain step's previous
        outputs) and ``embeds`` [T, H] at ``layout``'s positions, writing their K/V -> (pre-norm
        output [J, H], logits [J, Vd]) at rows ``last`` [J]; None when this batch takes the eager step."""
        plan = layout.attention_plan(self.window)
        if plan.gather is not None or plan.kv_len >= self.kv.max_len:
            return None
        self.kv.make_readable(plan.read_slots(layout.slots), plan.kv_len)
        with torch.inference_mode():
            found = self._fn(head, taps, hidden, embeds, layout.positions, layout.write_slots, layout.write_offsets,
                             plan.q_index, plan.mask, plan.lo + LO_BIAS, last)
        self.num_compiled += 1
        return found

    @torch.inference_mode()
    def warm_up(self, head: Eagle3Head, max_rows: int) -> float:
        """Compile (or load from inductor's cache) the graphs a proposal uses: catch-ups of one and
        ``max_rows`` rows, a chain step, on one and two sequences, in free slots. Returns seconds.
        In inference mode, as the drafter proposes: an inference tensor's dispatch keys differ, and
        graphs traced over ordinary tensors were traced again at the first proposals (0.4 s each)."""
        t0 = time.perf_counter()
        slots = self.kv.free_slots()[:2]
        h, tap = self.cfg.hidden_size, self.cfg.tap_size
        for batch in range(1, len(slots) + 1):
            # (rows, context): one row, several, and one row at position 0 (a context restarted after a hole: a
            # key length of 1, which dynamo specialises)
            for rows, ctx in ((1, 8), (max(2, max_rows), 8), (1, 0)):
                if ctx + rows >= self.kv.max_len:
                    continue
                n = batch * rows
                layout = BatchLayout.build([rows] * batch, [ctx] * batch, slots[:batch], device=head.device)
                last = torch.arange(rows - 1, n, rows, device=head.device)
                embeds = torch.zeros(n, h, dtype=head.dtype, device=head.device)
                self(head, torch.zeros(n, tap, dtype=head.dtype, device=head.device), embeds, layout, last)
                if rows == 1 and ctx:  # a chain step (its own tensors: dynamo guards on two inputs being one)
                    self(head, None, embeds, layout, last, hidden=torch.zeros_like(embeds))
        return time.perf_counter() - t0


class HeadSteps:
    """The compiled steps of the heads a drafter has drafted with, newest first (at most ``MAX_STEPS``),
    so a rollback to the previous head finds its step instead of compiling it again.

    A head of another configuration (a round widened its draft vocabulary, 8,192 -> 8,228 tokens) gets a
    step of its own, compiled at its first drafts on the engine thread: 8.4 s in one step on an AMD EPYC
    (3.1 s + 1.2 s on a Xeon, docs/benchmarks/learning.md). Compiling it ahead of the swap did worse
    (docs/benchmarks/swap_stall.py, 2026-12-07): on the updater's thread, dynamo and inductor held the GIL
    through most of the compile and the engine thread, which gives it up at every kernel call, waited for
    it each time (49 s of serving lost against 14 s); in a child process at a lower priority, the compile
    took a core for 81 s (serving ~30 % slower meanwhile), the first drafts still compiled for 7.4 s, 30 s lost.

    Example::

        steps = HeadSteps()
        steps.step(head, kv).warm_up(head, 5)          # at start-up
        steps.step(wider, kv)                           # a swapped-in head of 8228 draft tokens: a new step
        steps.step(head, kv)                            # rolled back: the first step again, nothing compiled
    """

    MAX_STEPS = 3

    def __init__(self) -> None:
        self.steps: list[CompiledHeadStep] = []
        self.num_built = 0  # steps built (each compiles its graphs at its first calls)

    def step(self, head: Eagle3Head, kv: KVCache) -> CompiledHeadStep:
        """The step that runs ``head`` over ``kv``: the one in use, else a kept one that serves it, else a
        new one (compiled at its first calls)."""
        if self.steps and self.steps[0].serves(head, kv):
            return self.steps[0]
        found = next((s for s in self.steps if s.serves(head, kv)), None)
        if found is None:
            found = CompiledHeadStep(head, kv)
            self.num_built += 1
        else:
            self.steps.remove(found)
        self.steps = [found, *self.steps][: self.MAX_STEPS]
        return found


def _kind(head: Eagle3Head) -> tuple[str, ...]:
    """The classes of the head's layers, in order: what a compiled graph was traced through."""
    return tuple(type(m).__name__ for m in head.modules())
