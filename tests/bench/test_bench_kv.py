"""``tidespec bench kv``: the same memory runs more sequences at once paged than in slots, with the
same outputs, and bad input is a one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidespec.bench.kv.run import KVBenchConfig, run_kv_bench, table
from tidespec.errors import UserError

pytestmark = pytest.mark.integration


def test_kv_bench_runs_more_sequences_at_once_paged_with_the_same_outputs(tmp_path: Path, two_threads) -> None:
    cfg = KVBenchConfig(path="float32", slots=1, max_model_len=256, requests=4, seq_tokens=48)
    doc = run_kv_bench(cfg, out_dir=tmp_path, progress=False)
    s, rows = doc["summary"], doc["rows"]
    assert s["identical"] and rows["slots"]["peak_running"] == 1 and rows["paged"]["peak_running"] == 4
    assert s["capacity_tokens"]["slots"] == 256 and s["capacity_tokens"]["paged"] >= 256
    assert rows["paged"]["steps"] < rows["slots"]["steps"]
    for name in ("results.json", "table.md", "plot.png"):
        assert (tmp_path / name).exists()
    assert "outputs identical: yes" in table(doc)


def test_kv_bench_with_a_shared_prefix_runs_more_sequences_at_once_sharing_its_blocks(tmp_path: Path,
                                                                                      two_threads) -> None:
    """272 positions of memory (17 blocks), a 96-token block before every prompt (6 blocks): held
    per sequence, the burst thrashes (admitted, then preempted as it grows); shared, all 4 run."""
    cfg = KVBenchConfig(path="float32", slots=1, max_model_len=256, requests=4, seq_tokens=48,
                        shared_prefix_tokens=96, workload="code_unseen")
    doc = run_kv_bench(cfg, out_dir=tmp_path, progress=False)
    s, rows = doc["summary"], doc["rows"]
    assert s["identical"] and s["layouts"] == ["paged", "paged+prefix"]
    new, base = rows["paged+prefix"], rows["paged"]
    assert new["peak_running"] == 4 and new["mean_running"] > 1.5 * base["mean_running"]
    assert new["preemptions"] < base["preemptions"] and new["steps"] < base["steps"]
    assert "after the same 96-token block" in table(doc)


@pytest.mark.parametrize("kw", [{"path": "float16"}, {"seq_tokens": 4096}, {"requests": 1},
                                {"shared_prefix_tokens": 2000}])
def test_kv_bench_rejects_bad_input_in_one_line(kw: dict[str, object]) -> None:
    with pytest.raises(UserError) as err:
        KVBenchConfig(**kw)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)
