"""``tidespec bench anchor``: plain decoding of a model shape against the compiled static-shape anchor.

Why this exists: on a GPU the question is how close an engine's decode step comes to what the
hardware allows for a given model shape. Speed does not depend on the weights' values, so the
models here have random weights of real shapes (no checkpoint travels); the yardstick is
``bench/anchor/model.py`` (gpt-fast's recipe: static cache, ``torch.compile(mode="reduce-overhead")``,
no host sync per token) over the same weights, measured in the same run, interleaved round by
round so drift hits both alike.

Method. Per shape and batch size B: tidespec's engine (the model flags as given: device, dtype,
``--compile``, ``--enforce-eager``) serves B requests of ``prompt_len`` random token ids, each
generating exactly ``max_tokens`` greedy tokens; tokens/s decode-only = tokens emitted by steps
that ran no prefill / those steps' wall time (the engine syncs once per step to read its tokens,
so a step's wall time is its whole cost: host work, launches and GPU time). The anchor decodes
B x ``max_tokens`` tokens from position ``prompt_len`` over a cache of ``prompt_len + max_tokens``
positions (never longer than tidespec's key range). Each figure is the median over ``rounds``.

Worked example (on a GPU)::

    tidespec bench anchor --device cuda --dtype bfloat16 --shapes smollm2-135m,tinyllama-1.1b --batch-sizes 1,16
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tidespec.bench.anchor.model import AnchorModel
from tidespec.bench.common import report
from tidespec.bench.decode.run import run_wave
from tidespec.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tidespec.engine.engine import LLMEngine
from tidespec.errors import ConfigError, check_at_least
from tidespec.llm import DTYPES
from tidespec.models.families import build_target
from tidespec.models.loading.loader import check_device
from tidespec.models.target import TargetConfig, TargetModel
from tidespec.sampling import SamplingParams
from tidespec.workloads.loader import Prompt, WorkloadRecord

# Real model shapes (architecture fields of their config.json), served with random weights.
SHAPES: dict[str, TargetConfig] = {
    "smollm2-135m": TargetConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                                max_position_embeddings=8192, tie_word_embeddings=True, eos_token_ids=(2,)),
    "tinyllama-1.1b": TargetConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=22,
                                  num_heads=32, num_kv_heads=4, head_dim=64, max_position_embeddings=2048,
                                  eos_token_ids=(2,)),
}


@dataclass
class AnchorBenchConfig:
    shapes: tuple[str, ...] = ("smollm2-135m", "tinyllama-1.1b")
    batch_sizes: tuple[int, ...] = (1, 16)
    prompt_len: int = 64
    max_tokens: int = 128
    rounds: int = 3
    seed: int = 0
    compile_anchor: bool = True  # False: the anchor runs eagerly (tests; its speed is then no anchor)

    def __post_init__(self) -> None:
        unknown = [s for s in self.shapes if s not in SHAPES]
        if not self.shapes or unknown:
            raise ConfigError(f"unknown shape(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(SHAPES)}")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ConfigError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        check_at_least(1, prompt_len=self.prompt_len, rounds=self.rounds)
        check_at_least(2, max_tokens=self.max_tokens)


def synthetic_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``t0 .. t{V-1}`` (``t0`` doubles as EOS): what an engine needs
    of a tokenizer (EOS id, detokenization) for models whose text means nothing."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", unk_token="t1")


def random_model(cfg: TargetConfig, dtype: torch.dtype, device: str, seed: int) -> TargetModel:
    """A ``TargetModel`` of shape ``cfg`` built on ``device``, matrices N(0, 0.02), norms 1."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = build_target(cfg)
    model = model.to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return model.eval()


