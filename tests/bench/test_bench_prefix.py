"""``tidespec bench prefix``: both engines serve the same requests, hits are counted and faster to a
first token, outputs are identical, and bad input is a one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidespec.bench.prefix.run import PrefixBenchConfig, run_prefix_bench, table
from tidespec.errors import UserError

pytestmark = pytest.mark.integration


def test_prefix_bench_reuses_the_shared_prefix_and_changes_no_output(tmp_path: Path, two_threads) -> None:
    cfg = PrefixBenchConfig(limit=2, prefix_tokens=160, max_tokens=4, concurrency=2, throughput_tokens=4, rounds=1,
                            max_model_len=512)
    doc = run_prefix_bench(cfg, out_dir=tmp_path, progress=False)
    s = doc["summary"]
    assert s["identical"] and s["requests"] == 4 and s["hits"] == 2  # the first of each kind caches it
    assert s["cached_tokens_per_hit"] >= 160 and len(doc["next_turn"]) == 2
    assert all(r["cached_tokens"] > r["history_tokens"] // 2 for r in doc["next_turn"])
    assert s["throughput_on_vs_off"] > 0 and doc["throughput"]["identical"]
    for name in ("results.json", "table.md", "plot.png"):
        assert (tmp_path / name).exists()
    assert "outputs identical with and without the cache | yes" in table(doc)


@pytest.mark.parametrize("kw", [{"path": "float16"}, {"prefix_tokens": 4}, {"concurrency": 0}])
def test_prefix_bench_rejects_bad_input_in_one_line(kw: dict[str, object]) -> None:
    with pytest.raises(UserError) as err:
        PrefixBenchConfig(**kw)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)
