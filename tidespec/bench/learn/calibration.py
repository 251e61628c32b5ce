"""``bench learn --judge-windows``: can the trainer's judgement tell a gain from noise on a window
the size of a round's held-out split?

Why this exists: the trainer publishes a version when the lower end of a 90 % bootstrap interval of
its walked gain is above 0 (``online.training.judge``). A round holds out a handful of requests,
so whether that interval means 90 % depends on what it resamples. Resampling blocks of 32 rows as
if they were independent ignores that a request's rows share its topic and wording; in a recovery
run, intervals such as +0.10 .. +0.61 on one or two held-out requests were not borne out by the
rows served next (round 4 in docs/benchmarks/learning.md, "What training on a new domain's first
requests buys"). This measures it: two heads (the one
``bench learn`` started from and the one it trained) are walked over every held-out request once;
their gain over all of them stands for the truth, and many random windows of ``w`` requests each
play a round's held-out split. Each window's interval is computed three ways: resampling its
blocks, its requests, and both (the span of the two: what ``judge.paired_bootstrap`` gives the
trainer). Per way we count how often it covers the truth (90 % is what it promises), how often
it would publish (lower end above 0), and its median width.

Worked example (``--judge-windows 1,2,4,8`` on 74 held-out requests of four workloads, the shipped
head fine-tuned at lr 1e-3, which lost 0.023 walked): windows of 2 requests, 300 draws: over
blocks the interval holds -0.023 in 74 % of the windows, over requests in 54 %, the span of both
in 76 %, and the span publishes the worse head in 5 % of them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tidespec.bench.common.report import markdown_table
from tidespec.online.training.judge import HeadWalk, bootstrap_interval, group_sums, paired_bootstrap

WAYS = ("blocks", "requests", "both")  # what a window's interval resamples; "both": the trainer's


def parse_windows(text: str) -> tuple[int, ...]:
    """"8,2,4" -> (2, 4, 8); each >= 1, no repeats; "" -> ()."""
    values = sorted({int(v) for v in text.split(",") if v.strip()})
    if values and values[0] < 1:
        raise ValueError(f"window sizes must be >= 1, got {text!r}")
    return tuple(values)


def judge_calibration(base: HeadWalk, cand: HeadWalk, windows: tuple[int, ...], draws: int,
                      confidence: float, seed: int = 0) -> dict[str, Any]:
    """For each window size ``w`` (at most half the requests, so windows differ): ``draws`` random
    windows of ``w`` requests of the two walks (paired block by block, ``groups`` numbering the
    requests), each judged with intervals over blocks and over requests; per way, the share of
    windows whose interval covers the gain over all requests, publishes (lower end > 0), or is
    unbounded, and the median width of the bounded ones."""
    groups = torch.tensor(base.groups, dtype=torch.int64)  # [K] request number per block
    n = int(groups.max()) + 1 if len(base.groups) else 0
    truth = cand.walk_mean - base.walk_mean
    gen = torch.Generator().manual_seed(seed)
    rows: list[dict[str, Any]] = []
    for w in windows:
        if w > n // 2:
            continue
        tally: dict[str, dict[str, list[float]]] = {way: {"covered": [], "published": [], "unbounded": [],
                                                          "width": []} for way in WAYS}
        blocks_per_window = []
        for r in range(draws):
            pick = torch.randperm(n, generator=gen)[:w]
            keep = torch.isin(groups, pick).nonzero().squeeze(1).tolist()
            b = [base.blocks[i] for i in keep]
            c = [cand.blocks[i] for i in keep]
            g = [base.groups[i] for i in keep]
            blocks_per_window.append(len(keep))
            bt = torch.tensor(b, dtype=torch.float64).reshape(-1, 2)  # [k, 2] steps, tokens
            ct = torch.tensor(c, dtype=torch.float64).reshape(-1, 2)
            gb, gc = group_sums(bt, ct, g)  # [w, 2] per request
            intervals = {"blocks": bootstrap_interval(bt, ct, confidence, seed=seed + r),
                         "requests": bootstrap_interval(gb, gc, confidence, seed=seed + r),
                         "both": paired_bootstrap(b, c, confidence, seed=seed + r, groups=g)}
            for way, (low, high) in intervals.items():
                t = tally[way]
                bounded = math.isfinite(low) and math.isfinite(high)
                t["covered"].append(float(low <= truth <= high))
                t["published"].append(float(low > 0.0))
                t["unbounded"].append(float(not bounded))
                if bounded:
                    t["width"].append(high - low)
        row: dict[str, Any] = {"window": w, "draws": draws, "mean_blocks": sum(blocks_per_window) / draws}
        for way, t in tally.items():
            row[way] = {"covered": _mean(t["covered"]), "published": _mean(t["published"]),
                        "unbounded": _mean(t["unbounded"]),
                        "median_width": float(torch.tensor(t["width"]).median()) if t["width"] else None}
        rows.append(row)
    return {"requests": n, "blocks": len(base.blocks), "base_walk": base.walk_mean, "cand_walk": cand.walk_mean,
            "truth_gain": truth, "confidence": confidence, "windows": rows}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def calibration_report(cal: dict[str, Any]) -> list[str]:
    """Markdown lines: what was compared, then one row per window size."""
    conf = 100 * cal["confidence"]
    lines = [(f"Judgement check: the start head and the trained head walked over all {cal['requests']} held-out "
              f"requests ({cal['blocks']} blocks): {cal['base_walk']:.3f} -> {cal['cand_walk']:.3f}, gain "
              f"{cal['truth_gain']:+.3f} (taken as the truth). Windows of w requests drawn at random play a "
              f"round's held-out split; each is judged with a {conf:.0f} % paired-bootstrap interval that resamples "
              "its blocks (as if independent), its requests, or both (the wider of the two: the trainer's). "
              f"Covered: the interval holds the truth ({conf:.0f} % promised); published: its lower end is above "
              "0; no interval: too few requests to show a spread (a window of one request, resampling requests)."),
             ""]
    table = []
    for row in cal["windows"]:
        cells: list[Any] = [row["window"], row["draws"], f"{row['mean_blocks']:.1f}"]
        for way in WAYS:
            t = row.get(way)
            if t is None:  # a run written before the third way
                cells += ["-", "-", "-"]
                continue
            width = "-" if t["median_width"] is None else f"{t['median_width']:.3f}"
            cells += [f"{100 * t['covered']:.0f} %", f"{100 * t['published']:.0f} %", width]
        cells.append(f"{100 * row['requests']['unbounded']:.0f} %")
        table.append(cells)
    headers = ["w (requests)", "draws", "blocks per window"]
    for way in WAYS:
        headers += [f"{way}: covered", "published", "median width"]
    lines.append(markdown_table(headers + ["no interval"], table))
    return lines


def plot_calibration(ax: Any, cal: dict[str, Any]) -> None:
    """Coverage (solid) and publication (dashed) against window size, one colour per way of
    resampling, the promised level dotted."""
    ws = [row["window"] for row in cal["windows"]]
    for way, marker in zip(WAYS, ("s", "^", "o")):
        if any(way not in row for row in cal["windows"]):
            continue
        line, = ax.plot(ws, [100 * row[way]["covered"] for row in cal["windows"]], marker=marker,
                        label=f"{way}: covered")
        ax.plot(ws, [100 * row[way]["published"] for row in cal["windows"]], marker=marker, ls="--",
                color=line.get_color(), label=f"{way}: published")
    ax.axhline(100 * cal["confidence"], color="grey", lw=0.8, ls=":", label=f"{100 * cal['confidence']:.0f} % promised")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ws, [str(w) for w in ws])
    ax.set_ylim(0, 102)
    ax.set_xlabel("held-out window (requests)")
    ax.set_ylabel("% of windows")
    ax.set_title(f"the judgement on small windows (gain over all {cal['requests']}: {cal['truth_gain']:+.3f})")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
