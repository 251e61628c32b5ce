"""The paged KV cache: the kernel reads blocks bit for bit as slots, admission by free blocks,
preemption by recompute, and every drafter's greedy output unchanged when blocks run out."""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers import run_to_completion, spec_drafter, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine, RequestError
from tidespec.models.kernels.ops import exact_attention_op
from tidespec.models.kv.paged import PagedKVCache, kernel_block_size
from tidespec.sampling import SamplingParams

V = 64
MAX_LEN = 200


@pytest.fixture(scope="module")
def model():
    # 4 layers (EAGLE-3 taps 3), head_dim 32: a block of 16 positions is 64 KiB in float64, so 1 MiB
    # of cache holds 16 blocks
    return tiny_llama(V, layers=4, head_dim=32, seed=4, scale=3.0)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(V)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_exact_attention_reads_a_paged_cache_bit_for_bit_as_slots(dtype: torch.dtype) -> None:
    """Each slot's positions scattered over shuffled blocks of 16: the same bits as the slot cache,
    for chains, a masked-out key and rows of several slots in one call."""
    torch.manual_seed(0)
    slots, n_kv, length, hd, n_h, bs = 3, 3, 256, 64, 9, 16
    keys = torch.randn(slots, n_kv, hd, length).to(dtype).transpose(2, 3)  # [S, n_kv, L, hd], stored transposed
    values = torch.randn(slots, n_kv, length, hd).to(dtype)
    per_slot = length // bs
    table = (torch.randperm(slots * per_slot) + 1).view(slots, per_slot)  # block 0 unused
    pool_k = torch.zeros(slots * per_slot + 1, n_kv, hd, bs, dtype=dtype).transpose(2, 3)
    pool_v = torch.zeros(slots * per_slot + 1, n_kv, bs, hd, dtype=dtype)
    for s in range(slots):
        for b in range(per_slot):
            pool_k[table[s, b]] = keys[s, :, b * bs:(b + 1) * bs]
            pool_v[table[s, b]] = values[s, :, b * bs:(b + 1) * bs]
    lens = [100, 101, 37, 250, 251, 252, 38]
    row_slots = torch.tensor([0, 0, 1, 2, 2, 2, 1])
    mask = torch.zeros(len(lens), length, dtype=torch.bool)
    for t, n in enumerate(lens):
        mask[t, :n] = True
    mask[5, 10] = False
    q = torch.randn(len(lens), n_h, hd).to(dtype)
    if dtype == torch.float64:  # the reference path reads any layout
        keys, pool_k = keys.contiguous(), pool_k.contiguous()
    op = exact_attention_op()
    assert torch.equal(op(q, keys, values, row_slots, mask, 0.125), op(q, pool_k, pool_v, row_slots, mask, 0.125, table))


def test_blocks_are_reserved_reclaimed_and_freed() -> None:
    kv = PagedKVCache(2, 3, 64, 1, 16, torch.float32, block_size=16, num_blocks=4)
    s = kv.allocate()
    assert s == 0 and kv.reserve(s, 20) and kv.blocks[s] == [1, 2]
    assert kv.block_table[s].tolist() == [1, 2, 0, 0]
    kv.set_length(s, 20)
    t = kv.allocate()
    assert t is not None and not kv.reserve(t, 40) and len(kv.blocks[t]) == 2  # keeps what it got
    kv.free(s)
    assert kv.reserve(t, 40) and kv.num_free_blocks == 1
    kv.set_length(t, 40)
    kv.set_length(t, 17)  # a rollback keeps the blocks until someone needs them
    assert len(kv.blocks[t]) == 3 and kv.num_free_blocks == 2
    u = kv.allocate()
    assert u is not None and kv.reserve(u, 32) and kv.blocks[t] == kv.blocks[t][:2] and len(kv.blocks[t]) == 2
    assert kv.room(u) == 32 and kv.capacity == 64
    with pytest.raises(ValueError, match="past the longest"):
        kv.reserve(u, 65)
    assert kernel_block_size(4) == 16 and kernel_block_size(24) == 32


