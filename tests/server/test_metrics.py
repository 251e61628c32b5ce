"""Prometheus metrics: hand-traced feeds from StepStats / RequestOutputs, and /metrics on a live app.

The end-to-end test runs the tiny model with the n-gram drafter on a repetitive prompt, so the
first decode step must speculate (the suffix ``t7`` occurs earlier in the prompt), and checks
that the counters parsed from ``/metrics`` agree with the request's own ``usage``.
"""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import tiny_llama, tiny_tokenizer
from tests.speculative.test_dynamic_vocab import _drafter, _head
from tidespec.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.engine.output import RequestOutput
from tidespec.server.app import ServerConfig, create_app
from tidespec.server.metrics import Metrics
from tidespec.speculative.drafters.ngram import NgramDrafter
from tidespec.speculative.policy.factory import PolicyOptions, make_policy
from tidespec.speculative.policy.speedup import Profile
from tidespec.speculative.policy.static import StaticPolicy
from tidespec.speculative.vocab.dynamic import DynamicVocab, DynamicVocabConfig
from tidespec.stats import RequestStats, StepStats


def _value(m: Metrics, name: str, **labels: str) -> float:
    v = m.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def _output(n_out: int, reason: str, stats: RequestStats) -> RequestOutput:
    return RequestOutput("r", [5, 6, 7], list(range(n_out)), "x", "", [], True, reason, stats)


