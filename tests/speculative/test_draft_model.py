"""Tests for the draft-model drafter on tiny random float64 Llama models.

The reference for every check is a plain, unbatched greedy loop over the target with its own KV
cache, so batching, catch-up, rollback and tree masks are all measured against the simplest
possible decoder.
"""

from __future__ import annotations

import pytest
import torch

from tidespec.models.families.decoder import DecoderModel
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.models.target import TargetConfig
from tidespec.sampling import SamplingParams, target_probs
from tidespec.speculative.api import Drafter, DraftInput
from tidespec.speculative.drafters.draft_model import DraftModelDrafter, draft_seed

VOCAB = 48
GREEDY = SamplingParams()


def make_target(seed: int = 0, num_layers: int = 2) -> DecoderModel:
    torch.manual_seed(seed)
    cfg = TargetConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=num_layers,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    model = DecoderModel(cfg).double()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # sharper distributions: fewer near-ties, more varied greedy text
    return model.eval()


@pytest.fixture(scope="module")
def target() -> DecoderModel:
    return make_target()


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def logits_after(model: DecoderModel, tokens: list[int]) -> torch.Tensor:
    """[V] logits of a plain single-sequence forward over ``tokens`` from an empty cache."""
    kv = KVCache.for_model(model.cfg, 1, 128, torch.float64)
    layout = BatchLayout.build([len(tokens)], [0], [0])
    out = model(torch.tensor(tokens), layout, kv, logits_rows=torch.tensor([len(tokens) - 1]))
    assert out.logits is not None
    return out.logits[0]


def greedy_continuation(model: DecoderModel, ctx: list[int], n: int) -> list[int]:
    """The model's own greedy continuation by a plain prefill-then-decode loop."""
    kv = KVCache.for_model(model.cfg, 1, 128, torch.float64)
    slot = kv.allocate()
    assert slot is not None
    layout = BatchLayout.build([len(ctx)], [0], [slot])
    out = model(torch.tensor(ctx), layout, kv, logits_rows=torch.tensor([len(ctx) - 1]))
    toks: list[int] = []
    pos = len(ctx)
    while True:
        assert out.logits is not None
        toks.append(int(out.logits[0].argmax()))
        if len(toks) == n:
            return toks
        layout = BatchLayout.build([1], [pos], [slot])
        out = model(torch.tensor([toks[-1]]), layout, kv)
        pos += 1


def propose_one(drafter: DraftModelDrafter, seq_id: int, ctx: list[int], gamma: int,
                params: SamplingParams = GREEDY, tree: bool = False):
    return drafter.propose([DraftInput(seq_id, list(ctx), gamma, params, tree)]).drafts[seq_id]


def test_satisfies_drafter_protocol(target: DecoderModel) -> None:
    d = DraftModelDrafter(target, 2, 64)
    assert isinstance(d, Drafter)
    assert d.tap_layers == () and d.name == "draft-model"


def test_draft_is_target_greedy_chain_matches_target(target: DecoderModel) -> None:
    """Self-drafting proposes exactly the target's greedy continuation, step after step (100%
    acceptance), including when the drafter reuses the K/V of its accepted drafts."""
    drafter = DraftModelDrafter(target, 2, 96)
    ctx = prompt(1, 7)
    for _ in range(4):
        expected = greedy_continuation(target, ctx, 6)
        d = propose_one(drafter, 0, ctx, 5)
        assert d.token_ids == expected[:5]
        assert d.parent_indices is None and d.draft_probs is None
        ctx = ctx + expected  # all 5 accepted + bonus token
    assert len(set(ctx[7:])) > 1  # the check is not vacuous (random text, not one repeated token)


