"""``tidespec bench quality`` on a tiny model: the rows, the reference's self-consistency, the files,
the CLI; and the bandwidth ceiling's byte count of a quantized model."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_llama, tiny_tokenizer
from tidespec.bench.cli import register
from tidespec.bench.profile.run import weight_bytes_per_token
from tidespec.bench.quality.run import QualityBenchConfig, identical_prefix, run_quality_bench
from tidespec.config import ConfigError
from tidespec.models.loading.loader import LoadedModel
from tidespec.models.quant.quantize import quantize_model


def _workload(path: Path, n: int = 3) -> Path:
    lines = [json.dumps({"id": f"r{i}", "domain": "test", "kind": "completion",
                         "prompt": " ".join(f"t{20 + (i * 7 + j) % 30}" for j in range(6 + 2 * i))}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_quality_bench_rows_reference_and_files(tmp_path: Path) -> None:
    model = tiny_llama(dtype=torch.float32, scale=2.0)
    target = LoadedModel(model=model, tokenizer=tiny_tokenizer(64), config=model.cfg, path="")
    wl = str(_workload(tmp_path / "wl.jsonl"))
    cfg = QualityBenchConfig(workloads=(wl,), limit=3, max_tokens=8)
    doc = run_quality_bench(cfg, target, out_dir=tmp_path / "out", command="tidespec bench quality --test", echo=False)
    assert [r["variant"] for r in doc["rows"]] == ["float32", "int8", "int4-g32", "bfloat16"]
    ref, int8, int4, bf16 = doc["rows"]
    assert ref["reference"] and ref["top1_agreement"] == 1.0 and ref["ppl_delta"] == 0.0 and ref["kl_mean"] == 0.0
    assert ref["identical_fraction"] == 1.0 and ref["continuation_tokens"] == 3 * 8  # tiny tokenizer: t0 = EOS
    for r in (int8, int4, bf16):
        assert 0.0 <= r["top1_agreement"] <= 1.0 and r["kl_mean"] > 0.0 and math.isfinite(r["ppl"])
        assert r["tokens_scored"] == ref["tokens_scored"] and r["weight_mb"] < ref["weight_mb"]
    assert int4["kl_mean"] > int8["kl_mean"]  # random weights: int4 is the coarser scheme
    assert isinstance(model.layers[0].mlp.down_proj, torch.nn.Linear)  # the reference was not quantized
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["bench"] == "quality" and saved["command"] == "tidespec bench quality --test"
    assert (tmp_path / "out" / "plot.png").stat().st_size > 0
    assert "| int4-g32 |" in (tmp_path / "out" / "table.md").read_text()


def test_quality_bench_cli_and_config_errors(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="tidespec")
    register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["bench", "quality", "--quantizations", "int8,int3"])
    with pytest.raises(ConfigError, match="unknown quantization 'int3'"):
        ns.func(ns)
    assert not hasattr(ns, "quantization")  # the variants are --quantizations; the reference is unquantized
    with pytest.raises(ConfigError, match="quant_group_size"):
        QualityBenchConfig(group_size=48)
    assert identical_prefix([1, 2, 3], [1, 2, 4]) == 2 and identical_prefix([1, 2], [1, 2, 3]) == 2


def test_weight_bytes_of_a_quantized_model_count_the_int_weights_and_scales() -> None:
    model = tiny_llama(dtype=torch.float32)  # untied: hidden 32, inter 64, vocab 64, 2 layers
    quantize_model(model, "int8")
    per_layer_int8 = (64 + 32 + 128) * 32 + 32 * 64  # qkv, o, gate_up [N, 32] + down [32, 64], 1 B each
    per_layer_scales = 2 * (64 + 32 + 128 + 32)  # one bf16 scale per output row
    norms = 4 * (2 * 32 * 2 + 32)  # float32 layer norms and the final norm
    head = 64 * 32 + 2 * 64  # int8 LM head and its scales
    assert weight_bytes_per_token(model) == 2 * (per_layer_int8 + per_layer_scales) + norms + head + 4 * 32
