"""Start-up profiler for the adaptive policies: T(b, q), D0 per drafter, catch-up cost table.

Why this exists: TIDE's analytic model (eq. 5) and Nightjar's switching cost need measured
costs of *this* model on *this* device and dtype. The forwards are timed through a
``ForwardExecutor`` built with the engine's options (``models/execution/executor.py``), so they are exactly
the forwards the engine runs (CUDA graphs, the compiled step or eager, over the same row-invariant
kernels and KV layout). Measuring takes seconds, so the result is cached under the tidespec cache
directory, keyed by the model, the drafter's networks, the executor (``executor_key``: its mode,
the kernels it chose, a digest of the kernel code) and a digest of this module's measuring code,
and reused until ``refresh`` is asked for.

What is measured (all medians after one warm-up forward; the T(b, q) grid is swept ``passes`` times and
each shape's median taken over the samples of every pass, so a slow spell of the machine — a
few seconds of a noisy neighbour or a frequency drop — lands in one pass's samples of a shape,
not in all of them: one outlier, T(1, 2) at 1.56x T(1, 1) against 1.21x in a re-measurement,
once decided a whole benchmark's batch-1 choice, docs/benchmarks/policies.md):
- ``verify_latency[(b, q)]``: one target forward with q new tokens for each of b sequences on a
  ``context``-token cache (q = gamma + 1 when verifying, 1 for plain decode);
- ``target_latency[n]``: the same for one sequence and n tokens (TIDE's T(n));
- ``draft_cost[name]``: D0, one drafting step with gamma = 1 on a ``context``-token sequence (for a
  drafter that reads the target's taps: ``observe`` of the new position with taps, then ``propose``),
  for each drafter of a ``MultiDrafter`` (``"default"``: the first);
- ``draft_batch_cost[(name, b)]``: the same step for b sequences at once, at ``draft_batches``: a
  drafter that runs a network costs more rows per step as the batch grows (EAGLE-3's gamma-1 drafting
  call 2.37 ms at batch 4 against 1.66 ms at batch 1 in the engine, ``docs/benchmarks/eagle3_draft_cost.py``,
  where one D0 priced both alike);
- ``catchup[(L, b)]``: extra seconds a stateful drafter spends re-ingesting L lagging tokens for
  each of b sequences (Nightjar's c_prefill(L, B)).

Worked example::

    prof, path = load_or_measure(model, drafter, options=ExecutorOptions(compile=True))
    prof.verify(1, 5) / prof.verify(1, 1)   # beta(1) at gamma = 4
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tidespec.errors import ConfigError
from tidespec.files import atomic_write, cache_root, cpu_name, measure_once
from tidespec.models.execution.executor import ExecutorOptions, ForwardExecutor, executor_key, prepare_target
from tidespec.models.quant.quantize import QuantizedLinear, quantization_of
from tidespec.models.target import TargetModel
from tidespec.sampling import SamplingParams
from tidespec.speculative.api import Drafter, DraftInput, Observation
from tidespec.speculative.policy.speedup import Profile

log = logging.getLogger(__name__)


@dataclass
class ProfilerConfig:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    tokens_per_seq: tuple[int, ...] = (1, 2, 3, 5, 9)  # q = gamma + 1 for gamma in {0, 1, 2, 4, 8}
    single_seq_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    catchup_tokens: tuple[int, ...] = (1, 8, 32, 128)
    catchup_batches: tuple[int, ...] = (1, 4, 16)
    draft_batches: tuple[int, ...] = (1, 4, 16)  # D0(b) per drafter (b = 1 always); linear between, extended above
    context: int = 200
    repeats: int = 1  # timed forwards per shape and pass (fewer on slow shapes, at least 1)
    target_s: float = 0.3  # time budget per shape and pass
    passes: int = 3  # sweeps over the T(b, q) grid, interleaved in time

    def __post_init__(self) -> None:
        if self.context < 1 or self.repeats < 1 or self.passes < 1:
            raise ValueError("context, repeats and passes must be >= 1")
        if min(self.batch_sizes) < 1 or min(self.tokens_per_seq) < 1 or min(self.draft_batches, default=1) < 1:
            raise ValueError("batch sizes and tokens per sequence must be >= 1")

    def fitted(self, max_len: int, max_seqs: int) -> ProfilerConfig:
        """This configuration within an engine's limits: a drafter sized for ``max_len`` tokens and
        ``max_seqs`` sequences is timed on contexts that fit (the catch-up lags, which grow one context,
        up to half of ``max_len``; the context in what is left) and at batch sizes it can draft for.
        A drafter timed past its room drafts nothing: EAGLE-3 sized for a benchmark's 180-token
        requests was once timed at 0.03 ms a step (no room on a 200-token context), and the controller
        priced its drafting as free.

        Example: the defaults fitted to (180, 4): catch-up lags (1, 8, 32) (their sum 41 <= 90),
        context min(200, 180 - 8 - 41) = 131, draft and catch-up batches (1, 4)."""
        lags: list[int] = []
        for t in self.catchup_tokens:
            if sum(lags) + t <= max_len // 2:
                lags.append(t)
        context = max(1, min(self.context, max_len - 8 - sum(lags)))
        def within(sizes: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(b for b in sizes if b <= max_seqs) or (1,)
        return dataclasses.replace(self, context=context, catchup_tokens=tuple(lags),
                                   draft_batches=within(self.draft_batches), catchup_batches=within(self.catchup_batches))


def sync_device(device: torch.device) -> None:
    """Wait for queued device work so wall-clock timings are real (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# one forward of tokens [T] for sequences with q_lens new tokens on ctx_lens cached ones in slots
Forward = Callable[[list[int], list[int], list[int], list[int]], object]


def executor_forward(executor: ForwardExecutor) -> Forward:
    """A decode-shaped forward through ``executor``: logits at every row, as a verification step."""
    return lambda tokens, q_lens, ctx_lens, slots: executor(tokens, q_lens, ctx_lens, slots, list(range(len(tokens))))


def forward_samples(forward: Forward, device: torch.device, vocab_size: int, batch: int, n: int, context: int,
                    repeats: int, target_s: float, gen: torch.Generator, warm_up: bool = True) -> list[float]:
    """Seconds of each timed ``forward`` of ``n`` new random tokens for each of ``batch`` sequences on a
    ``context``-token cache: ``repeats`` of them, fewer when the first one shows that they would
    overrun ``target_s`` (at least one). ``warm_up`` runs one untimed forward first.

    Example: ``forward_samples(executor_forward(ex), cpu, V, 4, 5, 200, 3, 0.3, gen)`` -> three
    timings of T(4, 5), or one if the first took over 0.3 s."""
    tokens = torch.randint(0, vocab_size, (batch * n,), generator=gen).tolist()  # [B*n]
    q_lens, ctx_lens, slots = [n] * batch, [context] * batch, list(range(batch))
    if warm_up:
        forward(tokens, q_lens, ctx_lens, slots)
    times: list[float] = []
    while len(times) < repeats and (not times or len(times) * times[0] < target_s):
        sync_device(device)
        t = time.perf_counter()
        forward(tokens, q_lens, ctx_lens, slots)
        sync_device(device)
        times.append(time.perf_counter() - t)
    return times


def time_forward(forward: Forward, device: torch.device, vocab_size: int, batch: int, n: int, context: int,
                 repeats: int, target_s: float, gen: torch.Generator) -> tuple[float, int]:
    """Median seconds of one forward (``forward_samples``), and the number of timed repeats."""
    times = forward_samples(forward, device, vocab_size, batch, n, context, repeats, target_s, gen)
    return statistics.median(times), len(times)


# read once, at import: the code that measures is the code that was imported (a process that read the
# file at call time once keyed a profile measured by the old code with the edited file's digest)
_MEASURING_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def measuring_digest() -> str:
    """A digest of this module's code as imported: cached profiles measured another way are never reused."""
    return _MEASURING_DIGEST


def profile_cache_dir() -> Path:
    """Directory holding measured profiles: ``<cache_root()>/profiles``."""
    return cache_root() / "profiles"


def profile_key(model: TargetModel, drafter_name: str, extra: dict[str, str] | None = None) -> str:
    """Stable key of what the costs depend on: architecture, dtype, weight quantization, device (and the
    CPU's model: a cache directory that outlives a machine must not hand one CPU's costs to another),
    drafter, threads."""
    parts = {"measure": measuring_digest(), "cfg": repr(model.cfg), "dtype": str(model.dtype), "device": str(model.device),
             "cpu": cpu_name(), "drafter": drafter_name, "threads": str(torch.get_num_threads()), **(extra or {})}
    quant = quantization_of(model)
    if quant != "none":  # only then, so the keys of unquantized models (and their cached profiles) stay
        parts["quantization"] = quant  # and which kernels run it: tidespec's verify few rows cheaper than ATen's
        parts["quant_kernels"] = ",".join(sorted({m.kernel_name for m in model.modules()
                                                  if isinstance(m, QuantizedLinear)}))
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]
    return f"{model.cfg.architecture}-L{model.cfg.num_layers}-H{model.cfg.hidden_size}-{drafter_name}-{digest}"


