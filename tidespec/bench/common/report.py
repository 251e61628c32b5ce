"""Shared helpers of the benchmarks: percentiles, markdown tables, machine info, result files, plots.

Why this exists: every benchmark must leave the same evidence behind — the numbers, the exact
command that produced them and the machine they were taken on — in the same shape, so that
``docs/benchmarks/`` can be written from the JSON files alone and two runs can be compared.

Worked example::

    percentile([1.0, 2.0, 3.0, 4.0], 50)          # 2.5 (linear interpolation, numpy's default)
    summarize([1.0, 2.0, 3.0, 4.0])              # {"mean": 2.5, "p50": 2.5, "p90": 3.7, ...}
    print(markdown_table(["batch", "tok/s"], [[1, 31.25], [4, 97.0]]))
    # | batch | tok/s |
    # |---:|---:|
    # | 1 | 31.2 |
    # | 4 | 97.0 |
    path = write_json(out_dir, "results.json", {"rows": ...}, command="tidespec bench decode")
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure

from tidespec.config import ConfigError
from tidespec.files import cpu_name


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN for no values.

    Example: ``percentile([1, 2, 3, 4], 50) == 2.5``; ``percentile(range(1, 11), 90) == 9.1``.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    finite = [float(v) for v in values if not math.isnan(float(v))]
    if not finite:
        return float("nan")
    return float(np.percentile(np.asarray(finite, dtype=np.float64), q))


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean, min, p10, p50, p90, max of ``values`` (NaNs ignored; all NaN when empty)."""
    finite = [float(v) for v in values if not math.isnan(float(v))]
    return {
        "mean": float(np.mean(finite)) if finite else float("nan"),
        "min": min(finite) if finite else float("nan"),
        "p10": percentile(finite, 10),
        "p50": percentile(finite, 50),
        "p90": percentile(finite, 90),
        "max": max(finite) if finite else float("nan"),
        "n": float(len(finite)),
    }


