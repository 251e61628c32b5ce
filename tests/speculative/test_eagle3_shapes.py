"""Deeper EAGLE-3 heads and Dovetail's gated fusion: inference = training, lossless, checkpoints, init."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import capture, run_to_completion, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, ConfigError, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.models.eagle3.checkpoint import export_eagle3, import_eagle3, state_dict_equal
from tidespec.models.eagle3.head import Eagle3Config, Eagle3ConfigError, Eagle3Head, init_from_target
from tidespec.models.families.decoder import DecoderModel
from tidespec.models.quant.a8 import a8_error
from tidespec.models.quant.base import QuantizationError
from tidespec.online.training.eagle3_train import SignalBatch, SignalSegment, ttt_loss, unroll
from tidespec.sampling import SamplingParams
from tidespec.speculative.api import DraftInput, Observation
from tidespec.speculative.drafters.eagle3 import Eagle3Drafter, Eagle3DrafterConfig
from tidespec.speculative.drafters.eagle3_options import Eagle3Options

V = 48
SHAPES = [(1, "gated"), (2, "concat"), (2, "gated"), (3, "gated")]
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15, 16, 12, 13, 14, 15, 16, 12], [3, 3, 3, 3]]


@pytest.fixture(scope="module")
def target() -> DecoderModel:
    return tiny_llama(V, layers=4, seed=2, scale=3.0)


def shaped_head(target: DecoderModel, layers: int, fusion: str, seed: int = 1) -> Eagle3Head:
    """A head of the given depth and fusion whose random weights are large enough to vary drafts."""
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target.cfg, num_layers=layers, fusion=fusion)).to(target.dtype)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return head


def drafter_for(head: Eagle3Head, target: DecoderModel, slots: int = 4, quantization: str = "none",
                min_draft_prob: float = 0.0) -> Eagle3Drafter:
    return Eagle3Drafter(head, target.embed_tokens, Eagle3DrafterConfig(max_num_seqs=slots, max_model_len=128,
                                                                        tree_depth=3, tree_top_k=2,
                                                                        quantization=quantization,
                                                                        min_draft_prob=min_draft_prob))


def test_config_validation() -> None:
    cfg = tiny_llama(V, layers=4).cfg
    with pytest.raises(Eagle3ConfigError, match="num_layers"):
        Eagle3Config.for_target(cfg, num_layers=0)
    with pytest.raises(Eagle3ConfigError, match="fusion"):
        Eagle3Config.for_target(cfg, fusion="sum")


@pytest.mark.parametrize("layers,fusion", SHAPES)
@pytest.mark.parametrize("gamma", [1, 4])
def test_inference_chain_equals_training_time_test_unroll(target: DecoderModel, layers: int, fusion: str,
                                                          gamma: int) -> None:
    head = shaped_head(target, layers, fusion)
    drafter = drafter_for(head, target)
    ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    taps = capture(target, ids, drafter.tap_layers)
    drafter.observe([Observation(0, ids, 11, taps[:11])])
    draft = drafter.propose([DraftInput(0, ids, gamma, SamplingParams())]).drafts[0]
    batch = SignalBatch.collate([SignalSegment(taps[:11], torch.tensor(ids))], head)
    steps = unroll(head, target.embed_tokens, batch, gamma, True)
    torch.testing.assert_close(drafter._states[0].last_logits, unroll(head, target.embed_tokens, batch, 1)[0][0, -1],
                               rtol=1e-9, atol=1e-9)
    assert draft.token_ids == [int(head.draft_to_target(lg[0, -1].argmax())) for lg in steps]
    loss, _ = ttt_loss(head, target.embed_tokens, [batch.segments[0]], 3)
    loss.backward()
    assert all(p.grad is not None for p in head.parameters())  # every block and the gate learn


def plain_outputs(target: DecoderModel, prompts: list[list[int]]) -> list[list[int]]:
    return generate(target, None, prompts, SpecConfig(), 4)[0]


def generate(target: DecoderModel, head: Eagle3Head | None, prompts: list[list[int]], spec: SpecConfig,
             slots: int, quantization: str = "none", min_draft_prob: float = 0.0,
             drafted: list[int] | None = None) -> tuple[list[list[int]], int]:
    """Outputs in prompt order and the number of draft tokens accepted (``drafted`` gets the
    number of draft tokens proposed appended)."""
    out: list[list[int]] = []
    accepted = proposed = 0
    for start in range(0, len(prompts), slots):
        cfg = EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=slots), spec=spec)
        drafter = drafter_for(head, target, slots, quantization, min_draft_prob) if head is not None else None
        engine = LLMEngine(target, tiny_tokenizer(V), cfg, drafter=drafter)
        ids = [engine.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True))
               for p in prompts[start:start + slots]]
        done = run_to_completion(engine)
        out += [done[i].token_ids for i in ids]
        accepted += sum(done[i].stats.num_accepted_tokens for i in ids)
        proposed += sum(done[i].stats.num_draft_tokens for i in ids)
    if drafted is not None:
        drafted.append(proposed)
    return out, accepted


@pytest.mark.parametrize("layers,fusion", SHAPES)
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_plain_for_every_head_shape(target: DecoderModel, layers: int, fusion: str, tree: bool,
                                                  batch: int) -> None:
    head = init_from_target(shaped_head(target, layers, fusion), target, "layer")  # drafts the target agrees with
    spec = SpecConfig(drafter="eagle3", num_speculative_tokens=4, tree=tree)
    got, accepted = generate(target, head, PROMPTS, spec, batch)
    assert got == plain_outputs(target, PROMPTS)
    assert accepted > 0  # some drafts were accepted: verification was exercised


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_plain_with_a_bfloat16_head_on_a_float64_target(target: DecoderModel, tree: bool,
                                                                      batch: int) -> None:
    """``--eagle3-dtype``: the head drafts in its own precision; the target's output does not move."""
    head = init_from_target(shaped_head(target, 2, "gated"), target, "layer").to(torch.bfloat16)
    spec = SpecConfig(drafter="eagle3", num_speculative_tokens=4, tree=tree)
    got, accepted = generate(target, head, PROMPTS, spec, batch)
    assert got == plain_outputs(target, PROMPTS)
    assert accepted > 0


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8"])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_plain_with_a_quantized_head(target: DecoderModel, quantization: str, tree: bool,
                                                   batch: int) -> None:
    """``--eagle3-quantization``: the head drafts with int8/int4/w8a8 weights; the target's output does not move."""
    head = init_from_target(shaped_head(target, 2, "gated"), target, "layer")
    if quantization == "w8a8" and a8_error() is not None:  # no AVX512-VNNI here: the head is refused in one line
        with pytest.raises(QuantizationError, match="w8a8"):
            drafter_for(head, target, batch, quantization)
        return
    spec = SpecConfig(drafter="eagle3", num_speculative_tokens=4, tree=tree)
    got, accepted = generate(target, head, PROMPTS, spec, batch, quantization)
    assert got == plain_outputs(target, PROMPTS)
    assert accepted > 0