def drafter_signature(drafter: Drafter | None) -> dict[str, str]:
    """What a drafter's costs depend on beyond its name: the shape and dtype of each neural drafter's
    network (an EAGLE-3 head of another depth or precision, a draft model of other layers), so the
    cached profile of one is never read for another.

    Example: a suffix + EAGLE-3 ``MultiDrafter`` -> ``{"eagle3": "Eagle3Config(...) torch.bfloat16"}``;
    with an int8 drafting copy of the head ``"Eagle3Config(...) torch.float32 int8"``.
    """
    members = drafter.members.values() if drafter is not None else ()
    return {d.name: s for d in members if (s := d.cost_signature())}


def profile_key_for(model: TargetModel, drafter: Drafter | None, executor: dict[str, str],
                    cfg: ProfilerConfig | None = None) -> str:
    """``profile_key`` of ``model`` speculating with ``drafter`` (its networks included), its forwards
    run as ``executor`` says (``executor_key``), measured as ``cfg`` says (in the key unless it is the
    default: a profile timed on short contexts is not another engine's)."""
    extra = {} if cfg is None or cfg == ProfilerConfig() else {"profiler": repr(cfg)}
    return profile_key(model, drafter.name if drafter is not None else "none",
                       {**executor, **drafter_signature(drafter), **extra})


