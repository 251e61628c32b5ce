"""``bench spec --predicted`` on a tiny model: every configuration's outputs equal plain's, the prediction
is drafted and accepted, the table, plot and results are written, and a workload without predictions is
a one-line error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import byte_tokenizer, run_to_completion, tiny_llama
from tidespec.bench.spec.predicted import CONFIGS, LOGPROB_CONFIGS, PredictedBenchConfig, run_predicted_bench
from tidespec.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, PolicyConfig
from tidespec.engine.engine import LLMEngine
from tidespec.models.loading.loader import LoadedModel
from tidespec.sampling import SamplingParams

MAX_TOKENS = 24
PROMPTS = [f"def f{i}(a, b):\n    return a + b\n\ndef g{i}(a, b):\n    return a * b\n\ndef" for i in range(3)]


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    tok = byte_tokenizer()
    model = tiny_llama(len(tok), layers=3, seed=3, scale=3.0, eos=0)  # EAGLE-3 taps three layers
    return LoadedModel(model=model, tokenizer=tok, config=model.cfg, path="")


def _workload(tmp_path: Path, target: LoadedModel, predicted: bool) -> Path:
    """The prompts, each with plain decoding's output as its prediction (decoded to text: the random
    model's invalid UTF-8 comes back as replacement characters, which the bench re-tokenizes, so a
    few tokens of each prediction are wrong, as in an edit)."""
    tok = target.tokenizer
    engine = LLMEngine(target.model, tok, EngineConfig(cache=CacheConfig(max_model_len=256, max_num_seqs=1)))
    ids = [engine.add_request(tok.encode(p), SamplingParams(max_tokens=MAX_TOKENS)) for p in PROMPTS]
    done = run_to_completion(engine)
    lines = [{"id": f"r{i}", "domain": "x", "kind": "completion", "prompt": p,
              **({"prediction": tok.decode(done[rid].token_ids)} if predicted else {})}
             for i, (p, rid) in enumerate(zip(PROMPTS, ids))]
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_predicted_bench_smoke_lossless(tmp_path: Path, target: LoadedModel) -> None:
    cfg = PredictedBenchConfig(workload=str(_workload(tmp_path, target, True)), limit=3, batch_sizes=(1, 2),
                               gamma=4, max_tokens=MAX_TOKENS, logprobs=2)
    out = tmp_path / "out"
    doc = run_predicted_bench(cfg, target, model_config=ModelConfig(dtype="float64"),
                              policy=PolicyConfig(name="bandit"), out_dir=out, echo=False)
    labels = list(CONFIGS) + [f"{lab}, logprobs 2" for lab in LOGPROB_CONFIGS]
    assert [c["config"] for c in doc["configs"]] == labels * 2
    assert (out / "plot.png").stat().st_size > 0 and "| 2 | prediction + controller" in (out / "table.md").read_text()
    for c in doc["configs"]:
        assert c["mismatches"] == 0 and c["requests"] == 3, c
        assert c["tokens_per_step"] >= 1.0 and c["decode_step_ms"] > 0
        assert (c["prediction_share"] > 0) == c["config"].startswith("prediction"), c
    assert set(doc["headline"]) == {"batch 1", "batch 2"}
    assert all(c["tokens_per_step"] > 1.2 for c in doc["configs"] if c["config"] == "prediction")


def test_a_workload_without_predictions_is_refused(tmp_path: Path, target: LoadedModel) -> None:
    cfg = PredictedBenchConfig(workload=str(_workload(tmp_path, target, False)), limit=1, batch_sizes=(1,), max_tokens=4)
    with pytest.raises(ConfigError, match="records without a 'prediction': r0"):
        run_predicted_bench(cfg, target, out_dir=tmp_path / "o", echo=False)
