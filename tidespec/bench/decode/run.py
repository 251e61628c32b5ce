"""``tidespec bench decode``: plain-decoding throughput and latency per batch size, optionally vs HF.

Why this exists: every speed claim of tidespec starts from plain decoding — how many tokens per
second one target model gives at batch 1 and how that scales with batch size — and from how it
compares with the reference everyone knows, HF transformers ``generate()``, on the same
prompts, in the same process, on the same cores.

Method. Every request generates exactly ``max_tokens`` tokens (``ignore_eos``; HF gets
``min_new_tokens = max_new_tokens``), greedy. For batch size B the workload's prompts are sent
in waves of B requests added together (prompts cycled to fill the last wave); the engine runs
until the wave finishes. Per batch size it reports:

* tokens/s with prefill: output tokens / wall time of the waves;
* tokens/s decode-only: tokens emitted by engine steps that ran no prefill / those steps' wall
  time (at batch 1 this is (n - 1) / (time after the first token));
* TTFT (arrival -> first token) and TPOT ((finish - first token) / (n - 1)) mean, p50, p90.

``--compare hf,llamacpp`` (either or both) runs reference engines on each batch-1 prompt right
after ours (interleaved, so drift of a shared machine hits all alike), same prompt token ids,
same token count, greedy, and reports each as a row (tok/s with prefill and decode-only, as ours
at batch 1: decode-only = (n - 1) / (time after the first token)) with its ratio to tidespec at
batch 1, and how many leading greedy tokens it shares with ours per prompt (information only: a
different numeric path may diverge). llama.cpp also runs each larger batch's waves right after
ours, the wave's prompts as parallel sequences of one context (as llama-server's slots; decode-only
= tokens after the first / time after the wave's last first token), and the headline gives
tidespec / llama.cpp per batch size, time to first token included. ``--prompt-tokens 512`` makes
every prompt 512 tokens (``lengthened``), the shape of a request with a document or a history:

* ``hf``: ``AutoModelForCausalLM.from_pretrained(<model dir>).generate()``; TTFT from a streamer
  timestamp.
* ``llamacpp``: llama.cpp through llama-cpp-python on the same GGUF file tidespec loaded (quantized
  as shipped), same thread count (``tidespec.bench.decode.llamacpp``). When llama-cpp-python is not
  installed or the target is not a GGUF file, a one-line notice says so (stderr, the report and
  ``results.json["skipped"]``) and the rest of the benchmark runs.

Worked example::

    target = resolve_target(None)                          # embedded SmolLM2-135M, float32
    cfg = DecodeBenchConfig(workload="code", limit=4, batch_sizes=(1, 4), max_tokens=32)
    result = run_decode_bench(cfg, target, out_dir=Path("runs/x"), command="tidespec bench decode ...")
    result["rows"][0]["tokens_per_s"], result["headline"]
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from tidespec.bench.common.report import (
    identical_prefix,
    log2_panel,
    machine_line,
    markdown_table,
    new_figure,
    save_figure,
    summarize,
    write_results,
)
from tidespec.bench.decode.llamacpp import LlamaCppRunner, open_llamacpp, target_gguf
from tidespec.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    PolicyConfig,
    SchedulerConfig,
    SpecConfig,
)
from tidespec.engine.engine import LLMEngine
from tidespec.llm import DTYPES, build_engine
from tidespec.models.loading.loader import LoadedModel, load_model
from tidespec.sampling import SamplingParams
from tidespec.workloads.loader import Prompt, lengthened, load_prompts

# --------------------------------------------------------------------------- shared plumbing


def resolve_target(model: LoadedModel | str | None, dtype: str = "float32", device: str = "cpu",
                   quantization: str = "none", quant_group_size: int = 32) -> LoadedModel:
    """An already-built ``LoadedModel`` as is; else load a path (None = the embedded model) with
    its linear layers quantized as asked (``--quantization``, ``--quant-group-size``)."""
    if isinstance(model, LoadedModel):
        return model
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return load_model(model, dtype=DTYPES[dtype], device=device, quantization=quantization,
                      quant_group_size=quant_group_size)


def workload_doc(target: LoadedModel, workload: str, prompts: list[Prompt], cfg: Any) -> dict[str, Any]:
    """The head of a workload benchmark's ``results.json``: the model, the workload, the prompts it
    ran (by record id) and the benchmark's settings (dataclass ``cfg``)."""
    return {"model": target.path or type(target.model).__name__, "workload": workload,
            "prompt_ids": [p.record.id for p in prompts], "config": dataclasses.asdict(cfg)}