def measure_profile(model: TargetModel, drafter: Drafter | None, cfg: ProfilerConfig | None = None,
                    progress: Callable[[str], None] | None = None, options: ExecutorOptions | None = None) -> Profile:
    """Measure a ``Profile`` (see the module docstring): T(b, q) of the forwards an engine with
    ``options`` runs (default ``ExecutorOptions()``: eager, row-invariant on a CPU)."""
    options = options or ExecutorOptions()
    cfg = cfg or ProfilerConfig()
    say = progress or (lambda _msg: None)
    gen = torch.Generator().manual_seed(0)
    max_b = max(cfg.batch_sizes + cfg.catchup_batches)
    max_q = max(cfg.tokens_per_seq + cfg.single_seq_tokens)
    # a model with a short context window (tiny test models) gets a shorter cache, not an error
    context = max(0, min(cfg.context, model.cfg.max_position_embeddings - max_q - 1))
    executor = ForwardExecutor(model, options, max_b, context + max_q + 1, rows_per_seq=max(cfg.tokens_per_seq))
    for k, v in zip(executor.kv.k, executor.kv.v):  # attention cost does not depend on the values; avoid NaNs
        k.zero_()
        v.zero_()
    forward = executor_forward(executor)

    def samples_of(b: int, q: int, warm_up: bool = False) -> list[float]:
        return forward_samples(forward, model.device, model.cfg.vocab_size, b, q, context, cfg.repeats, cfg.target_s,
                               gen, warm_up=warm_up)

    samples: dict[tuple[int, int], list[float]] = {(b, q): [] for b in cfg.batch_sizes for q in cfg.tokens_per_seq}
    single_samples: dict[int, list[float]] = {n: [] for n in cfg.single_seq_tokens}
    # one untimed forward of the largest shape warms up the kernels and the allocator for all shapes
    forward_samples(forward, model.device, model.cfg.vocab_size, max(cfg.batch_sizes), max(cfg.tokens_per_seq),
                    context, 1, 0.0, gen, warm_up=False)
    for p in range(cfg.passes):
        for b in cfg.batch_sizes:
            for q in cfg.tokens_per_seq:
                samples[(b, q)] += samples_of(b, q)
            if p == cfg.passes - 1:
                say(f"T(b={b}, q) = " + ", ".join(f"{statistics.median(samples[(b, q)]) * 1e3:.1f}"
                                                  for q in cfg.tokens_per_seq) + f" ms ({cfg.passes} passes)")
        for n in cfg.single_seq_tokens:
            single_samples[n] += samples_of(1, n)
    verify = {shape: statistics.median(times) for shape, times in samples.items()}
    single = {n: statistics.median(times) for n, times in single_samples.items()}
    draft_cost = {"default": 0.0}
    draft_batch_cost: dict[tuple[str, int], float] = {}
    catchup: dict[tuple[int, int], float] = {}
    members = list(drafter.members.values()) if drafter is not None else []
    for member in members:  # each drafter of a MultiDrafter on its own: the policy prices each choice
        clock = _DraftClock(member, len(member.tap_layers) * model.cfg.hidden_size, gen, model.cfg.hidden_size)
        d0 = _draft_cost(clock, model.cfg.vocab_size, cfg, gen)
        if clock.drafted == 0 and not member.model_free:  # model-free ones may find no match
            log.warning("%s proposed nothing while being timed on a %d-token context: D0 is not its drafting "
                        "cost", member.name, cfg.context)
        draft_cost[member.name] = d0
        if member is members[0]:
            draft_cost["default"] = d0
        for b in sorted({1, *cfg.draft_batches}):
            d0_b = d0 if b == 1 else _draft_cost(clock, model.cfg.vocab_size, cfg, gen, b)
            for name in (member.name, "default") if member is members[0] else (member.name,):
                draft_batch_cost[(name, b)] = d0_b
        say(f"D0({member.name}) = {d0 * 1e3:.2f} ms" + "".join(
            f", {draft_batch_cost[(member.name, b)] * 1e3:.2f} ms at b={b}" for b in cfg.draft_batches if b > 1))
        if member.stateful and not catchup:  # the catch-up of the (first) stateful one
            catchup = _catchup(clock, model.cfg.vocab_size, cfg, gen)
            say(f"catch-up table of {member.name} measured")
    key = profile_key_for(model, drafter, executor.key(), cfg)
    return Profile(target_latency=single, draft_cost=draft_cost, catchup=catchup, key=key, verify_latency=verify,
                   draft_batch_cost=draft_batch_cost)


