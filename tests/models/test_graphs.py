"""The CUDA graphs' static block layout gives the eager forward's outputs; the engine over it stays lossless.

On the CPU the block runs without capture (``GraphStep(capture=False)``): what a graph replays is
this same body, so these tests check its layout (rows per slot, padding into the spare slot, the
in-graph mask, the kept rows). tests/cuda/ replays real graphs on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_to_completion, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.llm import build_drafter
from tidespec.models.execution import executor as executor_module
from tidespec.models.execution.graphs import CHAIN, GraphStep, batch_buckets, block_rows, key_buckets
from tidespec.models.kernels.row_attention import block_mask
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.draft_model import DraftModelOptions


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(4) == [1, 2, 4]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert key_buckets(100) == [100]
    assert key_buckets(1040) == [256, 512, 1024, 1040]


@pytest.mark.parametrize("window", [None, 5])
def test_static_block_equals_eager_forward(window):
    model = tiny_llama(64, layers=2, seed=1, sliding_window=window)
    cfg = model.cfg
    eager_kv = KVCache.for_model(cfg, 6, 300, torch.float64)
    block_kv = KVCache.for_model(cfg, 6, 300, torch.float64, spare_slot=True)
    step = GraphStep(model, block_kv, tap_layers=(0, 1), max_q=4, capture=False)
    gen = torch.Generator().manual_seed(0)
    # prefill slots 1, 3, 4 alike in both caches (eager forward)
    ctx = {1: 9, 3: 20, 4: 5}
    for slot, n in ctx.items():
        ids = torch.randint(2, 64, (n,), generator=gen)
        for kv in (eager_kv, block_kv):
            model(ids, BatchLayout.build([n], [0], [slot]), kv)
    # one decode step: slot 3 plain, slot 1 verifying 3 drafts, slot 4 verifying 1
    slots, q_lens = [3, 1, 4], [1, 4, 2]
    tokens = torch.randint(2, 64, (sum(q_lens),), generator=gen).tolist()
    ctx_lens = [ctx[s] for s in slots]
    want = model(torch.tensor(tokens), BatchLayout.build(q_lens, ctx_lens, slots), eager_kv, tap_layers=(0, 1))
    got = step(tokens, q_lens, ctx_lens, slots, tap_layers=(0, 1))
    assert got is not None and got.taps is not None and want.taps is not None
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.taps, want.taps, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.last_hidden, want.last_hidden, rtol=1e-12, atol=1e-12)
    for s, c, q in zip(slots, ctx_lens, q_lens):  # the K/V went into the sequences' own slots
        torch.testing.assert_close(block_kv.k[1][s, :, :c + q], eager_kv.k[1][s, :, :c + q], rtol=1e-12, atol=1e-12)
    assert step.num_replayed == 1


def test_every_block_writes_its_logits_into_one_shared_buffer():
    """Blocks of different shapes return their logits from the same buffer (its first B x q rows),
    each forward's rows right while the next forward has not run."""
    model = tiny_llama(64, layers=2, seed=1)
    eager_kv = KVCache.for_model(model.cfg, 4, 64, torch.float64)
    block_kv = KVCache.for_model(model.cfg, 4, 64, torch.float64, spare_slot=True)
    step = GraphStep(model, block_kv, tap_layers=(), max_q=3, capture=False)
    for kv in (eager_kv, block_kv):
        model(torch.tensor([5, 6, 7]), BatchLayout.build([3], [0], [2]), kv)
    for tokens, q_lens, ctx in (([9], [1], 3), ([9, 4, 8], [3], 3), ([9, 4], [2], 3)):
        got = step(tokens, q_lens, [ctx], [2])
        want = model(torch.tensor(tokens), BatchLayout.build(q_lens, [ctx], [2]), eager_kv)
        assert got is not None
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-12, atol=1e-12)
    assert step.logits.shape == (step.batches[-1] * 3, 64)  # [max B x max q, V]
    for batch, rows in ((4, 3), (1, 1), (2, 2)):
        out = step._run_static(batch, rows, 64)
        assert out.logits.data_ptr() == step.logits.data_ptr() and out.logits.shape == (batch * rows, 64)


