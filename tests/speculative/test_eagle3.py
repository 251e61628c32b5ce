"""EAGLE-3 head, drafter and training: inference/training agreement, catch-up, trees, learning."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.helpers import capture
from tidespec.models.eagle3.head import Eagle3Config, Eagle3ConfigError, Eagle3Head, default_tap_layers
from tidespec.models.families.decoder import DecoderModel
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.models.target import TargetConfig
from tidespec.online.training.eagle3_train import (
    Eagle3TrainConfig,
    Eagle3Trainer,
    SignalBatch,
    SignalSegment,
    evaluate,
    segments_from_rows,
    select_draft_vocab,
    ttt_loss,
    unroll,
)
from tidespec.sampling import SamplingParams
from tidespec.speculative.api import Drafter, DraftInput, Observation
from tidespec.speculative.drafters.eagle3 import Eagle3Drafter, Eagle3DrafterConfig
from tidespec.speculative.tree import rerank_tree

VOCAB = 48


def tiny_target(dtype: torch.dtype = torch.float64, seed: int = 0, vocab: int = VOCAB) -> DecoderModel:
    torch.manual_seed(seed)
    cfg = TargetConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    return DecoderModel(cfg).to(dtype)


def tiny_head(target: DecoderModel, seed: int = 1, draft_vocab: int | None = None) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target.cfg, draft_vocab)).to(target.dtype)
    with torch.no_grad():  # larger random weights so drafts depend visibly on the inputs
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return head


def drafter_for(head: Eagle3Head, target: DecoderModel, **kw: int | bool) -> Eagle3Drafter:
    return Eagle3Drafter(head, target.embed_tokens, Eagle3DrafterConfig(max_num_seqs=4, max_model_len=128, **kw))


def caught_up(drafter: Eagle3Drafter) -> Eagle3Drafter:
    """Run the head's deferred catch-up now (``observe`` only keeps taps; ``propose`` catches up)."""
    drafter._sync(list(drafter._states.values()))
    return drafter


def test_default_tap_layers_and_config_validation() -> None:
    assert default_tap_layers(32) == (2, 16, 29)
    assert default_tap_layers(8) == (2, 4, 5)
    assert default_tap_layers(4) == (0, 2, 3)  # (2, 2, 1) collides -> fallback
    assert default_tap_layers(6) == (0, 3, 5)
    with pytest.raises(Eagle3ConfigError):
        default_tap_layers(2)
    cfg = Eagle3Config.for_target(tiny_target().cfg, 16)
    assert cfg.tap_size == 96 and cfg.draft_vocab_size == 16
    with pytest.raises(Eagle3ConfigError, match="tap_layers"):
        Eagle3Config(32, 4, 2, 8, 64, VOCAB, VOCAB, (3, 2, 1))
    with pytest.raises(Eagle3ConfigError, match="draft_vocab_size"):
        Eagle3Config(32, 4, 2, 8, 64, VOCAB, VOCAB + 1, (0, 1, 2))
    with pytest.raises(Eagle3ConfigError, match="divisible"):
        Eagle3Config(32, 4, 3, 8, 64, VOCAB, VOCAB, (0, 1, 2))


def test_module_names_match_vllm_layout() -> None:
    head = tiny_head(tiny_target())
    names = set(head.state_dict())
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.self_attn.qkv_proj.weight", "lm_head.weight", "norm.weight", "d2t", "t2d"} <= names
    assert tuple(head.midlayer.self_attn.qkv_proj.weight.shape) == (32 + 2 * 16, 64)  # q|k|v over 2H
    assert tuple(head.fc.weight.shape) == (32, 96)