def test_on_step_hand_traced() -> None:
    m = Metrics()
    m.on_step_end(StepStats(num_drafts=2, num_draft_tokens=8, num_accepted_tokens=5, accepted_per_pos=[2, 2, 1],
                        spec_lens={0: 4, 1: 4, 2: 0}, num_prefill_tokens=11, num_emitted_tokens=7,
                        num_running=3, num_waiting=1, kv_usage=0.75))
    m.on_step_end(StepStats(num_drafts=1, num_draft_tokens=4, num_accepted_tokens=1, accepted_per_pos=[1],
                        spec_lens={0: 2}, num_emitted_tokens=2, num_running=1, kv_usage=0.25, num_draft_errors=3,
                        num_trimmed=2))
    assert _value(m, "tidespec:spec_decode_num_drafts_total") == 3
    assert _value(m, "tidespec:spec_decode_draft_errors_total") == 3
    assert _value(m, "tidespec:spec_decode_num_trimmed_tokens_total") == 2
    assert _value(m, "tidespec:spec_decode_num_draft_tokens_total") == 12
    assert _value(m, "tidespec:spec_decode_num_accepted_tokens_total") == 6
    assert _value(m, "tidespec:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 3
    assert _value(m, "tidespec:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 2
    assert _value(m, "tidespec:spec_decode_num_accepted_tokens_per_pos_total", position="2") == 1
    assert _value(m, "tidespec:prompt_tokens_total") == 11
    assert _value(m, "tidespec:generation_tokens_total") == 9
    # gauges hold the last step
    assert _value(m, "tidespec:num_requests_running") == 1
    assert _value(m, "tidespec:num_requests_waiting") == 0
    assert _value(m, "tidespec:kv_cache_usage_perc") == 0.25
    assert _value(m, "tidespec:spec_decode_current_num_speculative_tokens") == 2.0


def test_current_spec_is_mean_of_last_step() -> None:
    m = Metrics()
    m.on_step_end(StepStats(spec_lens={0: 4, 1: 4, 2: 0}))
    assert _value(m, "tidespec:spec_decode_current_num_speculative_tokens") == pytest.approx(8 / 3)
    m.on_step_end(StepStats())
    assert _value(m, "tidespec:spec_decode_current_num_speculative_tokens") == 0.0


def test_on_request_finished_latencies_and_routes() -> None:
    m = Metrics(max_routes=2)
    st = RequestStats(arrival_time=10.0, first_token_time=10.5, finish_time=12.5, num_drafts=3, num_draft_tokens=12,
                      num_accepted_tokens=7)
    m.on_request_finished(_output(5, "length", st), "code")
    # TTFT 0.5 s, TPOT (12.5 - 10.5) / (5 - 1) = 0.5 s, e2e 2.5 s
    assert _value(m, "tidespec:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert _value(m, "tidespec:time_per_output_token_seconds_sum") == pytest.approx(0.5)
    assert _value(m, "tidespec:e2e_request_latency_seconds_sum") == pytest.approx(2.5)
    assert _value(m, "tidespec:e2e_request_latency_seconds_bucket", le="2.5") == 1
    assert _value(m, "tidespec:e2e_request_latency_seconds_bucket", le="2.0") == 0
    assert _value(m, "tidespec:request_success_total", finish_reason="length") == 1
    assert _value(m, "tidespec:request_spec_decode_num_draft_tokens_total", route="code") == 12
    assert _value(m, "tidespec:request_spec_decode_num_accepted_tokens_total", route="code") == 7
    assert _value(m, "tidespec:request_spec_decode_num_drafts_total", route="code") == 3
    assert _value(m, "tidespec:request_generation_tokens_total", route="code") == 5
    # one output token: no TPOT sample; an abort before any token: no TTFT sample
    m.on_request_finished(_output(1, "stop", RequestStats(0.0, 0.1, 0.1)), None)
    m.on_request_finished(_output(0, "abort", RequestStats(0.0, None, 0.3)), "chat")
    assert _value(m, "tidespec:time_per_output_token_seconds_count") == 1
    assert _value(m, "tidespec:time_to_first_token_seconds_count") == 2
    assert _value(m, "tidespec:e2e_request_latency_seconds_count") == 3
    assert _value(m, "tidespec:request_success_total", finish_reason="abort") == 1
    assert _value(m, "tidespec:request_generation_tokens_total", route="default") == 1
    # route labels are bounded: max_routes=2 holds code, chat; a third becomes "other"
    m.on_request_finished(_output(2, "stop", RequestStats(0.0, 0.1, 0.2)), "math")
    assert _value(m, "tidespec:request_generation_tokens_total", route="other") == 2
    assert m.route("math") == "other" and m.route("code") == "code"


def test_registries_are_independent() -> None:
    a, b = Metrics(), Metrics()
    a.on_step_end(StepStats(num_drafts=1))
    assert _value(a, "tidespec:spec_decode_num_drafts_total") == 1
    assert _value(b, "tidespec:spec_decode_num_drafts_total") == 0


def _families(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Parsed samples: {sample name: {sorted labels: value}}."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_metrics_endpoint_spec_counters_move() -> None:
    tok = tiny_tokenizer(64)
    cfg = EngineConfig(cache=CacheConfig(max_model_len=128, max_num_seqs=2), scheduler=SchedulerConfig(max_waiting=4),
                       spec=SpecConfig(drafter="ngram", num_speculative_tokens=3))
    engine = LLMEngine(tiny_llama(64), tok, cfg, drafter=NgramDrafter(1, 3))
    with TestClient(create_app(engine, ServerConfig(served_model_name="tiny"))) as client:
        before = _families(client.get("/metrics").text)
        assert before["tidespec:spec_decode_num_drafts_total"][()] == 0
        prompt = " ".join(["t5 t6 t7"] * 6)
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 24,
                                                 "temperature": 0, "ignore_eos": True},
                        headers={"X-Tidespec-Route": "repeat"})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        after = _families(client.get("/metrics").text)
    drafts = after["tidespec:spec_decode_num_drafts_total"][()]
    draft_tokens = after["tidespec:spec_decode_num_draft_tokens_total"][()]
    accepted = after["tidespec:spec_decode_num_accepted_tokens_total"][()]
    assert drafts >= 1 and draft_tokens >= drafts
    assert 0 <= accepted <= draft_tokens
    assert usage["draft_tokens"] == draft_tokens and usage["accepted_tokens"] == accepted
    per_pos = after.get("tidespec:spec_decode_num_accepted_tokens_per_pos_total", {})
    assert sum(per_pos.values()) == accepted
    route = (("route", "repeat"),)
    assert after["tidespec:request_spec_decode_num_draft_tokens_total"][route] == draft_tokens
    assert after["tidespec:request_spec_decode_num_accepted_tokens_total"][route] == accepted
    assert after["tidespec:request_success_total"][(("finish_reason", "length"),)] == 1
    assert after["tidespec:generation_tokens_total"][()] == usage["completion_tokens"] == 24
    assert after["tidespec:prompt_tokens_total"][()] == usage["prompt_tokens"] == 18
    assert after["tidespec:time_to_first_token_seconds_count"][()] == 1
    assert after["tidespec:kv_cache_usage_perc"][()] == 0.0
    assert after["tidespec:num_requests_running"][()] == 0.0


def _profile(d0: float = 0.001) -> Profile:
    return Profile(target_latency={1: 0.05, 4: 0.1, 16: 0.16}, draft_cost={"default": d0})


def test_policy_metrics_hand_traced() -> None:
    """Two decode steps at batch 4, gamma 3, 12 drafted and 8 emitted, 0.2 s each;
    T(4, 1) = T(4) = 0.1 s, T(4, 4) = T(16) = 0.16 s, D0 = 0: measured speedup =
    2 * 8 * 0.1 / 4 / 0.4 = 1.0, predicted = 0.4 / (2 * 0.16) = 1.25; a step with prefill is
    not tallied."""
    m = Metrics()
    profile = _profile(d0=0.0)
    m.attach_policy(StaticPolicy(3), profile)
    step = dict(num_decode_seqs=4, batch_size=4, spec_lens={i: 3 for i in range(4)}, num_emitted_tokens=8,
                total_time=0.2, num_drafts=4, num_draft_tokens=12, num_accepted_tokens=4)
    m.on_step_end(StepStats(**step))
    m.on_step_end(StepStats(**step))
    m.on_step_end(StepStats(**{**step, "num_prefill_tokens": 30, "total_time": 5.0}))
    m.render()
    assert _value(m, "tidespec:spec_policy_info", policy="static") == 1
    assert _value(m, "tidespec:spec_policy_gamma", bucket="4") == 3
    assert _value(m, "tidespec:spec_policy_steps_total", bucket="4", gamma="3") == 2
    assert _value(m, "tidespec:spec_policy_stat", stat="gamma") == 3
    assert _value(m, "tidespec:spec_policy_measured_speedup", bucket="4") == pytest.approx(1.0)
    assert _value(m, "tidespec:spec_policy_predicted_speedup", bucket="4") == pytest.approx(1.25)


def test_no_policy_no_policy_metrics() -> None:
    m = Metrics()
    m.on_step_end(StepStats(num_decode_seqs=1, batch_size=1, spec_lens={0: 2}, num_emitted_tokens=2, total_time=0.1))
    text = m.render().decode()
    assert "spec_policy_gamma{" not in text and "spec_policy_measured_speedup{" not in text


def test_decode_step_breakdown_counted_without_policy() -> None:
    """Two decode steps at batch 3 (bucket 4) and one at batch 1, no policy: steps, batch sizes,
    time by part and tokens add up per bucket; a step with prefill is not counted."""
    m = Metrics()
    step = dict(num_decode_seqs=3, batch_size=3, num_emitted_tokens=5, num_draft_tokens=6, total_time=0.3,
                verify_time=0.2, draft_time=0.04, other_time=0.06)
    m.on_step_end(StepStats(**step))
    m.on_step_end(StepStats(**step))
    m.on_step_end(StepStats(**{**step, "num_decode_seqs": 1, "num_emitted_tokens": 1, "num_draft_tokens": 0}))
    m.on_step_end(StepStats(**{**step, "num_prefill_tokens": 30, "total_time": 5.0}))
    assert _value(m, "tidespec:decode_steps_total", bucket="4") == 2
    assert _value(m, "tidespec:decode_step_seqs_total", bucket="4") == 6
    assert _value(m, "tidespec:decode_step_seconds_total", bucket="4", part="total") == pytest.approx(0.6)
    assert _value(m, "tidespec:decode_step_seconds_total", bucket="4", part="forward") == pytest.approx(0.4)
    assert _value(m, "tidespec:decode_step_seconds_total", bucket="4", part="draft") == pytest.approx(0.08)
    assert _value(m, "tidespec:decode_step_seconds_total", bucket="4", part="other") == pytest.approx(0.12)
    assert _value(m, "tidespec:decode_step_tokens_total", bucket="4", kind="emitted") == 10
    assert _value(m, "tidespec:decode_step_tokens_total", bucket="4", kind="drafted") == 12
    assert _value(m, "tidespec:decode_steps_total", bucket="1") == 1
    assert _value(m, "tidespec:decode_step_tokens_total", bucket="1", kind="drafted") == 0


def test_metrics_endpoint_exports_policy_decisions() -> None:
    """A live server with the hybrid policy: which policy runs, its explore/exploit counts, the
    gamma it chose per bucket, and predicted next to measured speedup are on /metrics."""
    tok = tiny_tokenizer(64)
    cfg = EngineConfig(cache=CacheConfig(max_model_len=128, max_num_seqs=2), scheduler=SchedulerConfig(max_waiting=4),
                       spec=SpecConfig(drafter="ngram", num_speculative_tokens=3))
    policy = make_policy("hybrid", PolicyOptions(gamma_max=3, profile=_profile()))
    engine = LLMEngine(tiny_llama(64), tok, cfg, drafter=NgramDrafter(1, 3), policy=policy)
    with TestClient(create_app(engine, ServerConfig(served_model_name="tiny"))) as client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": " ".join(["t5 t6 t7"] * 6),
                                                 "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        fams = _families(client.get("/metrics").text)
    assert fams["tidespec:spec_policy_info"][(("policy", "hybrid"),)] == 1
    decisions = fams["tidespec:spec_policy_decisions"]
    explore, exploit = decisions[(("kind", "explore"),)], decisions[(("kind", "exploit"),)]
    steps = fams["tidespec:spec_policy_steps_total"]
    assert explore + exploit >= sum(steps.values()) >= 1
    assert set(fams["tidespec:spec_policy_gamma"]) == {(("bucket", "1"),)}
    assert fams["tidespec:spec_policy_measured_speedup"][(("bucket", "1"),)] > 0
    assert fams["tidespec:spec_policy_predicted_speedup"][(("bucket", "1"),)] > 0
    assert (("stat", "calibration"),) in fams["tidespec:spec_policy_stat"]


def test_drafter_version_follows_swaps_in_responses_and_metrics() -> None:
    """An online-trained drafter changes ``version`` between steps; responses and
    ``tidespec:spec_decode_drafter_version`` must report the version in use now, not at start-up."""
    tok = tiny_tokenizer(64)
    cfg = EngineConfig(cache=CacheConfig(max_model_len=128, max_num_seqs=2), scheduler=SchedulerConfig(max_waiting=4),
                       spec=SpecConfig(drafter="ngram", num_speculative_tokens=3))
    drafter = NgramDrafter(1, 3)
    drafter.versioned, drafter.version = True, 3  # a versioned drafter (EAGLE-3) as its load_state leaves it
    engine = LLMEngine(tiny_llama(64), tok, cfg, drafter=drafter)
    body = {"model": "tiny", "prompt": "t5 t6 t7 t5 t6", "max_tokens": 4, "temperature": 0}
    with TestClient(create_app(engine, ServerConfig(served_model_name="tiny"))) as client:
        first = client.post("/v1/completions", json=body).json()
        v3 = _families(client.get("/metrics").text)["tidespec:spec_decode_drafter_version"][()]
        drafter.version = 4
        second = client.post("/v1/completions", json=body).json()
        v4 = _families(client.get("/metrics").text)["tidespec:spec_decode_drafter_version"][()]
    assert (first["drafter_version"], second["drafter_version"]) == ("3", "4")
    assert (v3, v4) == (3.0, 4.0)


def test_draft_vocab_counters_are_exported_at_scrape_time() -> None:
    vocab = DynamicVocab(DynamicVocabConfig(core_size=2, dynamic=False), [0, 1],
                         lambda ids: torch.zeros(len(ids), 4), start=False)
    m = Metrics()
    m.attach_vocab(vocab)
    vocab.record([(0, None), (5, None)], [])
    text = m.render().decode()
    assert 'tidespec:draft_vocab_stat{stat="coverage"} 0.5' in text
    assert 'tidespec:draft_vocab_stat{stat="oov_events"} 1.0' in text
    assert 'tidespec:draft_vocab_stat{stat="size"} 2.0' in text


def test_server_shutdown_stops_the_draft_vocabulary_worker() -> None:
    """The dynamic vocabulary's worker thread ends with the server (it used to outlive it)."""
    target = tiny_llama(64, layers=4, seed=2)
    drafter = _drafter(_head(target, draft_vocab=24), target, 2)
    drafter.vocab = DynamicVocab(DynamicVocabConfig(core_size=6, semantic_k=0), list(range(6)),
                                 lambda ids: drafter.head.output_rows(ids, target.lm_head.weight.detach()))
    worker = drafter.vocab._thread
    assert worker is not None and worker.is_alive()
    engine = LLMEngine(target, tiny_tokenizer(64), EngineConfig(cache=CacheConfig(max_model_len=128, max_num_seqs=2),
                       spec=SpecConfig(drafter="eagle3", num_speculative_tokens=3)), drafter=drafter)
    with TestClient(create_app(engine, ServerConfig(served_model_name="tiny"))) as client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "t5 t6 t7 t8", "max_tokens": 8,
                                                 "temperature": 0})
        assert r.status_code == 200
        assert worker.is_alive()
    assert not worker.is_alive()