def test_prompt_chunks_beside_decoding_sequences_in_one_block():
    """A prompt chunk is a run of new tokens like a verification: in a block of 16 rows per slot,
    beside a sequence verifying 2 drafts, it writes the eager forward's K/V; logits come back at
    the rows asked for (the chunk's last, the verifying sequence's three), taps at every row."""
    model = tiny_llama(64, layers=2, seed=1)
    eager_kv = KVCache.for_model(model.cfg, 4, 96, torch.float64)
    block_kv = KVCache.for_model(model.cfg, 4, 96, torch.float64, spare_slot=True)
    step = GraphStep(model, block_kv, tap_layers=(0, 1), max_q=3, capture=False, prompt_rows=64)
    assert step.row_sizes == [1, 2, 3, 16, 32, 64] and (4, 16) in step.blocks and (4, 32) not in step.blocks
    gen = torch.Generator().manual_seed(3)
    first = torch.randint(2, 64, (6,), generator=gen)
    for kv in (eager_kv, block_kv):  # slot 0 holds 6 tokens already
        model(first, BatchLayout.build([6], [0], [0]), kv)
    chunk = torch.randint(2, 64, (11,), generator=gen).tolist()  # slot 2: a prompt's second chunk, after 4
    eager_kv.set_length(2, 0)
    for kv in (eager_kv, block_kv):
        model(torch.tensor([7, 8, 9, 10]), BatchLayout.build([4], [0], [2]), kv)
    tokens, q_lens, ctx_lens, slots = [30, 31, 32] + chunk, [3, 11], [6, 4], [0, 2]
    logits_rows = [0, 1, 2, 13]
    want = model(torch.tensor(tokens), BatchLayout.build(q_lens, ctx_lens, slots), eager_kv,
                 logits_rows=torch.tensor(logits_rows), tap_layers=(0, 1))
    got = step(tokens, q_lens, ctx_lens, slots, tap_layers=(0, 1), logits_rows=logits_rows)
    assert got is not None and got.logits is not None and got.taps is not None and want.taps is not None
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.taps, want.taps, rtol=1e-12, atol=1e-12)
    for s, c, q in zip(slots, ctx_lens, q_lens):
        torch.testing.assert_close(block_kv.v[0][s, :, :c + q], eager_kv.v[0][s, :, :c + q], rtol=1e-12, atol=1e-12)
    assert step(chunk, [11], [4], [2], logits_rows=[]).logits is None  # a chunk before the prompt's end
    assert step([5] * 17, [17], [0], [3]) is None  # 32 rows x 4 slots > 64 rows: eager
    assert step([5] * 70, [70], [0], [0]) is None  # more rows than any block has
    assert step(list(range(2, 42)), [40], [0], [0]) is not None  # 64 rows x 1 slot
    assert step.num_declined == 2


def test_batches_no_graph_fits_are_declined():
    model = tiny_llama(64, layers=1)
    kv = KVCache.for_model(model.cfg, 2, 64, torch.float64, spare_slot=True)
    step = GraphStep(model, kv, tap_layers=(), max_q=2, capture=False)
    assert step([5, 6, 7], [3], [4], [0]) is None  # 3 rows > max_q
    assert step([5], [1], [64], [0]) is None  # 65 keys > the cache
    assert step([5], [1], [4], [0], tap_layers=(0,)) is None  # other taps than captured
    assert step.num_declined == 3
    with pytest.raises(ValueError, match="spare slot"):
        GraphStep(model, KVCache.for_model(model.cfg, 2, 64, torch.float64), (), 2, capture=False)


