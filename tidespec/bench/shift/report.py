"""``tidespec bench shift``'s report: README.md tables and ``shift.png`` (acceptance and tokens/s over the trace).

Why this exists: a run's ``bench_shift.json`` holds every step and request, so the rendering
reads that document alone: ``bench.shift.run`` renders right after a run, ``--replot`` again from
an earlier run's JSON, and a change to a table or curve needs no new run.

Worked example: ``_curves`` with window 2 over requests accepting (drafts, accepted) (2, 2),
(2, 4), (1, 0) -> acceptance points at 2 requests: (6 + 4) / 4 = 2.5, at 3: (0 + 1) / 1 = 1.0.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tidespec.bench.common.report import eos_words, machine_line, markdown_table, new_figure, save_figure
from tidespec.bench.shift.config import served_label
from tidespec.config import SpecConfig
from tidespec.online.training.judge import gain_interval

COLORS = {"plain": "tab:gray", "frozen": "tab:blue", "online": "tab:orange", "vocab-static": "tab:red",
          "vocab-dynamic": "tab:green", "vocab-full": "tab:purple", "vocab-static-lora": "tab:pink",
          "vocab-dynamic-lora": "darkkhaki", "suffix": "tab:cyan", "ngram": "tab:brown",
          "no-learning": "tab:olive"}  # same in both panels
SPARE_COLORS = ("black", "gold", "navy", "lime", "maroon", "teal", "darkviolet", "salmon")


def config_colors(names: list[str]) -> dict[str, str]:
    """One distinct colour per configuration: its own from ``COLORS``, else the first spare one no
    other configuration of the run uses (sized vocabularies such as ``vocab-static:4096``).

    Example: ["plain", "vocab-static:6", "suffix"] -> plain tab:gray, vocab-static:6 black, suffix tab:cyan.
    """
    colors = {n: COLORS[n] for n in names if n in COLORS}
    spare = iter(c for c in SPARE_COLORS if c not in colors.values())
    return {n: colors.get(n) or next(spare, "tab:gray") for n in names}


def _fmt(v: Any, digits: int = 2) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{digits}f}"


def _section(title: str, heads: list[str], rows: list[list[str]]) -> list[str]:
    """A report section: its title line and table, or nothing when there are no rows."""
    return [title, "", markdown_table(heads, rows), ""] if rows else []


QUARTERS = ["1st quarter", "2nd", "3rd", "4th"]


def _phase_requests(run: dict[str, Any]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Each phase of a run's records: its label ("2: zh_topics") and its requests in trace order."""
    for p in sorted({r["phase"] for r in run["requests"]}):
        reqs = [r for r in run["requests"] if r["phase"] == p]
        yield f"{p + 1}: {reqs[0]['workload']}", reqs


def _step_lines(doc: dict[str, Any]) -> list[str]:
    """Tokens per target step per quarter of each phase (every step, drafted or not), with the ratio
    to ``no-learning`` on the same requests where that control ran."""
    control = doc["configs"].get("no-learning")
    rows = []
    for name, s in doc["configs"].items():
        if name == "plain":
            continue
        for i, p in enumerate(s["phases"]):
            qs = p.get("quarter_tokens_per_step")
            if not qs:
                continue  # a report saved before this figure existed
            base = control["phases"][i].get("quarter_tokens_per_step") if control and name != "no-learning" else None
            rows.append([name, f"{p['phase']}: {p['workload']}"]
                        + [_fmt(q) + (f" ({_fmt(q / b)}x)" if _positive(q) and _positive(b) else "")
                           for q, b in zip(qs, base or [None] * len(qs))])
    return _section("Tokens per target step per quarter of each phase's requests (every step, drafted or not: served "
                    "acceptance counts drafted steps only" + ("; in brackets the ratio to no-learning on the same "
                                                               "requests" if control else "") + "):",
                    ["config", "phase", *QUARTERS], rows)


