"""``tidespec bench invariance-cost``: both engines decode the same prompts step by step, the report
has a row per path and batch size, and bad input is a one-line error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_hf_model, write_tiny_checkpoint
from tidespec.bench.invariance_cost.run import InvarianceCostConfig, run_invariance_cost, table
from tidespec.errors import UserError


def test_invariance_cost_times_both_engines_on_the_same_steps(tmp_path: Path, two_threads) -> None:
    """On a tiny checkpoint (the embedded model's two loads and kernel measurements took minutes on a
    cold cache and measure nothing this test checks)."""
    hf, _ = tiny_hf_model("llama", torch.float32)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    words = [" ".join(f"w{3 + (i * 7 + j) % 60}" for j in range(8)) for i in range(4)]
    workload = tmp_path / "wl.jsonl"
    workload.write_text("".join(json.dumps({"id": f"p{i}", "domain": "t", "kind": "completion", "prompt": w}) + "\n"
                                for i, w in enumerate(words)))
    cfg = InvarianceCostConfig(paths="float32", batch_sizes="1,2", max_tokens=4, rounds=1, projection_rows="1,3",
                               model=str(ckpt), workload=str(workload))
    doc = run_invariance_cost(cfg, out_dir=tmp_path, progress=False)
    assert [(r["path"], r["batch"]) for r in doc["rows"]] == [("float32", 1), ("float32", 2)]
    for r in doc["rows"]:
        assert r["steps"] >= 2 and r["ms_off"] > 0 and r["ms_on"] > 0 and r["exact"]
        assert r["speed_on_vs_off"] == pytest.approx(r["ms_off"] / r["ms_on"])
    assert (tmp_path / "results.json").exists() and (tmp_path / "plot.png").exists()
    assert "| float32 | 2 |" in table(doc)
    kernels = doc["projections"]["float32"]  # every candidate kernel and the plan, timed at 1 and 3 rows
    assert "exact" in kernels and "plan" in kernels and "tile16" in kernels
    assert all(set(ms) == {"1", "3"} and min(ms.values()) > 0 for ms in kernels.values())
    assert "| 3 | " in table(doc)


@pytest.mark.parametrize("kw", [{"paths": "float16"}, {"batch_sizes": "0"}, {"batch_sizes": "x"},
                                {"projection_rows": "1,x"}])
def test_invariance_cost_rejects_bad_input_in_one_line(kw: dict[str, str]) -> None:
    with pytest.raises(UserError) as err:
        InvarianceCostConfig(**kw)
    assert "\n" not in str(err.value)
