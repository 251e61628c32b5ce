"""Waves of prompts through one engine per configuration, round-robin: the loop ``bench spec
--structured`` and ``bench spec --predicted`` share.

Why this exists: both put several configurations (drafters, forced tokens, a prediction) next to plain
decoding *of the same engine* on the same prompts. Each configuration gets its own engine per batch
size (sharing the target); the prompts run in waves of the batch size and every configuration runs
each wave in turn, so the VM's drift falls on all of them alike. Per configuration the counters add
up the wall time and, over the steps without a prompt chunk, the decode steps, their sequences,
tokens and seconds (tokens per target step per sequence = ``decode_tokens / decode_rows``).

Worked example::

    target, prompts = wave_target(ModelConfig(), None, "code_edit", 4)
    runs = [WaveRun("plain", 1, engine)]
    run_rounds(runs, prompts, (1,), "bench", lambda r, idx: run_wave(r, prompts, idx, params), echo=False)
    speed_summary(runs[0], runs[0])["speedup"]  # 1.0
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tidespec.bench.decode.run import resolve_target, wave_indices
from tidespec.config import ConfigError, ModelConfig, PolicyConfig
from tidespec.engine.engine import LLMEngine
from tidespec.models.loading.loader import LoadedModel
from tidespec.sampling import SamplingParams
from tidespec.workloads.loader import Prompt, load_prompts


@dataclass
class WaveBenchConfig:
    """What every wave benchmark takes: the workload and how much of it, the batch sizes, the drafters'
    speculation length, the output length. Each benchmark subclasses it with its own defaults."""

    workload: str = ""
    limit: int = 24
    batch_sizes: tuple[int, ...] = (1, 4)
    gamma: int = 8
    max_tokens: int = 192
    # prompts per wave = refill x the batch size, run on batch-size KV slots: as a sequence finishes, the
    # engine admits the next queued prompt (continuous batching, as a server or vLLM's offline generate
    # does); 1: waves of exactly the batch, an offline batch that lasts as long as its slowest sequence
    refill: int = 1

    def __post_init__(self) -> None:
        if self.limit < 1 or not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError(f"need limit >= 1 and batch sizes >= 1, got {self.limit}, {self.batch_sizes}")
        if self.refill < 1:
            raise ConfigError(f"need refill >= 1 (prompts per wave = refill x batch size), got {self.refill}")
        if not 1 <= self.gamma <= 64 or self.max_tokens < 2:
            raise ConfigError(f"need gamma in [1, 64] and max_tokens >= 2, got {self.gamma}, {self.max_tokens}")


@dataclass
class WaveRun:
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
    decode_time: float = 0.0  # seconds of those steps
    mask_seconds: float = 0.0


def wave_target(mc: ModelConfig, target: LoadedModel | str | None, workload: str,
                limit: int) -> tuple[LoadedModel, list[Prompt]]:
    """The target (loaded once, shared by every engine) and the workload's first ``limit`` prompts."""
    if mc.threads:
        torch.set_num_threads(mc.threads)
    loaded = resolve_target(target if target is not None else mc.model, mc.dtype, mc.device, mc.quantization,
                            mc.quant_group_size)
    return loaded, load_prompts(workload, loaded.tokenizer, limit)


def controller_policy(policy: PolicyConfig | None) -> PolicyConfig:
    """The policy the controller configurations run under: the given one, analytic when none or static."""
    return policy if policy is not None and policy.name != "static" else PolicyConfig(name="analytic")


def run_wave(run: WaveRun, prompts: list[Prompt], idx: list[int], params: Callable[[Prompt], SamplingParams]) -> None:
    """Run prompts ``idx`` at once on ``run``'s engine to the end (each with ``params(prompt)``), adding to
    its counters."""
    e = run.engine
    clock0 = e.grammars.clock.seconds
    t0 = time.perf_counter()
    rids = {e.add_request(prompts[i].token_ids, params(prompts[i])): i for i in idx}
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
                run.decode_time += s.total_time
        for o in outs:
            if o.finished:
                i = rids[o.request_id]
                run.outputs[i], run.texts[i] = list(o.token_ids), o.text
                run.tokens += len(o.token_ids)
    run.wall += time.perf_counter() - t0
    run.mask_seconds += e.grammars.clock.seconds - clock0