def test_the_free_block_count_follows_every_change_without_a_sweep() -> None:
    """``num_free_blocks`` is kept up to date per slot (the scheduler asks for it once per prompt
    chunk): after random reserves, lengths, rollbacks, reclaims and frees it equals the count over
    every slot."""
    kv = PagedKVCache(1, 6, 96, 1, 16, torch.float32, block_size=16, num_blocks=12)
    rng = random.Random(0)
    owned: list[int] = []
    for _ in range(600):
        op = rng.random()
        if op < 0.2 and kv.num_free_slots:
            slot = kv.allocate()
            assert slot is not None
            owned.append(slot)
        elif op < 0.3 and owned:
            kv.free(owned.pop(rng.randrange(len(owned))))
        elif owned:
            slot = rng.choice(owned)
            upto = rng.randint(1, 96)
            if op < 0.7 and kv.reserve(slot, upto):
                kv.set_length(slot, upto)
            elif op >= 0.7:
                kv.set_length(slot, min(kv.lengths[slot], rng.randint(0, 96)))  # a rollback
        swept = len(kv._free_blocks) + sum(len(b) - kv._kept(s) for s, b in enumerate(kv.blocks))
        assert kv.num_free_blocks == swept


def test_shared_and_held_blocks_are_counted_once_and_freed_by_their_last_holder() -> None:
    """Random reserves, rollbacks, frees, prefix-cache holds and shares: every block's count equals
    its holders (table entries and the cache's hold); the free count equals the free list, the
    slack and the blocks only the cache holds; a block is on the free list exactly when unheld."""
    kv = PagedKVCache(1, 6, 96, 1, 16, torch.float32, block_size=16, num_blocks=14)
    rng = random.Random(1)
    owned: list[int] = []
    for _ in range(800):
        op = rng.random()
        if op < 0.15 and kv.num_free_slots:
            slot = kv.allocate()
            assert slot is not None
            held = [b for b in range(1, 15) if kv._held[b]]
            if held and rng.random() < 0.5:  # start it with some cached blocks, as a prefix hit does
                kv.share(slot, rng.sample(held, rng.randint(1, min(3, len(held)))))
            owned.append(slot)
        elif op < 0.25 and owned:
            kv.free(owned.pop(rng.randrange(len(owned))))
        elif op < 0.35 and owned:  # the cache keeps a sequence's full block
            slot = rng.choice(owned)
            full = [b for b in kv.blocks[slot][:kv.lengths[slot] // 16] if not kv._held[b]]
            if full:
                kv.hold(rng.choice(full))
        elif op < 0.42:  # the cache lets go of one
            held = [b for b in range(1, 15) if kv._held[b]]
            if held:
                kv.unhold(rng.choice(held))
        elif owned:
            slot = rng.choice(owned)
            floor = 16 * sum(kv._held[b] or kv.refs(b) > 1 for b in kv.blocks[slot])  # never below shared blocks
            upto = rng.randint(max(1, floor), 96)
            if op < 0.75 and kv.reserve(slot, upto):
                kv.set_length(slot, max(upto, kv.lengths[slot]))
            elif op >= 0.75:
                kv.set_length(slot, max(floor, min(kv.lengths[slot], upto)))  # a rollback
        holders = [sum(t.count(b) for t in kv.blocks) + kv._held[b] for b in range(15)]
        assert [kv.refs(b) for b in range(1, 15)] == holders[1:]
        assert sorted(kv._free_blocks) == [b for b in range(1, 15) if holders[b] == 0]
        idle = sum(kv._held[b] and holders[b] == 1 for b in range(1, 15))
        swept = len(kv._free_blocks) + sum(len(b) - kv._kept(s) for s, b in enumerate(kv.blocks)) + idle
        assert kv.num_free_blocks == swept and kv.num_idle_blocks == idle


def test_compact_moves_a_tree_path_across_blocks() -> None:
    kv = PagedKVCache(1, 1, 64, 1, 16, torch.float64, block_size=16, num_blocks=4)
    s = kv.allocate()
    assert s is not None and kv.reserve(s, 40)
    for p in range(40):
        blk, row = kv.locate(s, p, p + 1)
        kv.k[0][blk, :, row] = float(p)
    kv.compact(s, [17, 33, 35], 15)  # positions 17, 33, 35 become 15, 16, 17: two block boundaries
    got = [kv.k[0][b, 0, r, 0].item() for b, r in zip(*kv.locate(s, 14, 18))]
    assert got == [14.0, 17.0, 33.0, 35.0]


def make_engine(model, tok, spec: SpecConfig | None = None, memory_mb: int = 0, slots: int = 12,
                max_len: int = MAX_LEN) -> LLMEngine:
    spec = spec or SpecConfig()
    cfg = EngineConfig(cache=CacheConfig(max_model_len=max_len, max_num_seqs=slots, kv_cache_memory_mb=memory_mb),
                       spec=spec)
    return LLMEngine(model, tok, cfg, drafter=spec_drafter(spec, model, slots, max_len))


def run(engine: LLMEngine, n: int = 12, max_tokens: int = 120, seed: int | None = None) -> list[list[int]]:
    r = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0 if seed is None else 1.0, seed=seed)
    ids = [engine.add_request([r.randrange(1, V) for _ in range(r.randrange(5, 60))], params) for _ in range(n)]
    done = run_to_completion(engine)
    return [done[i].token_ids for i in ids]


DRAFTERS = [SpecConfig(),
            SpecConfig(drafter="ngram", num_speculative_tokens=4),
            SpecConfig(drafter="draft-model", num_speculative_tokens=3),
            SpecConfig(drafter="eagle3", num_speculative_tokens=3),
            SpecConfig(drafter="eagle3", num_speculative_tokens=4, tree=True)]


# make test: plain, n-gram and EAGLE-3 trees (a tree path compacted across blocks); the chains of the
# draft model and EAGLE-3 in make test-slow
@pytest.mark.parametrize("spec", [pytest.param(s, marks=pytest.mark.slow) if s.drafter in ("draft-model", "eagle3")
                                  and not s.tree else s for s in DRAFTERS],
                         ids=lambda s: s.drafter + ("-tree" if s.tree else ""))
def test_preempted_sequences_decode_exactly_as_with_room_for_all(model, tok, spec: SpecConfig) -> None:
    """12 sequences of up to 180 tokens in a cache of 256 positions: sequences are preempted and
    prefilled again, and every greedy output is plain decoding's with room for all of them."""
    plain = run(make_engine(model, tok))
    e = make_engine(model, tok, spec, memory_mb=1)
    assert isinstance(e.kv, PagedKVCache) and e.kv.capacity == 256
    assert run(e) == plain
    preempted = sum(s.num_preempted for s in e.history)
    assert preempted > 0 and max(s.num_running for s in e.history) < 12
    assert e.component_errors == 0 and e.draft_errors == 0
    if spec.drafter != "none":
        assert sum(s.num_accepted_tokens for s in e.history) > 0


def test_seeded_sampling_is_reproduced_through_preemption(model, tok) -> None:
    sampled = run(make_engine(model, tok), seed=7)
    e = make_engine(model, tok, SpecConfig(drafter="ngram", num_speculative_tokens=4), memory_mb=1)
    assert run(e, seed=7) == sampled and sum(s.num_preempted for s in e.history) > 0


def test_more_sequences_run_at_once_than_slots_of_the_full_length_hold(tok) -> None:
    """The memory of 4 slots of 2,048 positions (float64: 4 MiB): slots would run 4 sequences of 256
    tokens at once, the paged cache runs them 4x as many and more."""
    model = tiny_llama(V, seed=4)  # 8 KiB a block of 16
    e = make_engine(model, tok, memory_mb=4, slots=64, max_len=2048)
    assert isinstance(e.kv, PagedKVCache) and e.kv.capacity == 4 * 2048
    r = random.Random(1)
    for _ in range(64):
        e.add_request([r.randrange(1, V) for _ in range(16)], SamplingParams(max_tokens=240, ignore_eos=True))
    done = run_to_completion(e)
    assert len(done) == 64 and all(len(o.token_ids) == 240 for o in done.values())
    assert max(s.num_running for s in e.history) >= 4 * 4


def test_max_num_seqs_no_longer_multiplies_a_full_length_reservation(model, tok) -> None:
    """3,000 slots of 512 positions would be 5.9 GiB here; the pool takes the 1 MiB it is given, and
    a request that could not fit even alone is refused at once."""
    e = make_engine(model, tok, memory_mb=1, slots=3000, max_len=512)
    assert isinstance(e.kv, PagedKVCache) and e.kv.num_blocks == 16
    with pytest.raises(RequestError, match="capacity"):  # the whole pool is 256 positions
        e.add_request([1] * 100, SamplingParams(max_tokens=200))
    assert run(e, n=4, max_tokens=40) == run(make_engine(model, tok), n=4, max_tokens=40)