class _DraftClock:
    """Times drafting steps the way the engine drives a drafter: for a drafter that reads the
    target's hidden states (``tap_layers``), ``observe`` first hands it random taps for the
    positions that became final since its last step (the values do not change the cost), then
    ``propose``. Without the taps a feature drafter has no context and proposes nothing: EAGLE-3's
    drafting was once timed at 0.01 ms that way, against 9-14 ms for a real 4-token chain."""

    def __init__(self, drafter: Drafter, tap_width: int, gen: torch.Generator, hidden_width: int = 0) -> None:
        self.drafter = drafter
        self.tap_width = tap_width if drafter.tap_layers else 0
        self.hidden_width = hidden_width if drafter.drafts_from_hidden else 0
        self.gen = gen
        self.fed: dict[int, int] = {}  # seq_id -> positions whose taps the drafter has
        self.drafted = 0  # draft tokens proposed over all timed steps

    def step(self, contexts: list[list[int]], seq_ids: list[int]) -> float:
        """Seconds of one drafting step (observe if tapped, then propose with gamma = 1)."""
        observations = []
        if self.tap_width or self.hidden_width:
            for sid, ctx in zip(seq_ids, contexts):
                start = self.fed.get(sid, 0)
                new = max(0, len(ctx) - 1 - start)  # the last token is not in the target's cache yet
                # taps [new, num_taps * H], hidden [new, H]: random, the values do not change the cost
                taps = torch.randn(new, self.tap_width, generator=self.gen) if self.tap_width else None
                hidden = torch.randn(new, self.hidden_width, generator=self.gen) if self.hidden_width else None
                observations.append(Observation(sid, list(ctx), new, taps, start, hidden))
                self.fed[sid] = start + new
        inputs = [DraftInput(i, ctx, 1, SamplingParams()) for i, ctx in zip(seq_ids, contexts)]
        t = time.perf_counter()
        if observations:
            self.drafter.observe(observations)
        proposal = self.drafter.propose(inputs)
        elapsed = time.perf_counter() - t
        self.drafted += proposal.num_draft_tokens
        return elapsed

    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.drafter.release(sid)
            self.fed.pop(sid, None)