@pytest.mark.parametrize("batch", [1, 4])
def test_confident_chains_stop_early_and_stay_lossless(target: DecoderModel, batch: int) -> None:
    """``--eagle3-min-draft-prob``: a chain ends once its drafts' probability product falls below
    the floor (fewer draft tokens than the policy asked), and greedy output does not move."""
    head = init_from_target(shaped_head(target, 1, "concat"), target, "layer")
    spec = SpecConfig(drafter="eagle3", num_speculative_tokens=4)
    counts: list[int] = []
    full, _ = generate(target, head, PROMPTS, spec, batch, drafted=counts)
    cut, accepted = generate(target, head, PROMPTS, spec, batch, min_draft_prob=0.5, drafted=counts)
    assert full == cut == plain_outputs(target, PROMPTS)
    assert accepted > 0 and 0 < counts[1] < counts[0]
    with pytest.raises(Eagle3ConfigError, match="min_draft_prob"):
        Eagle3DrafterConfig(min_draft_prob=1.0)
    with pytest.raises(ConfigError, match="min-draft-prob"):
        Eagle3Options(min_draft_prob=-0.1)


def test_quantized_drafting_copy_follows_every_weight_swap(target: DecoderModel) -> None:
    """The float head stays the drafter's ``head`` (swaps, rollbacks and adapters read it); the int8
    copy that drafts is rebuilt from it at every ``load_state`` and drafts what the float head does."""
    from tidespec.models.quant.quantize import Int8Linear
    head = init_from_target(shaped_head(target, 1, "concat"), target, "layer")
    drafter = drafter_for(head, target, 1, "int8")
    assert drafter.head is head and isinstance(head.lm_head, torch.nn.Linear)
    assert isinstance(drafter.served.lm_head, Int8Linear) and isinstance(drafter.served.fc, Int8Linear)
    other = shaped_head(target, 1, "concat", seed=7)
    drafter.load_state(3, other.state_dict())
    assert drafter.head is head and state_dict_equal(head.state_dict(), other.state_dict())
    w = other.lm_head.weight.detach().float()
    assert float((drafter.served.lm_head.dequantize() - w).abs().max()) <= float(w.abs().max()) / 127
    ids = PROMPTS[2]
    taps = capture(target, ids, drafter.tap_layers)
    float_drafter = drafter_for(other, target, 1)
    drafts = []
    for d in (drafter, float_drafter):
        d.observe([Observation(0, ids, len(ids) - 1, taps[:len(ids) - 1])])
        drafts.append(d.propose([DraftInput(0, ids, 4, SamplingParams())]).drafts[0].token_ids)
    assert drafts[0][:2] == drafts[1][:2]  # int8 weights draft what float ones do (up to late near-ties)
    prepared = drafter.prepare(head.state_dict())  # an updater's thread quantizes; the swap installs it
    drafter.load_state(4, head.state_dict(), served=prepared)
    assert drafter.served is prepared and float_drafter.prepare(head.state_dict()) is None


