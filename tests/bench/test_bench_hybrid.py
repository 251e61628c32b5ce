"""``bench spec --hybrid`` on a tiny model: every configuration's outputs equal plain's, the two over
several drafters report who drafted, and the table, plot and results are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import byte_tokenizer, tiny_llama
from tidespec.bench.decode.run import wave_indices
from tidespec.bench.spec.hybrid import CONFIGS, HybridBenchConfig, configs_for, run_hybrid_bench, shares
from tidespec.bench.spec.waves import schedule
from tidespec.config import ConfigError, ModelConfig, PolicyConfig
from tidespec.models.loading.loader import LoadedModel
from tidespec.speculative.policy.speedup import Profile

PROMPTS = ["abcabcabcabc", "the cat sat on the mat; the cat sat on the", "xq7!", "1 2 3 1 2 3 1 2"]


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    tok = byte_tokenizer()
    model = tiny_llama(len(tok), layers=3, seed=3, scale=3.0, eos=0)  # EAGLE-3 taps three layers
    return LoadedModel(model=model, tokenizer=tok, config=model.cfg, path="")


def test_the_model_drafter_is_a_choice() -> None:
    assert list(configs_for("medusa")) == ["plain", "suffix", "medusa", "controller (suffix, medusa)",
                                           "per-sequence (suffix, medusa)"]
    assert configs_for("medusa")["per-sequence (suffix, medusa)"] == ("suffix,medusa", True, True)
    assert list(configs_for("eagle3", untrimmed=True))[-2:] == ["controller (suffix, eagle3), untrimmed",
                                                                "per-sequence (suffix, eagle3), untrimmed"]
    assert configs_for("eagle3", untrimmed=True)["controller (suffix, eagle3), untrimmed"] == ("suffix,eagle3", False,
                                                                                               False)
    assert CONFIGS == configs_for()


def test_shares_hand_traced() -> None:
    assert shares({"suffix": 2, "eagle3": 1, "none": 1}) == {"eagle3": 0.25, "none": 0.25, "suffix": 0.5}
    assert shares({}) == {}


def test_hybrid_bench_smoke_lossless(tmp_path: Path, target: LoadedModel) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"id": f"r{i}", "domain": "x", "kind": "completion", "prompt": p}) + "\n"
                                for i, p in enumerate(PROMPTS)))
    profile = tmp_path / "profile.json"  # a flat target: drafting pays wherever something is accepted
    Profile(target_latency={1: 0.010, 64: 0.010}, draft_cost={"default": 0.0, "suffix": 0.0, "eagle3": 0.002}
            ).save(profile)
    cfg = HybridBenchConfig(workload=str(workload), limit=4, batch_sizes=(1, 2), gamma=3, max_tokens=24)
    out = tmp_path / "out"
    doc = run_hybrid_bench(cfg, target, model_config=ModelConfig(dtype="float64"),
                           policy=PolicyConfig(name="analytic", profile=str(profile)), out_dir=out, echo=False)
    assert [c["config"] for c in doc["configs"]] == list(CONFIGS) * 2
    assert (out / "plot.png").stat().st_size > 0 and "| 2 | per-sequence (suffix, eagle3)" in (out / "table.md").read_text()
    for c in doc["configs"]:
        assert c["mismatches"] == 0 and c["requests"] == 4, c
        assert c["tokens_per_step"] >= 1.0 and sum(c["shares"].values()) == pytest.approx(1.0)
    routed = [c["shares"] for c in doc["configs"] if c["config"].startswith("per-sequence")]
    assert all(s.get("suffix", 0) > 0 for s in routed)
    assert set(doc["headline"]) == {"batch 1", "batch 2"}


def test_schedule_hand_traced() -> None:
    assert schedule(16, 4) == wave_indices(16, 4) and len(schedule(16, 4)) == 4
    assert schedule(16, 4, 2) == [list(range(8)), list(range(8, 16))]
    assert schedule(16, 4, 8) == [list(range(16))]
    assert schedule(2, 4, 8) == [[0, 1, 0, 1]]  # never below the batch
    with pytest.raises(ConfigError, match="refill"):
        HybridBenchConfig(refill=0)


def test_refilled_waves_keep_the_batch_full_and_stay_lossless(tmp_path: Path, target: LoadedModel) -> None:
    """--refill 2 at batch 2: one wave of all four prompts on two KV slots, the engine admitting a queued
    prompt whenever a sequence finishes; outputs still equal plain's, every request answered."""
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"id": f"r{i}", "domain": "x", "kind": "completion", "prompt": p}) + "\n"
                                for i, p in enumerate(PROMPTS)))
    profile = tmp_path / "profile.json"
    Profile(target_latency={1: 0.010, 64: 0.010}, draft_cost={"default": 0.0, "suffix": 0.0, "eagle3": 0.002}
            ).save(profile)
    cfg = HybridBenchConfig(workload=str(workload), limit=4, batch_sizes=(2,), gamma=3, max_tokens=16, refill=2)
    doc = run_hybrid_bench(cfg, target, model_config=ModelConfig(dtype="float64"),
                           policy=PolicyConfig(name="analytic", profile=str(profile)), out_dir=tmp_path / "out",
                           echo=False)
    assert doc["refill"] == 2 and "refilled as sequences finish" in (tmp_path / "out" / "table.md").read_text()
    for c in doc["configs"]:
        assert c["mismatches"] == 0 and c["requests"] == 4, c