def _cell(value: Any, digits: int) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 1) -> str:
    """A GitHub markdown table; floats get ``digits`` decimals, NaN and None print as ``-``.
    Columns whose first row holds a number are right-aligned."""
    if any(len(r) != len(headers) for r in rows):
        raise ValueError("every row must have one cell per header")
    numeric = [bool(rows) and isinstance(rows[0][i], (int, float)) and not isinstance(rows[0][i], bool)
               for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(_cell(c, digits) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def machine_info(dtype: str | None = None) -> dict[str, Any]:
    """Where and how a benchmark ran: CPU, cores, threads, library versions, dtype."""
    import transformers

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 0
    return {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "dtype": dtype,
    }


def machine_line(info: dict[str, Any]) -> str:
    """One human line for a report header."""
    dtype = f", dtype {info['dtype']}" if info.get("dtype") else ""  # none: the report names one per row
    return (f"{info['cpu']}, {info['usable_cores']} usable cores, torch {info['torch']} with "
            f"{info['torch_threads']} threads, transformers {info['transformers']}{dtype}")


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as a user would retype it (``tidespec bench decode ...``)."""
    args = list(sys.argv if argv is None else argv)
    if not args:
        return ""
    prog = Path(args[0]).name
    if prog in ("cli.py", "__main__.py"):
        prog = "python -m tidespec.cli"
    return " ".join([prog, shlex.join(args[1:])]).strip()


def default_out_dir(kind: str, root: str | Path = "runs") -> Path:
    """``runs/bench-<kind>-<YYYYmmdd-HHMMSS>`` (relative to the working directory)."""
    return Path(root) / f"bench-{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None  # JSON has no NaN; null reads as "not measured"
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        return _jsonable(obj.item())
    if isinstance(obj, Path):
        return str(obj)
    return obj


def finish_run(out_dir: Path, kind: str, doc: dict[str, Any], command: str, dtype: str,
               render: Callable[[dict[str, Any]], str], plot: Callable[[dict[str, Any], Path], Any],
               log: Callable[[str], None]) -> dict[str, Any]:
    """Write ``bench_<kind>.json`` (with command and machine), then ``README.md`` from ``render``
    and the plot; log the report. Returns ``doc`` with ``command`` and ``machine`` added."""
    info = machine_info(dtype)
    write_json(out_dir, f"bench_{kind}.json", doc, command, info)
    doc["command"], doc["machine"] = command, info
    text = render(doc)
    write_text(out_dir, "README.md", text)
    plot(doc, out_dir)
    log(text)
    return doc


def write_results(kind: str, doc: dict[str, Any], out_dir: Path | None, command: str, dtype: str,
                  render: Callable[[dict[str, Any], str, dict[str, Any]], str], plot: Callable[[Path], Any],
                  echo: bool) -> dict[str, Any]:
    """The output tail of ``bench decode`` / ``spec`` / ``profile``: ``results.json`` holding
    ``{"bench": kind, **doc}`` (with command and machine), the plot (``plot(out_dir)``) and
    ``table.md`` from ``render(doc, command, machine)``, all in ``out_dir`` (default
    ``runs/bench-<kind>-<time>``); the table printed when ``echo``. Returns the document."""
    info = machine_info(dtype)
    doc = {"bench": kind, **doc}
    out_dir = out_dir or default_out_dir(kind)
    write_json(out_dir, "results.json", doc, command, info)
    plot(out_dir)
    text = render(doc, command, info)
    write_text(out_dir, "table.md", text)
    if echo:
        print(text)
        print(f"\nwrote {out_dir / 'results.json'}, {out_dir / 'plot.png'}")
    return doc


def rerender_run(out_dir: Path, kind: str, render: Callable[[dict[str, Any]], str],
                 plot: Callable[[dict[str, Any], Path], Any]) -> dict[str, Any]:
    """``--replot``: README.md and the plot of an earlier run again, from its ``bench_<kind>.json``
    (``ConfigError``, a one-line CLI error, when that file is not there)."""
    path = out_dir / f"bench_{kind}.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found (is {out_dir} a bench {kind} output directory?)")
    doc = json.loads(path.read_text(encoding="utf-8"))
    write_text(out_dir, "README.md", render(doc))
    plot(doc, out_dir)
    return doc


def write_json(out_dir: Path, name: str, payload: dict[str, Any], command: str,
               machine: dict[str, Any]) -> Path:
    """Write ``{"command", "machine", "time", **payload}`` to ``out_dir/name`` (NaN -> null)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"command": command, "machine": machine, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **payload}
    path = out_dir / name
    path.write_text(json.dumps(_jsonable(doc), indent=2) + "\n", encoding="utf-8")
    return path


def new_figure(ncols: int, width_per_col: float = 5.5, height: float = 4.0) -> tuple[Figure, list[Any]]:
    """A matplotlib ``Figure`` (Agg canvas, no pyplot global state) with ``ncols`` side-by-side axes."""
    fig = Figure(figsize=(width_per_col * ncols, height), layout="constrained")
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def log2_panel(ax: Any, ticks: Sequence[int], xlabel: str, ylabel: str, title: str, log_y: bool = False) -> None:
    """Finish one panel plotted over powers of two (batch sizes, tokens per sequence): a log2 x
    axis ticked at ``ticks``, a log y axis when ``log_y``, labels, title, light grid, legend."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def save_figure(fig: Figure, out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    fig.savefig(path, dpi=110)
    return path


def save_report(out_dir: Path, doc: dict[str, Any], text: str, plot: Callable[[dict[str, Any], Path], Any]) -> None:
    """A benchmark's three files in ``out_dir``: ``results.json`` (``doc``), ``table.md`` (``text``) and
    ``plot.png`` (``plot(doc, path)``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1))
    write_text(out_dir, "table.md", text)
    plot(doc, out_dir / "plot.png")


def write_text(out_dir: Path, name: str, text: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    return path


def identical_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists. Example: ``identical_prefix([1, 2, 3], [1, 2, 4]) == 2``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def eos_words(ignore_eos: bool, max_tokens: int) -> str:
    """How a report states the requests' length. Example: ``eos_words(False, 128)`` ->
    ``"up to 128 tokens each, ending at EOS"``."""
    return f"{max_tokens} tokens each, EOS ignored" if ignore_eos else f"up to {max_tokens} tokens each, ending at EOS"
