"""Batched attention over the KV slots equals attention of each sequence on its own.

The reference is the same model run once per sequence (a one-sequence layout pads nothing and
masks only its own causal/tree/window structure); the batch under test mixes decode chains,
trees, a chunked-prefill chunk and a plain decode row, on close (viewed) and scattered
(gathered) slots, with and without a sliding window. float64: equal to rounding (SDPA sums in a
different order when a sequence's keys and queries are padded, and the projections run over a
different number of rows; the differences are ~1e-16, against ~1e-2 for any masking error).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import tiny_llama
from tidespec.models.families.decoder import DecoderModel
from tidespec.models.kernels.attention import AttentionPlan
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.speculative.tree import tree_depths, tree_mask

PARENTS = [-1, 0, 0, 1]  # a 4-token draft tree below the verified token (index 0 = root)


def _fill_contexts(model: DecoderModel, kv: KVCache, contexts: dict[int, list[int]]) -> None:
    for slot, ids in contexts.items():  # each context prefilled alone
        model(torch.tensor(ids), BatchLayout.build([len(ids)], [0], [slot]), kv)


def _batch(slots: list[int]) -> tuple[list[list[int]], list[int], list[list[int] | None], list[torch.Tensor | None]]:
    """(new tokens, ctx lens, depths, masks) of 4 sequences: a 3-token chain on 7 cached tokens, a
    tree of 1 + 4 tokens on 5, a 6-token prefill chunk on 4, one decode token on 9."""
    tree = [[0] + [d + 1 for d in tree_depths(PARENTS)], tree_mask(PARENTS)]
    new = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18], [19]]
    ctx = [7, 5, 4, 9]
    depths: list[list[int] | None] = [None, tree[0], None, None]
    masks: list[torch.Tensor | None] = [None, tree[1], None, None]
    return new, ctx, depths, masks


@pytest.mark.parametrize("exact", [False, True], ids=["sdpa", "exact"])
@pytest.mark.parametrize("slots", [[2, 0, 3, 1], [0, 9, 4, 15]], ids=["view", "gather"])
@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
def test_ragged_batch_equals_each_sequence_alone(slots: list[int], window: int | None, exact: bool) -> None:
    model = tiny_llama(vocab_size=32, layers=2, sliding_window=window)
    new, ctx, depths, masks = _batch(slots)
    kv = KVCache.for_model(model.cfg, num_slots=16, max_len=32, dtype=torch.float64, transposed_keys=exact)
    _fill_contexts(model, kv, {s: [(3 * s + i) % 32 for i in range(c)] for s, c in zip(slots, ctx)})
    ref_kv = copy.deepcopy(kv)

    layout = BatchLayout.build([len(n) for n in new], ctx, slots, depths, masks)
    plan = layout.attention_plan(window, exact=exact)
    assert plan.exact == exact and (plan.gather is not None) == (slots[1] == 9 and not exact)
    got = model(torch.tensor([t for n in new for t in n]), layout, kv).logits  # [T, V]

    start = 0
    for n, c, s, d, m in zip(new, ctx, slots, depths, masks):
        alone = model(torch.tensor(n), BatchLayout.build([len(n)], [c], [s], [d], [m]), ref_kv).logits
        torch.testing.assert_close(got[start:start + len(n)], alone, rtol=0, atol=1e-12, msg=f"slot {s}")
        start += len(n)
    for layer in range(model.cfg.num_layers):  # the same K/V written for every sequence
        for s, c, n in zip(slots, ctx, new):
            torch.testing.assert_close(kv.k[layer][s, :, :c + len(n)], ref_kv.k[layer][s, :, :c + len(n)],
                                       rtol=0, atol=1e-12)


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, tmask: torch.Tensor | None,
                         window: int | None) -> torch.Tensor:
    """Textbook attention of one sequence: q [q, n_h, hd]; k, v [n_kv, ctx + q, hd] -> [q, n_h, hd]."""
    n, n_h, hd = q.shape
    rep = n_h // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)  # [n_h, ctx + q, hd]
    allowed = torch.zeros(n, ctx + n, dtype=torch.bool)
    for i in range(n):
        for j in range(ctx + n):
            new_ok = j >= ctx and (bool(tmask[i, j - ctx]) if tmask is not None else j - ctx <= i)
            allowed[i, j] = (j < ctx or new_ok) and (window is None or ctx + i - j < window)
    scores = torch.einsum("qhd,hkd->hqk", q, k) / hd ** 0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)  # [n_h, q, ctx + q]
    return torch.einsum("hqk,hkd->qhd", probs, v)


@pytest.mark.parametrize("slots", [[2, 0, 3, 1], [0, 9, 4, 15]], ids=["view", "gather"])
@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
def test_plan_attend_matches_textbook_attention(slots: list[int], window: int | None) -> None:
    torch.manual_seed(0)
    new, ctx, _, masks = _batch(slots)
    q_lens = [len(n) for n in new]
    k = torch.randn(16, 2, 32, 8, dtype=torch.float64)  # [S, n_kv, L, hd]
    v = torch.randn_like(k)
    q = torch.randn(sum(q_lens), 4, 8, dtype=torch.float64)  # [T, n_h, hd]
    got = AttentionPlan.build(q_lens, ctx, slots, masks, window, "cpu").attend(q, k, v)
    start = 0
    for n, c, s, m in zip(q_lens, ctx, slots, masks):
        ref = _reference_attention(q[start:start + n], k[s, :, :c + n], v[s, :, :c + n], c, m, window)
        torch.testing.assert_close(got[start:start + n], ref, rtol=0, atol=1e-12, msg=f"slot {s}")
        start += n


def test_unwritten_cache_positions_never_reach_an_output() -> None:
    """Slot 1 is read up to the longest sequence's length but holds only 2 tokens: the NaN left in
    its unwritten positions must not leak (they are zero-filled before being read)."""
    model = tiny_llama(vocab_size=32, layers=1)
    kv = KVCache.for_model(model.cfg, num_slots=2, max_len=16, dtype=torch.float64)
    for k, v in zip(kv.k, kv.v):
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    kv.zero_chunk = 1  # zero exactly what is read
    layout = BatchLayout.build([10, 2], [0, 0], [0, 1])
    out = model(torch.arange(12), layout, kv).logits
    assert torch.isfinite(out).all()
    assert kv.finite == [10, 10]


def test_plan_worked_example() -> None:
    plan = AttentionPlan.build([2, 1], [3, 1], [0, 1], [None, None], None, "cpu")
    assert (plan.lo, plan.hi, plan.q_max, plan.kv_len) == (0, 2, 2, 5)
    assert plan.q_index.tolist() == [0, 1, 2]  # A's rows at 0, 1; B's one row at 1 * q_max + 0
    assert plan.mask[0, 0].int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert plan.mask[1, 0].int().tolist() == [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]


def _transposed(k: torch.Tensor) -> torch.Tensor:
    """The same keys [S, n_kv, L, hd] stored as the row-invariant kernel reads them ([S, n_kv, hd, L])."""
    return k.transpose(2, 3).contiguous().transpose(2, 3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
def test_exact_kernel_matches_textbook_attention(dtype: torch.dtype, window: int | None) -> None:
    """The row-invariant kernel computes attention: chains, a tree, a prompt chunk and a decode row
    against the textbook formula (to rounding), GQA with 2 query heads per KV head."""
    torch.manual_seed(0)
    slots = [2, 0, 3, 1]
    new, ctx, _, masks = _batch(slots)
    q_lens = [len(n) for n in new]
    k = torch.randn(16, 2, 32, 8, dtype=dtype)  # [S, n_kv, L, hd]
    v = torch.randn_like(k)
    q = torch.randn(sum(q_lens), 4, 8, dtype=dtype)  # [T, n_h, hd]
    got = AttentionPlan.build(q_lens, ctx, slots, masks, window, "cpu", exact=True).attend(q, _transposed(k), v)
    start = 0
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    for n, c, s, m in zip(q_lens, ctx, slots, masks):
        ref = _reference_attention(q[start:start + n].double(), k[s, :, :c + n].double(), v[s, :, :c + n].double(),
                                   c, m, window)
        torch.testing.assert_close(got[start:start + n].double(), ref, rtol=0, atol=tol, msg=f"slot {s}")
        start += n


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_exact_kernel_soft_caps_scores_as_the_padded_path_does(dtype: torch.dtype) -> None:
    """Gemma 2's soft cap (scores -> cap * tanh(score / cap)) in the row-invariant kernel equals the
    padded path's (transformers' eager formula, itself checked against transformers in
    test_model_reference.py), with a non-default scale, and changes the output."""
    torch.manual_seed(2)
    slots = [2, 0, 3, 1]
    new, ctx, _, masks = _batch(slots)
    q_lens = [len(n) for n in new]
    k = torch.randn(16, 2, 32, 8, dtype=dtype) * 2  # scores of a few units: the cap of 1.5 bends them
    v = torch.randn_like(k)
    q = torch.randn(sum(q_lens), 4, 8, dtype=dtype)

    def attend(exact: bool, softcap: float | None) -> torch.Tensor:
        plan = AttentionPlan.build(q_lens, ctx, slots, masks, 6, "cpu", exact=exact)
        return plan.attend(q, _transposed(k) if exact else k, v, scale=0.3, softcap=softcap)

    capped = attend(True, 1.5)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(capped, attend(False, 1.5), rtol=0, atol=tol)
    assert (capped - attend(True, None)).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_exact_kernel_sinks_join_the_softmax_as_the_padded_path_does(dtype: torch.dtype) -> None:
    """gpt-oss's sinks (a logit per head in each softmax's denominator) in the row-invariant kernel equal
    the padded path's (transformers' eager formula, itself checked against transformers in
    test_model_reference.py), beside a soft cap and a window; a sink far below the scores changes nothing,
    one far above silences the head; and a token's row keeps its bits decoded alone."""
    torch.manual_seed(3)
    slots = [2, 0, 3, 1]
    new, ctx, _, masks = _batch(slots)
    q_lens = [len(n) for n in new]
    k = torch.randn(16, 2, 32, 8, dtype=dtype) * 2
    v = torch.randn_like(k)
    q = torch.randn(sum(q_lens), 4, 8, dtype=dtype)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0], dtype=dtype)

    def attend(exact: bool, sinks: torch.Tensor | None, softcap: float | None = None,
               rows: slice = slice(None)) -> torch.Tensor:
        keep = list(range(len(slots)))[rows]
        plan = AttentionPlan.build([q_lens[i] for i in keep], [ctx[i] for i in keep], [slots[i] for i in keep],
                                   [masks[i] for i in keep], 6, "cpu", exact=exact)
        starts = [sum(q_lens[:i]) for i in keep]
        qs = torch.cat([q[s:s + q_lens[i]] for s, i in zip(starts, keep)])
        return plan.attend(qs, _transposed(k) if exact else k, v, scale=0.3, softcap=softcap, sinks=sinks)

    tol = 1e-12 if dtype == torch.float64 else 2e-6
    with_sinks = attend(True, sinks)
    torch.testing.assert_close(with_sinks, attend(False, sinks), rtol=0, atol=tol)
    torch.testing.assert_close(attend(True, sinks, 1.5), attend(False, sinks, 1.5), rtol=0, atol=tol)
    assert (with_sinks - attend(True, None)).abs().max() > 0.1
    low, high = torch.full((4,), -1e4, dtype=dtype), torch.full((4,), 1e4, dtype=dtype)
    assert torch.equal(attend(True, low), attend(True, None))
    assert attend(True, high).abs().max() == 0
    assert torch.equal(attend(True, sinks, rows=slice(1, 2)), with_sinks[q_lens[0]:q_lens[0] + q_lens[1]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_exact_kernel_row_has_the_same_bits_whatever_the_call_holds(dtype: torch.dtype) -> None:
    """A token's output from the row-invariant kernel is bit for bit its output decoded alone, when
    it is verified among 1..8 rows, batched beside short and far longer sequences, part of a long
    prompt chunk, or a node of a draft tree (its ancestors in breadth-first cache order): what makes
    speculation and batching on a CPU exactly lossless. SDPA fails this on the same inputs."""
    torch.manual_seed(1)
    S, n_kv, n_h, hd, L = 4, 3, 9, 64, 1700  # SmolLM2's head layout
    k = torch.randn(S, n_kv, L, hd, dtype=dtype)
    v = torch.randn_like(k)
    kt = _transposed(k)
    qs = torch.randn(S, L, n_h, hd, dtype=dtype)  # the query of the token at each position

    def run(seqs: list[tuple[int, int, int]], trees: list[torch.Tensor | None] | None = None,
            exact: bool = True) -> list[torch.Tensor]:
        """seqs: (slot, ctx, q) -> each sequence's outputs [q, n_h, hd]."""
        plan = AttentionPlan.build([q for _, _, q in seqs], [c for _, c, _ in seqs], [s for s, _, _ in seqs],
                                   trees or [None] * len(seqs), None, "cpu", exact=exact)
        out = plan.attend(torch.cat([qs[s, c:c + q] for s, c, q in seqs]), kt if exact else k, v)
        return list(out.split([q for _, _, q in seqs]))

    sdpa_differs = False
    for ctx in (5, 100, 300, 700, 1500):
        alone = [run([(0, ctx + i, 1)])[0][0] for i in range(8)]
        cases = [[(0, ctx, n)] for n in range(2, 9)]
        cases += [[(0, ctx, 5), (1, 1600, 5), (2, 30, 1)], [(2, 12, 1), (0, ctx, 3)], [(0, ctx - 4, 12)]]
        for seqs in cases:
            mine = next(i for i, (s, _, _) in enumerate(seqs) if s == 0)
            s, c, n = seqs[mine]
            got = run(seqs)[mine]
            for i in range(max(0, ctx - c), min(n, ctx - c + 8)):
                assert torch.equal(got[i], alone[c + i - ctx]), (ctx, seqs, i)
            ref = run(seqs, exact=False)[mine]
            sdpa_differs |= any(not torch.equal(ref[i], run([(0, c + i, 1)], exact=False)[0][0])
                                for i in range(max(0, ctx - c), min(n, ctx - c + 8)))
    assert sdpa_differs, "SDPA matched too: the test would not tell the kernels apart"
    # a tree over drafts a, b (children of the root), c under a, d under c: inputs [root, a, b, c, d]
    # at cache offsets ctx + 0..4; d's ancestors sit at +0, +1, +3, where a chain root-a-c-d holds them
    # at +0, +1, +2 (slot 3 gets slot 0's context and that chain)
    ctx, path = 200, [0, 1, 3, 4]
    mask = tree_mask([-1, -1, 0, 2])  # [5, 5] ancestor-or-self over [root, a, b, c, d]
    kc, vc = k.clone(), v.clone()
    kc[3], vc[3] = k[0], v[0]
    for i, node in enumerate(path):
        kc[3, :, ctx + i], vc[3, :, ctx + i] = k[0, :, ctx + node], v[0, :, ctx + node]
    tree_out = AttentionPlan.build([5], [ctx], [0], [mask], None, "cpu", exact=True).attend(qs[0, ctx:ctx + 5], kt, v)
    chain_out = AttentionPlan.build([1], [ctx + 3], [3], [None], None, "cpu", exact=True).attend(
        qs[0, ctx + 4:ctx + 5], _transposed(kc), vc)
    assert torch.equal(tree_out[4], chain_out[0])


def test_a_tree_fed_level_by_level_equals_the_tree_fed_whole() -> None:
    """A level's tokens attend to earlier levels kept in the cache through a [q, p + q] mask (how
    EAGLE-3 grows its draft trees): each token's output equals feeding the whole tree at once."""
    parents = [-1, -1, 0, 0, 1, 2]  # levels: [0, 1], [2, 3, 4], [5]
    levels = [[0, 1], [2, 3, 4], [5]]
    model = tiny_llama(vocab_size=32, layers=2, dtype=torch.float64)
    ctx = [3, 1, 4, 1, 5]
    tokens = [9, 2, 6, 5, 3, 8]
    whole_kv = KVCache.for_model(model.cfg, num_slots=1, max_len=16, dtype=torch.float64)
    _fill_contexts(model, whole_kv, {0: ctx})
    layout = BatchLayout.build([6], [len(ctx)], [0], depths=[tree_depths(parents)],
                               tree_masks=[tree_mask(parents)[1:, 1:]])
    whole = model(torch.tensor(tokens), layout, whole_kv).logits  # [6, V]
    kv = KVCache.for_model(model.cfg, num_slots=1, max_len=16, dtype=torch.float64)
    _fill_contexts(model, kv, {0: ctx})
    depths = tree_depths(parents)
    for level in levels:
        prev = level[0]  # tokens of earlier levels, in the cache after the context
        layout = BatchLayout.build([len(level)], [len(ctx) + prev], [0], depths=[[depths[j] - prev for j in level]],
                                   tree_masks=[tree_mask(parents[:level[-1] + 1])[prev + 1:, 1:]])
        got = model(torch.tensor([tokens[j] for j in level]), layout, kv).logits
        torch.testing.assert_close(got, whole[level[0]:level[-1] + 1], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="tree mask"):  # wider than the cache holds
        AttentionPlan.build([2], [1], [0], [torch.ones(2, 4, dtype=torch.bool)], None, "cpu")