def test_catch_up_matches_every_step_and_fresh(target: DecoderModel) -> None:
    """A drafter that skipped speculation for several steps, one that proposed every step (with
    mostly rejected drafts), and a fresh one all propose the same for the final context."""
    draft = target.truncated(1)
    base = prompt(2, 5)
    growth = prompt(3, 7)  # tokens the "target" produced: unrelated to the drafts
    every, skip = DraftModelDrafter(draft, 2, 64), DraftModelDrafter(draft, 2, 64)
    propose_one(skip, 0, base, 4)
    for i in range(len(growth)):
        propose_one(every, 0, base + growth[:i], 4)
    final = base + growth
    fresh = propose_one(DraftModelDrafter(draft, 2, 64), 0, final, 4).token_ids
    assert propose_one(every, 0, final, 4).token_ids == fresh
    assert propose_one(skip, 0, final, 4).token_ids == fresh
    assert fresh == greedy_continuation(draft, final, 4)
    # the context may also shrink (e.g. recomputation after preemption)
    shorter = final[:6]
    assert propose_one(skip, 0, shorter, 3).token_ids == greedy_continuation(draft, shorter, 3)


def test_catch_up_feeds_only_missing_tokens(target: DecoderModel) -> None:
    """Hand-traced token counts per forward: prefill 6; drafts re-use accepted K/V."""
    drafter = DraftModelDrafter(target, 2, 64)
    fed: list[int] = []
    handle = target.register_forward_pre_hook(lambda _m, args: fed.append(int(args[0].numel())))
    try:
        ctx = prompt(4, 6)
        d = propose_one(drafter, 0, ctx, 3).token_ids
        assert fed == [6, 1, 1]  # prefill, then feed d0 and d1 (d2 is never fed)
        fed.clear()
        x = (d[1] + 1) % VOCAB  # d0 accepted, d1 rejected and replaced by x
        ctx = ctx + [d[0], x]
        e = propose_one(drafter, 0, ctx, 3).token_ids
        assert fed == [1, 1, 1]  # d0's K/V is reused; only x is fed
        fed.clear()
        ctx = ctx + e + [7]  # all accepted + bonus: e0, e1 cached, e2 and bonus missing
        propose_one(drafter, 0, ctx, 3)
        assert fed == [2, 1, 1]
        fed.clear()
        propose_one(drafter, 0, ctx, 3)  # same context again: re-feed only the last token
        assert fed == [1, 1, 1]
    finally:
        handle.remove()


def test_batched_gammas_equal_alone(target: DecoderModel) -> None:
    draft = target.truncated(1)
    ctxs = [prompt(10, 4), prompt(11, 9), prompt(12, 6)]
    gammas = [1, 3, 5]
    drafter = DraftModelDrafter(draft, 4, 64)
    batch = drafter.propose([DraftInput(i, c, g, GREEDY) for i, (c, g) in enumerate(zip(ctxs, gammas))])
    assert set(batch.drafts) == {0, 1, 2}
    assert batch.num_draft_tokens == 9
    for i, (c, g) in enumerate(zip(ctxs, gammas)):
        alone = propose_one(DraftModelDrafter(draft, 1, 64), 7, c, g)
        assert batch.drafts[i].token_ids == alone.token_ids == greedy_continuation(draft, c, g)
    # second step: different growth per sequence, one sequence sits out
    ctxs2 = [ctxs[0] + [3, 4, 5], ctxs[1]]
    batch2 = drafter.propose([DraftInput(0, ctxs2[0], 2, GREEDY), DraftInput(1, ctxs2[1], 4, GREEDY)])
    for i, c in enumerate(ctxs2):
        assert batch2.drafts[i].token_ids == greedy_continuation(draft, c, [2, 4][i])


def test_batched_sampled_equal_alone(target: DecoderModel) -> None:
    """Per-sequence seeded generators: batching does not change what is drawn."""
    params = [SamplingParams(temperature=0.9, seed=s) for s in (1, 2)]
    ctxs = [prompt(20, 5), prompt(21, 8)]
    batch = DraftModelDrafter(target, 2, 64).propose(
        [DraftInput(i, c, 4, p) for i, (c, p) in enumerate(zip(ctxs, params))])
    for i, (c, p) in enumerate(zip(ctxs, params)):
        alone = propose_one(DraftModelDrafter(target, 1, 64), 0, c, 4, p)
        assert batch.drafts[i].token_ids == alone.token_ids
        assert batch.drafts[i].draft_probs is not None and alone.draft_probs is not None
        torch.testing.assert_close(batch.drafts[i].draft_probs, alone.draft_probs)


