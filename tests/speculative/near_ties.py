"""The prompts of ``make test``'s exactness subset: where plain decoding comes closest to a tie.

Why this exists: a kernel that is not row-invariant changes a row's logits by a rounding error, and
that changes a greedy output only where the target's two best tokens are that close. The full
matrix (``make exactness``: 24 prompts x 256 tokens a path) finds such places by volume; the subset
in ``make test`` cannot afford that, so it starts where they are. This module runs, once per path,
plain decoding of the full matrix's prompts (4 workloads x 6 prompts x 256 tokens), measures the
gap between the two best logits at every generated position (one eager forward over the prompt and
its continuation), and keeps, from distinct prompts, the ``--per-path`` positions with the smallest
gaps. Each becomes a prompt of the subset: the original prompt plus the continuation up to ``LEAD``
tokens before the near-tie, so a 32-token run reaches it early (and the tokens after it too). By
row invariance, prefilling that prefix gives the bits that decoding it gave, so plain decoding from
it meets the same near-tie. The result is stored with the tests (``near_ties.json``); it is a
selection, not a reference: the test compares each path with its own plain decoding on the
machine it runs on.

Run (about 15 minutes on 2 cores, every path of ``test_exact_matrix.PATHS``)::

    .venv/bin/python -m tests.speculative.near_ties               # writes tests/speculative/near_ties.json
    .venv/bin/python -m tests.speculative.near_ties --paths int8  # one path again, the others kept

Worked example of one entry: ``{"id": "code/c03@41", "tokens": [...], "tie_at": 8, "gap": 3.1e-05}``
is prompt ``c03`` of the code workload plus the first 41 tokens of its plain continuation; plain
decoding's 9th token from there is chosen by a top-2 logit gap of 3.1e-05.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tidespec.bench.common.report import machine_info
from tidespec.bench.exactness.run import ExactnessBenchConfig, PathRun, parse_path, target_model
from tidespec.models.families.decoder import DecoderModel
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.models.loading.loader import LoadedModel
from tidespec.workloads.loader import Prompt, WorkloadRecord, load_prompts

STORE = Path(__file__).with_name("near_ties.json")
LEAD = 8  # generated tokens before the near-tie
WORKLOADS = "code,chat,zh_chat,multilingual"  # the full matrix's prompts (make exactness)
CANDIDATES = 6  # prompts per workload
TOKENS = 256  # generated per candidate


def top2_gaps(model: DecoderModel, prompt: list[int], continuation: list[int]) -> list[float]:
    """The gap between the two best logits at each generated position: [len(continuation)] from one
    eager forward over ``prompt + continuation[:-1]``.

    Example: a continuation of 3 tokens -> 3 gaps, the first from the prompt's last row."""
    seq = prompt + continuation[:-1]
    kv = KVCache.for_model(model.cfg, 1, len(seq), model.dtype, model.device)
    rows = torch.arange(len(prompt) - 1, len(seq), device=model.device)
    with torch.inference_mode():
        out = model(torch.tensor(seq, device=model.device), BatchLayout.build([len(seq)], [0], [0], device=model.device),
                    kv, logits_rows=rows)
    assert out.logits is not None
    top = torch.topk(out.logits.double(), 2, dim=-1).values  # [len(continuation), 2]
    return (top[:, 0] - top[:, 1]).tolist()


def select(run: PathRun, per_path: int) -> list[dict[str, Any]]:
    """The ``per_path`` positions with the smallest gaps, one per prompt, as subset prompts; equal
    gaps (exact ties, common where logits carry bfloat16's precision) go round the workloads."""
    best: list[tuple[float, int, int]] = []  # (gap, prompt index, position)
    for i, (prompt, cont) in enumerate(zip(run.ids, run.plain)):
        gaps = top2_gaps(run.target.model, prompt, cont)
        j = min(range(LEAD, len(gaps)), key=gaps.__getitem__)  # the earliest of equal gaps: the shortest prompt
        best.append((gaps[j], i, j))
    rank: dict[int, int] = {}  # prompt index -> its place among its workload's prompts, by gap
    seen: dict[str, int] = {}
    for gap, i, j in sorted(best):
        domain = run.prompts[i].record.domain.split("_")[0]
        rank[i] = seen[domain] = seen.get(domain, -1) + 1
    out = []
    for gap, i, j in sorted(best, key=lambda b: (b[0], rank[b[1]]))[:per_path]:
        start = j - LEAD
        out.append({"id": f"{run.prompts[i].record.domain}/{run.prompts[i].record.id}@{start}",
                    "tokens": run.ids[i] + run.plain[i][:start], "tie_at": LEAD, "gap": gap})
    return out


def stored_prompts(path: str, store: Path = STORE) -> list[Prompt]:
    """The subset's prompts for ``path`` (empty when none are stored for it)."""
    entries = json.loads(store.read_text())["paths"].get(path, []) if store.exists() else []
    return [Prompt(WorkloadRecord(e["id"], e["id"].split("/")[0], "completion", ""), list(e["tokens"]))
            for e in entries]


def write_store(doc: dict[str, Any], out: Path) -> None:
    """``doc`` as JSON with one entry a line (a path's prompts are long lists of token ids)."""
    head = {k: v for k, v in doc.items() if k != "paths"}
    lines = ["{", *(f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()), ' "paths": {']
    paths = sorted(doc["paths"])
    for n, path in enumerate(paths):
        entries = doc["paths"][path]
        lines.append(f"  {json.dumps(path)}: [")
        lines += [f"   {json.dumps(e)}" + ("," if k < len(entries) - 1 else "") for k, e in enumerate(entries)]
        lines.append("  ]" + ("," if n < len(paths) - 1 else ""))
    out.write_text("\n".join(lines + [" }", "}"]) + "\n")


def main(argv: list[str] | None = None) -> int:
    from tests.speculative.test_exact_matrix import LAYERS_COMPILED, PATHS  # the paths the subset checks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated paths (default: the subset's)")
    ap.add_argument("--per-path", type=int, default=4, help="prompts kept per path")
    ap.add_argument("--out", type=Path, default=STORE)
    ns = ap.parse_args(argv)
    torch.set_num_threads(2)  # as the subset runs (its tests take two threads)
    doc = json.loads(ns.out.read_text()) if ns.out.exists() else {"paths": {}}
    targets: dict[tuple[str, str], LoadedModel] = {}
    for path in tqdm(ns.paths.split(","), desc="paths"):
        layers = LAYERS_COMPILED if parse_path(path)[2] else 0
        cfg = ExactnessBenchConfig(workloads=WORKLOADS, limit=CANDIDATES, max_tokens=TOKENS, paths=path, drafters="",
                                   layers=layers)
        tokenizer = target_model(parse_path(path)[0], "none", targets).tokenizer
        prompts = [p for w in cfg.workload_list for p in load_prompts(w, tokenizer, limit=cfg.limit)]
        run = PathRun(cfg, path, prompts, targets, batched_reference=True)
        doc["paths"][path] = select(run, ns.per_path)
        doc.update({"command": " ".join(["python -m tests.speculative.near_ties", *(argv or [])]),
                    "date": time.strftime("%Y-%m-%d"), "machine": machine_info("selection"), "lead": LEAD,
                    "candidates": f"{WORKLOADS} x {CANDIDATES} prompts x {TOKENS} tokens"})
        write_store(doc, ns.out)
        print(path, ", ".join(f"{e['id']} gap {e['gap']:.1e}" for e in doc["paths"][path]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
