"""``tidespec bench anchor``: the anchor computes the same greedy tokens as the engine; the bench runs end to end."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import run_to_completion, tiny_llama
from tidespec.bench.anchor.model import AnchorModel
from tidespec.bench.anchor.run import SHAPES, AnchorBenchConfig, run_anchor_bench, synthetic_tokenizer
from tidespec.config import CacheConfig, ConfigError, EngineConfig, ModelConfig
from tidespec.engine.engine import LLMEngine
from tidespec.models.target import TargetConfig
from tidespec.sampling import SamplingParams


def test_anchor_decodes_what_the_engine_decodes():
    model = tiny_llama(64, layers=2, seed=3, scale=2.0)
    prompts = [[5, 9, 11, 3, 7], [8, 8, 2, 40, 41]]
    engine = LLMEngine(model, synthetic_tokenizer(64), EngineConfig(cache=CacheConfig(max_model_len=64, max_num_seqs=2)))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = run_to_completion(engine)
    anchor = AnchorModel(model, batch=2, max_len=32, compile=False)
    with torch.inference_mode():
        for i in range(len(prompts[0]) - 1):  # prefill token by token
            anchor.forward(torch.tensor([[p[i]] for p in prompts]), torch.tensor([i]))
    got = anchor.decode(torch.tensor([[p[-1]] for p in prompts]), len(prompts[0]) - 1, 12)
    assert got.tolist() == [done[i].token_ids for i in ids]


def test_anchor_bench_runs_and_rejects_unknown_shapes(tmp_path, monkeypatch):
    tiny = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=256)
    monkeypatch.setitem(SHAPES, "tiny", tiny)
    cfg = AnchorBenchConfig(shapes=("tiny",), batch_sizes=(1, 2), prompt_len=4, max_tokens=6, rounds=2,
                            compile_anchor=False)
    doc = run_anchor_bench(cfg, ModelConfig(), out_dir=tmp_path, command="test", echo=False)
    assert [r["batch"] for r in doc["rows"]] == [1, 2]
    assert all(r["tidespec_tok_s"] > 0 and r["anchor_tok_s"] > 0 and len(r["tidespec_runs"]) == 2 for r in doc["rows"])
    assert json.loads((tmp_path / "results.json").read_text())["bench"] == "anchor"
    assert (tmp_path / "plot.png").is_file() and "NOT compiled" in (tmp_path / "table.md").read_text()
    with pytest.raises(ConfigError, match="unknown shape"):
        AnchorBenchConfig(shapes=("gpt-5",))
