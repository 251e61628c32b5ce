"""``tidespec bench kv``: how many sequences run at once in the same KV memory, paged or in slots.

Why this exists: a slot cache reserves ``--max-model-len`` positions per sequence, so the memory
given to the cache bounds the sequences in flight by the worst case; the paged cache
(``models/kv/paged.py``) bounds them by the tokens really held. This benchmark gives both the
same memory -- ``--slots`` sequences of ``--max-model-len`` positions -- and the same burst of
``--requests`` requests of ``--seq-tokens`` tokens each (a chat prompt, then output to that length,
EOS ignored), and records the sequences running each step, output tokens/s (over each engine's
own steps) and preemptions. "Slots" is the paged engine with blocks of ``--max-model-len``
tokens: one block per sequence, the slot cache's reservation, with the same kernels, admission
and arithmetic, so the two differ by the block size alone. Both engines live in one process over the same target
and their steps alternate, so a burst of load on a shared machine hits both; greedy outputs are
compared (``identical``).

With ``--shared-prefix-tokens N`` every prompt starts with the same N-token few-shot block
(``--prefix-from``'s prompts) and both engines are paged: prefix caching off ("paged": each
sequence computes and holds the block itself) against on ("paged+prefix": its KV blocks are
cached once and sit in every sequence's block table, ``models/kv/blocks.py``). A
request before the burst puts the block in the cache, as earlier traffic would have; both engines
serve it. Each sequence then holds ``N + --seq-tokens`` positions.

Worked example::

    doc = run_kv_bench(KVBenchConfig(path="int4", requests=32), out_dir=Path("runs/kv"))
    doc["summary"]["concurrency_ratio"]   # e.g. 7.5: peak sequences at once, paged over slots
    doc = run_kv_bench(KVBenchConfig(path="int4", shared_prefix_tokens=1024, workload="code_unseen"))
    doc["summary"]["concurrency_ratio"]   # sharing the cached block over holding it per sequence
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tidespec.bench.common.report import command_line, machine_info, machine_line, markdown_table, save_report
from tidespec.bench.exactness.run import parse_path, target_model
from tidespec.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, Section, opt
from tidespec.engine.engine import LLMEngine
from tidespec.llm import build_engine
from tidespec.sampling import SamplingParams
from tidespec.workloads.loader import load_workload, prefix_text, prompt_token_ids

LAYOUTS = ("slots", "paged")  # what is compared, the baseline first
SHARING = ("paged", "paged+prefix")  # with --shared-prefix-tokens


@dataclass
class KVBenchConfig(Section):
    path: str = opt("int4", "target path: [float32|bfloat16+][int8|int4|w4a8|w8a8|gguf][+compile]")
    slots: int = opt(4, "the memory given to both caches: this many sequences of --max-model-len", min=1)
    max_model_len: int = opt(2048, "context per sequence (the slot layout's block)", min=64)
    requests: int = opt(32, "requests in the burst, all sent at once", min=2)
    seq_tokens: int = opt(256, "tokens per sequence, prompt + output", min=32)
    block_size: int = opt(16, "the paged layout's block size", min=16)
    workload: str = opt("chat", "workload whose prompts start the sequences")
    shared_prefix_tokens: int = opt(0, "when > 0: every prompt starts with the same block of this many tokens, "
                                       "and prefix caching (shared blocks) is compared with none, both paged", min=0)
    prefix_from: str = opt("code_extra", "workloads whose prompts make the shared block")
    threads: int = opt(2, "intra-op threads", min=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_path(self.path)
        if self.shared_prefix_tokens + self.seq_tokens > self.max_model_len:
            raise ConfigError(f"shared_prefix_tokens + seq_tokens ({self.shared_prefix_tokens} + {self.seq_tokens}) "
                              f"exceeds max_model_len {self.max_model_len}")

    @property
    def layouts(self) -> tuple[str, str]:
        return SHARING if self.shared_prefix_tokens else LAYOUTS


def _engine(target: Any, cfg: KVBenchConfig, memory_mb: int, layout: str) -> LLMEngine:
    dtype, quant, compile_ = parse_path(cfg.path)
    mc = ModelConfig(dtype=dtype, quantization=quant, compile=compile_, threads=cfg.threads)
    cache = CacheConfig(max_model_len=cfg.max_model_len, max_num_seqs=cfg.requests, kv_cache_memory_mb=memory_mb,
                        block_size=cfg.max_model_len if layout == "slots" else cfg.block_size,
                        enable_prefix_caching=layout == "paged+prefix")
    return build_engine(EngineConfig(model=mc, cache=cache), model=target.model, tokenizer=target.tokenizer)


def _burst(engines: dict[str, LLMEngine], prompts: list[list[int]], cfg: KVBenchConfig, bar: tqdm,
           shared: int = 0) -> dict[str, dict[str, Any]]:
    """Every request at once on both engines, their steps alternating until both are done; each
    generates to ``--seq-tokens`` tokens past the ``shared`` first ones."""
    state: dict[str, dict[str, Any]] = {}
    for name, e in engines.items():
        ids = [e.add_request(p, SamplingParams(max_tokens=shared + cfg.seq_tokens - len(p), ignore_eos=True))
               for p in prompts]
        state[name] = {"ids": ids, "spent": 0.0, "running": [], "out": {}, "preempted": 0}
    order = list(cfg.layouts)
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name in order:
            e, st = engines[name], state[name]
            if not e.has_unfinished_requests():
                continue
            t = time.perf_counter()
            outs = e.step()
            st["spent"] += time.perf_counter() - t
            st["running"].append(e.last_stats.num_running)
            st["preempted"] += e.last_stats.num_preempted
            for o in outs:
                if o.finished:
                    st["out"][o.request_id] = list(o.token_ids)
                    bar.update()
        order.reverse()
    rows = {}
    for name, st in state.items():
        tokens = sum(len(t) for t in st["out"].values())
        rows[name] = {"steps": len(st["running"]), "peak_running": max(st["running"]),
                      "mean_running": statistics.fmean(st["running"]), "preemptions": st["preempted"],
                      "tok_s": tokens / st["spent"], "seconds": st["spent"], "tokens": tokens,
                      "outputs": [st["out"][i] for i in st["ids"]]}
    return rows


def run_kv_bench(cfg: KVBenchConfig, out_dir: Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Both layouts on one target; writes ``results.json``, ``table.md`` and ``plot.png``."""
    torch.set_num_threads(cfg.threads)
    dtype, quant, _ = parse_path(cfg.path)
    target = target_model(dtype, quant, {})
    mcfg = target.model.cfg
    per_position = 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * target.model.dtype.itemsize
    memory_mb = math.ceil(cfg.slots * cfg.max_model_len * per_position / 2**20)
    records = load_workload(cfg.workload)
    shared: list[int] = []
    if cfg.shared_prefix_tokens:
        text = prefix_text(cfg.prefix_from, target.tokenizer, cfg.shared_prefix_tokens)
        shared = target.tokenizer.encode(text, add_special_tokens=False)
    prompts = []
    for i in range(cfg.requests + 1):  # the last one: the request before the burst
        ids = prompt_token_ids(records[i % len(records)], target.tokenizer)
        prompts.append(shared + ids[:cfg.seq_tokens // 2])  # at most half the sequence: every request generates
    base, new = cfg.layouts
    engines = {name: _engine(target, cfg, memory_mb, name) for name in cfg.layouts}
    earlier = prompts.pop()
    if shared:  # earlier traffic: the shared block is in the cache before the burst
        for e in engines.values():
            e.add_request(earlier, SamplingParams(max_tokens=1))
            while e.has_unfinished_requests():
                e.step()
    bar = tqdm(total=2 * cfg.requests, desc="kv", unit="req", disable=not progress)
    rows = _burst(engines, prompts, cfg, bar, len(shared))
    bar.close()
    identical = rows[base]["outputs"] == rows[new]["outputs"]
    for row in rows.values():
        del row["outputs"]
    capacity = {name: e.kv.num_blocks * e.kv.block_size for name, e in engines.items()}  # type: ignore[attr-defined]
    summary = {"memory_mb": memory_mb, "capacity_tokens": capacity, "layouts": [base, new],
               "concurrency_ratio": rows[new]["peak_running"] / rows[base]["peak_running"],
               "throughput_ratio": rows[new]["tok_s"] / rows[base]["tok_s"], "identical": identical}
    doc = {"config": asdict(cfg), "command": command_line(), "machine": machine_info(dtype), "summary": summary,
           "rows": rows}
    if out_dir is not None:
        save_report(out_dir, doc, table(doc), _plot)
    return doc


def table(doc: dict[str, Any]) -> str:
    """The markdown report."""
    c, s, r = doc["config"], doc["summary"], doc["rows"]
    rows = [[name, f"{s['capacity_tokens'][name]:,}", r[name]["peak_running"], f"{r[name]['mean_running']:.1f}",
             r[name]["preemptions"], r[name]["steps"], f"{r[name]['tok_s']:.1f}"] for name in s["layouts"]]
    shared = c.get("shared_prefix_tokens", 0)
    title = (f"### KV layout on `{c['path']}`: {s['memory_mb']} MiB (= {c['slots']} slots of {c['max_model_len']}), "
             f"{c['requests']} requests of {c['seq_tokens']} tokens at once"
             + (f", each after the same {shared}-token block" if shared else ""))
    notes = (f"{s['layouts'][1]} over {s['layouts'][0]}: **{s['concurrency_ratio']:.1f}x** the sequences at once, "
             f"{s['throughput_ratio']:.2f}x the output tokens/s; outputs identical: "
             f"{'yes' if s['identical'] else '**NO**'}.")
    return "\n".join([title, "", f"Command: `{doc['command']}`", "", f"Machine: {machine_line(doc['machine'])}", "",
                      markdown_table(["layout", "tokens the memory holds", "peak sequences at once", "mean at once",
                                      "preemptions", "steps", "output tok/s"], rows), "", notes])


def _plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r, names = doc["rows"], doc["summary"]["layouts"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    colors = ["tab:gray", "tab:blue"]
    ax1.bar(names, [r[n]["peak_running"] for n in names], color=colors)
    ax1.set_ylabel("peak sequences at once")
    ax2.bar(names, [r[n]["tok_s"] for n in names], color=colors)
    ax2.set_ylabel("output tok/s")
    shared = doc["config"].get("shared_prefix_tokens", 0)
    fig.suptitle(f"same KV memory ({doc['summary']['memory_mb']} MiB), {doc['config']['requests']} requests at once"
                 + (f", each after the same {shared}-token block" if shared else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