def test_tree_full_levels(target: DecoderModel) -> None:
    """gamma=6, top_k=2: levels of 2 and 4 nodes; every node's children are the top-2 of the
    target's own distribution after context + path (checks the tree attention mask)."""
    drafter = DraftModelDrafter(target, 2, 64, tree_top_k=2)
    ctx = prompt(30, 6)
    d = propose_one(drafter, 0, ctx, 6, tree=True)
    assert d.parent_indices == [-1, -1, 0, 0, 1, 1]
    assert d.draft_probs is None and d.is_tree
    paths = {-1: []}
    for j, p in enumerate(d.parent_indices):
        paths[j] = paths[p] + [d.token_ids[j]]
    for node in (-1, 0, 1):
        kids = [d.token_ids[j] for j, p in enumerate(d.parent_indices) if p == node]
        top2 = torch.topk(logits_after(target, ctx + paths[node]), 2).indices.tolist()
        assert kids == top2  # distinct siblings, best first
    # the tree's K/V was rolled back: a following chain proposal is unaffected
    assert propose_one(drafter, 0, ctx, 3).token_ids == greedy_continuation(target, ctx, 3)


@pytest.mark.parametrize("gamma,top_k", [(5, 2), (7, 3), (4, 1), (1, 2)])
def test_tree_contains_greedy_chain(target: DecoderModel, gamma: int, top_k: int) -> None:
    drafter = DraftModelDrafter(target, 2, 64, tree_top_k=top_k)
    ctx = prompt(31, 5)
    d = propose_one(drafter, 0, ctx, gamma, tree=True)
    assert d.num_tokens == gamma
    parents = d.parent_indices if d.parent_indices is not None else list(range(-1, gamma - 1))
    assert all(-1 <= p < j for j, p in enumerate(parents))
    for node in [-1] + list(range(gamma)):
        kids = [d.token_ids[j] for j, p in enumerate(parents) if p == node]
        assert len(kids) == len(set(kids)) and len(kids) <= top_k
    depth = [0] * gamma
    for j, p in enumerate(parents):
        depth[j] = 0 if p < 0 else depth[p] + 1
    greedy = greedy_continuation(target, ctx, max(depth) + 1)
    node = -1
    for tok in greedy:  # walk the greedy chain down the tree
        matches = [j for j, p in enumerate(parents) if p == node and d.token_ids[j] == tok]
        assert len(matches) == 1
        node = matches[0]


def test_mixed_chain_and_tree_batch(target: DecoderModel) -> None:
    draft = target.truncated(1)
    ctxs = [prompt(40, 5), prompt(41, 3)]
    batch = DraftModelDrafter(draft, 2, 64, tree_top_k=2).propose(
        [DraftInput(0, ctxs[0], 3, GREEDY), DraftInput(1, ctxs[1], 5, GREEDY, tree=True)])
    alone_tree = propose_one(DraftModelDrafter(draft, 1, 64, tree_top_k=2), 1, ctxs[1], 5, tree=True)
    assert batch.drafts[0].token_ids == greedy_continuation(draft, ctxs[0], 3)
    assert batch.drafts[1].token_ids == alone_tree.token_ids
    assert batch.drafts[1].parent_indices == alone_tree.parent_indices


def test_sampled_draft_probs(target: DecoderModel) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    ctx = prompt(50, 6)
    d = propose_one(DraftModelDrafter(target, 1, 64), 0, ctx, 5, params)
    assert d.draft_probs is not None and d.draft_probs.shape == (5, VOCAB)
    torch.testing.assert_close(d.draft_probs.sum(-1), torch.ones(5, dtype=d.draft_probs.dtype))
    for i, tok in enumerate(d.token_ids):
        assert d.draft_probs[i, tok] > 0
    # row 0 is exactly the target-processed distribution after the context (draft = target)
    torch.testing.assert_close(d.draft_probs[0], target_probs(logits_after(target, ctx)[None], params)[0])
    assert (d.draft_probs == 0).any()  # top-p truncation applied, as for the target
    again = propose_one(DraftModelDrafter(target, 1, 64), 3, ctx, 5, params)
    assert again.token_ids == d.token_ids  # seeded


