"""``bench spec --structured`` on a tiny model: every configuration's outputs equal constrained plain's,
the table, plot and results are written, and a workload without schemas is a one-line error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import byte_tokenizer, tiny_llama
from tidespec.bench.spec.structured import CONFIGS, StructuredBenchConfig, run_structured_bench
from tidespec.config import ConfigError, ModelConfig, PolicyConfig
from tidespec.models.loading.loader import EMBEDDED_CHAT_TEMPLATE, LoadedModel

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "ok": {"type": "boolean"}, "tag": {"enum": ["red", "blue"]}},
          "required": ["name", "ok", "tag"], "additionalProperties": False}


def _workload(tmp_path: Path, schema: dict | None) -> Path:
    path = tmp_path / "w.jsonl"
    lines = [{"id": f"r{i}", "domain": "x", "kind": "completion", "prompt": f'{{"name": "a{i}", "ok": true, "tag": "red"}} '
              f'{{"name": "a{i}", ', **({"schema": schema} if schema else {})} for i in range(3)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_structured_bench_smoke_lossless(tmp_path: Path) -> None:
    tok = byte_tokenizer()
    model = tiny_llama(len(tok), layers=2, seed=3, scale=3.0, eos=0)
    target = LoadedModel(model=model, tokenizer=tok, config=model.cfg, path="")
    cfg = StructuredBenchConfig(workload=str(_workload(tmp_path, SCHEMA)), limit=3, batch_sizes=(1, 2), gamma=4,
                                max_tokens=24)
    out = tmp_path / "out"
    doc = run_structured_bench(cfg, target, model_config=ModelConfig(dtype="float64"),
                               policy=PolicyConfig(name="bandit"), out_dir=out, echo=False)
    assert (out / "plot.png").stat().st_size > 0 and "| 2 | controller" in (out / "table.md").read_text()
    assert [c["config"] for c in doc["configs"]] == list(CONFIGS) * 2
    for c in doc["configs"]:
        assert c["mismatches"] == 0 and c["requests"] == 3, c
        assert c["tokens_per_step"] >= 1.0 and 0.0 < c["mask_share"] < 1.0
    forced = next(c for c in doc["configs"] if c["config"] == "grammar" and c["batch_size"] == 1)
    assert forced["tokens_per_step"] > 1.0  # the keys the schema forces were drafted and accepted


def test_tool_use_records_force_one_call_of_their_tools(tmp_path: Path) -> None:
    """A record with tools: the chat template shows them, one call in the template's format is forced,
    and it is valid when it is a call of one of them with arguments that fit its parameters."""
    tok = byte_tokenizer()
    tok.chat_template = EMBEDDED_CHAT_TEMPLATE.read_text()  # renders tools in the hermes format
    model = tiny_llama(len(tok), layers=2, seed=3, scale=3.0, eos=0, max_position_embeddings=1024)
    target = LoadedModel(model=model, tokenizer=tok, config=model.cfg, path="")
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"], "additionalProperties": False}}}]
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": "t0", "domain": "x", "kind": "chat", "prompt": "time?", "tools": tools}) + "\n")
    doc = run_structured_bench(StructuredBenchConfig(workload=str(path), limit=1, batch_sizes=(1,), gamma=4,
                                                     max_tokens=96), target, model_config=ModelConfig(dtype="float64"),
                               policy=PolicyConfig(name="bandit"), out_dir=tmp_path / "out", echo=False)
    for c in doc["configs"]:
        assert c["mismatches"] == 0 and c["schema_valid"] == 1, c  # the enum leaves nothing to run away


def test_a_workload_without_schemas_is_refused(tmp_path: Path) -> None:
    tok = byte_tokenizer()
    model = tiny_llama(len(tok), layers=1, eos=0)
    target = LoadedModel(model=model, tokenizer=tok, config=model.cfg, path="")
    cfg = StructuredBenchConfig(workload=str(_workload(tmp_path, None)), limit=1, batch_sizes=(1,), max_tokens=4)
    with pytest.raises(ConfigError, match="has no schema and no tools"):
        run_structured_bench(cfg, target, policy=PolicyConfig(name="bandit"), out_dir=tmp_path / "o", echo=False)
