"""``tidespec bench prefix``: what automatic prefix caching saves, and what it costs where nothing is shared.

Why this exists: prefix caching (``engine/prefix_cache.py``) is on by default, so it must pay where
prompts share a prefix and cost nothing where they do not, without changing a token. On a shared
2-core machine two benchmark runs minutes apart differ by 10-40 %, so both engines live in one
process over the same target -- one with prefix caching, one without -- and their requests or
steps alternate (A B, B A, ...), so a burst of load hits both. Three parts:

1. **shared prefix**: every request is a ``--prefix-tokens`` system prompt (chat records) or
   few-shot block (completion records), made of ``--prefix-from``'s prompts, then one record of
   ``--workload``; one request at a time. Time to first token without the cache, and with it on
   a hit (the cached engine's first request of each kind computes and caches the prefix: a miss,
   reported apart, so its cost shows too).
2. **next chat turn**: each chat record's answer, then the next record's question, resent with the
   whole history (system, question, answer) as an OpenAI client does; TTFT of that second turn.
3. **no sharing**: ``--throughput-workload`` prompts, ``--concurrency`` at once, each round on new
   prompts; the two engines' steps alternate; output tokens/s with the cache over without.

Every output of the cached engine is compared with the uncached engine's (greedy): ``identical``.

Worked example::

    cfg = PrefixBenchConfig(path="int4", limit=4, rounds=1)
    doc = run_prefix_bench(cfg, out_dir=Path("runs/prefix"))
    doc["summary"]["ttft_speedup"]     # e.g. 9.3: median TTFT without the cache / with it, on hits
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tidespec.bench.common.report import command_line, machine_info, machine_line, markdown_table, save_report
from tidespec.bench.exactness.run import parse_path, target_model
from tidespec.config import CacheConfig, EngineConfig, ModelConfig, Section, opt
from tidespec.engine.engine import LLMEngine
from tidespec.llm import build_engine
from tidespec.models.loading.loader import LoadedModel
from tidespec.sampling import SamplingParams
from tidespec.workloads.loader import WorkloadRecord, load_workload, prefix_text, prompt_token_ids


@dataclass
class PrefixBenchConfig(Section):
    path: str = opt("float32", "target path: [float32|bfloat16+][int8|int4|w4a8|w8a8|gguf][+compile]")
    workload: str = opt("code_unseen,chat", "comma-separated workloads whose records follow the shared prefix")
    limit: int = opt(8, "records of each workload", min=2)
    prefix_from: str = opt("code_extra", "workloads whose prompts make the shared prefix")
    prefix_tokens: int = opt(1024, "tokens of the shared prefix", min=16)
    max_tokens: int = opt(24, "tokens generated per request in parts 1 and 2 (EOS ignored)", min=1)
    throughput_workload: str = opt("chat", "prompts of part 3 (nothing shared but the chat template)")
    concurrency: int = opt(8, "requests at once in part 3", min=1)
    throughput_tokens: int = opt(64, "tokens generated per request in part 3 (EOS ignored)", min=1)
    rounds: int = opt(3, "rounds of part 3, each on the next prompts", min=1)
    threads: int = opt(2, "intra-op threads", min=1)
    max_model_len: int = opt(2048, "context of both engines", min=64)

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_path(self.path)


def _engines(target: LoadedModel, cfg: PrefixBenchConfig, slots: int) -> dict[bool, LLMEngine]:
    """{caching: engine}: the same target, prefix caching off and on."""
    dtype, quant, compile_ = parse_path(cfg.path)
    mc = ModelConfig(dtype=dtype, quantization=quant, compile=compile_, threads=cfg.threads)
    return {on: build_engine(EngineConfig(model=mc, cache=CacheConfig(max_model_len=cfg.max_model_len,
                                                                      max_num_seqs=slots, enable_prefix_caching=on)),
                             model=target.model, tokenizer=target.tokenizer) for on in (False, True)}


def _one(engine: LLMEngine, ids: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """One request alone: (seconds to its first token, its tokens, prompt tokens reused)."""
    t0 = time.perf_counter()
    engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    ttft, out = None, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if ttft is None and o.token_ids:
                ttft = time.perf_counter() - t0
            if o.finished:
                out = o
    assert ttft is not None and out is not None
    return ttft, list(out.token_ids), out.stats.num_cached_tokens


def _pair(engines: dict[bool, LLMEngine], ids: list[int], max_tokens: int, turn: int) -> dict[str, Any]:
    """The same request on both engines, the order alternating with ``turn``."""
    got = {}
    for on in ((False, True) if turn % 2 == 0 else (True, False)):
        got[on] = _one(engines[on], ids, max_tokens)
    return {"prompt_tokens": len(ids), "ttft_off_ms": 1e3 * got[False][0], "ttft_on_ms": 1e3 * got[True][0],
            "cached_tokens": got[True][2], "identical": got[False][1] == got[True][1], "tokens": got[False][1]}


def _shared_prefix(engines: dict[bool, LLMEngine], records: list[WorkloadRecord], cfg: PrefixBenchConfig,
                   bar: tqdm) -> list[dict[str, Any]]:
    tok = engines[True].tokenizer
    rows = []
    for i, rec in enumerate(records):
        row = _pair(engines, prompt_token_ids(rec, tok), cfg.max_tokens, i)
        rows.append({"id": rec.id, "kind": rec.kind, **row})
        bar.update()
    return rows


def _next_turn(engines: dict[bool, LLMEngine], records: list[WorkloadRecord], first: list[dict[str, Any]],
               cfg: PrefixBenchConfig, bar: tqdm) -> list[dict[str, Any]]:
    """Each chat record's first turn was served in part 1; its second turn resends the history."""
    tok = engines[True].tokenizer
    chats = [(rec, row) for rec, row in zip(records, first) if rec.kind == "chat"]
    rows = []
    for i, (rec, row) in enumerate(chats):
        follow = chats[(i + 1) % len(chats)][0].prompt
        answer = tok.decode(row["tokens"], skip_special_tokens=True)
        messages = rec.messages() + [{"role": "assistant", "content": answer}, {"role": "user", "content": follow}]
        ids = [int(t) for t in tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)]
        rows.append({"id": rec.id, "history_tokens": row["prompt_tokens"] + len(row["tokens"]),
                     **_pair(engines, ids, cfg.max_tokens, i)})
        bar.update()
    return rows


