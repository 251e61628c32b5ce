"""``--exactness-check`` (``engine/exactness.py``): finished greedy requests re-decoded plainly in
idle time match what was served; an injected difference is reported at its position with the
top-2 logit gap, counted in /metrics, and the check never holds a slot a request waits for."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from tests.helpers import run_to_completion, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.engine.exactness import ExactnessChecker
from tidespec.engine.observer import Hooks
from tidespec.engine.sequence import Sequence
from tidespec.sampling import SamplingParams
from tidespec.server.app import ServerConfig, create_app
from tidespec.speculative.drafters.ngram import NgramDrafter

V = 64
PROMPTS = [[5, 9, 12, 5, 9, 13, 5, 9, 12, 5, 9, 13, 5, 9, 12, 5, 9, 13, 5, 9, 12], [7, 8, 9], [20, 21, 22, 20, 21, 22, 20]]


def _engine(budget: int = 64) -> LLMEngine:
    cfg = EngineConfig(cache=CacheConfig(max_model_len=128, max_num_seqs=3),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget),
                       spec=SpecConfig(drafter="ngram", num_speculative_tokens=3))
    return LLMEngine(tiny_llama(V, layers=2, seed=3, scale=1.5), tiny_tokenizer(V), cfg, drafter=NgramDrafter(1, 3))


def _serve(engine: LLMEngine, params: SamplingParams) -> None:
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, params, request_id=f"r{i}")
    run_to_completion(engine)


def _drain(checker: ExactnessChecker) -> None:
    while checker.tick(0.05):
        pass


def test_speculative_batched_greedy_requests_match_their_plain_redecode() -> None:
    engine = _engine(budget=16)  # a prompt longer than the budget are re-decoded in chunks, as served
    checker = ExactnessChecker(engine, rate=1.0)
    _serve(engine, SamplingParams(max_tokens=30, ignore_eos=True))
    assert len(checker.pending) == 3
    _drain(checker)
    assert checker.counts == {"match": 3, "mismatch": 0, "dropped": 0, "abandoned": 0}
    assert engine.kv.num_free_slots == 3  # every check gave its slot back


def test_an_injected_difference_is_reported_with_its_position_and_gap() -> None:
    engine = _engine()

    def corrupt(seq: Sequence) -> None:  # registered before the checker: it sees the changed output
        if seq.request_id == "r1":
            seq.output_ids[4] = (seq.output_ids[4] + 1) % V
    engine.add_observer(Hooks(finish=corrupt))
    seen: list[str] = []
    checker = ExactnessChecker(engine, rate=1.0, on_result=lambda result, _: seen.append(result))
    _serve(engine, SamplingParams(max_tokens=12, ignore_eos=True))
    _drain(checker)
    assert checker.counts["mismatch"] == 1 and checker.counts["match"] == 2 and sorted(seen).count("match") == 2
    m = checker.mismatches[0]
    assert (m.request_id, m.position) == ("r1", 4) and m.served_token != m.plain_token and m.top2_gap >= 0


def test_sampled_rate_and_non_greedy_requests_are_not_checked() -> None:
    engine = _engine()
    checker = ExactnessChecker(engine, rate=1.0)
    _serve(engine, SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True))
    assert not checker.pending
    none = ExactnessChecker(_engine(), rate=0.0)
    _serve(none.engine, SamplingParams(max_tokens=6, ignore_eos=True))
    assert not none.pending


def test_a_waiting_request_takes_back_the_slot_of_a_check() -> None:
    engine = _engine()
    checker = ExactnessChecker(engine, rate=1.0)
    _serve(engine, SamplingParams(max_tokens=20, ignore_eos=True))
    checker.tick(0.0)  # one forward: the first check now holds a slot
    assert engine.kv.num_free_slots == 2
    for i in range(4):  # more requests than free slots: one waits
        engine.add_request([3, 4, 5], SamplingParams(max_tokens=4), request_id=f"new{i}")
    engine.step()
    assert engine.num_waiting
    assert checker.tick(0.05)  # gives the slot up instead of working while a request waits
    assert checker.counts["abandoned"] == 1 and engine.kv.num_free_slots >= 1
    run_to_completion(engine)
    _drain(checker)
    assert checker.counts["match"] == 3 + 4 and checker.counts["mismatch"] == 0


def test_served_requests_are_checked_in_idle_time_and_counted_in_metrics() -> None:
    engine = _engine()

    def corrupt(seq: Sequence) -> None:
        if seq.request_id.startswith("cmpl") and len(seq.output_ids) > 2 and not corrupt.done:
            seq.output_ids[2] = (seq.output_ids[2] + 1) % V
            corrupt.done = True
    corrupt.done = False
    engine.add_observer(Hooks(finish=corrupt))
    with TestClient(create_app(engine, ServerConfig(served_model_name="tiny", exactness_check=1.0))) as client:
        assert 'tidespec:exactness_checks_total{result="mismatch"} 0.0' in client.get("/metrics").text
        for _ in range(2):
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": "t5 t9 t12 t5 t9", "max_tokens": 10,
                                                     "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
        deadline = time.time() + 30
        text = ""
        while time.time() < deadline:
            text = client.get("/metrics").text
            if 'tidespec:exactness_checks_total{result="match"} 1.0' in text and \
                    'tidespec:exactness_checks_total{result="mismatch"} 1.0' in text:
                break
            time.sleep(0.1)
    assert 'result="mismatch"} 1.0' in text and 'result="match"} 1.0' in text, text[-2000:]