def test_rerank_tree_hand_traced() -> None:
    # root -> 0 (-0.1) -> 2 (-0.3) -> 3 (-2.0); root -> 1 (-1.0)
    kept, parents = rerank_tree([-0.1, -1.0, -0.3, -2.0], [-1, -1, 0, 2], 3)
    assert kept == [0, 1, 2] and parents == [-1, -1, 0]
    # a child whose parent is not kept is skipped even when it scores well enough
    kept, parents = rerank_tree([-0.5, -0.1, -0.5], [-1, -1, 0], 2)
    assert kept == [0, 1] and parents == [-1, -1]
    # ties go to the shallower candidate (parent before its log-prob-0 child)
    kept, parents = rerank_tree([-0.2, -0.2, -0.9], [-1, 0, -1], 2)
    assert kept == [0, 1] and parents == [-1, 0]


def test_select_draft_vocab_hand_traced() -> None:
    d2t, t2d = select_draft_vocab(torch.tensor([5, 0, 9, 1]), 2)
    assert d2t.tolist() == [0, 1] and t2d.tolist() == [True, False, True, False]
    d2t, t2d = select_draft_vocab(torch.tensor([3, 3, 3, 1, 7]), 3)  # tie: lower ids win
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 4] and int(t2d.sum()) == 3


def test_segments_from_rows_hand_traced() -> None:
    taps = torch.arange(4, dtype=torch.float64).unsqueeze(1).repeat(1, 6)
    segs = segments_from_rows(taps, torch.tensor([10, 11, 13, 20]), torch.tensor([11, 12, 14, 21]),
                              torch.tensor([7, 7, 7, 9]), torch.tensor([3, 4, 6, 0]))
    assert [(s.start_position, s.token_ids.tolist()) for s in segs] == [(3, [10, 11, 12]), (6, [13, 14]), (0, [20, 21])]
    assert segs[0].taps[:, 0].tolist() == [0.0, 1.0]


def test_drafter_protocol_and_first_draft_matches_training_forward() -> None:
    target = tiny_target()
    head = tiny_head(target)
    drafter = drafter_for(head, target)
    assert isinstance(drafter, Drafter) and drafter.name == "eagle3" and drafter.tap_layers == (0, 2, 3)
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    taps = capture(target, ids, drafter.tap_layers)
    drafter.observe([Observation(0, ids, 11, taps[:11])])  # target KV holds 11 of 12 tokens
    seg = SignalSegment(taps[:11], torch.tensor(ids))
    step1 = unroll(head, target.embed_tokens, SignalBatch.collate([seg], head), 1)[0][0]  # [11, Vd]
    state = drafter._states[0]
    assert state.kv_len == 0  # observe keeps the taps; the head's catch-up waits for a propose
    drafter.propose([DraftInput(0, ids, 1, SamplingParams())])
    assert state.kv_len == 11 and state.last_logits is not None
    torch.testing.assert_close(state.last_logits, step1[-1], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_chain_equals_training_time_test_self_unroll(gamma: int) -> None:
    target = tiny_target()
    head = tiny_head(target, draft_vocab=32)
    d2t, t2d = select_draft_vocab(torch.arange(VOCAB, 0, -1), 32)
    head.set_vocab_map(d2t, t2d)
    drafter = drafter_for(head, target)
    ids = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    taps = capture(target, ids, drafter.tap_layers)
    drafter.observe([Observation(0, ids, 9, taps[:9])])
    draft = drafter.propose([DraftInput(0, ids, gamma, SamplingParams())]).drafts[0]
    batch = SignalBatch.collate([SignalSegment(taps[:9], torch.tensor(ids))], head)
    own = [int(head.draft_to_target(lg[0, -1].argmax())) for lg in unroll(head, target.embed_tokens, batch, gamma, True)]
    assert draft.token_ids == own and draft.draft_probs is None and draft.parent_indices is None
    # proposing rolled the speculative K/V back: the same call gives the same drafts
    again = drafter.propose([DraftInput(0, ids, gamma, SamplingParams())]).drafts[0]
    assert again.token_ids == draft.token_ids and drafter._states[0].kv_len == 9


def test_catch_up_equals_step_by_step_observation() -> None:
    target = tiny_target()
    head = tiny_head(target)
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(7)).tolist()
    taps = capture(target, ids, head.cfg.tap_layers)
    stepwise, bulk = drafter_for(head, target), drafter_for(head, target)
    cached = 0
    for new in (6, 1, 3, 1, 2, 4, 2):  # prefill chunk, then accepted runs of various lengths
        caught_up(stepwise).observe([Observation(0, ids[:cached + new + 1], new, taps[cached:cached + new])])
        cached += new
    # speculation was off: a single observation covering everything, then one with no new tokens
    bulk.observe([Observation(0, ids[:cached + 1], cached, taps[:cached])])
    bulk.observe([Observation(0, ids[:cached + 1], 0, taps[:0])])
    caught_up(stepwise), caught_up(bulk)
    a, b = stepwise._states[0], bulk._states[0]
    assert a.kv_len == b.kv_len == cached
    for kv_a, kv_b in ((stepwise.kv.k[0], bulk.kv.k[0]), (stepwise.kv.v[0], bulk.kv.v[0])):
        torch.testing.assert_close(kv_a[a.slot, :, :cached], kv_b[b.slot, :, :cached], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(a.last_logits, b.last_logits, rtol=1e-9, atol=1e-9)
    inp = [DraftInput(0, ids[:cached + 1], 3, SamplingParams())]
    assert stepwise.propose(inp).drafts[0].token_ids == bulk.propose(inp).drafts[0].token_ids


def test_pending_tap_row_waits_for_its_next_token() -> None:
    target = tiny_target()
    head = tiny_head(target)
    ids = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(9)).tolist()
    taps = capture(target, ids, head.cfg.tap_layers)
    drafter = drafter_for(head, target)
    drafter.observe([Observation(0, ids[:5], 5, taps[:5])])  # tap row 4 has no next token yet
    assert caught_up(drafter)._states[0].kv_len == 4
    assert drafter.propose([DraftInput(0, ids[:3], 2, SamplingParams())]).drafts == {}  # context mismatch
    # the next token arrives with the proposal: row 4 is paired with it before drafting
    late = drafter.propose([DraftInput(0, ids[:6], 3, SamplingParams())]).drafts[0]
    assert drafter._states[0].kv_len == 5
    reference = drafter_for(head, target)
    reference.observe([Observation(0, ids[:6], 5, taps[:5])])
    assert reference.propose([DraftInput(0, ids[:6], 3, SamplingParams())]).drafts[0].token_ids == late.token_ids