def _throughput(engines: dict[bool, LLMEngine], prompts: list[list[int]], cfg: PrefixBenchConfig,
                bar: tqdm) -> dict[str, Any]:
    """Rounds of ``concurrency`` new prompts on both engines, steps alternating; output tok/s each."""
    params = SamplingParams(max_tokens=cfg.throughput_tokens, ignore_eos=True)
    spent, tokens, same = {False: 0.0, True: 0.0}, {False: 0, True: 0}, True
    cached = 0
    for r in range(cfg.rounds):
        batch = [prompts[(r * cfg.concurrency + i) % len(prompts)] for i in range(cfg.concurrency)]
        ids = {on: [e.add_request(p, params) for p in batch] for on, e in engines.items()}
        outs: dict[bool, dict[str, list[int]]] = {False: {}, True: {}}
        order = [False, True]
        while any(e.has_unfinished_requests() for e in engines.values()):
            for on in order:
                if not engines[on].has_unfinished_requests():
                    continue
                t0 = time.perf_counter()
                done = engines[on].step()
                spent[on] += time.perf_counter() - t0
                for o in done:
                    if o.finished:
                        outs[on][o.request_id] = list(o.token_ids)
                        tokens[on] += len(o.token_ids)
                        cached += o.stats.num_cached_tokens if on else 0
            order.reverse()
        same = same and [outs[False][i] for i in ids[False]] == [outs[True][i] for i in ids[True]]
        bar.update()
    return {"seconds_off": spent[False], "seconds_on": spent[True], "tok_s_off": tokens[False] / spent[False],
            "tok_s_on": tokens[True] / spent[True], "speed_on_vs_off": spent[False] / spent[True],
            "cached_tokens": cached, "prompt_tokens": sum(len(p) for p in prompts[:cfg.rounds * cfg.concurrency]),
            "identical": same}


def _median(rows: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rows]
    return float(statistics.median(values)) if values else float("nan")


def summarize(shared: list[dict[str, Any]], turns: list[dict[str, Any]], thr: dict[str, Any]) -> dict[str, Any]:
    """Medians: TTFT without the cache (every request), with it on hits and on misses; the next turn's;
    the throughput ratio; whether every output was identical."""
    hits = [r for r in shared if r["cached_tokens"]]
    misses = [r for r in shared if not r["cached_tokens"]]
    turn_hits = [r for r in turns if r["cached_tokens"]]
    return {
        "ttft_off_ms": _median(shared, "ttft_off_ms"), "ttft_hit_ms": _median(hits, "ttft_on_ms"),
        "ttft_speedup": _median(hits, "ttft_off_ms") / _median(hits, "ttft_on_ms") if hits else float("nan"),
        "hits": len(hits), "requests": len(shared), "cached_tokens_per_hit": _median(hits, "cached_tokens"),
        "miss_on_vs_off": (sum(r["ttft_on_ms"] for r in misses) / sum(r["ttft_off_ms"] for r in misses)
                           if misses else float("nan")),
        "turn_ttft_off_ms": _median(turns, "ttft_off_ms"), "turn_ttft_on_ms": _median(turn_hits, "ttft_on_ms"),
        "turn_speedup": (_median(turn_hits, "ttft_off_ms") / _median(turn_hits, "ttft_on_ms")
                         if turn_hits else float("nan")),
        "turn_cached_fraction": (sum(r["cached_tokens"] for r in turns) / sum(r["prompt_tokens"] for r in turns)
                                 if turns else float("nan")),
        "throughput_on_vs_off": thr["speed_on_vs_off"],
        "identical": all(r["identical"] for r in shared + turns) and thr["identical"],
    }


