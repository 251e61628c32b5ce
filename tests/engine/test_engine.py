"""Engine core on tiny float64 models: batching exactness, rollback, abort, admission, stops."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_to_completion, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig, SpecConfig
from tidespec.engine import engine as engine_module
from tidespec.engine.engine import LLMEngine, RequestError
from tidespec.engine.observer import Hooks
from tidespec.engine.runner import rows_of
from tidespec.engine.scheduler import QueueFullError
from tidespec.engine.sequence import Sequence
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.sampling import SamplingParams, SamplingParamsError
from tidespec.speculative.api import DrafterBase, DraftInput, DraftProposal, Observation, SeqDraft
from tidespec.speculative.drafters.ngram import NgramDrafter
from tidespec.stats import StepStats

V = 64


@pytest.fixture(scope="module")
def model():
    return tiny_llama(V, layers=2, seed=1)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(V)


def make_engine(model, tok, slots=8, max_len=128, budget=512, max_waiting=0) -> LLMEngine:
    cfg = EngineConfig(cache=CacheConfig(max_model_len=max_len, max_num_seqs=slots),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_waiting=max_waiting))
    return LLMEngine(model, tok, cfg)


def prompts8() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, V, (n,), generator=g).tolist() for n in (3, 17, 5, 40, 1, 9, 26, 12)]


def test_batch_with_staggered_arrivals_equals_alone(model, tok):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = {}
    for i, p in enumerate(prompts8()):
        e = make_engine(model, tok, slots=1)
        e.add_request(p, params, request_id=f"r{i}")
        alone.update({rid: o.token_ids for rid, o in run_to_completion(e).items()})
    # small budget forces chunked prefill; requests arrive at different steps
    e = make_engine(model, tok, slots=8, budget=24)
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts8()))
    step = 0
    while pending or e.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            e.add_request(p, params, request_id=f"r{i}")
        for o in e.step():
            if o.finished:
                got[o.request_id] = o.token_ids
        step += 1
    assert got == alone
    assert all(len(v) == 12 for v in got.values())


def test_rollback_then_reappend_matches_fresh(model):
    ids = torch.randint(1, V, (20,), generator=torch.Generator().manual_seed(3))
    fresh = KVCache.for_model(model.cfg, 1, 64, torch.float64)  # same chunking, no detour: bitwise comparable
    model(ids[:10], BatchLayout.build([10], [0], [0]), fresh)
    ref = torch.cat([torch.empty(10, V, dtype=torch.float64),
                     model(ids[10:], BatchLayout.build([10], [10], [0]), fresh).logits])
    kv = KVCache.for_model(model.cfg, 1, 64, torch.float64)
    model(ids[:10], BatchLayout.build([10], [0], [0]), kv)
    junk = torch.randint(1, V, (6,), generator=torch.Generator().manual_seed(4))
    model(junk, BatchLayout.build([6], [10], [0]), kv)  # append k=6 wrong tokens
    kv.set_length(0, 10)  # roll back j=6
    out = model(ids[10:], BatchLayout.build([10], [10], [0]), kv)
    assert torch.equal(out.logits, ref[10:])


def test_tree_compaction_matches_chain(model):
    """K/V kept from a tree branch after compaction equals K/V of the same tokens as a chain."""
    ctx = torch.randint(1, V, (8,), generator=torch.Generator().manual_seed(5))
    kv = KVCache.for_model(model.cfg, 1, 64, torch.float64)
    model(ctx, BatchLayout.build([8], [0], [0]), kv)
    # tree over [root=ctx[-1] already cached? no: feed root + 3 nodes] root->a->b, root->c
    from tidespec.speculative.tree import tree_mask
    parents = [-1, 0, -1]
    new = torch.tensor([5, 6, 7, 9])  # root, a, b, c
    lay = BatchLayout.build([4], [8], [0], depths=[[0, 1, 2, 1]], tree_masks=[tree_mask(parents)])
    tree_out = model(new, lay, kv).logits
    kv.compact(0, [8, 9, 10], 8)  # keep root, a, b
    kv.set_length(0, 11)
    ref_kv = KVCache.for_model(model.cfg, 1, 64, torch.float64)
    chain = torch.cat([ctx, torch.tensor([5, 6, 7])])
    ref = model(chain, BatchLayout.build([11], [0], [0]), ref_kv).logits
    assert torch.allclose(tree_out[:3], ref[8:11], atol=1e-12)
    assert torch.allclose(kv.k[0][0, :, :11], ref_kv.k[0][0, :, :11], atol=1e-12)
    # the sibling c attends only to root: equals chain [ctx, 5, 9]
    ref2 = model(torch.cat([ctx, torch.tensor([5, 9])]), BatchLayout.build([10], [0], [0]),
                 KVCache.for_model(model.cfg, 1, 64, torch.float64)).logits
    assert torch.allclose(tree_out[3], ref2[9], atol=1e-12)


def test_abort_frees_kv_and_200_requests_finish(model, tok):
    e = make_engine(model, tok, slots=8, max_len=64)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    ids = [e.add_request([1 + (i % 50), 2, 3], params) for i in range(200)]
    e.step()
    assert e.kv.num_free_slots == 0 and e.num_waiting == 192
    assert e.abort_request(ids[0]) and e.abort_request(ids[150])
    assert not e.abort_request(ids[0])
    done = {rid: o.token_ids for rid, o in run_to_completion(e).items()}
    assert len(done) == 198 and all(len(v) == 4 for v in done.values())
    assert e.kv.num_free_slots == 8 and e.kv.usage() == 0.0


def test_bounded_queue_raises(model, tok):
    """1 slot + 2 waiting: a third request is accepted (the free slot takes it at the next step),
    a fourth is refused; once the slot is taken, 2 wait."""
    e = make_engine(model, tok, slots=1, max_waiting=2)
    for _ in range(3):
        e.add_request([1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        e.add_request([1, 2], SamplingParams(max_tokens=2))
    e.step()
    assert (e.num_running, e.num_waiting) == (1, 2)
    with pytest.raises(QueueFullError):
        e.add_request([1, 2], SamplingParams(max_tokens=2))


def test_a_burst_is_not_refused_while_slots_are_free(model, tok):
    """8 requests arrive between two steps with 8 free slots and max_waiting 1: all are accepted
    (only the waiting queue used to be counted: the second one got QueueFullError)."""
    e = make_engine(model, tok, slots=8, max_waiting=1)
    for _ in range(9):
        e.add_request([1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        e.add_request([1, 2], SamplingParams(max_tokens=2))
    assert len(run_to_completion(e)) == 9


def test_bad_inputs(model, tok):
    e = make_engine(model, tok, max_len=32)
    with pytest.raises(RequestError, match="exceeds the context"):
        e.add_request(list(range(1, 30)), SamplingParams(max_tokens=8))
    with pytest.raises(RequestError, match="empty"):
        e.add_request([], SamplingParams())
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ConfigError):
        CacheConfig(max_num_seqs=0)
    assert not e.has_unfinished_requests()


def test_stop_tokens_strings_and_streaming(model, tok):
    e = make_engine(model, tok)
    p = [3, 4, 5]
    e.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True), request_id="a")
    full = run_to_completion(e)["a"].token_ids
    # stop token id: generation ends at its first occurrence, inclusive
    stop_tok = full[4]
    e.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[stop_tok]), request_id="b")
    got = run_to_completion(e)["b"].token_ids
    assert got == full[:full.index(stop_tok) + 1]
    # stop string: text ends right before it, streaming deltas concatenate to the final text
    text = tok.decode(full)
    stop = " ".join(text.split()[3:5])
    e.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True, stop=[stop]), request_id="c")
    deltas, final = [], None
    while e.has_unfinished_requests():
        for o in e.step():
            deltas.append(o.delta_text)
            final = o
    assert final is not None and final.finish_reason == "stop"
    assert "".join(deltas) == final.text
    assert stop not in final.text and text.startswith(final.text.strip())  # word-level decode adds a leading space


def test_eos_stops_unless_ignored(model, tok):
    e = make_engine(model, tok)
    e.add_request([3, 4, 5], SamplingParams(max_tokens=40, ignore_eos=True), request_id="a")
    full = run_to_completion(e)["a"].token_ids
    if 0 in full:
        e.add_request([3, 4, 5], SamplingParams(max_tokens=40), request_id="b")
        assert run_to_completion(e)["b"].token_ids == full[:full.index(0) + 1]
    else:
        e.add_request([3, 4, 5], SamplingParams(max_tokens=40, stop_token_ids=[full[2]]), request_id="b")
        assert run_to_completion(e)["b"].token_ids == full[:full.index(full[2]) + 1]


def test_seeded_sampling_is_reproducible(model, tok):
    outs = []
    for _ in range(2):
        e = make_engine(model, tok)
        e.add_request([3, 4], SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True),
                      request_id="s")
        outs.append(run_to_completion(e)["s"].token_ids)
    assert outs[0] == outs[1]


def test_top_p_that_underflows_fails_no_request() -> None:
    """top_p=1e-300 passes validation but is 0 in float32; it used to mask every
    token and make the whole step raise. It now keeps the most likely token, and the other request
    of the same step completes exactly as it does alone."""
    model, tok = tiny_llama(dtype=torch.float32), tiny_tokenizer(64)  # float32 logits: 1e-300 rounds to 0
    cfg = EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=2))
    alone = LLMEngine(model, tok, cfg)
    alone.add_request([3, 4, 5], SamplingParams(max_tokens=8, ignore_eos=True), request_id="g")
    expected = run_to_completion(alone)["g"].token_ids
    e = LLMEngine(model, tok, cfg)
    e.add_request([3, 4, 5], SamplingParams(max_tokens=8, ignore_eos=True), request_id="g")
    e.add_request([6, 7], SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, top_p=1e-300, seed=1),
                  request_id="p")
    done = run_to_completion(e)
    assert done["g"].token_ids == expected and len(done["p"].token_ids) == 8


def test_a_row_that_fails_verification_leaves_every_sequence_as_it_was(monkeypatch) -> None:
    """The whole batch is verified before any sequence is committed: when one row raises, no other
    sequence has advanced its KV without its tokens, so stepping again gives exactly the outputs of
    an undisturbed run."""
    import tidespec.engine.decide as decide_mod

    class RepeatDrafter(DrafterBase):
        """Drafts the last token repeated for every sequence (lossless: verification decides)."""

        name = "repeat"

        def propose(self, inputs: list[DraftInput]) -> DraftProposal:
            return DraftProposal({i.seq_id: SeqDraft([i.token_ids[-1]] * i.num_speculative_tokens) for i in inputs})

        def observe(self, observations: list[Observation]) -> None:
            return None

        def release(self, seq_id: int) -> None:
            return None

    model, tok = tiny_llama(), tiny_tokenizer(64)
    cfg = EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=2), spec=SpecConfig(
        drafter="ngram", num_speculative_tokens=3))
    prompts = {"a": [3, 4, 5, 3, 4, 5, 3, 4], "b": [7, 8, 7, 8, 7, 8]}

    def run(fail_once: bool) -> dict[str, list[int]]:
        e = LLMEngine(model, tok, cfg, drafter=RepeatDrafter())
        for rid, p in prompts.items():
            e.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True), request_id=rid)
        e.step()  # prefill both
        if fail_once:
            calls = []
            real = decide_mod.verify_greedy

            def flaky(draft, argmax):  # the second row of the next step raises (both rows draft)
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("row failed")
                return real(draft, argmax)

            monkeypatch.setattr(decide_mod, "verify_greedy", flaky)
            with pytest.raises(RuntimeError, match="row failed"):
                while True:
                    e.step()
            monkeypatch.setattr(decide_mod, "verify_greedy", real)
        return {rid: o.token_ids for rid, o in run_to_completion(e).items()}

    assert run(fail_once=True) == run(fail_once=False)


def test_a_component_failing_after_commit_does_not_lose_a_finished_request(caplog) -> None:
    """Request "a" finishes in the step in which the drafter's observe and a finish listener raise:
    its final output is still returned, the engine keeps serving "b", and both outputs equal an
    undisturbed run (the failures are logged and counted). On the old engine the step raised after
    "a" had been removed, so "a" was neither delivered nor failed."""

    class FlakyObserver(DrafterBase):
        """Proposes nothing; its observe raises once, on the step that finishes "a"."""

        name = "flaky"

        def __init__(self) -> None:
            self.armed = False

        def propose(self, inputs: list[DraftInput]) -> DraftProposal:
            return DraftProposal()

        def observe(self, observations: list[Observation]) -> None:
            if self.armed:
                self.armed = False
                raise RuntimeError("observe broke")

        def release(self, seq_id: int) -> None:
            return None

    model, tok = tiny_llama(), tiny_tokenizer(64)
    cfg = EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=2))

    def run(flaky: bool) -> dict[str, list[int]]:
        drafter = FlakyObserver()
        e = LLMEngine(model, tok, cfg, drafter=drafter)
        if flaky:
            def listener(seq: Sequence) -> None:
                if seq.request_id == "a":
                    raise RuntimeError("listener broke")
            e.add_observer(Hooks(finish=listener))
        e.add_request([3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True), request_id="a")
        e.add_request([7, 8], SamplingParams(max_tokens=6, ignore_eos=True), request_id="b")
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        finished = set()
        while e.has_unfinished_requests():
            seq_a = e.seqs.get("a")
            drafter.armed = flaky and seq_a is not None and seq_a.remaining_tokens == 1
            for o in e.step():
                tokens[o.request_id] += o.delta_token_ids
                if o.finished:
                    finished.add(o.request_id)
        assert finished == {"a", "b"}
        assert e.component_errors == (2 if flaky else 0)
        return tokens

    with caplog.at_level("ERROR", logger="tidespec.engine.engine"):
        assert run(flaky=True) == run(flaky=False)
    assert "drafter observe failed" in caplog.text and "finish observer failed" in caplog.text


def test_a_drafter_failing_in_propose_costs_its_drafts_not_the_requests(caplog, monkeypatch) -> None:
    """Drafts are optional: when the drafter raises in ``propose`` (a bug, a cache it outgrew), the
    sequences it was asked for decode without drafts that step, are counted and logged, and every
    request finishes with plain decoding's tokens. Before, the step raised and the server failed
    every request in flight."""

    class FlakyProposer(NgramDrafter):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def propose(self, inputs: list[DraftInput]) -> DraftProposal:
            self.calls += 1
            if self.calls % 3 == 1:
                raise RuntimeError("propose broke")
            proposal = super().propose(inputs)
            if self.calls % 3 == 2:  # a draft longer than the gamma asked for breaks the contract too
                for inp in inputs:
                    proposal.drafts[inp.seq_id] = SeqDraft([1] * (inp.num_speculative_tokens + 1))
            return proposal

    model, tok = tiny_llama(), tiny_tokenizer(64)
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [7, 8, 7, 8, 7, 8]]

    def run(drafter: NgramDrafter | None) -> tuple[list[list[int]], LLMEngine, list[StepStats]]:
        spec = SpecConfig(drafter="ngram", num_speculative_tokens=3) if drafter else SpecConfig()
        e = LLMEngine(model, tok, EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=2), spec=spec),
                      drafter=drafter)
        steps: list[StepStats] = []
        e.add_observer(Hooks(step_end=steps.append))
        ids = [e.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
        done = run_to_completion(e)
        return [done[i].token_ids for i in ids], e, steps

    plain, _, _ = run(None)
    monkeypatch.setattr(engine_module, "DRAFT_ERROR_LOG_EVERY", 1)  # log every failure (default: 1 in 100)
    with caplog.at_level("ERROR", logger="tidespec.engine.engine"):
        got, engine, steps = run(FlakyProposer())
    assert got == plain
    failed = [s for s in steps if s.num_draft_errors]
    assert engine.draft_errors == len(failed) > 0 and engine.component_errors == 0
    assert all(not s.spec_lens or max(s.spec_lens.values()) == 0 for s in failed)  # those steps decoded plainly
    assert any(s.num_drafts for s in steps)  # the other steps still speculated
    assert "drafter ngram failed" in caplog.text and "proposed 4 > 3 tokens" in caplog.text


def test_observed_rows_are_copies_of_the_kept_rows():
    """The rows handed to observers: a chain's consecutive rows by slice, a tree's path by gather,
    either way a copy that later writes to the forward's output do not reach."""
    out = torch.arange(24, dtype=torch.float64).view(6, 4)  # [T, H] a forward output
    for rows in ([2, 3, 4], [0, 2, 5], [5]):
        got = rows_of(out, rows)
        assert torch.equal(got, out.index_select(0, torch.tensor(rows)))
        before = got.clone()
        out.add_(100.0)
        assert torch.equal(got, before)
    assert rows_of(None, [0, 1]) is None


def test_a_step_restores_the_thread_count_the_engine_was_built_with(model, tok):
    """Another thread's set_num_threads has been seen to reach the thread that steps (tidespec.threads):
    each step pins the count the engine was built with again."""
    built = torch.get_num_threads()
    engine = make_engine(model, tok)
    other = 1 if built > 1 else 2
    try:
        torch.set_num_threads(other)
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
        engine.step()
        assert torch.get_num_threads() == built == engine.intraop_threads
    finally:
        torch.set_num_threads(built)