def test_tree_proposal_shape_and_topk1_equals_chain() -> None:
    target = tiny_target()
    head = tiny_head(target)
    ids = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(11)).tolist()
    taps = capture(target, ids, head.cfg.tap_layers)
    drafter = drafter_for(head, target, tree_depth=4, tree_top_k=3)
    drafter.observe([Observation(0, ids, 9, taps[:9]), Observation(1, ids[:6], 5, taps[:5])])
    prop = drafter.propose([DraftInput(0, ids, 8, SamplingParams(), tree=True),
                            DraftInput(1, ids[:6], 5, SamplingParams(), tree=True)])
    for sid, budget in ((0, 8), (1, 5)):
        d = prop.drafts[sid]
        assert d.parent_indices is not None and d.num_tokens == budget and d.draft_probs is None
        assert all(-1 <= p < j for j, p in enumerate(d.parent_indices))
        kids: dict[int, list[int]] = {}
        for tok, p in zip(d.token_ids, d.parent_indices):
            kids.setdefault(p, []).append(tok)
        assert all(len(set(v)) == len(v) for v in kids.values())  # siblings distinct
        assert all(0 <= t < VOCAB for t in d.token_ids)
    assert prop.drafts[0].is_tree
    chain_drafter = drafter_for(head, target, tree_depth=4, tree_top_k=1)
    chain_drafter.observe([Observation(0, ids, 9, taps[:9])])
    tree1 = chain_drafter.propose([DraftInput(0, ids, 4, SamplingParams(), tree=True)]).drafts[0]
    chain = chain_drafter.propose([DraftInput(0, ids, 4, SamplingParams())]).drafts[0]
    assert tree1.token_ids == chain.token_ids and tree1.parent_indices == [-1, 0, 1, 2]
    assert chain_drafter._states[0].kv_len == 9


