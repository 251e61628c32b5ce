"""Automatic prefix caching: the block chain and its eviction, and an engine whose prompts reuse
cached prefixes decoding exactly as one that computes every prompt, with every drafter."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_to_completion, spec_drafter, tiny_config, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.engine.observer import Hooks
from tidespec.engine.prefix_cache import PrefixCache
from tidespec.models.kv.blocks import KVBlockPool, SharedBlocks
from tidespec.models.kv.cache import KVCache
from tidespec.models.kv.paged import PagedKVCache
from tidespec.sampling import SamplingParams
from tidespec.speculative.api import Observation

V = 48
MAX_LEN = 192


@pytest.fixture(scope="module")
def model():
    return tiny_llama(V, layers=4, seed=2, scale=3.0)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(V)


def filled_cache(transposed: bool = False, block: int = 4, blocks: int = 16) -> tuple[KVCache, PrefixCache]:
    """A 2-layer cache of 3 slots whose every position holds distinct random values, and a prefix
    cache over it."""
    kv = KVCache.for_model(tiny_config(V), num_slots=3, max_len=64, dtype=torch.float64, transposed_keys=transposed)
    g = torch.Generator().manual_seed(0)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    return kv, PrefixCache(KVBlockPool(kv, blocks, block))


def test_the_worked_example() -> None:
    kv, pc = filled_cache()
    assert pc.match([1, 2, 3, 4, 5, 6, 7, 8, 9]) == []
    kv.set_length(0, 9)
    assert pc.insert(7, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9], num_final=9) == 2
    assert len(pc.match([1, 2, 3, 4, 5, 6, 7, 8, 42])) == 2
    assert len(pc.match([1, 2, 3, 4, 5, 6, 7, 8])) == 1  # the last prompt token is always computed
    assert pc.match([1, 2, 3, 5, 5, 6, 7, 8, 9]) == []
    assert pc.match([9, 9, 9, 9, 5, 6, 7, 8, 9]) == []  # a block is named by its prefix too
    assert pc.insert(8, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9], num_final=9) == 0  # cached already


@pytest.mark.parametrize("transposed", [False, True])
def test_a_reused_prefix_has_the_bits_its_slot_had(transposed: bool) -> None:
    kv, pc = filled_cache(transposed)
    tokens = list(range(1, 20))
    kv.set_length(0, 19)
    assert pc.insert(0, 0, tokens, num_final=19) == 4
    hit, _ = pc.reuse(1, 2, tokens + [30], frozenset())
    assert hit == 16 and kv.lengths[2] == 16 and pc.hit_tokens == 16 and pc.query_tokens == 20
    for k, v in zip(kv.k, kv.v):
        assert torch.equal(k[2, :, :16], k[0, :, :16]) and torch.equal(v[2, :, :16], v[0, :, :16])


def test_least_recently_used_leaves_go_first_and_a_root_takes_its_branches() -> None:
    kv, pc = filled_cache(blocks=4)
    kv.set_length(0, 12)
    a = [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    pc.insert(0, 0, a, 12)  # root A1 -> A2 -> A3
    b = [1, 1, 1, 1, 5, 5, 5, 5]
    pc.insert(1, 0, b, 8)  # shares A1, adds B2: 4 blocks, the pool is full
    assert pc.num_cached_blocks == 4
    c = [7, 7, 7, 7]
    pc.insert(2, 0, c, 4)  # evicts the least recently used leaf: A3 (A1 was touched last, by b)
    assert len(pc.match(a + [0])) == 2 and len(pc.match(b + [0])) == 2 and len(pc.match(c + [0])) == 1
    pc._evict(pc.match(a + [0])[0])  # the root: every block reachable through it goes with it
    assert pc.num_cached_blocks == 1 and pc.match(b + [0]) == [] and pc.num_evicted == 4


def test_a_long_prefix_fills_the_pool_without_evicting_itself() -> None:
    kv, pc = filled_cache(blocks=3)
    kv.set_length(0, 20)
    assert pc.insert(0, 0, list(range(20)), 20) == 3  # 5 full blocks, room for 3: the first 3 kept
    assert len(pc.match(list(range(21)))) == 3


def test_side_rows_are_kept_while_contiguous_from_position_0() -> None:
    kv, pc = filled_cache()
    kv.set_length(0, 16)
    taps = torch.arange(16 * 2, dtype=torch.float64).reshape(16, 2)
    pc.record(0, 0, {"taps": taps[:6]})
    pc.record(0, 6, {"taps": taps[6:9]})
    pc.record(0, 9, {})  # a step without taps: a hole
    pc.record(0, 10, {"taps": taps[10:12]})
    pc.insert(0, 0, list(range(16)), 16)
    need = frozenset({"taps"})
    assert len(pc.match(list(range(17)), need)) == 2 and len(pc.match(list(range(17)))) == 4
    _, side = pc.reuse(1, 1, list(range(17)), need)
    assert torch.equal(side["taps"], taps[:8])
    # the same prefix seen again with taps everywhere: the blocks that lacked them get them
    pc.forget(2)
    pc.record(2, 0, {"taps": taps})
    pc.insert(2, 0, list(range(16)), 16)
    assert len(pc.match(list(range(17)), need)) == 4


def test_a_failed_copy_registers_no_block(monkeypatch: pytest.MonkeyPatch) -> None:
    kv, pc = filled_cache()
    kv.set_length(0, 8)

    def broken(*args: object, **kw: object) -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(pc.pool, "save", broken)
    with pytest.raises(RuntimeError):
        pc.insert(0, 0, list(range(8)), 8)
    assert pc.num_cached_blocks == 0 and pc.match(list(range(9))) == [] and pc.pool.num_free == 16


def paged_cache(num_blocks: int = 8) -> tuple[PagedKVCache, PrefixCache]:
    """A paged cache of 4 slots of 128 positions in blocks of 16, and a prefix cache sharing its blocks."""
    kv = PagedKVCache(2, 4, 128, 1, 16, torch.float64, block_size=16, num_blocks=num_blocks)
    return kv, PrefixCache(SharedBlocks(kv))


def test_over_a_paged_cache_a_hit_shares_the_blocks_and_idle_ones_are_evicted_when_needed() -> None:
    kv, pc = paged_cache()
    s = kv.allocate()
    assert s is not None and kv.reserve(s, 40)
    kv.set_length(s, 40)
    tokens = list(range(40))
    assert pc.insert(0, s, tokens, 40) == 2  # the 2 full blocks, kept as they are
    assert [kv.refs(b) for b in kv.blocks[s]] == [2, 2, 1]
    t = kv.allocate()
    assert t is not None
    hit, _ = pc.reuse(1, t, tokens + [99], frozenset())
    assert hit == 32 and kv.blocks[t] == kv.blocks[s][:2] and kv.lengths[t] == 32
    assert kv.block_table[t, :2].tolist() == kv.block_table[s, :2].tolist()
    assert [kv.refs(b) for b in kv.blocks[t]] == [3, 3] and kv.num_free_blocks == 5
    kv.free(s)
    kv.free(t)
    assert kv.num_idle_blocks == 2 and kv.num_free_blocks == 8 and kv.usage() == 0.0
    u = kv.allocate()  # needs every block: the free list has 6, the cache lets go of its 2
    assert u is not None and kv.reserve(u, 128) and pc.num_cached_blocks == 0 and pc.num_evicted == 2
    assert pc.match(tokens + [99]) == [] and kv.num_idle_blocks == 0


def test_a_cached_block_a_sequence_holds_is_not_evicted_and_frees_nothing() -> None:
    kv, pc = paged_cache(num_blocks=4)
    s = kv.allocate()
    assert s is not None and kv.reserve(s, 32)
    kv.set_length(s, 32)
    pc.insert(0, s, list(range(32)), 32)
    t = kv.allocate()
    assert t is not None and not kv.reserve(t, 64)  # 2 free blocks; the cached 2 are s's
    assert pc.num_cached_blocks == 2 and len(kv.blocks[t]) == 2
    pc.reset()  # the cache lets go: s keeps its blocks
    assert kv.refs(kv.blocks[s][0]) == 1 and kv.num_free_blocks == 0
    kv.free(s)
    assert kv.reserve(t, 64)


def make_engine(model, tok, spec: SpecConfig | None = None, caching: bool = True, slots: int = 4,
                budget: int = 512, **model_kw: object) -> LLMEngine:
    spec = spec or SpecConfig()
    cfg = EngineConfig(model=ModelConfig(**model_kw),
                       cache=CacheConfig(max_model_len=MAX_LEN, max_num_seqs=slots, enable_prefix_caching=caching,
                                         block_size=4),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget), spec=spec)
    return LLMEngine(model, tok, cfg, drafter=spec_drafter(spec, model, slots, MAX_LEN))


def prompts() -> list[list[int]]:
    """Three groups sharing a 40-token system prompt, two-by-two sharing more, and one stranger."""
    g = torch.Generator().manual_seed(3)
    system = torch.randint(1, V, (40,), generator=g).tolist()
    few_shot = system + torch.randint(1, V, (13,), generator=g).tolist()
    tails = [torch.randint(1, V, (n,), generator=g).tolist() for n in (5, 9, 2, 7, 11)]
    return ([system + tails[0], system + tails[1], few_shot + tails[2], few_shot + tails[3]]
            + [torch.randint(1, V, (25,), generator=g).tolist()])


def outputs(engine: LLMEngine, prompt_list: list[list[int]], batched: bool, max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if not batched:
        return [outputs(engine, [p], True, max_tokens)[0] for p in prompt_list]
    ids = [engine.add_request(p, params) for p in prompt_list]
    done = run_to_completion(engine)
    return [done[i].token_ids for i in ids]


@pytest.mark.parametrize("budget", [512, 24])  # 24: prompts in several chunks, cut inside blocks
def test_prompts_that_reuse_a_prefix_decode_exactly_as_computed_in_full(model, tok, budget: int) -> None:
    plain = outputs(make_engine(model, tok, caching=False), prompts(), batched=False)
    e = make_engine(model, tok, budget=budget)
    assert e.prefix_cache is not None
    assert outputs(e, prompts(), batched=False) == plain  # each prompt after the others: shared prefixes hit
    first, b = e.prefix_cache.hit_tokens, e.prefix_cache.block_size  # b: the paged cache's block, 16
    assert first >= 40 // b * b * 3  # prompts 2-4 reuse at least the system prompt's full blocks
    assert outputs(e, prompts(), batched=True) == plain  # all at once, every prompt cached whole
    assert e.prefix_cache.hit_tokens - first >= sum(len(p) - b for p in prompts())
    hits = sum(s.num_prefix_hit_tokens for s in e.history)
    assert hits == e.prefix_cache.hit_tokens and e.component_errors == 0


def test_a_chat_turn_reuses_the_previous_turns_output(model, tok) -> None:
    """A multi-turn chat resends its history: the blocks of the first answer are cached too."""
    e = make_engine(model, tok)
    first = prompts()[0]
    answer = outputs(e, [first], batched=False, max_tokens=20)[0]
    second = first + answer + [3, 4, 5]
    rid = e.add_request(second, SamplingParams(max_tokens=16, ignore_eos=True))
    out = run_to_completion(e)[rid]
    b = e.prefix_cache.block_size if e.prefix_cache is not None else 0
    assert out.stats.num_cached_tokens == b * ((len(first) + 19) // b)  # up to the answer's last cached token
    assert out.token_ids == outputs(make_engine(model, tok, caching=False), [second], False, 16)[0]


def test_requests_that_share_a_cached_prefix_hold_its_blocks_once(model, tok) -> None:
    """Three requests after the one that cached their system prompt: its blocks sit in all four
    block tables (the cache's and three sequences'), not copied."""
    e = make_engine(model, tok)
    first, *rest = prompts()[:4]
    outputs(e, [first], batched=False, max_tokens=4)
    for p in rest:
        e.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
    e.step()
    tables = [e.kv.blocks[seq.slot] for seq in e.seqs.values() if seq.slot is not None]
    shared = tables[0][:40 // e.kv.block_size]
    assert len(tables) == 3 and shared and all(t[:len(shared)] == shared for t in tables)
    assert all(e.kv.refs(b) == 4 for b in shared)
    run_to_completion(e)
    assert all(e.kv.refs(b) == 1 for b in shared) and e.kv.usage() == 0.0  # only the cache holds them


def test_a_failed_hit_gives_the_shared_blocks_back_and_the_prompt_is_computed_in_full(model, tok,
                                                                                     monkeypatch) -> None:
    """The blocks are shared, then reading their side rows fails: the request's prompt is computed
    in full into blocks of its own (none written over), its tokens are plain decoding's, and the
    cached blocks end with the cache as their only holder."""
    e = make_engine(model, tok, SpecConfig(drafter="eagle3", num_speculative_tokens=3))
    first, second = prompts()[:2]
    outputs(e, [first], batched=False, max_tokens=4)
    assert e.prefix_cache is not None and isinstance(e.prefix_cache.pool, SharedBlocks)
    cached = [blk.index for blk in e.prefix_cache.match(second)]

    def broken(*args: object) -> None:
        raise RuntimeError("side rows lost")

    monkeypatch.setattr(e.prefix_cache.pool.side, "load", broken)
    rid = e.add_request(second, SamplingParams(max_tokens=24, ignore_eos=True))
    e.step()
    slot = e.seqs[rid].slot
    assert slot is not None and not set(e.kv.blocks[slot]) & set(cached)  # its prefill writes its own blocks
    got = run_to_completion(e)[rid].token_ids
    plain = outputs(make_engine(model, tok, caching=False), [second], batched=False)[0]
    assert got == plain and e.component_errors == 1 and cached
    assert all(e.kv.refs(b) == 1 for b in cached) and e.kv.usage() == 0.0


def test_reset_prefix_cache_drops_every_block(model, tok) -> None:
    """As vLLM's ``reset_prefix_cache``: after it, a repeated prompt is computed in full (same
    tokens); the pool is whole again; an engine without a cache has nothing to drop."""
    e = make_engine(model, tok)
    first = prompts()[0]
    before = outputs(e, [first], batched=False)[0]
    assert e.prefix_cache is not None and e.prefix_cache.num_cached_blocks > 0
    assert e.reset_prefix_cache() == (len(first) + 23) // e.prefix_cache.block_size  # prompt and output, full blocks
    assert e.prefix_cache.num_cached_blocks == 0 and e.kv.num_free_blocks == e.kv.num_blocks  # paged: shared blocks
    rid = e.add_request(first, SamplingParams(max_tokens=24, ignore_eos=True))
    out = run_to_completion(e)[rid]
    assert out.stats.num_cached_tokens == 0 and out.token_ids == before
    assert e.reset_prefix_cache() > 0 and e.reset_prefix_cache() == 0
    assert make_engine(model, tok, caching=False).reset_prefix_cache() == 0


DRAFTERS = [SpecConfig(drafter="ngram", num_speculative_tokens=3),
            SpecConfig(drafter="suffix", num_speculative_tokens=4),
            SpecConfig(drafter="draft-model", num_speculative_tokens=3),
            SpecConfig(drafter="eagle3", num_speculative_tokens=3),
            SpecConfig(drafter="eagle3", num_speculative_tokens=4, tree=True)]


@pytest.mark.parametrize("spec", DRAFTERS, ids=lambda s: s.drafter + ("-tree" if s.tree else ""))
def test_every_drafter_with_prefix_hits_is_exact_and_drafts_as_without(model, tok, spec: SpecConfig) -> None:
    """Greedy outputs equal plain decoding without a cache, alone and batched; and the drafts are
    those of the same drafter without a cache: EAGLE-3 got the reused positions' taps."""
    plain = outputs(make_engine(model, tok, caching=False), prompts(), batched=False)
    drafted: dict[bool, list[tuple[int, ...]]] = {}
    for caching in (False, True):
        e = make_engine(model, tok, spec, caching=caching)
        drafted[caching] = recorded_drafts(e)
        assert outputs(e, prompts(), batched=False) == plain
        if caching:
            assert e.prefix_cache is not None and e.prefix_cache.hit_tokens > 0
            assert outputs(e, prompts(), batched=True) == plain
            assert e.component_errors == 0 and e.draft_errors == 0
    assert len(drafted[True]) > 20
    assert drafted[True][:len(drafted[False])] == drafted[False]  # one prompt at a time: the same drafts


