"""The EAGLE-3 head's graph bodies (``models/eagle3/graphs.py``) draft exactly what the eager drafter drafts.

On a CPU the bodies run uncaptured (``capture=False``): the static block, its padding rows and
spare slot, the in-body argmax / d2t / embedding chain and the one host read are the same code a
GPU captures, so equal drafts here check the layout; ``tests/cuda`` checks the captured replay.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import capture, run_to_completion, tiny_llama, tiny_tokenizer
from tests.speculative.test_eagle3 import VOCAB, tiny_head, tiny_target
from tidespec.config import CacheConfig, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.models.eagle3.graphs import MAX_CATCH_UP_ROWS, HeadGraphs
from tidespec.models.kv.cache import KVCache
from tidespec.online.training.eagle3_train import select_draft_vocab
from tidespec.sampling import SamplingParams
from tidespec.speculative.api import DraftInput, Observation
from tidespec.speculative.drafters.eagle3 import Eagle3Drafter, Eagle3DrafterConfig
from tidespec.speculative.drafters.eagle3_state import confident_prefix


def _pair(min_draft_prob: float = 0.0, compile: bool = False) -> tuple[Eagle3Drafter, Eagle3Drafter, torch.nn.Module]:
    """(eager drafter, drafter through the graph bodies) over one head with a 32-token draft vocabulary."""
    target = tiny_target()
    head = tiny_head(target, draft_vocab=32)
    head.set_vocab_map(*select_draft_vocab(torch.arange(VOCAB, 0, -1), 32))
    make = [Eagle3Drafter(head, target.embed_tokens, Eagle3DrafterConfig(
        max_num_seqs=6, max_model_len=300, min_draft_prob=min_draft_prob, graphs=g, compile=compile))
        for g in (False, True)]
    return make[0], make[1], target


# compiled head graphs in make test-slow (28 s of g++ on CI's empty cache)
@pytest.mark.parametrize("min_draft_prob,compile", [(0.0, False), (0.2, False),
                                                    pytest.param(0.0, True, marks=pytest.mark.slow)])
def test_graph_bodies_draft_what_the_eager_drafter_drafts(min_draft_prob: float, compile: bool) -> None:
    """(compile: the bodies' head steps compiled by inductor, as ``--compile`` does on a GPU.)"""
    eager, graphed, target = _pair(min_draft_prob, compile)
    gen = torch.Generator().manual_seed(11)
    seqs = {s: torch.randint(0, VOCAB, (60,), generator=gen).tolist() for s in (0, 1, 2, 3)}
    taps = {s: capture(target, ids, eager.tap_layers) for s, ids in seqs.items()}
    # prompts of 20 (more rows than a catch-up graph takes: the eager forward), 5, 9 and 3 tokens
    cached = {0: 20, 1: 5, 2: 9, 3: 3}
    for d in (eager, graphed):
        d.observe([Observation(s, seqs[s][:c + 1], c, taps[s][:c]) for s, c in cached.items()])
        d.release(1)  # slot 1 is free from now on: the others sit in slots 0, 2, 3 of the block
    del cached[1]
    gammas = {0: 4, 2: 1, 3: 3}
    for accepted in ([1, 3, 2], [2, 1, 4], [4, 2, 1], [1, 1, 1]):
        inputs = [DraftInput(s, seqs[s][:c + 1], gammas[s], SamplingParams()) for s, c in cached.items()]
        want, got = eager.propose(inputs).drafts, graphed.propose(inputs).drafts
        assert {s: d.token_ids for s, d in got.items()} == {s: d.token_ids for s, d in want.items()}
        assert len(want) == 3 and all(d.draft_probs is None and d.parent_indices is None for d in got.values())
        for s, d in got.items():  # path probabilities for the draft trim: products of the head's, non-increasing
            assert d.token_probs is not None and all(a >= b for a, b in zip(d.token_probs, d.token_probs[1:]))
            if min_draft_prob > 0:
                assert d.token_probs == pytest.approx(want[s].token_probs, rel=1e-5)
        # inductor's kernels round otherwise (float32-level)
        same_head_state(eager, graphed, cached, 1e-5 if compile else 1e-9)
        advance(eager, graphed, seqs, taps, cached, accepted)
    graphs = graphed._graphs
    assert graphs is not None and graphs.num_replayed == 4 + 3  # 4 chains; catch-ups but the first


def same_head_state(eager: Eagle3Drafter, other: Eagle3Drafter, cached: dict[int, int], tol: float) -> None:
    """Both drafters hold the same head K/V length, logits where drafting starts and K/V (to ``tol``)."""
    for s in cached:
        a, b = eager._states[s], other._states[s]
        assert a.kv_len == b.kv_len and a.last_logits is not None and b.last_logits is not None
        torch.testing.assert_close(b.last_logits, a.last_logits, rtol=tol, atol=tol)
        torch.testing.assert_close(other.kv.k[0][b.slot, :, :b.kv_len], eager.kv.k[0][a.slot, :, :a.kv_len],
                                   rtol=tol, atol=tol)


def advance(eager: Eagle3Drafter, other: Eagle3Drafter, seqs: dict[int, list[int]], taps: dict[int, torch.Tensor],
            cached: dict[int, int], accepted: list[int]) -> None:
    """Both drafters observe ``accepted[i]`` more tokens of the i-th sequence of ``cached`` (updated)."""
    for (s, c), n in zip(list(cached.items()), accepted):
        for d in (eager, other):
            d.observe([Observation(s, seqs[s][:c + n + 1], n, taps[s][c:c + n])])
        cached[s] = c + n


def test_confident_prefix_hand_traced() -> None:
    draft = confident_prefix([7, 8, 9, 10], [0.9, 0.5, 0.6, 0.8], 0.3)
    assert draft.token_ids == [7, 8, 9] and draft.token_probs == pytest.approx([0.9, 0.45, 0.27])
    assert confident_prefix([7, 8], [0.1, 0.9], 0.3).token_ids == [7]  # the first draft is always kept
    assert confident_prefix([7, 8, 9], [0.1, 0.1, 0.1], 0.0).token_ids == [7, 8, 9]


def test_trees_sampled_chains_and_no_fitting_graph_take_the_eager_path() -> None:
    eager, graphed, target = _pair()
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    taps = capture(target, ids, eager.tap_layers)
    for d in (eager, graphed):
        d.observe([Observation(0, ids[:11], 10, taps[:10])])
    tree = [DraftInput(0, ids[:11], 4, SamplingParams(), tree=True)]
    want, got = eager.propose(tree).drafts[0], graphed.propose(tree).drafts[0]
    assert got.token_ids == want.token_ids and got.parent_indices == want.parent_indices
    replayed = graphed._graphs.num_replayed if graphed._graphs is not None else 0
    sampled = graphed.propose([DraftInput(0, ids[:11], 3, SamplingParams(temperature=1.0))]).drafts[0]
    assert sampled.draft_probs is not None and len(sampled.token_ids) == 3
    graphs = graphed._graphs
    assert graphs is not None and graphs.num_replayed == replayed  # no chain graph for a sampled chain
    # a chain longer than the cache leaves room for, or a catch-up past the rows a graph takes
    assert graphs.chain(torch.zeros(1, 32, dtype=torch.float64), torch.zeros(1, 32, dtype=torch.float64),
                        [299], [0], 3) is None
    rows = MAX_CATCH_UP_ROWS + 1
    assert graphs.catch_up(taps[:rows], ids[1:rows + 1], [rows], [0], [0]) is None


def test_head_graphs_refuse_a_cache_without_a_spare_slot() -> None:
    target = tiny_target()
    head = tiny_head(target)
    kv = KVCache(1, 2, 64, head.cfg.num_kv_heads, head.cfg.head_dim, torch.float64)
    with pytest.raises(ValueError, match="spare slot"):
        HeadGraphs(head, target.embed_tokens, kv, capture=False)


def test_greedy_speculation_through_the_graph_bodies_equals_plain() -> None:
    model = tiny_llama(VOCAB, layers=3, seed=2, scale=3.0)
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15, 16, 12, 13, 14, 15, 16, 12], [3, 3, 3, 3]]
    outs = []
    for gamma in (0, 3):
        spec = SpecConfig(drafter="eagle3" if gamma else "none", num_speculative_tokens=gamma)
        drafter = None
        if gamma:
            head = tiny_head(model)  # random: most drafts are rejected, every one is verified
            drafter = Eagle3Drafter(head, model.embed_tokens, Eagle3DrafterConfig(max_num_seqs=4, max_model_len=96,
                                                                                  graphs=True))
        engine = LLMEngine(model, tiny_tokenizer(VOCAB), EngineConfig(
            cache=CacheConfig(max_model_len=96, max_num_seqs=4), spec=spec), drafter=drafter)
        ids = [engine.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in prompts]
        done = run_to_completion(engine)
        outs.append([done[i].token_ids for i in ids])
        if drafter is not None:
            assert drafter._graphs is not None and drafter._graphs.num_replayed > 0
    assert outs[0] == outs[1]