def test_sampled_chain_returns_draft_probs_over_target_vocab() -> None:
    target = tiny_target()
    head = tiny_head(target, draft_vocab=16)
    d2t, t2d = select_draft_vocab(torch.arange(VOCAB) % 7, 16)
    head.set_vocab_map(d2t, t2d)
    drafter = drafter_for(head, target)
    ids = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(13)).tolist()
    drafter.observe([Observation(0, ids, 8, capture(target, ids, head.cfg.tap_layers)[:8])])
    params = SamplingParams(temperature=0.8, seed=4)
    d = drafter.propose([DraftInput(0, ids, 3, params)]).drafts[0]
    assert d.draft_probs is not None and tuple(d.draft_probs.shape) == (3, VOCAB)
    torch.testing.assert_close(d.draft_probs.sum(-1), torch.ones(3, dtype=d.draft_probs.dtype))
    assert bool((d.draft_probs[:, ~t2d] == 0).all())
    assert all(float(d.draft_probs[i, t]) > 0 for i, t in enumerate(d.token_ids))
    fresh = drafter_for(head, target)
    fresh.observe([Observation(0, ids, 8, capture(target, ids, head.cfg.tap_layers)[:8])])
    assert fresh.propose([DraftInput(0, ids, 3, params)]).drafts[0].token_ids == d.token_ids  # seeded


def test_weight_swap_rebuilds_head_kv_from_retained_taps() -> None:
    target = tiny_target()
    head = tiny_head(target)
    new_weights = tiny_head(target, seed=2).state_dict()
    ids = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(17)).tolist()
    taps = capture(target, ids, head.cfg.tap_layers)
    drafter = drafter_for(head, target)
    caught_up(drafter).observe([Observation(0, ids[:9], 8, taps[:8])])
    caught_up(drafter).load_state(5, new_weights)
    caught_up(drafter).observe([Observation(0, ids, 5, taps[8:13])])
    reference = drafter_for(tiny_head(target, seed=2), target)
    reference.observe([Observation(0, ids, 13, taps[:13])])
    caught_up(drafter), caught_up(reference)
    a, b = drafter._states[0], reference._states[0]
    assert drafter.version == 5 and a.kv_len == b.kv_len == 13
    torch.testing.assert_close(drafter.kv.k[0][a.slot, :, :13], reference.kv.k[0][b.slot, :, :13])
    torch.testing.assert_close(a.last_logits, b.last_logits)
    # without retained taps the old K/V is kept and drafting continues
    lean = drafter_for(tiny_head(target), target, retain_taps=False)
    caught_up(lean).observe([Observation(0, ids[:9], 8, taps[:8])])
    caught_up(lean).load_state(1, new_weights)
    caught_up(lean).observe([Observation(0, ids, 5, taps[8:13])])
    assert caught_up(lean)._states[0].kv_len == 13 and lean._states[0].taps.start == 13
    assert len(lean.propose([DraftInput(0, ids, 2, SamplingParams())]).drafts[0].token_ids) == 2


def test_release_missing_taps_and_slot_exhaustion() -> None:
    target = tiny_target()
    head = tiny_head(target)
    ids = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(19)).tolist()
    taps = capture(target, ids, head.cfg.tap_layers)
    drafter = Eagle3Drafter(head, target.embed_tokens, Eagle3DrafterConfig(max_num_seqs=1, max_model_len=32))
    drafter.observe([Observation(0, ids[:3], 2, None)])  # taps missing: this sequence cannot be drafted
    drafter.observe([Observation(0, ids, 3, taps[2:5])])
    assert drafter.propose([DraftInput(0, ids, 2, SamplingParams())]).drafts == {}
    drafter.observe([Observation(1, ids, 5, taps[:5])])  # no free slot: silently not tracked
    assert drafter.propose([DraftInput(1, ids, 2, SamplingParams())]).drafts == {}
    drafter.release(0)
    drafter.observe([Observation(1, ids, 5, taps[:5])])  # seen mid-stream before: stays untracked
    assert drafter.num_live == 0
    drafter.release(1)
    drafter.observe([Observation(1, ids, 5, taps[:5])])
    assert drafter.num_live == 1
    assert len(drafter.propose([DraftInput(1, ids, 2, SamplingParams())]).drafts[1].token_ids) == 2
    with pytest.raises(ValueError, match="shape"):
        drafter.observe([Observation(1, ids + [1], 1, taps[:2])])


