"""EAGLE-3 checkpoint export/import (vLLM / SGLang layout), validation, and atomic versioned publish."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.helpers import tiny_llama
from tidespec.files import latest_version, list_versions
from tidespec.models.eagle3 import checkpoint as ckpt
from tidespec.models.eagle3.checkpoint import (
    DrafterCheckpointError,
    export_eagle3,
    import_eagle3,
    load_version,
    publish,
    state_dict_equal,
    validate_eagle3_dir,
)
from tidespec.models.eagle3.head import Eagle3Config, Eagle3Head
from tidespec.models.target import TargetConfig
from tidespec.online.training.eagle3_train import select_draft_vocab
from tidespec.speculative.drafters.eagle3 import Eagle3Drafter, Eagle3DrafterConfig, build_eagle3_drafter

TARGET = TargetConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=8, num_heads=4,
                     num_kv_heads=2, head_dim=4)


def make_head(dtype: torch.dtype = torch.float64, seed: int = 0, draft_vocab: int = 24) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(TARGET, draft_vocab)).to(dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_()
    counts = torch.arange(TARGET.vocab_size) % 5
    head.set_vocab_map(*select_draft_vocab(counts, draft_vocab))
    return head


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_export_import_round_trip_is_bitwise_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    head = make_head(dtype)
    export_eagle3(head, tmp_path)
    cfg, sd = import_eagle3(tmp_path)
    assert cfg == head.cfg
    assert state_dict_equal(sd, head.state_dict())
    fresh = Eagle3Head(cfg).to(dtype)
    fresh.load_state_dict(sd)
    assert state_dict_equal(fresh.state_dict(), head.state_dict())


def test_directory_has_vllm_names_shapes_and_config_keys(tmp_path: Path) -> None:
    head = make_head()
    embed = torch.nn.Embedding(TARGET.vocab_size, TARGET.hidden_size).double()
    export_eagle3(head, tmp_path, embed=embed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    expected_cfg = {"hidden_size": 16, "intermediate_size": 24, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 4, "num_hidden_layers": 1, "vocab_size": 40, "draft_vocab_size": 24,
                    "tie_word_embeddings": False, "max_position_embeddings": 2048}
    assert {k: config[k] for k in expected_cfg} == expected_cfg
    assert {"rms_norm_eps", "rope_theta", "torch_dtype"} <= config.keys()
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert shapes == {
        "fc.weight": (16, 48),
        "midlayer.input_layernorm.weight": (16,),
        "midlayer.hidden_norm.weight": (16,),
        "midlayer.self_attn.q_proj.weight": (16, 32),
        "midlayer.self_attn.k_proj.weight": (8, 32),
        "midlayer.self_attn.v_proj.weight": (8, 32),
        "midlayer.self_attn.o_proj.weight": (16, 16),
        "midlayer.post_attention_layernorm.weight": (16,),
        "midlayer.mlp.gate_proj.weight": (24, 16),
        "midlayer.mlp.up_proj.weight": (24, 16),
        "midlayer.mlp.down_proj.weight": (16, 24),
        "norm.weight": (16,),
        "lm_head.weight": (24, 16),
        "d2t": (24,),
        "t2d": (40,),
        "embed_tokens.weight": (40, 16),
    }
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert bool(t2d[torch.arange(24) + d2t].all()) and int(t2d.sum()) == 24
    validate_eagle3_dir(tmp_path, TARGET)


def test_import_accepts_layers0_names_and_missing_identity_vocab_map(tmp_path: Path) -> None:
    head = make_head(draft_vocab=TARGET.vocab_size)
    export_eagle3(head, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    cfg, sd = import_eagle3(tmp_path)
    assert torch.equal(sd["midlayer.self_attn.qkv_proj.weight"], head.state_dict()["midlayer.self_attn.qkv_proj.weight"])
    assert bool((sd["d2t"] == 0).all()) and bool(sd["t2d"].all()) and cfg.draft_vocab_size == TARGET.vocab_size


def _corrupt(tmp_path: Path, edit: str) -> Path:
    d = tmp_path / edit
    export_eagle3(make_head(), d)
    weights = d / "model.safetensors"
    tensors = load_file(str(weights))
    if edit == "nan":
        tensors["midlayer.mlp.up_proj.weight"][3, 1] = float("nan")
    elif edit == "shape":
        tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1].contiguous()
    elif edit == "missing":
        del tensors["midlayer.hidden_norm.weight"]
    elif edit == "extra":
        tensors["midlayer.self_attn.q_norm.weight"] = torch.ones(4, dtype=torch.float64)
    elif edit == "d2t":
        tensors["d2t"][1] = tensors["d2t"][0] - 1  # draft ids 0 and 1 -> the same target id
    elif edit == "truncated":
        save_file(tensors, str(weights))
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        return d
    elif edit == "config":
        (d / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": ')
        return d
    save_file(tensors, str(weights))
    return d


@pytest.mark.parametrize("edit,message", [
    ("nan", "non-finite"), ("shape", "shape"), ("missing", "missing tensor"), ("extra", "unexpected"),
    ("d2t", "same target id"), ("truncated", "unreadable"), ("config", "unreadable"),
])
def test_validate_refuses_broken_checkpoints(tmp_path: Path, edit: str, message: str) -> None:
    d = _corrupt(tmp_path, edit)
    with pytest.raises(DrafterCheckpointError, match=message):
        validate_eagle3_dir(d, TARGET)


def test_validate_refuses_a_checkpoint_for_another_target(tmp_path: Path) -> None:
    export_eagle3(make_head(), tmp_path)
    validate_eagle3_dir(tmp_path, TARGET)
    other = TargetConfig(vocab_size=41, hidden_size=16, intermediate_size=24, num_layers=8, num_heads=4,
                        num_kv_heads=2, head_dim=4)
    with pytest.raises(DrafterCheckpointError, match="vocab_size"):
        validate_eagle3_dir(tmp_path, other)
    shallow = TargetConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=5, num_heads=4,
                          num_kv_heads=2, head_dim=4)
    with pytest.raises(DrafterCheckpointError, match="tap layers"):
        validate_eagle3_dir(tmp_path, shallow)
    with pytest.raises(DrafterCheckpointError, match="config.json"):
        validate_eagle3_dir(tmp_path / "nowhere", TARGET)


def test_publish_versions_and_ignores_partial_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "drafters"
    assert latest_version(root) is None
    h1, h2 = make_head(seed=1), make_head(seed=2)
    assert publish(root, h1, {"accept_len": 2.1}) == 1
    assert publish(root, h2, {"accept_len": 2.4}) == 2
    # a crashed writer left a half-written temp dir behind: readers never see it
    partial = root / ".tmp-v3-deadbeef"
    partial.mkdir()
    (partial / "config.json").write_text("{\"architectures\": [")
    assert latest_version(root) == 2 and list_versions(root) == [1, 2]
    # a crash in the middle of writing the weights leaves no version and LATEST untouched

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        publish(root, h1, {})
    monkeypatch.undo()
    assert latest_version(root) == 2 and list_versions(root) == [1, 2]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-")) == [".tmp-v3-deadbeef"]
    pub = load_version(root, 2, TARGET)
    assert pub.version == 2 and pub.metrics["accept_len"] == 2.4 and pub.config == h2.cfg
    assert state_dict_equal(pub.state_dict, h2.state_dict())
    assert publish(root, h1, {}) == 3
    assert (root / "LATEST").read_text().strip() == "3"
    (root / "LATEST").unlink()  # lost pointer: fall back to the newest complete version
    assert latest_version(root) == 3
    with pytest.raises(DrafterCheckpointError, match="not found"):
        load_version(root, 9)


def test_published_weights_swap_into_a_live_drafter(tmp_path: Path) -> None:
    head = make_head(seed=1)
    embed = torch.nn.Embedding(TARGET.vocab_size, TARGET.hidden_size).double()
    drafter = Eagle3Drafter(head, embed, Eagle3DrafterConfig(max_num_seqs=2, max_model_len=32))
    n = publish(tmp_path, make_head(seed=2), {"accept_len": 3.0})
    pub = load_version(tmp_path, n, TARGET)
    drafter.load_state(pub.version, pub.state_dict, pub.config)
    assert drafter.version == n and state_dict_equal(drafter.head.state_dict(), make_head(seed=2).state_dict())
    bigger = make_head(seed=3, draft_vocab=32)  # a new draft vocabulary rebuilds the head
    drafter.load_state(n + 1, bigger.state_dict(), bigger.cfg)
    assert drafter.head.cfg.draft_vocab_size == 32


def test_a_fresh_head_says_how_to_load_a_trained_one(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    boot = ckpt.shipped_bootstrap()
    assert boot is not None and (boot / "config.json").is_file()  # the embedded model's head ships with the package
    model = tiny_llama(48, layers=8, seed=2)
    with caplog.at_level("WARNING", logger="tidespec.llm"):
        build_eagle3_drafter(model, None)
    assert f"--eagle3-dir {boot}" in caplog.text and "fresh random head" in caplog.text
    caplog.clear()
    ckpt.export_eagle3(Eagle3Head(Eagle3Config.for_target(model.cfg)), tmp_path / "head")
    with caplog.at_level("WARNING", logger="tidespec.llm"):
        build_eagle3_drafter(model, tmp_path / "head")
    assert "fresh random head" not in caplog.text