def engine_decode_speed(engine: LLMEngine, batch: int, prompt_len: int, max_tokens: int,
                        gen: torch.Generator) -> float:
    """Decode-only tokens/s of one wave of ``batch`` random prompts through ``engine`` (``run_wave``'s
    accounting: tokens of steps without prefill over those steps' wall time)."""
    vocab = engine.model.cfg.vocab_size
    prompts = [Prompt(WorkloadRecord(f"random-{i}", "random", "completion", ""),
                      torch.randint(1, vocab, (prompt_len,), generator=gen).tolist()) for i in range(batch)]
    wave = run_wave(engine, prompts, list(range(batch)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return wave.decode_tokens / wave.decode_time if wave.decode_time else float("nan")


def run_anchor_bench(cfg: AnchorBenchConfig, model_config: ModelConfig, out_dir: Path | None = None,
                     command: str = "", echo: bool = True) -> dict[str, Any]:
    """Measure every (shape, batch) for tidespec and the anchor; write results.json, table.md, plot.png."""
    dtype = DTYPES[model_config.dtype]
    check_device(model_config.device)
    gen = torch.Generator().manual_seed(cfg.seed)
    rows: list[dict[str, Any]] = []
    for shape in cfg.shapes:
        model = random_model(SHAPES[shape], dtype, model_config.device, cfg.seed)
        params = sum(p.numel() for p in model.parameters())  # a tied LM head counted once
        tok = synthetic_tokenizer(model.cfg.vocab_size)
        engines, anchors, setup = {}, {}, {}
        for b in cfg.batch_sizes:
            ec = EngineConfig(model=model_config, cache=CacheConfig(max_model_len=max(512, cfg.prompt_len +
                                                                                   cfg.max_tokens), max_num_seqs=b),
                              scheduler=SchedulerConfig(max_num_batched_tokens=max(512, b * cfg.prompt_len)))
            t0 = time.perf_counter()
            engines[b] = LLMEngine(model, tok, ec)
            setup[b] = time.perf_counter() - t0
            anchors[b] = AnchorModel(model, b, cfg.prompt_len + cfg.max_tokens, compile=cfg.compile_anchor)
        ours: dict[int, list[float]] = {b: [] for b in cfg.batch_sizes}
        theirs: dict[int, list[float]] = {b: [] for b in cfg.batch_sizes}
        for _ in range(cfg.rounds):
            for b in cfg.batch_sizes:
                ours[b].append(engine_decode_speed(engines[b], b, cfg.prompt_len, cfg.max_tokens, gen))
                theirs[b].append(anchors[b].decode_speed(cfg.prompt_len, cfg.max_tokens))
        for b in cfg.batch_sizes:
            graphs = engines[b].executor.graphs
            row = {"shape": shape, "params": params, "batch": b, "tidespec_tok_s": statistics.median(ours[b]),
                   "anchor_tok_s": statistics.median(theirs[b]), "tidespec_runs": ours[b], "anchor_runs": theirs[b],
                   "engine_setup_s": setup[b], "graphs": len(graphs.graphs) if graphs is not None else 0,
                   "graph_forwards": graphs.num_replayed if graphs is not None else 0}
            row["ratio"] = row["tidespec_tok_s"] / row["anchor_tok_s"]
            rows.append(row)
            print(f"{shape} batch {b}: tidespec {row['tidespec_tok_s']:.0f} tok/s, anchor {row['anchor_tok_s']:.0f} "
                  f"tok/s ({row['ratio']:.2f}x)", flush=True)
        del engines, anchors, model
        if model_config.device.startswith("cuda"):
            torch.cuda.empty_cache()
    doc = {"config": dataclasses.asdict(cfg), "model": dataclasses.asdict(model_config), "rows": rows,
           "device": torch.cuda.get_device_name(0) if model_config.device.startswith("cuda") else "cpu"}
    return report.write_results("anchor", doc, out_dir, command, model_config.dtype, _render,
                         lambda d: _plot(rows, cfg, d), echo)


def _render(doc: dict[str, Any], command: str, info: dict[str, Any]) -> str:
    mc = doc["model"]
    eager = "eager forward" if mc["enforce_eager"] or not mc["device"].startswith("cuda") else "CUDA graphs"
    mode = f"{eager}{' over an inductor-compiled decoder layer' if mc['compile'] else ''}"
    table = report.markdown_table(
        ["shape", "params", "batch", "tidespec tok/s", "anchor tok/s", "tidespec / anchor", "graphs", "setup s"],
        [[r["shape"], f"{r['params'] / 1e6:.0f}M", r["batch"], r["tidespec_tok_s"], r["anchor_tok_s"], r["ratio"],
          r["graphs"], r["engine_setup_s"]] for r in doc["rows"]], digits=2)
    c = doc["config"]
    machine = f"machine: {report.machine_line(info)}; device {doc['device']}"
    method = (f"Plain greedy decode, random weights, {c['prompt_len']}-token prompts, {c['max_tokens']} tokens each; "
              f"tidespec ({mode}) decode-only tok/s against the compiled static-shape anchor "
              f"(reduce-overhead{'' if c['compile_anchor'] else ', here NOT compiled'}); median of {c['rounds']} "
              "interleaved rounds.")
    return "\n".join(["# tidespec bench anchor", "", f"command: `{command}`", "", machine, "", method, "", table, ""])


def _plot(rows: list[dict[str, Any]], cfg: AnchorBenchConfig, out_dir: Path) -> Path:
    fig, axes = report.new_figure(len(cfg.shapes))
    for ax, shape in zip(axes, cfg.shapes):
        mine = [r for r in rows if r["shape"] == shape]
        bs = [r["batch"] for r in mine]
        ax.plot(bs, [r["tidespec_tok_s"] for r in mine], "o-", label="tidespec")
        ax.plot(bs, [r["anchor_tok_s"] for r in mine], "s--", label="compiled static-shape anchor")
        report.log2_panel(ax, bs, "batch size", "decode tok/s", shape, log_y=True)
    return report.save_figure(fig, out_dir, "plot.png")