def warm_up(run: WaveRun, prompts: list[Prompt], params: Callable[[Prompt], SamplingParams],
            waves: Sequence[list[int]] = ([0],)) -> None:
    """Uncounted ``waves`` (by default one of the first prompt: the first kernels run), then an empty
    prefix cache. A compiled engine meets a new prompt length with a new compile: given every wave of
    the timed schedule, those compiles happen here, not inside the first configuration's timed waves."""
    for wave in waves:
        run_wave(dataclasses.replace(run, outputs={}, texts={}), prompts, wave, params)
        run.engine.reset_prefix_cache()


def schedule(num_prompts: int, batch: int, refill: int = 1) -> list[list[int]]:
    """The waves of prompt indices a batch size runs (``WaveBenchConfig.refill``): ``refill`` x ``batch``
    prompts a wave, at most every prompt once (the last wave cycles to fill, never below the batch).

    Example: ``schedule(16, 4) == wave_indices(16, 4)`` (4 waves of 4); ``schedule(16, 4, 2)``: 2 waves
    of 8; ``schedule(16, 4, 8)``: one wave of all 16; ``schedule(2, 4, 8) == [[0, 1, 0, 1]]``."""
    return wave_indices(num_prompts, max(batch, min(batch * refill, num_prompts)))


def run_rounds(runs: Sequence[WaveRun], num_prompts: int, batch_sizes: Sequence[int], desc: str,
               each: Callable[[WaveRun, list[int]], None], echo: bool, refill: int = 1) -> None:
    """For every batch size and wave of it (``schedule``), ``each(run, wave)`` for every run of that batch
    size in turn (an empty prefix cache before each), with a progress bar."""
    total = sum(len(schedule(num_prompts, r.batch, refill)) for r in runs)
    with tqdm(total=total, desc=desc, unit="run", disable=not echo, file=sys.stderr) as bar:
        for batch in batch_sizes:
            group = [r for r in runs if r.batch == batch]
            for wave in schedule(num_prompts, batch, refill):
                for r in group:
                    bar.set_postfix_str(f"batch {batch} {r.label}")
                    r.engine.reset_prefix_cache()
                    each(r, wave)
                    bar.update()


def speed_summary(run: WaveRun, plain: WaveRun) -> dict[str, Any]:
    """A configuration's speed next to plain's of the same batch size, and its outputs that differ."""
    tps = run.tokens / run.wall if run.wall > 0 else float("nan")
    plain_tps = plain.tokens / plain.wall if plain.wall > 0 else float("nan")
    return {"config": run.label, "batch_size": run.batch, "tokens": run.tokens, "tokens_per_s": tps,
            "speedup": tps / plain_tps, "tokens_per_step": run.decode_tokens / max(run.decode_rows, 1),
            "decode_step_ms": 1e3 * run.decode_time / max(run.decode_steps, 1),
            "mismatches": sum(run.outputs[i] != plain.outputs[i] for i in plain.outputs),
            "requests": len(run.outputs)}


def plot_speedups(configs: list[dict[str, Any]], labels: list[str], title: str, ylabel: str, out: Path) -> None:
    """``plot.png``: each configuration's ``speedup``, one bar per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({c["batch_size"] for c in configs})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(batches)
    for k, b in enumerate(batches):
        ys = [next(c["speedup"] for c in configs if c["batch_size"] == b and c["config"] == lab) for lab in labels]
        ax.bar([i + k * width for i in range(len(labels))], ys, width, label=f"batch {b}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([i + width * (len(batches) - 1) / 2 for i in range(len(labels))], labels, rotation=15, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "plot.png", dpi=120)
    plt.close(fig)
