"""``tidespec bench memory``: the server's resident memory after a burst of large rejected requests.

Why this exists: each ~1 MB prompt that the server refuses (longer than the context) is still
received, parsed, rendered through the chat template and tokenized before the refusal, and those
copies are freed; glibc keeps freed pages in its arenas, so resident memory used to settle 25-60 %
above its post-warm-up level and stay there. The server now hands them back
(``server.guard.MemoryTrimmer``); this benchmark shows it, before and after, on a live
``tidespec serve``: for each configuration (``--configs trim,no-trim``: the server with its default
``--trim-memory`` and with ``--no-trim-memory``) it warms the server up with a few normal requests,
records RSS, sends ``--num-requests`` prompts of ``--prompt-bytes`` (half completions, half chat,
multilingual words), samples RSS after each, lets the server idle ``--settle-s`` and records the
final RSS. The bar: final RSS within 15 % of the post-warm-up level.

Worked example::

    cfg = MemoryBenchConfig(num_requests=200, configs="trim,no-trim")
    doc = run_memory_bench(cfg, out_dir=Path("runs/bench-memory"))
    doc["rows"][0]   # {"config": "trim", "warm_mb": 1433.3, "peak_mb": 1720.8, "final_mb": 1528.3, "ratio": 1.066, ...}
"""

from __future__ import annotations

import json
import random
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from tqdm import tqdm

from tidespec.bench.common.report import command_line, machine_info, machine_line
from tidespec.bench.serve.run import free_port, launch_server, stop_server
from tidespec.config import ConfigError, Section, opt

CONFIGS = {"trim": "--trim-memory", "no-trim": "--no-trim-memory"}
BAR = 1.15  # final RSS / post-warm-up RSS the issue asks for
WORDS = ("tide", "spec", "river", "token", "delta", "marée", "Gezeiten", "данные", "поток", "潮汐", "数据", "波")


@dataclass
class MemoryBenchConfig(Section):
    configs: str = opt("trim,no-trim", f"comma-separated server configurations: {', '.join(CONFIGS)}")
    engine_args: str = opt("--threads 2 --max-num-seqs 4 --max-model-len 1024",
                           "engine flags of the launched tidespec serve (default model: the embedded one)")
    num_requests: int = opt(200, "large prompts sent (each refused: longer than the context)", min=1)
    prompt_bytes: int = opt(1_000_000, "bytes of each prompt (the body limit is 4 MiB)", min=1024, max=4_000_000)
    warmup_requests: int = opt(3, "normal requests before the post-warm-up RSS", min=1)
    settle_s: float = opt(3.0, "idle seconds before the final RSS", min=0.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        for c in self.config_list:
            if c not in CONFIGS:
                raise ConfigError(f"--configs: unknown configuration {c!r} (choose from {', '.join(CONFIGS)})")

    @property
    def config_list(self) -> list[str]:
        return [c.strip() for c in self.configs.split(",") if c.strip()]


def _prompt(rng: random.Random, size: int) -> str:
    words: list[str] = []
    n = 0
    while n < size:
        words.append(rng.choice(WORDS))
        n += len(words[-1].encode()) + 1
    return " ".join(words).encode()[:size].decode(errors="ignore")


def _burst(cfg: MemoryBenchConfig, name: str, bar: tqdm) -> dict[str, Any]:
    port = free_port()
    proc = launch_server(f"{cfg.engine_args} {CONFIGS[name]}", port, None, timeout=600, log_path=None)
    url = f"http://127.0.0.1:{port}"
    rss = psutil.Process(proc.pid)
    try:
        with httpx.Client(base_url=url, timeout=300) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            for _ in range(cfg.warmup_requests):
                r = c.post("/v1/completions", json={"model": model, "prompt": "def f(x):", "max_tokens": 16})
                r.raise_for_status()
            warm = rss.memory_info().rss
            samples: list[float] = []
            rng = random.Random(0)
            statuses: dict[str, int] = {}
            for i in range(cfg.num_requests):
                text = _prompt(rng, cfg.prompt_bytes)
                if i % 2:
                    r = c.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user",
                                                                                             "content": text}]})
                else:
                    r = c.post("/v1/completions", json={"model": model, "prompt": text})
                statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
                samples.append(rss.memory_info().rss / 2**20)
                bar.update()
            time.sleep(cfg.settle_s)
            final = rss.memory_info().rss
    finally:
        stop_server(proc)
    return {"config": name, "warm_mb": warm / 2**20, "peak_mb": max(samples), "final_mb": final / 2**20,
            "ratio": final / warm, "statuses": statuses, "rss_mb": samples}


def run_memory_bench(cfg: MemoryBenchConfig, out_dir: Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Every configuration: RSS after warm-up, during the burst and after it settled."""
    rows: list[dict[str, Any]] = []
    doc = {"config": asdict(cfg), "command": command_line(), "machine": machine_info(), "rows": rows}
    bar = tqdm(total=cfg.num_requests * len(cfg.config_list), desc="memory", unit="req", disable=not progress)
    for name in cfg.config_list:
        rows.append(_burst(cfg, name, bar))
        bar.write(f"{name}: {rows[-1]['warm_mb']:.0f} MB after warm-up, peak {rows[-1]['peak_mb']:.0f}, "
                  f"final {rows[-1]['final_mb']:.0f} ({rows[-1]['ratio']:.3f}x)")
        if out_dir is not None:
            _save(doc, out_dir)
    bar.close()
    if out_dir is not None:
        _save(doc, out_dir)
    return doc


def _save(doc: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1))
    (out_dir / "table.md").write_text(table(doc) + "\n")
    if doc["rows"]:
        _plot(doc, out_dir / "plot.png")


def table(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = [f"### Server RSS after {cfg['num_requests']} refused prompts of {cfg['prompt_bytes']:,} bytes", "",
             f"Command: `{doc['command']}`", "", f"Machine: {machine_line(doc['machine'])}", "",
             f"Server: `tidespec serve {shlex.join(shlex.split(cfg['engine_args']))}`", "",
             "| server | RSS after warm-up, MB | peak, MB | after the burst, MB | after / warm-up | within 15 % | answers |",
             "|---|---:|---:|---:|---:|---|---|"]
    for r in doc["rows"]:
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items()))
        lines.append(f"| {CONFIGS[r['config']]} | {r['warm_mb']:.0f} | {r['peak_mb']:.0f} | {r['final_mb']:.0f} | "
                     f"{r['ratio']:.3f}x | {'yes' if r['ratio'] <= BAR else 'no'} | {answers} |")
    return "\n".join(lines)


def _plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    for r in doc["rows"]:
        line = ax.plot(range(1, len(r["rss_mb"]) + 1), r["rss_mb"], label=CONFIGS[r["config"]])[0]
        ax.axhline(r["warm_mb"] * BAR, color=line.get_color(), lw=0.8, ls="--")
        ax.scatter([len(r["rss_mb"]) + 1], [r["final_mb"]], color=line.get_color(), marker="o")
    ax.set_xlabel("refused large request (dot: after settling; dashes: 1.15 x post-warm-up)")
    ax.set_ylabel("server RSS, MB")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