def _draft_cost(clock: _DraftClock, vocab: int, cfg: ProfilerConfig, gen: torch.Generator, batch: int = 1) -> float:
    """Median seconds of one drafting step for ``batch`` sequences of ``context`` random tokens, each
    one token longer than at the step before (after an untimed first step: the first-sight prefill)."""
    ctxs = [torch.randint(0, vocab, (cfg.context,), generator=gen).tolist() for _ in range(batch)]
    sids = [(1 << 40) + i for i in range(batch)]  # far from real sequence ids
    clock.step(ctxs, sids)
    times = []
    for _ in range(max(3, cfg.repeats)):
        ctxs = [c + [int(torch.randint(0, vocab, (1,), generator=gen))] for c in ctxs]
        times.append(clock.step(ctxs, sids))
    clock.release(sids)
    return statistics.median(times)


def _catchup(clock: _DraftClock, vocab: int, cfg: ProfilerConfig, gen: torch.Generator) -> dict[tuple[int, int], float]:
    """Extra drafting time when L tokens arrived since the last step, for b sequences."""
    table: dict[tuple[int, int], float] = {}
    base_id = 1 << 41
    for b in cfg.catchup_batches:
        ids = [base_id + i for i in range(b)]
        ctxs = [torch.randint(0, vocab, (cfg.context,), generator=gen).tolist() for _ in ids]
        clock.step(ctxs, ids)
        ctxs = [c + [1] for c in ctxs]
        one = clock.step(ctxs, ids)
        for lag in cfg.catchup_tokens:
            ctxs = [c + torch.randint(0, vocab, (lag,), generator=gen).tolist() for c in ctxs]
            table[(lag, b)] = max(0.0, clock.step(ctxs, ids) - one)
        clock.release(ids)
    return table


def load_or_measure(model: TargetModel, drafter: Drafter | None, cfg: ProfilerConfig | None = None,
                    refresh: bool = False, progress: Callable[[str], None] | None = None,
                    options: ExecutorOptions | None = None) -> tuple[Profile, Path]:
    """The cached profile for this model/device/dtype/drafter and forwards run with ``options`` (the
    target is prepared for them first: its row-invariant kernels chosen), measured (and cached)
    when missing."""
    options = options or ExecutorOptions()
    key = profile_key_for(model, drafter, executor_key(model, options, prepare_target(model, options)), cfg)
    path = profile_cache_dir() / f"{key}.json"
    def measure() -> Profile:
        prof = measure_profile(model, drafter, cfg, progress, options)
        atomic_write(path, prof.to_json().encode())
        return prof

    # timed alone: another process profiling the same target waits, then reads it
    return measure_once(path, lambda: None if refresh else _cached_profile(path), measure), path


def _cached_profile(path: Path) -> Profile | None:
    """The profile cached at ``path``; None when there is none, or it is stale or torn (measured again)."""
    if not path.exists():
        return None
    try:
        return Profile.load(path)
    except ConfigError:  # unreadable, or JSON of another shape
        return None