V = 48
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15, 16, 12, 13, 14, 15, 16, 12], [3, 3, 3, 3]]


def _generate(model, spec: SpecConfig) -> tuple[list[list[int]], LLMEngine]:
    cfg = EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=4), spec=spec)
    drafter = build_drafter(spec, model, 4, 96) if spec.drafter != "none" else None
    engine = LLMEngine(model, tiny_tokenizer(V), cfg, drafter=drafter)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done = run_to_completion(engine)
    return [done[i].token_ids for i in ids], engine


@pytest.mark.parametrize("drafter,tree", [("none", False), ("suffix", False), ("draft-model", False),
                                          ("draft-model", True), ("eagle3", False), ("eagle3", True)])
def test_engine_over_the_static_block_is_lossless(monkeypatch, drafter, tree):
    model = tiny_llama(V, layers=3, seed=2, scale=3.0)
    spec = SpecConfig(drafter=drafter, num_speculative_tokens=3, tree=tree,
                      options={"draft-model": DraftModelOptions(layers=1, tree_top_k=2)})
    plain, _ = _generate(model, SpecConfig())
    monkeypatch.setattr(executor_module, "uses_graphs", lambda device, enforce_eager: True)  # as on a GPU
    got, engine = _generate(model, spec)
    assert got == plain
    graphs = engine.executor.graphs
    # every forward without a tree went through the block, the prompts' prefills included
    assert graphs is not None and graphs.num_replayed > 0 and graphs.num_declined == 0


@pytest.mark.slow  # a compile: 22 s of g++ on CI's empty cache
def test_compiled_layer_in_the_static_block_equals_eager_forward():
    model = tiny_llama(64, layers=2, seed=1, dtype=torch.float32)
    eager_kv = KVCache.for_model(model.cfg, 3, 64, torch.float32)
    block_kv = KVCache.for_model(model.cfg, 3, 64, torch.float32, spare_slot=True)
    step = GraphStep(model, block_kv, tap_layers=(), max_q=3, capture=False, compile=True)
    for kv in (eager_kv, block_kv):
        model(torch.tensor([4, 5, 6, 7]), BatchLayout.build([4], [0], [1]), kv)
    for tokens, q_lens, ctx_lens in (([9, 10, 11], [3], [4]), ([12], [1], [7])):
        want = model(torch.tensor(tokens), BatchLayout.build(q_lens, ctx_lens, [1]), eager_kv)
        got = step(tokens, q_lens, ctx_lens, [1])
        assert got is not None
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)


def test_block_rows_hand_traced():
    # slot 0 decodes one token after 5, slot 2 verifies two after 3; a block of 4 slots x 2 rows, spare slot 9
    b = block_rows([7, 8, 9], [1, 2], [5, 3], [0, 2], batch=4, rows=2, spare=9)
    assert b.ids == [7, 0, 0, 0, 8, 9, 0, 0] and b.positions == [5, 0, 0, 0, 3, 4, 0, 0]
    assert b.write_slots == [0, 9, 9, 9, 2, 2, 9, 9] and b.write_offsets == b.positions
    assert b.ctx == [5, 0, 3, 0] and b.kept == [0, 4, 5]


def _prefilled(model, slots_ctx: dict[int, int], max_len: int = 300, seed: int = 0):
    """An eager cache and a block cache holding the same random prompts in ``slots_ctx`` (slot: length)."""
    eager_kv = KVCache.for_model(model.cfg, 6, max_len, torch.float64)
    block_kv = KVCache.for_model(model.cfg, 6, max_len, torch.float64, spare_slot=True)
    gen = torch.Generator().manual_seed(seed)
    for slot, n in slots_ctx.items():
        ids = torch.randint(2, 64, (n,), generator=gen)
        for kv in (eager_kv, block_kv):
            model(ids, BatchLayout.build([n], [0], [slot]), kv)
    return eager_kv, block_kv