def test_ttt_loss_masks_labels_outside_the_draft_vocab() -> None:
    target = tiny_target()
    head = tiny_head(target, draft_vocab=4)
    ids = [10, 11, 12, 13, 14, 15, 16]
    seg = SignalSegment(capture(target, ids[:-1], head.cfg.tap_layers), torch.tensor(ids))
    loss, acc = ttt_loss(head, target.embed_tokens, [seg], 2)  # draft vocab = ids 0..3: all labels masked
    assert float(loss) == 0.0 and all(a != a for a in acc)
    head.set_vocab_map(*select_draft_vocab(torch.bincount(torch.tensor(ids), minlength=VOCAB), 4))
    loss, _ = ttt_loss(head, target.embed_tokens, [seg], 2)
    assert float(loss.detach()) > 0.0 and loss.requires_grad


def _greedy_generations(target: DecoderModel, prompts: list[list[int]], new_tokens: int) -> list[SignalSegment]:
    """Batched greedy decoding, then one capture pass per sequence: signals from the target's own output."""
    taps_layers = Eagle3Config.for_target(target.cfg).tap_layers
    kv = KVCache.for_model(target.cfg, len(prompts), 64, target.dtype)
    seqs = [list(p) for p in prompts]
    layout = BatchLayout.build([len(p) for p in prompts], [0] * len(prompts), list(range(len(prompts))))
    rows = torch.tensor(list(torch.tensor([len(p) for p in prompts]).cumsum(0) - 1))
    out = target(torch.tensor([t for p in prompts for t in p]), layout, kv, logits_rows=rows)
    for _ in range(new_tokens):
        assert out.logits is not None
        nxt = out.logits.argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(int(t))
        layout = BatchLayout.build([1] * len(seqs), [len(s) - 1 for s in seqs], list(range(len(seqs))))
        out = target(torch.tensor(nxt), layout, kv)
    segs: list[SignalSegment] = []
    for s in seqs:
        ckv = KVCache.for_model(target.cfg, 1, 64, target.dtype)
        full = target(torch.tensor(s), BatchLayout.build([len(s)], [0], [0]), ckv, tap_layers=taps_layers)
        assert full.logits is not None and full.taps is not None
        nxt_ids = full.logits.argmax(-1)
        segs.append(SignalSegment(full.taps, torch.tensor(s + [int(nxt_ids[-1])]), nxt_ids))
    return segs


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny matmuls: intra-op threads only add contention on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("one_thread")
def test_training_raises_simulated_acceptance_length() -> None:
    target = tiny_target(torch.float32, seed=0, vocab=64)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (4,), generator=gen).tolist() for _ in range(12)]
    segs = _greedy_generations(target, prompts, 28)
    train, held_out = segs[:8], segs[8:]
    torch.manual_seed(1)
    head = Eagle3Head(Eagle3Config.for_target(target.cfg))
    before = evaluate(head, target.embed_tokens, held_out, gamma=3)
    trainer = Eagle3Trainer(head, target.embed_tokens, Eagle3TrainConfig(lr=3e-3, ttt_steps=3))
    first_loss, _ = trainer.step(train)
    for _ in range(110):
        loss, acc = trainer.step(train)
    assert loss < 0.5 * first_loss
    after_train = evaluate(head, target.embed_tokens, train, gamma=3)
    after = evaluate(head, target.embed_tokens, held_out, gamma=3)
    assert before < 1.2
    assert after_train > 3.0  # fits its own training signals (max is gamma + 1 = 4)
    assert after > before + 0.5  # and generalizes to held-out generations of the same target