def recorded_drafts(engine: LLMEngine) -> list[tuple[int, ...]]:
    """Every draft ``engine``'s drafter proposes from now on, in order (a list that grows)."""
    drafts: list[tuple[int, ...]] = []
    drafter = engine.drafter
    assert drafter is not None
    propose = drafter.propose

    def recording(inputs):  # type: ignore[no-untyped-def]
        proposal = propose(inputs)
        drafts.extend(tuple(proposal.drafts[i.seq_id].token_ids) for i in inputs if i.seq_id in proposal.drafts)
        return proposal

    drafter.propose = recording  # type: ignore[method-assign]
    return drafts


def test_prefix_caching_is_off_where_it_could_change_outputs(model, tok) -> None:
    assert make_engine(model, tok, caching=False).prefix_cache is None
    assert make_engine(model, tok, row_invariant=False).prefix_cache is None
    assert make_engine(model, tok).prefix_cache is not None


def test_a_reused_prefix_hands_the_drafter_and_observers_the_taps_and_hidden_states_of_a_prefill(model, tok) -> None:
    """What the drafter and the observers see of each prompt -- positions, taps, final hidden
    states -- is the same bits whether the prompt was computed in full or mostly reused."""
    seen: dict[bool, dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor]]]] = {}
    for caching in (False, True):
        e = make_engine(model, tok, SpecConfig(drafter="eagle3", num_speculative_tokens=3), caching=caching)
        got: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = seen.setdefault(caching, {})

        def record(observations: list[Observation], got=got) -> None:  # type: ignore[no-untyped-def]
            for o in observations:
                if o.start < o.num_prompt_tokens:  # the prompt's positions
                    assert o.taps is not None and o.hidden is not None
                    got.setdefault(o.seq_id, []).append((o.start, o.num_new_cached, o.taps, o.hidden))

        e.add_observer(Hooks(hidden=lambda: True, observations=record))
        outputs(e, prompts(), batched=False, max_tokens=4)
    assert sum(len(v) for v in seen[True].values()) > 0
    for seq_id, chunks in seen[False].items():
        ref_taps, ref_hidden = torch.cat([c[2] for c in chunks]), torch.cat([c[3] for c in chunks])
        got = seen[True][seq_id]
        assert [c[0] for c in got] == [0] + [sum(c[1] for c in got[:i]) for i in range(1, len(got))]
        assert torch.equal(torch.cat([c[2] for c in got]), ref_taps)
        assert torch.equal(torch.cat([c[3] for c in got]), ref_hidden)
    assert any(len(seen[True][i]) == 2 and seen[True][i][0][1] >= 32 for i in seen[True])  # hits happened