def test_per_drafter_counters_hand_traced() -> None:
    """The docstring's example: suffix and eagle3 under one controller, a third sequence at gamma 0."""
    m = Metrics()
    m.on_step_end(StepStats(num_decode_seqs=3, spec_lens={1: 3, 2: 4, 3: 0}, seq_drafters={1: "suffix", 2: "eagle3"},
                        drafter_outcomes={"suffix": [(3, 3, 2)], "eagle3": [(4, 4, 1)]}))
    drafts, tokens, accepted, choices = ("tidespec:spec_decode_drafter_num_drafts_total",
                                         "tidespec:spec_decode_drafter_num_draft_tokens_total",
                                         "tidespec:spec_decode_drafter_num_accepted_tokens_total",
                                         "tidespec:spec_policy_choices_total")
    for name, want in ((drafts, {"suffix": 1, "eagle3": 1}), (tokens, {"suffix": 3, "eagle3": 4}),
                       (accepted, {"suffix": 2, "eagle3": 1}), (choices, {"suffix": 1, "eagle3": 1, "none": 1})):
        for drafter, value in want.items():
            assert _value(m, name, drafter=drafter) == value, (name, drafter)
    m.series.default_drafter = "ngram"  # a single drafter: named "" in the step's stats
    m.on_step_end(StepStats(num_decode_seqs=1, spec_lens={1: 2}, drafter_outcomes={"": [(2, 2, 2)]}))
    assert _value(m, accepted, drafter="ngram") == 2 and _value(m, choices, drafter="ngram") == 1