def _positive(v: Any) -> bool:
    """A figure to divide by: a finite number above 0 (not nan, nor the null a saved nan becomes)."""
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _quarter_lines(doc: dict[str, Any]) -> list[str]:
    """Acceptance length per quarter of each phase: served, and per drafter where several drafted."""
    rows = []
    for name, s in doc["configs"].items():
        for p in s["phases"]:
            for who, qs in (p.get("quarters") or {}).items():
                if who == "served" and len(p["quarters"]) == 2:
                    continue  # one drafter: its own row says the same
                if all(q is None or not math.isfinite(q) for q in qs):  # nan, or null once saved as JSON
                    continue
                rows.append([name, f"{p['phase']}: {p['workload']}", who, *(_fmt(q) for q in qs)])
    return _section("Acceptance length per quarter of each phase's requests (served: every draft; per drafter: the "
                    "drafts it made in that quarter's steps):", ["config", "phase", "drafts", *QUARTERS], rows)


def _share_lines(doc: dict[str, Any]) -> list[str]:
    """Each route's share of the sequence-steps per quarter of each phase (``quarter_shares``, from the
    run's own step records, so ``--replot`` shows it for any earlier run), where a policy chose among
    routes: several drafters, or a drafter and none."""
    rows = []
    for name, run in doc.get("runs", {}).items():
        for phase, reqs in _phase_requests(run):
            shares = quarter_shares(reqs, run["steps"])
            if len(shares) < 2:
                continue  # one route every step (plain: none; a static drafter): nothing was chosen
            rows += [[name, phase, who, *(_fmt(q) for q in qs)] for who, qs in shares.items()]
    return _section("Share of each quarter's sequence-steps per route (none: decoded without a draft); what a learned "
                    "drafter gains reaches only its own share of the steps:", ["config", "phase", "route", *QUARTERS],
                    rows)


def _gate_lines(doc: dict[str, Any]) -> list[str]:
    """Per configuration and phase, the model-drafter gate of per-sequence drafting (``policy/gate.py``) in
    each batch-size bucket: the epochs it ran with the model drafters in and out during the phase, its arm
    and its paired estimate of log(goodput in / goodput out) at the phase's last finish. From the policy
    stats each request records as it finishes (a run saved before they were recorded shows nothing).

    Example: a phase that ends with ``gate_epochs_in_b1`` 9 and ``gate_epochs_out_b1`` 30, after a phase
    that ended at 5 and 10 -> in 4, out 20 epochs in the phase."""
    rows = []
    for name, run in doc.get("runs", {}).items():
        before: dict[str, float] = {}
        for phase, reqs in _phase_requests(run):
            last = max(reqs, key=lambda r: r["t_end"]).get("policy") or {}  # the phase's last finish
            for key in sorted(k for k in last if k.startswith("gate_in_b")):
                b = key[len("gate_in_b"):]
                epochs = [last.get(f"gate_epochs_{arm}_b{b}", 0.0) - before.get(f"gate_epochs_{arm}_b{b}", 0.0)
                          for arm in ("in", "out")]
                rows.append([name, phase, b, *(f"{e:.0f}" for e in epochs),
                             "in" if last[key] else "out", _fmt(last.get(f"gate_diff_b{b}"), 3)])
            before = last
    return _section("The model-drafter gate per phase (`--gate-model-drafters`: epochs with the model drafters in and "
                    "out during the phase; its arm and paired estimate of log(goodput in / out) at the phase's end):",
                    ["config", "phase", "batch bucket", "epochs in", "epochs out", "arm at the end",
                     "log(g_in / g_out)"], rows)


def _default_start(drafter: str) -> str:
    """What frozen and online start from without --bootstrap: EAGLE-3's fresh head, or Medusa's seeded heads."""
    return ("the heads a server starts from (shipped for the embedded model, else zero)"
            if SpecConfig(drafter=drafter).online_drafter == "medusa" else "fresh random head")