def run_prefix_bench(cfg: PrefixBenchConfig, out_dir: Path | None = None, progress: bool = True) -> dict[str, Any]:
    """The three parts on one target; writes ``results.json``, ``table.md`` and ``plot.png``."""
    torch.set_num_threads(cfg.threads)
    dtype, quant, _ = parse_path(cfg.path)
    target = target_model(dtype, quant, {})
    tok = target.tokenizer
    prefix = prefix_text(cfg.prefix_from, tok, cfg.prefix_tokens)
    records = [dataclasses.replace(r, system=prefix) for name in cfg.workload.split(",") if name.strip()
               for r in load_workload(name.strip(), cfg.limit)]
    plain = [prompt_token_ids(r, tok) for r in load_workload(cfg.throughput_workload)]
    chats = sum(r.kind == "chat" for r in records)
    bar = tqdm(total=len(records) + chats + cfg.rounds, desc="prefix", unit="part", disable=not progress)
    engines = _engines(target, cfg, cfg.concurrency)
    shared = _shared_prefix(engines, records, cfg, bar)
    turns = _next_turn(engines, records, shared, cfg, bar) if chats > 1 else []
    engines = _engines(target, cfg, cfg.concurrency)  # part 3 starts from empty caches
    thr = _throughput(engines, plain, cfg, bar)
    bar.close()
    for row in shared:
        del row["tokens"]
    doc = {"config": asdict(cfg), "command": command_line(), "machine": machine_info(dtype),
           "summary": summarize(shared, turns, thr), "shared_prefix": shared, "next_turn": turns, "throughput": thr}
    if out_dir is not None:
        save_report(out_dir, doc, table(doc), _plot)
    return doc


def table(doc: dict[str, Any]) -> str:
    """The markdown report."""
    s, c, thr = doc["summary"], doc["config"], doc["throughput"]
    rows = [
        ["shared prefix: TTFT, no cache (all requests)", f"{s['ttft_off_ms']:.0f} ms", ""],
        ["shared prefix: TTFT on a hit", f"{s['ttft_hit_ms']:.0f} ms",
         (f"{s['ttft_speedup']:.1f}x faster ({s['hits']}/{s['requests']} hits, "
          f"{s['cached_tokens_per_hit']:.0f} tokens reused)")],
        ["shared prefix: TTFT on a miss, cache on / off", f"{s['miss_on_vs_off']:.3f}x", "saving the blocks"],
        ["next chat turn (history resent): TTFT, no cache", f"{s['turn_ttft_off_ms']:.0f} ms", ""],
        ["next chat turn: TTFT with the cache", f"{s['turn_ttft_on_ms']:.0f} ms",
         f"{s['turn_speedup']:.1f}x faster ({s['turn_cached_fraction']:.0%} of its prompt reused)"],
        [f"no sharing ({c['throughput_workload']}, {c['concurrency']} at once): output tok/s, off -> on",
         f"{thr['tok_s_off']:.1f} -> {thr['tok_s_on']:.1f}", f"{s['throughput_on_vs_off']:.3f}x"],
        ["outputs identical with and without the cache", "yes" if s["identical"] else "**NO**", ""],
    ]
    title = (f"### Prefix caching on `{c['path']}`: a {c['prefix_tokens']}-token shared prefix, one request at a "
             f"time; {c['throughput_workload']} at {c['concurrency']} in flight")
    return "\n".join([title, "",
                      f"Command: `{doc['command']}`", "", f"Machine: {machine_line(doc['machine'])}", "",
                      markdown_table(["", "measured", "note"], rows)])


def _plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 1]})
    rows = doc["shared_prefix"] + doc["next_turn"]
    x = range(len(rows))
    ax1.bar([i - 0.2 for i in x], [r["ttft_off_ms"] for r in rows], width=0.4, label="no prefix cache",
            color="tab:gray")
    ax1.bar([i + 0.2 for i in x], [r["ttft_on_ms"] for r in rows], width=0.4, label="prefix cache", color="tab:blue")
    ax1.axvline(len(doc["shared_prefix"]) - 0.5, color="black", lw=0.8)
    ax1.set_yscale("log")
    ax1.set_ylabel("time to first token, ms")
    ax1.set_xlabel("request (left: shared prefix, one at a time; right: next chat turn)")
    ax1.legend(loc="upper right")
    thr = doc["throughput"]
    ax2.bar(["off", "on"], [thr["tok_s_off"], thr["tok_s_on"]], color=["tab:gray", "tab:blue"])
    ax2.set_ylabel(f"output tok/s, {doc['config']['concurrency']} at once, nothing shared")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