@pytest.mark.parametrize("layers,fusion", SHAPES)
def test_checkpoint_round_trip_and_layer_names(tmp_path: Path, target: DecoderModel, layers: int, fusion: str) -> None:
    head = shaped_head(target, layers, fusion)
    export_eagle3(head, tmp_path)
    cfg, sd = import_eagle3(tmp_path, target.cfg)
    assert cfg == head.cfg and state_dict_equal(sd, head.state_dict())
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {f"layers.{i}.self_attn.q_proj.weight" for i in range(1, layers)} <= names
    assert ("midlayer.gated.gate.weight" in names) == (fusion == "gated")
    assert ("midlayer.input_layernorm.weight" in names) == (fusion == "concat")


def test_init_from_target_copies_the_last_layers_in_order(target: DecoderModel) -> None:
    head = init_from_target(shaped_head(target, 3, "gated"), target, "layer")
    blocks = list(target.layers)[-3:]
    assert torch.equal(head.midlayer.self_attn.qkv_proj.weight, blocks[0].self_attn.qkv_proj.weight)
    for mine, theirs in zip(head.blocks, blocks[1:]):
        assert state_dict_equal(mine.state_dict(), theirs.state_dict())


@pytest.mark.parametrize("tree", [False, True])
def test_requests_that_run_to_the_context_limit_stay_lossless(target: DecoderModel, tree: bool) -> None:
    """Near the end of the context a tree has fewer cache rows to grow into than its levels would
    fill (top-k rows per level): it grows shallower instead of writing past the head's cache (a
    tree of 4 then raised in the step and failed every request in it)."""
    limit = 32
    head = init_from_target(shaped_head(target, 1, "concat"), target, "layer")
    outputs = []
    for drafter in (None, Eagle3Drafter(head, target.embed_tokens, Eagle3DrafterConfig(
            max_num_seqs=2, max_model_len=limit, tree_depth=4, tree_top_k=4))):
        spec = SpecConfig(drafter="eagle3", num_speculative_tokens=4, tree=tree) if drafter else SpecConfig()
        engine = LLMEngine(target, tiny_tokenizer(V), EngineConfig(cache=CacheConfig(max_model_len=limit, max_num_seqs=2),
                                                                   spec=spec), drafter=drafter)
        ids = [engine.add_request(p, SamplingParams(max_tokens=limit - len(p), ignore_eos=True)) for p in PROMPTS[:2]]
        done = run_to_completion(engine)
        outputs.append([done[i].token_ids for i in ids])
    assert outputs[1] == outputs[0] and all(len(o) == limit - len(p) for o, p in zip(outputs[0], PROMPTS))