def report(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = ["# bench shift", "", f"Command: `{doc.get('command', '')}`", "",
             f"Machine: {machine_line(doc['machine'])}", "",
             f"Trace: {' -> '.join(f'{w} x{n}' for w, n in doc['phase_sizes'])}, "
             f"{eos_words(cfg.get('ignore_eos', True), cfg['max_tokens'])}, {cfg['concurrency']} in flight, gamma {cfg['gamma']} ({'trees' if cfg.get('tree') else 'chains'}); "
             f"starting drafter: {cfg['bootstrap'] or _default_start(cfg.get('drafter', 'eagle3'))}."
             + (f" Trainer children ran alone {cfg['trainer_catchup_s']:g} s after each of their configuration's "
                "turns, on no configuration's clock (a trainer on hardware of its own)."
                if cfg.get("trainer_catchup_s") else ""), ""]
    rows = []
    for name, s in doc["configs"].items():
        rows.append([name, _fmt(s["tok_s"], 1), _fmt(s.get("speedup")), _fmt(s.get("latency_speedup")),
                     _fmt(s["mean_acceptance_length"]), str(s.get("mismatches", "-"))]
                    + [f"{_fmt(p['mean_acceptance_length'])} / {_fmt(p['second_half_acceptance_length'])}"
                       for p in s["phases"]])
    heads = ["config", "tok/s", "speedup", "latency speedup", "accept len"] + ["mismatches"] + [
        f"phase {i + 1} {w}: accept len (all / 2nd half)" for i, w in enumerate(doc["phases"])]
    lines += [markdown_table(heads, rows), ""]
    lines += [("Tokens/s per phase (speedup over plain in the same phase; each configuration's own clock, which "
               "stops outside its turns):"), "",
              markdown_table(["config"] + [f"phase {i + 1} {w}" for i, w in enumerate(doc["phases"])],
                             [[name] + [f"{_fmt(p['tok_s'], 1)}" + (f" ({_fmt(p['speedup'])}x)" if "speedup" in p else "")
                                        for p in s["phases"]] for name, s in doc["configs"].items()]), ""]
    lines += [("Mean request latency per phase, ms from arrival to the last token (speedup: plain's mean latency "
               "on the same requests over this one's; under open-loop arrivals tokens/s follows the rate and this "
               "is the figure that moves):"), "",
              markdown_table(["config"] + [f"phase {i + 1} {w}" for i, w in enumerate(doc["phases"])],
                             [[name] + [(_fmt(1e3 * p["mean_latency_s"], 0) if "mean_latency_s" in p else "-")
                                        + (f" ({_fmt(p['latency_speedup'])}x)" if "latency_speedup" in p else "")
                                        for p in s["phases"]] for name, s in doc["configs"].items()]), ""]
    lines += _quarter_lines(doc) + _share_lines(doc) + _gate_lines(doc) + _step_lines(doc)
    lines += _vocab_lines(doc)
    for name, s in doc["configs"].items():
        ads = s.get("online", {}).get("adapters")
        if ads:
            lines += _adapter_lines(name, s["online"], ads)
    if "online" in doc["configs"]:
        on = doc["configs"]["online"]["online"]
        lines += [f"Online: drafter v{on.get('drafter_version')} at the end, {on.get('swaps')} swaps, "
                  f"{on.get('captured')} signals captured ({on.get('dropped')} dropped), collector "
                  f"{on.get('collector', {})}.", ""]
        rounds = on.get("rounds", [])
        if rounds:
            metric = "walked" if any("judgement" in r for r in rounds) else "per row"  # runs before walked judging
            lines += [markdown_table(["round", "train rows", "held-out rows", f"accept len before ({metric})", "after",
                                      "gain interval", "published"],
                                     [[r.get("round"), r.get("num_train_rows"), r.get("num_heldout_rows"),
                                       _fmt(r.get("baseline_accept_len")), _fmt(r.get("candidate_accept_len")),
                                       gain_interval(r.get("judgement")).strip(" ()") or "-",
                                       r.get("published_version") or "-"] for r in rounds]), ""]
        judged = on.get("judgements", [])
        if judged:
            lines += [("Served judgements (each published version against the head it replaced, both scored on "
                       "the same rows captured after it):"), "",
                      markdown_table(["version", "replaced", "rows",
                                      f"accept len ({'walked' if any('confidence' in j for j in judged) else 'per row'})",
                                      "replaced's",
                                      "gain interval", "verdict"],
                                     [[j.get("version"), j.get("replaced_version"), j.get("judged_rows"),
                                       _fmt(j.get("accept_len")), _fmt(j.get("replaced_accept_len")),
                                       gain_interval(j).strip(" ()") or "-",
                                       f"reverted as v{j['reverted_as']}" if j.get("reverted_as") else "kept"]
                                      for j in judged]), ""]
    ov = doc.get("capture_overhead")
    if ov:
        lines += [f"Capture overhead (frozen drafter, {ov['requests']} requests, capture forced on vs off, "
                  f"{len(ov['pairs'])} pairs): throughput ratio {_fmt(ov['ratio_on_off'], 3)} -> overhead "
                  f"{100 * ov['overhead']:.1f} %; pairs (tok/s off/on): "
                  + ", ".join(f"{p['off']:.1f}/{p['on']:.1f}" for p in ov["pairs"])
                  + f"; rows dropped {ov['dropped_rows']}.", ""]
    ts = doc.get("training_sources")
    if ts and "error" not in ts:
        lines += [f"Training from signals vs recomputing (one epoch, {ts['rows']} rows of {ts['sequences']} "
                  f"sequences): from the store {ts['epoch_from_signals_s']:.1f} s (read {ts['load_s']:.1f} + train "
                  f"{ts['train_stored_s']:.1f}); recomputing {ts['epoch_recomputing_s']:.1f} s (target prefill "
                  f"{ts['recompute_s']:.1f} + train {ts['train_recomputed_s']:.1f}) -> {ts['speedup']:.2f}x.", ""]
    elif ts:
        lines += [f"Training from signals vs recomputing: {ts['error']}", ""]
    return "\n".join(lines)


def _vocab_lines(doc: dict[str, Any]) -> list[str]:
    """Per phase and configuration: coverage of V_t (share of verified tokens inside it), acceptance
    length, and the drafter's time per draft token (the engine's draft timer); then each draft
    vocabulary's counters over the run."""
    names = [n for n, s in doc["configs"].items() if "coverage" in s["phases"][0] or n == "frozen"]
    if not any(n.startswith("vocab-") for n in names):
        return []
    rows = [[name] + [f"{_fmt(100 * p['coverage'], 1) if 'coverage' in p else '-'} / "
                      f"{_fmt(p['mean_acceptance_length'])} / {_fmt(p['draft_ms_per_token'])}"
                      for p in doc["configs"][name]["phases"]] for name in names]
    heads = ["config"] + [f"phase {i + 1} {w}: coverage % / accept len / draft ms per token"
                          for i, w in enumerate(doc["phases"])]
    out = ["Draft vocabularies (frozen: the head's own vocabulary):", "", markdown_table(heads, rows), ""]
    base = doc["configs"].get("frozen", {}).get("draft_ms_per_token")
    pooled = [f"{name} {_fmt(doc['configs'][name].get('draft_ms_per_token'))} ms"
              + (f" ({_fmt(doc['configs'][name]['draft_ms_per_token'] / base, 3)}x frozen)"
                 if base and name != "frozen" and "draft_ms_per_token" in doc["configs"][name] else "")
              for name in names]
    out += ["Draft ms per draft token over the whole run (all phases' steps pooled): " + ", ".join(pooled) + ".", ""]
    for name in names:
        v = doc["configs"][name].get("vocab")
        if v:
            out.append(f"- {name}: |V_t| {v['size']} at the end (core {v['core']}), "
                       f"coverage {_fmt(100 * v['coverage'], 1)} %, "
                       f"{v['oov_events']} OOV events, {v['published']} V_t swaps, {v['retrievals']} retrievals "
                       f"(mean {_fmt(v['mean_retrieval_ms'])} ms off the step), "
                       f"{_fmt(v.get('mean_build_ms', float('nan')))} ms per V_t build (worker), "
                       f"buffer admitted {v['admitted']} / "
                       f"evicted {v['evicted']}, {v['dropped']} records dropped, {v['errors']} errors")
    return out + [""]


def _finished_windows(run: dict[str, Any], window: int) -> list[tuple[int, list[dict[str, Any]]]]:
    """A run's requests in finish order, cut into windows of ``window``: (requests finished by the
    window's end, the window's requests). Example: 5 requests, window 2 -> (2, r0-r1), (4, r2-r3), (5, r4)."""
    reqs = sorted(run["requests"], key=lambda r: r["t_end"])
    return [(min(i + window, len(reqs)), reqs[i:i + window]) for i in range(0, len(reqs), window)]


def _curves(run: dict[str, Any], window: int, bin_s: float) -> tuple[list[float], list[float], list[float], list[float]]:
    xs, ys = [], []
    for x, chunk in _finished_windows(run, window):
        d = sum(r["drafts"] for r in chunk)
        if d:
            xs.append(x)
            ys.append((sum(r["accepted"] for r in chunk) + d) / d)
    steps = run["steps"]
    ts, rates = [], []
    if steps:
        end = steps[-1]["t"]
        k = 0
        t = 0.0
        while t < end:
            tok = 0
            while k < len(steps) and steps[k]["t"] < t + bin_s:
                tok += steps[k]["emitted"]
                k += 1
            width = min(bin_s, end - t)
            if width > 0:
                ts.append(t + width / 2)
                rates.append(tok / width)
            t += bin_s
    return xs, ys, ts, rates


def _adapter_lines(name: str, on: dict[str, Any], ads: list[dict[str, Any]]) -> list[str]:
    """One line on an online configuration's LoRA path (``vocab-*-lora``, or ``online`` with
    ``--online-lora``): adapters published, their update cost and scores."""
    lora = on.get("lora") or {}
    ms = sorted(float(a["metrics"].get("update_ms", "nan")) for a in ads)
    median = ms[len(ms) // 2] if ms else float("nan")
    last = ads[-1]["metrics"] if ads else {}
    return [f"LoRA ({name}): {len(ads)} adapters published, adapter {lora.get('adapter', 0)} served at the end "
            f"({lora.get('adapter_swaps', 0)} swaps, refused {lora.get('refused_adapters', [])}); update "
            f"(optimizer steps) median {_fmt(median, 0)} ms in the trainer child; the last adapter: accept len on "
            f"{last.get('judged_rows', '-')} rows served after it {_fmt(last.get('baseline_accept_len'))} -> "
            f"{_fmt(last.get('adapted_accept_len'))}, "
            f"{last.get('eligible_rows', '-')} replay rows of {last.get('seen_rows', '-')}; "
            f"{on.get('captured')} signals captured ({on.get('dropped')} dropped).", ""]


def _mark_served(ax: Any, requests: list[dict[str, Any]], color: str) -> None:
    """A dashed line and the drafter's label (``v2``, ``v2+a1``) at the first finished request served by
    each new drafter version or LoRA adapter (requests in the order they finished, as the curve)."""
    done = sorted(requests, key=lambda r: r["t_end"])
    before = served_label(int(done[0]["version"]), done[0].get("adapter", 0)) if done else ""
    for i, r in enumerate(done):
        label = served_label(int(r["version"]), r.get("adapter", 0))
        if label != before:
            ax.axvline(i + 1, color=color, linestyle="--", linewidth=0.8)
            ax.annotate(label, (i + 1, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -12),
                        textcoords="offset points", fontsize=8, color=color)
        before = label


def drafter_acceptance(steps: list[dict[str, Any]], names: list[str]) -> dict[str, float]:
    """Each of ``names``' mean acceptance length over the drafts it made in ``steps`` (nan: none).

    Example: steps where suffix drafted 2 + 2 sequences with 3 + 1 tokens accepted -> {"suffix": 2.0}."""
    out = {}
    for n in names:
        k = sum(s.get("by_drafter", {}).get(n, 0) for s in steps)
        out[n] = (sum(s.get("accepted_by_drafter", {}).get(n, 0) for s in steps) + k) / k if k else float("nan")
    return out


def drafter_shares(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Each drafter's share of the sequence-steps of decode steps (``none``: a sequence decoded without
    a draft), from a shift run's step records. Example: two steps of 2 sequences, suffix drafting two
    and eagle3 one -> suffix 50 %, eagle3 25 %, none 25 %."""
    counts: Counter[str] = Counter()
    for s in steps:
        seqs = s.get("decode_seqs", 0)
        drafted = s.get("by_drafter", {})
        counts.update({d: n for d, n in drafted.items() if n})
        counts["none"] += max(0, seqs - sum(drafted.values()))
    total = sum(counts.values())
    return {d: n / total for d, n in sorted(counts.items())} if total else {}


def quarters_of(reqs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A phase's requests in four consecutive slices: 8 requests -> 0-1, 2-3, 4-5, 6-7; 2 -> [], [0], [], [1]."""
    n = len(reqs)
    return [reqs[n * q // 4:n * (q + 1) // 4] for q in range(4)]


def quarter_steps(reqs: list[dict[str, Any]], steps: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The steps of each quarter of a phase's requests (``quarters_of``): from the quarter's first
    request's start to the next quarter's (the last: to the phase's last finish); a quarter without
    requests has none. Example: 8 requests of 1 s each from t = 0, one step at t + 0.5 of each ->
    the steps at 0.5 and 1.5, 2.5 and 3.5, and so on."""
    bounds = quarters_of(reqs)
    edges = [min((r["t_start"] for r in b), default=float("nan")) for b in bounds]
    edges.append(max((r["t_end"] for r in reqs), default=float("nan")) + 1e-9)  # the phase's end closes the last
    for q in reversed(range(4)):  # an empty quarter (a phase of < 4 requests) ends where the next one starts
        edges[q] = edges[q + 1] if math.isnan(edges[q]) else edges[q]
    return [[s for s in steps if edges[q] <= s["t"] < edges[q + 1]] if b else [] for q, b in enumerate(bounds)]


def quarter_shares(reqs: list[dict[str, Any]], steps: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each drafter's share of the sequence-steps per quarter of a phase's requests (``drafter_shares`` of
    the quarter's steps; ``none``: decoded without a draft; 0.0 where it drafted nothing that quarter,
    nan in a quarter without steps). Why: under a controller or per-sequence routing, what a learned
    drafter gains reaches only the steps routed to it, so its share bounds what learning can add to
    the phase's tokens per step.

    Example: a quarter whose steps drafted suffix for 3 sequence-steps and left 1 undrafted -> suffix
    0.75, none 0.25."""
    per_q = [drafter_shares(q) for q in quarter_steps(reqs, steps)]
    names = sorted({d for q in per_q for d, share in q.items() if share > 0})  # the routes taken
    return {n: [q.get(n, 0.0) if q else float("nan") for q in per_q] for n in names}


def tokens_per_step(reqs: list[dict[str, Any]]) -> float:
    """Output tokens per target step the requests took part in, drafted or not: a step emits its
    accepted drafts plus one token, so the steps are ``tokens - accepted``. Why: served acceptance
    counts drafted steps only, so a configuration that drafts less often but surer reads higher
    though it is slower; this counts every step (plain decoding: 1.0).

    Example: a request of 64 tokens with 43 accepted drafts took 21 steps -> 64 / 21 = 3.05.
    """
    steps = sum(r["tokens"] - r["accepted"] for r in reqs)
    return sum(r["tokens"] for r in reqs) / steps if steps else float("nan")


def _drafter_curves(run: dict[str, Any], window: int) -> dict[str, tuple[list[float], list[float]]]:
    """Each drafter's own acceptance length per window of finished requests (the steps between the
    window's first and last finish), when several drafted under one controller; else nothing.

    Example: windows of 4; suffix drafted 10 sequences with 12 tokens accepted in the steps of the
    first window -> suffix's curve starts at (4, 2.2)."""
    steps = run["steps"]
    names = sorted({d for s in steps for d in s.get("accepted_by_drafter", {})})
    if len(names) < 2:
        return {}
    ends = sorted(r["t_end"] for r in run["requests"])
    out: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names}
    lo = float("-inf")
    for i in range(0, len(ends), window):
        hi = ends[min(i + window, len(ends)) - 1]
        for n, acc in drafter_acceptance([s for s in steps if lo < s["t"] <= hi], names).items():
            if math.isfinite(acc):
                out[n][0].append(min(i + window, len(ends)))
                out[n][1].append(acc)
        lo = hi
    return out


def _step_curve(run: dict[str, Any], window: int) -> tuple[list[int], list[float]]:
    """Tokens per target step (``tokens_per_step``) per window of finished requests, in finish order.

    Example: windows of 2; requests finished (64 tokens, 43 accepted), (64, 0) -> (2, 128 / 85 = 1.51)."""
    windows = _finished_windows(run, window)
    return [x for x, _ in windows], [tokens_per_step(part) for _, part in windows]


def plot_shift(doc: dict[str, Any], out_dir: Path) -> Path:
    """Acceptance length per window of finished requests, tokens per target step per window (every
    step: learning shows against ``no-learning`` there), and tokens/s over time."""
    cfg = doc["config"]
    fig, (ax_a, ax_s, ax_t) = new_figure(3, width_per_col=6.0)
    edge = 0
    for _, n in doc["phase_sizes"][:-1]:
        edge += n
        ax_a.axvline(edge, color="grey", linestyle=":", linewidth=1)
        ax_s.axvline(edge, color="grey", linestyle=":", linewidth=1)
    colors = config_colors(list(doc["runs"]))
    for name, run in doc["runs"].items():
        xs, ys, ts, rates = _curves(run, cfg["window"], cfg["bin_s"])
        color = colors[name]
        if xs:
            ax_a.plot(xs, ys, marker="o", markersize=3, label=name, color=color)
        if name != "plain" and run["requests"]:
            ax_s.plot(*_step_curve(run, cfg["window"]), marker="o", markersize=3, label=name, color=color)
        for (drafter, (dx, dy)), style in zip(_drafter_curves(run, cfg["window"]).items(), ("--", ":", "-.")):
            ax_a.plot(dx, dy, linestyle=style, linewidth=1, label=f"{name}: {drafter}'s drafts", color=color)
        ax_t.plot(ts, rates, label=name, color=color)
        if name == "online":
            swaps = [s["t"] for a, s in zip(run["steps"], run["steps"][1:])
                     if (s["version"], s.get("adapter", 0)) != (a["version"], a.get("adapter", 0))]
            for j, t in enumerate(swaps):
                ax_t.axvline(t, color=color, linestyle="--", linewidth=0.8,
                             label="online: new drafter" if j == 0 else None)
            _mark_served(ax_a, run["requests"], color)
            _mark_served(ax_s, run["requests"], color)
    ax_a.set_xlabel(f"requests finished (phases: {' -> '.join(doc['phases'])})")
    ax_a.set_ylabel(f"mean acceptance length (window {cfg['window']})")
    ax_a.set_title("acceptance over the trace")
    ax_a.legend()
    ax_s.set_xlabel(f"requests finished (phases: {' -> '.join(doc['phases'])})")
    ax_s.set_ylabel(f"output tokens per target step (window {cfg['window']})")
    ax_s.set_title("tokens per target step, drafted or not (plain: 1)")
    if ax_s.get_legend_handles_labels()[0]:
        ax_s.legend()
    ax_t.set_xlabel("seconds")
    ax_t.set_ylabel(f"output tokens/s ({cfg['bin_s']:g} s bins)")
    ax_t.set_title("throughput over time")
    ax_t.legend()
    return save_figure(fig, out_dir, "shift.png")
