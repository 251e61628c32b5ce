"""``tidespec bench fleet`` end to end on a tiny checkpoint: a fleet of 2 (one trainer) and 2
independent servers (a trainer each) run the same short trace. Needs Ray (``make test-fleet``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_hf_model, write_tiny_checkpoint
from tidespec.bench.fleet.run import FleetBenchConfig, run_fleet_bench

pytest.importorskip("ray")
pytestmark = pytest.mark.fleet


def test_a_short_run_of_both_configurations(tmp_path: Path) -> None:
    hf, _ = tiny_hf_model("qwen2", torch.float32)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"id": f"p{i}", "domain": "w", "kind": "completion",
                                            "prompt": " ".join(f"w{3 + (i * 7 + j * 3) % 40}" for j in range(6))})
                                + "\n" for i in range(64)))
    cfg = FleetBenchConfig(engine_args=f"--model {ckpt} --drafter eagle3 --threads 1 --max-num-seqs 4 "
                                       "--num-speculative-tokens 3 --collect-n-threshold 300 --online-poll-s 0.5",
                           workload=str(workload), requests_per_replica=24, max_tokens=24, trainer_threads=2,
                           trainer_args="--poll-s 0.5 --max-steps 80 --lr 3e-3 --heldout-frac 0.25", window=4)
    doc = run_fleet_bench(cfg, tmp_path / "out")
    rows = doc["summary"]["configs"]
    assert set(rows) == {"fleet", "independent"}
    for name, row in rows.items():
        assert row["requests"] == 48 and row["errors"] == 0, (name, row)
    assert rows["fleet"]["versions_published"] >= 1  # the one trainer trained on both replicas' rows
    assert len({r["replica"] for r in doc["requests"]["fleet"]}) == 2  # the ingress used both replicas
    assert {r["replica"] for r in doc["requests"]["independent"]} == {"server-0", "server-1"}
    assert (tmp_path / "out" / "plot.png").stat().st_size > 0 and "requests/replica" in (
        tmp_path / "out" / "table.md").read_text()