@pytest.mark.parametrize("fixed_shape,row_kernel", [(False, False), (True, False), (False, True)])
def test_trees_verify_in_the_block(fixed_shape, row_kernel):
    """A tree (rows 1 and 2 children of row 0, row 3 a child of row 1) beside a chain: the block's
    in-graph mask (``lim``/``bits``) and depth positions give the eager forward's logits and K/V —
    with SDPA, and through the row attention op (on the CPU its SDPA reference over the same mask)."""
    model = tiny_llama(64, layers=2, seed=1)
    eager_kv, block_kv = _prefilled(model, {0: 12, 2: 7})
    step = GraphStep(model, block_kv, tap_layers=(), max_q=4, capture=False, fixed_shape=fixed_shape,
                     row_kernel=row_kernel)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    tokens, q_lens, ctx_lens, slots = [9, 10, 11, 12, 20, 21], [4, 2], [12, 7], [0, 2]
    depths, masks = [[0, 1, 1, 2], None], [tree, None]
    layout = BatchLayout.build(q_lens, ctx_lens, slots, depths=depths, tree_masks=masks)
    want = model(torch.tensor(tokens), layout, eager_kv)
    got = step(tokens, q_lens, ctx_lens, slots, depths=depths, masks=masks)
    assert got is not None and step.num_declined == 0
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block_kv.k[1][0, :, :16], eager_kv.k[1][0, :, :16], rtol=1e-12, atol=1e-12)
    # a tree over cached levels (mask wider than its new tokens) is not the block's: eager
    assert step([5], [1], [16], [0], depths=[[-1]], masks=[torch.ones(1, 2, dtype=torch.bool)]) is None


def test_fixed_shape_blocks_run_decode_and_verification_alike():
    """Fixed shapes: one 8-row block per batch size for decode and verification, over the cache's
    whole length; a decode step and a 4-row verification both give the eager forward's logits."""
    model = tiny_llama(64, layers=2, seed=1)
    eager_kv, block_kv = _prefilled(model, {1: 9}, max_len=600)
    step = GraphStep(model, block_kv, tap_layers=(), max_q=5, capture=False, fixed_shape=True, prompt_rows=64)
    assert step.row_sizes == [8, 16, 32, 64] and step.key_lens == [600] and step.verify_rows == 8
    assert {(b, r) for b, r in step.blocks if r == 8} == {(b, 8) for b in step.batches}
    for tokens, ctx in (([30], 9), ([31, 32, 33, 34], 10)):
        want = model(torch.tensor(tokens), BatchLayout.build([len(tokens)], [ctx], [1]), eager_kv)
        got = step(tokens, [len(tokens)], [ctx], [1])
        assert got is not None
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-12, atol=1e-12)
    # more rows than a fixed block: a verification of 9 rows goes to the 16-row prompt block
    assert step(list(range(2, 11)), [9], [14], [1]) is not None and step.num_declined == 0


def test_block_mask_hand_traced():
    """Slot 0: 3 cached tokens and a 2-row chain; slot 1: 1 cached token and a 3-token tree (rows 1
    and 2 children of row 0) in a 3-row block; a window of 4 on the second call."""
    ctx = torch.tensor([3, 1])
    lim = torch.tensor([0, 1, 0, 0, 2, 2])
    bits = torch.tensor([CHAIN, CHAIN, CHAIN, 0b1, 0b11, 0b101])
    offsets = torch.tensor([3, 4, 0, 1, 2, 3])
    mask = block_mask(ctx, lim, bits, offsets, rows=3, keys=6, window=None).int()
    assert mask[0, 0].tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]  # row 2: padding
    assert mask[1, 0].tolist() == [[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0]]
    windowed = block_mask(ctx, lim, bits, offsets, rows=3, keys=6, window=4).int()
    assert windowed[0, 0, 1].tolist() == [0, 1, 1, 1, 1, 0]  # offset 4 sees offsets > 0