def parse_str_list(text: str, name: str) -> tuple[str, ...]:
    """``"a, b"`` -> ``("a", "b")``; one-line ``ConfigError`` when it lists nothing."""
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    if not values:
        raise ConfigError(f"{name} must be a non-empty comma-separated list, got {text!r}")
    return values


def parse_int_list(text: str, name: str, minimum: int = 1) -> tuple[int, ...]:
    """``"1,4,16"`` -> ``(1, 4, 16)``; one-line ``ConfigError`` on anything else."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{name} must be a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise ConfigError(f"{name} must list integers >= {minimum}, got {text!r}")
    return values


def parse_float_list(text: str, name: str) -> tuple[float, ...]:
    """``"0, 0.3"`` -> ``(0.0, 0.3)``; one-line ``ConfigError`` on anything else (ranges are the
    config's to check)."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{name} must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise ConfigError(f"{name} must be a non-empty comma-separated list, got {text!r}")
    return values


def bench_engine_config(prompts: list[Prompt], max_tokens: int, max_batch: int, max_position: int,
                        model: ModelConfig | None = None, scheduler: SchedulerConfig | None = None,
                        spec: SpecConfig | None = None, policy: PolicyConfig | None = None,
                        longest: int | None = None) -> EngineConfig:
    """An engine config sized for the workload: ``max_batch`` KV slots just long enough for the
    longest prompt (``longest`` when the prompts are not all known yet: later turns of a chat) plus
    ``max_tokens`` (plus speculation slack), capped by the model's context."""
    spec = spec or SpecConfig()
    longest = max(len(p.token_ids) for p in prompts) if longest is None else longest
    need = longest + max_tokens + spec.num_speculative_tokens + 1
    if need > max_position:
        raise ConfigError(f"longest prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                          f"context ({max_position}); lower --max-tokens or --limit the workload")
    return EngineConfig(model=model or ModelConfig(), cache=CacheConfig(max_model_len=max(need, 8), max_num_seqs=max_batch),
                        scheduler=scheduler or SchedulerConfig(), spec=spec, policy=policy or PolicyConfig())


@dataclass
class RequestRecord:
    """Timing and output of one request (ours or HF's). Times in seconds."""

    prompt_index: int
    prompt_id: str
    prompt_tokens: int
    output_tokens: int
    ttft: float
    latency: float  # arrival -> last token
    token_ids: list[int] = field(default_factory=list, repr=False)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache served (not computed)

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first; NaN for a single token."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else float("nan")

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "token_ids"}
        d["tpot"] = self.tpot
        return d


@dataclass
class WaveResult:
    """One wave: requests added together and run to completion."""

    requests: list[RequestRecord]
    wall_time: float
    decode_tokens: int  # tokens emitted by steps without prefill
    decode_time: float  # wall time of those steps
    draft_time: float = 0.0  # seconds in the drafter's proposals, all steps (the engine's draft timer)
    verify_time: float = 0.0  # seconds in the target's forwards, all steps
    steps: int = 0  # engine steps that scheduled work


def run_wave(engine: LLMEngine, prompts: list[Prompt], indices: list[int], params: SamplingParams) -> WaveResult:
    """Add ``prompts[i]`` for each i in ``indices`` at once and step the engine until all finish."""
    if engine.has_unfinished_requests():
        raise RuntimeError("run_wave needs an idle engine")
    decode_tokens, decode_time, draft_time, verify_time, steps = 0, 0.0, 0.0, 0.0, 0
    t0 = time.perf_counter()
    rids = [engine.add_request(prompts[i].token_ids, params) for i in indices]
    final: dict[str, Any] = {}
    counted = engine.last_stats
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - ts
        if engine.last_stats is not counted:  # a step with nothing scheduled leaves the last stats in place
            counted = engine.last_stats
            steps += 1
            draft_time += counted.draft_time
            verify_time += counted.verify_time
        if not outs:
            continue
        if engine.last_stats.num_prefill_tokens == 0:
            decode_tokens += engine.last_stats.num_emitted_tokens
            decode_time += dt
        for o in outs:
            if o.finished:
                final[o.request_id] = o
    wall = time.perf_counter() - t0
    records = []
    for rid, i in zip(rids, indices):
        o = final[rid]
        s = o.stats
        first = s.first_token_time if s.first_token_time is not None else s.arrival_time
        finish = s.finish_time if s.finish_time is not None else first
        records.append(RequestRecord(i, prompts[i].record.id, len(prompts[i].token_ids), len(o.token_ids),
                                     first - s.arrival_time, finish - s.arrival_time, list(o.token_ids),
                                     s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.num_cached_tokens))
    return WaveResult(records, wall, decode_tokens, decode_time, draft_time, verify_time, steps)


def wave_indices(num_prompts: int, batch_size: int) -> list[list[int]]:
    """Prompt indices per wave: ceil(N / B) waves of B, prompts cycled to fill the last.

    Example: ``wave_indices(3, 2) == [[0, 1], [2, 0]]``.
    """
    waves = math.ceil(num_prompts / batch_size)
    return [[(w * batch_size + j) % num_prompts for j in range(batch_size)] for w in range(waves)]


class _TimingStreamer(BaseStreamer):
    """Records when ``generate()`` hands over each chunk (the first call carries the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        self.times.append(time.perf_counter())


class HFRunner:
    """HF transformers ``AutoModelForCausalLM`` on the same checkpoint, for reference timings."""

    def __init__(self, path: str, dtype: str = "float32", device: str = "cpu") -> None:
        if not path:
            raise ConfigError("--compare hf needs the model's HF checkpoint directory (none is known for this model)")
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation="sdpa")
        self.model = self.model.to(device).eval()
        self.device = device
        eos = self.model.generation_config.eos_token_id
        self.eos = eos[0] if isinstance(eos, list) else eos

    def generate(self, prompt: Prompt, index: int, max_tokens: int, pld_tokens: int | None = None,
                 ignore_eos: bool = True) -> RequestRecord:
        """Greedy ``generate()`` of exactly ``max_tokens`` tokens at batch 1 (prompt lookup when
        ``pld_tokens`` is set); ``ignore_eos=False``: at most ``max_tokens``, ending at EOS."""
        from transformers import GenerationConfig

        ids = torch.tensor([prompt.token_ids], dtype=torch.int64, device=self.device)  # [1, P]
        gc = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens if ignore_eos else None, do_sample=False,
                              eos_token_id=self.eos, pad_token_id=self.eos, prompt_lookup_num_tokens=pld_tokens)
        streamer = _TimingStreamer()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                                      streamer=streamer)
        t1 = time.perf_counter()
        new = out[0, ids.shape[1]:].tolist()
        first = streamer.times[1] if len(streamer.times) > 2 else t1
        return RequestRecord(index, prompt.record.id, len(prompt.token_ids), len(new), first - t0, t1 - t0, new)


def records_summary(records: list[RequestRecord], wall_time: float, decode_tokens: int,
                    decode_time: float) -> dict[str, Any]:
    """Throughput and latency figures of a set of requests (ms for latencies)."""
    out_tokens = sum(r.output_tokens for r in records)
    ttft = summarize([r.ttft * 1e3 for r in records])
    tpot = summarize([r.tpot * 1e3 for r in records])
    return {
        "requests": len(records),
        "output_tokens": out_tokens,
        "wall_time_s": wall_time,
        "tokens_per_s": out_tokens / wall_time if wall_time > 0 else float("nan"),
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time > 0 else float("nan"),
        "ttft_ms": {k: ttft[k] for k in ("mean", "p50", "p90")},
        "tpot_ms": {k: tpot[k] for k in ("mean", "p50", "p90")},
    }


def reference_decode_split(records: list[RequestRecord]) -> tuple[int, float]:
    """(tokens after the first, time after the first token) summed over a reference engine's requests."""
    return (sum(r.output_tokens - 1 for r in records), sum(r.latency - r.ttft for r in records))


# --------------------------------------------------------------------------- the decode bench


# --compare names -> the engine label of their row
COMPARE_ENGINES = {"hf": "hf-transformers", "llamacpp": "llama.cpp"}


def parse_compare(text: str | None) -> tuple[str, ...]:
    """``--compare`` value -> engine names: ``"hf,llamacpp"`` -> ``("hf", "llamacpp")``; None -> ()."""
    return () if text is None else parse_str_list(text, "--compare")


@dataclass
class DecodeBenchConfig:
    workload: str = "code"
    limit: int = 16
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    max_tokens: int = 128
    compare: tuple[str, ...] = ()  # reference engines at batch 1, in run order: "hf", "llamacpp" (every batch size)
    warmup: bool = True
    prompt_tokens: int = 0  # > 0: every prompt made exactly this long (``lengthened``)

    def __post_init__(self) -> None:
        unknown = [c for c in self.compare if c not in COMPARE_ENGINES]
        if unknown:
            raise ConfigError(f"unknown --compare engine {unknown[0]!r}; choose from {', '.join(COMPARE_ENGINES)}")
        self.compare = tuple(dict.fromkeys(self.compare))  # duplicates run once
        if self.limit < 1:
            raise ConfigError(f"limit must be >= 1, got {self.limit}")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ConfigError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.max_tokens < 2:
            raise ConfigError(f"max_tokens must be >= 2 (TPOT needs two tokens), got {self.max_tokens}")
        if self.prompt_tokens < 0:
            raise ConfigError(f"prompt tokens must be >= 0 (0: the workload's own lengths), got {self.prompt_tokens}")


def run_decode_bench(cfg: DecodeBenchConfig, target: LoadedModel | str | None = None, *,
                     model_config: ModelConfig | None = None, scheduler: SchedulerConfig | None = None,
                     out_dir: Path | None = None, command: str = "", echo: bool = True) -> dict[str, Any]:
    """Run the decode benchmark, write ``results.json``, ``plot.png`` and ``table.md`` into
    ``out_dir`` (default ``runs/bench-decode-<timestamp>``), print the table when ``echo``, and
    return the JSON document."""
    mc = model_config or ModelConfig()
    if mc.threads:
        torch.set_num_threads(mc.threads)
    source = target if target is not None else mc.model
    target = resolve_target(source, mc.dtype, mc.device, mc.quantization, mc.quant_group_size)
    prompts = load_prompts(cfg.workload, target.tokenizer, cfg.limit)
    if cfg.prompt_tokens:
        prompts = lengthened(prompts, cfg.prompt_tokens)
    econf = bench_engine_config(prompts, cfg.max_tokens, max(cfg.batch_sizes), target.model.cfg.max_position_embeddings,
                                mc, scheduler)
    engine = build_engine(econf, model=target.model, tokenizer=target.tokenizer)
    refs, batched, closers, skipped, ref_settings = _reference_engines(cfg, target, source, mc, econf, prompts[0].token_ids)
    try:  # the reference engines' resources (llama.cpp's contexts) are freed however the measurement ends
        rows, ref_rows, per_batch_requests = _measure(cfg, engine, prompts, refs, batched, ref_settings)
    finally:
        for close in closers:
            close()
    _add_ratios(rows, ref_rows)

    doc = {
        **workload_doc(target, cfg.workload, prompts, cfg),
        "engine_config": dataclasses.asdict(econf),
        "rows": rows + ref_rows,
        "headline": _decode_headline(rows, ref_rows),
        "skipped": skipped,
        "requests": per_batch_requests,
    }
    return write_results("decode", doc, out_dir, command, mc.precision, format_decode_report,
                         lambda out: _plot_decode(rows, ref_rows, out), echo)


def _measure(cfg: DecodeBenchConfig, engine: LLMEngine, prompts: list[Prompt], refs: dict[str, ReferenceEngine],
             batched: dict[str, BatchedReference], ref_settings: dict[str, dict[str, Any]]
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """Every batch size's waves through ``engine``, the reference engines interleaved (batch 1 prompt by
    prompt, larger batches wave by wave): (our rows, the references' rows, every request's record)."""
    params = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True)
    if cfg.warmup:
        run_wave(engine, prompts, [0], SamplingParams(max_tokens=min(8, cfg.max_tokens), ignore_eos=True))
        for ref in refs.values():
            ref(prompts[0], 0, min(8, cfg.max_tokens))

    rows: list[dict[str, Any]] = []
    per_batch_requests: dict[str, list[dict[str, Any]]] = {}
    ours_by_prompt: dict[int, list[int]] = {}  # greedy tokens of our smallest batch size, per prompt
    ref_records: dict[str, list[RequestRecord]] = {name: [] for name in refs}
    ref_waves: dict[str, dict[int, list[list[RequestRecord]]]] = {name: {} for name in batched}  # b > 1
    for b in cfg.batch_sizes:
        waves: list[WaveResult] = []
        records: list[RequestRecord] = []
        for idx in wave_indices(len(prompts), b):
            # every wave prefills from a cold prefix cache, as the reference engines do: the warm-up,
            # the batch sizes before and a last wave's cycled prompts ran the same prompts
            engine.reset_prefix_cache()
            waves.append(run_wave(engine, prompts, idx, params))
            records.extend(waves[-1].requests)
            if b == 1:  # reference engines interleaved with ours, prompt by prompt
                for name, ref in refs.items():
                    ref_records[name].append(ref(prompts[idx[0]], idx[0], cfg.max_tokens))
            else:  # and wave by wave where they batch
                for name, wave_ref in batched.items():
                    ref_waves[name].setdefault(b, []).append(wave_ref(prompts, idx, cfg.max_tokens))
        summary = records_summary(records, sum(w.wall_time for w in waves), sum(w.decode_tokens for w in waves),
                                  sum(w.decode_time for w in waves))
        rows.append({"engine": "tidespec", "batch_size": b, "waves": len(waves), **summary})
        per_batch_requests[str(b)] = [r.to_json() for r in records]
        if b == min(cfg.batch_sizes):
            ours_by_prompt = {r.prompt_index: r.token_ids for r in reversed(records)}
    ref_rows: list[dict[str, Any]] = []
    for name, ref in refs.items():
        recs = ref_records[name] or [ref(p, i, cfg.max_tokens) for i, p in enumerate(prompts)]  # batch 1 not run
        dtok, dtime = reference_decode_split(recs)
        row, per_batch_requests[name] = _reference_row(name, 1, len(recs), recs, sum(r.latency for r in recs), dtok,
                                                       dtime, ours_by_prompt, cfg.max_tokens, ref_settings)
        ref_rows.append(row)
    for name, by_batch in ref_waves.items():
        for b, ref_wave_list in by_batch.items():
            recs = [r for wave in ref_wave_list for r in wave]
            dtok = sum(r.output_tokens - 1 for r in recs)  # a wave decodes once every prompt is in
            dtime = sum(max(r.latency for r in w) - max(r.ttft for r in w) for w in ref_wave_list)
            row, per_batch_requests[f"{name}-b{b}"] = _reference_row(
                name, b, len(ref_wave_list), recs, sum(max(r.latency for r in w) for w in ref_wave_list), dtok, dtime,
                ours_by_prompt, cfg.max_tokens, ref_settings)
            ref_rows.append(row)
    return rows, ref_rows, per_batch_requests


def _reference_row(name: str, b: int, waves: int, recs: list[RequestRecord], wall: float, dtok: int, dtime: float,
                   ours_by_prompt: dict[int, list[int]], max_tokens: int, ref_settings: dict[str, dict[str, Any]]
                   ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A reference engine's row at batch size ``b`` and its requests' records, each with how many of its
    first tokens equal ours (information only: another engine's greedy text may differ at a near-tie)."""
    prefix = [identical_prefix(r.token_ids, ours_by_prompt[r.prompt_index]) for r in recs]
    row = {"engine": COMPARE_ENGINES[name], "batch_size": b, "waves": waves, **records_summary(recs, wall, dtok, dtime),
           "identical_prefix_vs_tidespec": {"per_prompt": prefix, "mean": sum(prefix) / len(prefix),
                                            "identical_prompts": sum(n == max_tokens for n in prefix)},
           "settings": ref_settings.get(name, {})}
    return row, [{**r.to_json(), "identical_prefix_vs_tidespec": n} for r, n in zip(recs, prefix)]


ReferenceEngine = Callable[[Prompt, int, int], RequestRecord]  # (prompt, prompt index, max_tokens) -> record


# (all prompts, one wave's prompt indices, max_tokens) -> that wave's records, its prompts decoded together
BatchedReference = Callable[[list[Prompt], list[int], int], list[RequestRecord]]


def _reference_engines(cfg: DecodeBenchConfig, target: LoadedModel, source: LoadedModel | str | None,
                       mc: ModelConfig, econf: EngineConfig, probe_ids: list[int],
                       ) -> tuple[dict[str, ReferenceEngine], dict[str, BatchedReference], list[Callable[[], None]],
                                  dict[str, str], dict[str, dict[str, Any]]]:
    """The ``--compare`` engines that can run (in ``cfg.compare`` order), those of them that also run
    batches (llama.cpp), what frees them, a one-line notice per engine that cannot (printed to stderr
    now), and settings worth recording per engine. An unusable HF checkpoint stays an error."""
    refs: dict[str, ReferenceEngine] = {}
    batched: dict[str, BatchedReference] = {}
    closers: list[Callable[[], None]] = []
    skipped: dict[str, str] = {}
    settings: dict[str, dict[str, Any]] = {}
    for name in cfg.compare:
        if name == "hf":
            hf = HFRunner(target.path, mc.dtype, mc.device)
            refs[name] = lambda p, i, n, hf=hf: hf.generate(p, i, n)
        elif name == "llamacpp":
            if isinstance(source, LoadedModel):  # built by the caller: use it only if it is --model's conversion
                gguf, reason = target_gguf(mc.model, target.path)
            else:
                gguf, reason = target_gguf(source, None)
            runner, notice = open_llamacpp(gguf, reason, n_ctx=econf.cache.max_model_len,
                                           n_threads=torch.get_num_threads(),
                                           n_batch=econf.scheduler.max_num_batched_tokens, probe_ids=probe_ids)
            if runner is None:
                skipped[name] = notice
                print(notice, file=sys.stderr)
            else:
                refs[name] = lambda p, i, n, runner=runner: _llamacpp_record(runner, p, i, n)
                batched[name] = lambda ps, idx, n, runner=runner: _llamacpp_wave(runner, ps, idx, n)
                closers.append(runner.close)
                settings[name] = runner.settings()
                if runner.note:
                    print(f"llama.cpp: {runner.note}", file=sys.stderr)
    return refs, batched, closers, skipped, settings


def _llamacpp_record(runner: LlamaCppRunner, prompt: Prompt, index: int, max_tokens: int) -> RequestRecord:
    run = runner.generate(prompt.token_ids, max_tokens)
    return RequestRecord(index, prompt.record.id, len(prompt.token_ids), len(run.token_ids), run.ttft, run.latency,
                         run.token_ids)


def _llamacpp_wave(runner: LlamaCppRunner, prompts: list[Prompt], indices: list[int],
                   max_tokens: int) -> list[RequestRecord]:
    runs = runner.generate_batch([prompts[i].token_ids for i in indices], max_tokens)
    return [RequestRecord(i, prompts[i].record.id, len(prompts[i].token_ids), len(run.token_ids), run.ttft,
                          run.latency, run.token_ids) for i, run in zip(indices, runs)]


def _add_ratios(rows: list[dict[str, Any]], ref_rows: list[dict[str, Any]]) -> None:
    """Each row's tok/s (with prefill, decode-only) over tidespec's batch-1 row, when there is one."""
    base = next((r for r in rows if r["batch_size"] == 1), None)
    for r in rows + ref_rows:
        for key in ("tokens_per_s", "decode_tokens_per_s"):
            r[f"{key}_vs_tidespec_b1"] = r[key] / base[key] if base is not None and base[key] > 0 else float("nan")


def _headline_key(key: str, b: int) -> str:
    """The headline's name of tidespec / reference ``key`` at batch ``b``: vs_llamacpp, vs_llamacpp_b4."""
    return f"vs_{key}" if b == 1 else f"vs_{key}_b{b}"


def _decode_headline(rows: list[dict[str, Any]], ref_rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_b = {r["batch_size"]: r for r in rows}
    head: dict[str, Any] = {}
    if 1 in by_b and len(by_b) > 1:
        bmax = max(by_b)
        head["largest_batch"] = bmax
        head["throughput_ratio_largest_vs_batch1"] = by_b[bmax]["tokens_per_s"] / by_b[1]["tokens_per_s"]
        head["decode_ratio_largest_vs_batch1"] = by_b[bmax]["decode_tokens_per_s"] / by_b[1]["decode_tokens_per_s"]
    for ref in ref_rows:  # tidespec / reference at the same batch size: vs_hf_*, vs_llamacpp_*, vs_llamacpp_b4_*
        key = next(k for k, v in COMPARE_ENGINES.items() if v == ref["engine"])
        b = ref["batch_size"]
        if b in by_b:
            name = _headline_key(key, b)
            head[f"{name}_with_prefill"] = by_b[b]["tokens_per_s"] / ref["tokens_per_s"]
            head[f"{name}_decode_only"] = by_b[b]["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
            head[f"{name}_ttft"] = ref["ttft_ms"]["mean"] / by_b[b]["ttft_ms"]["mean"]  # > 1: our first token sooner
    return head


def format_decode_report(doc: dict[str, Any], command: str, info: dict[str, Any]) -> str:
    """Markdown: command, machine, the table, the headline ratios, skipped comparisons."""
    def ratio(r: dict[str, Any]) -> str:
        x = r.get("decode_tokens_per_s_vs_tidespec_b1")
        return "-" if x is None or math.isnan(x) else f"{x:.2f}x"

    table = markdown_table(
        ["engine", "batch", "requests", "tok/s (with prefill)", "tok/s (decode only)", "TTFT mean ms",
         "TTFT p50", "TTFT p90", "TPOT mean ms", "TPOT p50", "TPOT p90", "decode vs tidespec b1"],
        [[r["engine"], r["batch_size"], r["requests"], r["tokens_per_s"], r["decode_tokens_per_s"],
          r["ttft_ms"]["mean"], r["ttft_ms"]["p50"], r["ttft_ms"]["p90"], r["tpot_ms"]["mean"],
          r["tpot_ms"]["p50"], r["tpot_ms"]["p90"], ratio(r)] for r in doc["rows"]])
    cfg = doc["config"]
    lines = [f"### Decode throughput ({doc['workload']}, {len(doc['prompt_ids'])} prompts, "
             f"{cfg['max_tokens']} tokens each, greedy, EOS ignored)", "",
             f"Command: `{command}`", "", f"Machine: {machine_line(info)}", "", table, ""]
    h = doc["headline"]
    if "throughput_ratio_largest_vs_batch1" in h:
        lines.append(f"- batch {h['largest_batch']} / batch 1 throughput: {h['throughput_ratio_largest_vs_batch1']:.2f}x "
                     f"with prefill, {h['decode_ratio_largest_vs_batch1']:.2f}x decode-only")
    for key, label in (("hf", "HF transformers generate()"), ("llamacpp", "llama.cpp (llama-cpp-python, same GGUF)")):
        for b in cfg["batch_sizes"]:
            name = _headline_key(key, b)
            if f"{name}_with_prefill" in h:
                lines.append(f"- tidespec / {label} at batch {b}: {h[f'{name}_with_prefill']:.2f}x with prefill, "
                             f"{h[f'{name}_decode_only']:.2f}x decode-only; time to first token "
                             f"{h[f'{name}_ttft']:.2f}x (theirs / ours: above 1, ours comes sooner)")
    for r in doc["rows"]:
        agree = r.get("identical_prefix_vs_tidespec")
        if agree:
            lines.append(f"- {r['engine']} (batch {r['batch_size']}) greedy tokens identical to tidespec's for the first "
                         f"{agree['mean']:.1f} of {cfg['max_tokens']} on average (per prompt: "
                         f"{', '.join(str(n) for n in agree['per_prompt'])}; information only)")
    for r in doc["rows"]:
        if r.get("settings", {}).get("note"):
            lines.append(f"- {r['engine']}: {r['settings']['note']}")
    for notice in doc.get("skipped", {}).values():
        lines.append(f"- {notice}")
    return "\n".join(lines)


def _plot_decode(rows: list[dict[str, Any]], ref_rows: list[dict[str, Any]], out_dir: Path) -> Path:
    fig, (ax, ax2) = new_figure(2)
    bs = [r["batch_size"] for r in rows]
    ax.plot(bs, [r["tokens_per_s"] for r in rows], "o-", label="tidespec (with prefill)")
    ax.plot(bs, [r["decode_tokens_per_s"] for r in rows], "s--", label="tidespec (decode only)")
    engines = list(dict.fromkeys(r["engine"] for r in ref_rows))
    for engine, color in zip(engines, ("r", "g", "m")):
        mine = [r for r in ref_rows if r["engine"] == engine]
        rb = [r["batch_size"] for r in mine]
        ax.plot(rb, [r["tokens_per_s"] for r in mine], f"{color}*:", markersize=12, label=f"{engine} (with prefill)")
        ax.plot(rb, [r["decode_tokens_per_s"] for r in mine], f"{color}x:", markersize=10,
                label=f"{engine} (decode only)")
    log2_panel(ax, bs, "batch size", "output tokens / s", "Decode throughput")
    ax2.plot(bs, [r["tpot_ms"]["p50"] for r in rows], "o-", label="TPOT p50")
    ax2.plot(bs, [r["ttft_ms"]["p50"] for r in rows], "s--", label="TTFT p50")
    log2_panel(ax2, bs, "batch size", "ms", "Latency per batch size", log_y=True)
    return save_figure(fig, out_dir, "plot.png")
