"""Dovetail-style placement (``--drafter-device``): the flag, and drafters whose weights are their own
copies on the drafter's device, still lossless.

This machine has one device (the CPU), so the copying path is forced by making
``placement.elsewhere`` answer "another device": the drafters then hold copies of the target's
embedding / layers on the same CPU, and the outputs must still equal plain decoding.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.helpers import run_to_completion, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.errors import ConfigError
from tidespec.llm import build_drafter
from tidespec.models.execution import placement
from tidespec.models.kernels.linear import Linear
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.draft_model import DraftModelDrafter, DraftModelOptions
from tidespec.speculative.drafters.eagle3 import Eagle3Drafter
from tidespec.speculative.drafters.eagle3_options import Eagle3Options
from tidespec.speculative.drafters.multi import MultiDrafter
from tidespec.speculative.registry import add_engine_args, check_config, engine_config_from_args

V = 48
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15, 16, 12, 13, 14]]
CPU = torch.device("cpu")


# -- the flag --------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_drafter_device_accepts_device_names(value: str) -> None:
    assert SpecConfig(drafter="eagle3", drafter_device=value).drafter_device == value


@pytest.mark.parametrize("value", ["gpu", "CPU", "cpu:0", "cuda:", "cuda:x", "cuda:-1", " cuda", "mps", "cuda:0,1"])
def test_drafter_device_rejects_other_values_in_one_line(value: str) -> None:
    with pytest.raises(ConfigError, match="drafter_device must be") as err:
        SpecConfig(drafter="eagle3", drafter_device=value)
    assert "\n" not in str(err.value)


def test_drafter_device_flag() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).spec.drafter_device == ""
    cfg = engine_config_from_args(p.parse_args(["--drafter", "eagle3", "--drafter-device", "cuda:1"]))
    assert cfg.spec.drafter_device == "cuda:1"
    with pytest.raises(ConfigError, match="drafter_device"):
        engine_config_from_args(p.parse_args(["--drafter-device", "tpu"]))


def test_int8_eagle3_head_needs_the_drafter_on_the_cpu() -> None:
    int8 = {"eagle3": Eagle3Options(quantization="int8")}
    with pytest.raises(ConfigError, match="needs the drafter on the CPU"):
        check_config(EngineConfig(spec=SpecConfig(drafter="eagle3", drafter_device="cuda", options=int8)))
    with pytest.raises(ConfigError, match="needs the drafter on the CPU"):
        check_config(EngineConfig(model=ModelConfig(device="cuda"), spec=SpecConfig(drafter="eagle3", options=int8)))
    # a target on a GPU with the drafter on the CPU: the head may draft in int8
    check_config(EngineConfig(model=ModelConfig(device="cuda"), spec=SpecConfig(drafter="eagle3", drafter_device="cpu",
                                                                               options=int8)))


def test_resolve_device() -> None:
    assert placement.resolve_device("", CPU) == CPU
    assert placement.resolve_device("cpu", torch.device("cuda", 0)) == CPU
    if torch.cuda.is_available():
        assert placement.resolve_device("cuda", CPU) == torch.device("cuda", torch.cuda.current_device())
    else:
        with pytest.raises(ConfigError, match="CUDA device"):
            placement.resolve_device("cuda", CPU)


# -- the copy helpers ------------------------------------------------------------------------------


def _tensor_ptrs(module: torch.nn.Module) -> set[int]:
    return {t.data_ptr() for t in [*module.parameters(), *module.buffers()]}


def test_module_copy_shares_no_tensor_and_computes_the_same() -> None:
    target = tiny_llama(V, layers=3, tie_word_embeddings=True)
    shared = target.truncated(2)
    own = placement.module_copy(shared, CPU)
    assert _tensor_ptrs(own).isdisjoint(_tensor_ptrs(target))
    assert own.lm_head.weight is own.embed_tokens.weight  # tied parameters stay tied
    assert own._rope_tables is not target._rope_tables and len(own.layers) == 2
    for (name, a), (_, b) in zip(shared.state_dict().items(), own.state_dict().items()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        own.layers[0].self_attn.qkv_proj.weight.add_(1.0)  # the copy's weights are its own
    assert not torch.equal(own.layers[0].self_attn.qkv_proj.weight, target.layers[0].self_attn.qkv_proj.weight)


def test_module_copy_drops_caches_of_the_source_tensors() -> None:
    target = tiny_llama(V, layers=2, dtype=torch.float32)
    lin = target.layers[0].self_attn.qkv_proj
    assert isinstance(lin, Linear)
    lin.choice, lin.tuned_threads = ("split",), 2
    assert lin.blocks(2) is not None  # a cache of the source weight
    copied = placement.module_copy(target.truncated(1), CPU).layers[0].self_attn.qkv_proj
    assert copied._blocks is None and copied.choice == ("split",)  # a CPU copy keeps the measured kernels
    on_meta = placement.module_copy(target.truncated(1), torch.device("meta"))  # a device that is not the CPU
    assert on_meta.device.type == "meta" and on_meta.layers[0].self_attn.qkv_proj.choice == ()  # F.linear there


def test_embedding_copy_casts_and_owns_its_table() -> None:
    target = tiny_llama(V, layers=2)  # float64
    embed = placement.embedding_copy(target.embed_tokens, CPU, torch.float32)
    assert embed.weight.dtype == torch.float32 and not embed.weight.requires_grad
    assert embed.weight.data_ptr() != target.embed_tokens.weight.data_ptr()
    ids = torch.tensor([3, 7, 7, 40])
    assert torch.equal(embed(ids), target.embed_tokens(ids).to(torch.float32))  # cast then look up == look up then cast


# -- drafters on the drafter device: lossless ------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_llama(V, layers=4, seed=2, scale=3.0)  # float64: greedy comparisons are exact


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(V)


def generate(model, tok, spec: SpecConfig, drafter=None) -> tuple[list[list[int]], int]:
    cfg = EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=len(PROMPTS)), spec=spec)
    e = LLMEngine(model, tok, cfg, drafter=drafter)
    ids = [e.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in PROMPTS]
    done = run_to_completion(e)
    return [done[i].token_ids for i in ids], sum(o.stats.num_draft_tokens for o in done.values())


@pytest.fixture(scope="module")
def plain(model, tok) -> list[list[int]]:
    return generate(model, tok, SpecConfig())[0]


def spec_for(drafter: str, tree: bool) -> SpecConfig:
    return SpecConfig(drafter=drafter, num_speculative_tokens=3, tree=tree, drafter_device="cpu",
                      options={"draft-model": DraftModelOptions(layers=1, tree_top_k=2),
                               "eagle3": Eagle3Options(tree_depth=3, tree_top_k=2)})


def members(drafter) -> list:
    return list(drafter.members.values()) if isinstance(drafter, MultiDrafter) else [drafter]


def check_placement(drafter, model, copied: bool) -> None:
    for d in members(drafter):
        if isinstance(d, Eagle3Drafter):
            assert d.head.device == CPU
            assert (d.embed is not model.embed_tokens) == copied
            if copied:
                assert d.embed.weight.data_ptr() != model.embed_tokens.weight.data_ptr()
                assert torch.equal(d.embed.weight, model.embed_tokens.weight.to(d.head.dtype))
        elif isinstance(d, DraftModelDrafter):
            assert d.model.device == CPU
            disjoint = _tensor_ptrs(d.model).isdisjoint(_tensor_ptrs(model))
            assert disjoint == copied


@pytest.mark.parametrize("copied", [False, True], ids=["same-device", "forced-copy"])
@pytest.mark.parametrize("drafter,tree", [("eagle3", False), ("eagle3", True), ("draft-model", False),
                                          ("draft-model", True), ("ngram", False), ("suffix,eagle3", False)])
def test_placed_drafter_greedy_equals_plain(model, tok, plain, monkeypatch, drafter, tree, copied) -> None:
    if copied:  # one device here: pretend "cpu" is another device than the target's, so the copies are made
        monkeypatch.setattr(placement, "elsewhere", lambda device, target_device: True)
    spec = spec_for(drafter, tree)
    built = build_drafter(spec, model, len(PROMPTS), 96)
    check_placement(built, model, copied)
    got, drafted = generate(model, tok, spec, drafter=built)
    assert got == plain
    assert drafted > 0, "the drafter never proposed: verification was not exercised"
