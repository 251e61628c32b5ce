"""The exactness matrix, fast subset: on the embedded model, every path and drafter gives exactly the
path's plain greedy decoding of each prompt alone, one request at a time and all at once, and
the target's rows have the same bits in verifications, batches and prompt chunks as decoded alone
(``tidespec bench exactness``; the full matrix -- 24 prompts x 256 tokens, every path x every
drafter -- is ``make exactness``). Without row-invariant kernels the row probe fails."""

from __future__ import annotations

import pytest

from tidespec.bench.exactness.run import (
    ExactnessBenchConfig,
    exact,
    parse_path,
    row_probe,
    run_exactness_bench,
    table,
    target_model,
)
from tidespec.config import CacheConfig, ConfigError, EngineConfig, ModelConfig
from tidespec.llm import build_engine
from tidespec.models.quant_a8 import a8_error
from tidespec.workloads.loader import load_prompts

pytestmark = pytest.mark.integration
PROMPTS = {"workloads": "code,multilingual", "limit": 1, "max_tokens": 32, "max_num_seqs": 4}


@pytest.mark.parametrize("paths,drafters", [
    ("float32", "suffix;eagle3-tree"),
    ("int8", "draft-model;suffix,eagle3+analytic"),
    ("bfloat16", "ngram;eagle3"),
    ("int4+compile", "suffix"),
    ("bfloat16+compile", "suffix"),  # its graphs round like eager code (emulate_precision_casts); else probe 0/48
    pytest.param("w4a8+compile", "suffix;eagle3-tree",
                 marks=pytest.mark.skipif(a8_error() is not None, reason=f"no w4a8 kernels: {a8_error()}")),
])
def test_path_and_drafters_alone_and_batched_equal_plain_decoding_alone(paths: str, drafters: str,
                                                                         two_threads) -> None:
    doc = run_exactness_bench(ExactnessBenchConfig(paths=paths, drafters=drafters, **PROMPTS), progress=False)
    assert exact(doc), table(doc)
    for path in doc["paths"]:
        probe = path["row_probe"]
        assert path["invariance"]["exact"] and probe["identical"] == probe["rows"], probe


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_without_row_invariant_kernels_rows_depend_on_the_batch(embedded, quantization: str, two_threads) -> None:
    """The control: the same probe on the engine without row-invariant kernels (SDPA, the fastest
    kernel per row count) finds rows whose bits depend on what else the forward holds."""
    target = target_model("float32", quantization, {("float32", "none"): embedded})
    prompts = [p.token_ids for p in load_prompts("code", target.tokenizer, limit=2)]
    config = EngineConfig(model=ModelConfig(quantization=quantization, row_invariant=False),
                          cache=CacheConfig(max_model_len=512, max_num_seqs=4))
    engine = build_engine(config, model=target.model, tokenizer=target.tokenizer)
    probe = row_probe(engine, prompts)
    assert probe["identical"] < probe["rows"], probe


def test_paths_name_dtype_quantization_and_compile() -> None:
    assert parse_path("int4+compile") == ("float32", "int4", True)
    assert parse_path("bfloat16+int4") == ("bfloat16", "int4", False)
    assert parse_path("bfloat16+compile") == ("bfloat16", "none", True)
    assert parse_path("w4a8+compile") == ("float32", "w4a8", True)
    for bad in ("int5", "compile", "int4+x", "float16", "bfloat16+compile+compile"):
        with pytest.raises(ConfigError, match="unknown path"):
            ExactnessBenchConfig(paths=f"float32,{bad}")