def test_sampled_probs_exact_across_steps(target: DecoderModel) -> None:
    """Every draft_probs row equals the target-processed distribution of a plain forward over
    context + earlier drafts, also after accepted drafts' K/V was reused (stale K/V would show)."""
    params = SamplingParams(temperature=1.0, seed=9)
    drafter = DraftModelDrafter(target, 1, 64)
    ctx = prompt(51, 5)
    for step in range(3):
        d = propose_one(drafter, 0, ctx, 3, params)
        assert d.draft_probs is not None
        for i in range(3):
            ref = target_probs(logits_after(target, ctx + d.token_ids[:i])[None], params)[0]
            torch.testing.assert_close(d.draft_probs[i], ref)
        ctx = ctx + d.token_ids + [step]  # all accepted + a bonus token


def test_draft_seed_differs_from_request_seed() -> None:
    assert draft_seed(None) is None
    assert draft_seed(0) == 0x1E3779B97F4A7C15
    assert all(draft_seed(s) != s for s in (0, 1, 2**62, 2**63 + 5, -3))
    assert len({draft_seed(s) for s in range(100)}) == 100


def test_release_recycles_slots(target: DecoderModel) -> None:
    draft = target.truncated(1)
    drafter = DraftModelDrafter(draft, 2, 64)
    for seq in range(6):  # 6 sequences over time through 2 slots
        ctx = prompt(60 + seq, 4 + seq)
        assert propose_one(drafter, seq, ctx, 2).token_ids == greedy_continuation(draft, ctx, 2)
        assert drafter.num_live <= 2
        if seq:
            drafter.release(seq - 1)
    drafter.release(5)
    drafter.release(5)  # releasing twice (or an unknown id) is harmless
    assert drafter.kv.num_free_slots == 2 and drafter.num_live == 0


def test_full_cache_raises(target: DecoderModel) -> None:
    drafter = DraftModelDrafter(target, 1, 64)
    propose_one(drafter, 0, prompt(70, 3), 1)
    with pytest.raises(RuntimeError, match="draft KV cache is full"):
        propose_one(drafter, 1, prompt(71, 3), 1)


def test_gamma_clamped_to_max_model_len(target: DecoderModel) -> None:
    drafter = DraftModelDrafter(target, 2, 10)
    assert propose_one(drafter, 0, prompt(80, 9), 5).num_tokens == 2  # 9 + 2 - 1 == 10 positions
    out = drafter.propose([DraftInput(1, prompt(81, 12), 3, GREEDY)])
    assert 1 not in out.drafts


def test_input_validation(target: DecoderModel) -> None:
    drafter = DraftModelDrafter(target, 2, 16)
    with pytest.raises(ValueError, match="twice"):
        drafter.propose([DraftInput(0, [1, 2], 1, GREEDY), DraftInput(0, [1, 2], 1, GREEDY)])
    with pytest.raises(ValueError, match="empty context"):
        drafter.propose([DraftInput(0, [], 1, GREEDY)])
    with pytest.raises(ValueError, match="tree_top_k"):
        DraftModelDrafter(target, 2, 16, tree_top_k=0)
    assert drafter.propose([]).drafts == {}


def test_truncated_target_proposals(target: DecoderModel) -> None:
    small = target.truncated(1)
    drafter = DraftModelDrafter(small, 2, 64, tree_top_k=2)
    ctx = prompt(90, 7)
    chain = propose_one(drafter, 0, ctx, 4)
    assert chain.token_ids == greedy_continuation(small, ctx, 4)
    assert all(0 <= t < VOCAB for t in chain.token_ids)
    tree = propose_one(drafter, 1, ctx, 6, tree=True)
    assert tree.parent_indices == [-1, -1, 0, 0, 1, 1]
    assert tree.token_ids[0] == chain.token_ids[0]
