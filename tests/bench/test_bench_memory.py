"""``tidespec bench memory`` end to end on a tiny checkpoint: a live server, refused large prompts,
RSS before and after, the report and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_hf_model, write_tiny_checkpoint
from tidespec.bench.memory.run import MemoryBenchConfig, run_memory_bench
from tidespec.config import ConfigError


@pytest.mark.slow  # two servers started and measured (19-24 s); make test checks the config
def test_memory_bench_on_a_tiny_checkpoint(tmp_path: Path) -> None:
    hf, _ = tiny_hf_model("qwen2", torch.float32)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    cfg = MemoryBenchConfig(configs="trim,no-trim", engine_args=f"--model {ckpt} --threads 1 --max-model-len 64",
                            num_requests=4, prompt_bytes=4096, warmup_requests=1, settle_s=0.0)
    doc = run_memory_bench(cfg, out_dir=tmp_path / "out", progress=False)
    assert [r["config"] for r in doc["rows"]] == ["trim", "no-trim"]
    for row in doc["rows"]:
        assert row["statuses"] == {"400": 4}  # every prompt refused: longer than the context
        assert len(row["rss_mb"]) == 4 and row["warm_mb"] > 0 and row["ratio"] > 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["rows"][0]["final_mb"] == doc["rows"][0]["final_mb"]
    table = (tmp_path / "out" / "table.md").read_text()
    assert "--trim-memory" in table and "--no-trim-memory" in table
    assert (tmp_path / "out" / "plot.png").stat().st_size > 0


def test_memory_bench_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="unknown configuration"):
        MemoryBenchConfig(configs="trim,bogus")
    with pytest.raises(ConfigError, match="prompt_bytes"):
        MemoryBenchConfig(prompt_bytes=10**9)
