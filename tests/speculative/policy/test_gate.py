"""The model-drafter gate (``speculative/policy/gate.py``): model drafters in or out of per-sequence drafting by the
goodput of paired epochs, and the analytic policy and engine under it."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.helpers import run_to_completion, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig, PolicyConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.llm import build_drafter
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.multi import MultiDrafter
from tidespec.speculative.policy.analytic import AnalyticPolicy
from tidespec.speculative.policy.api import PlanInput, SeqState
from tidespec.speculative.policy.factory import PolicyOptions, make_policy
from tidespec.speculative.policy.gate import ModelGate
from tidespec.speculative.policy.guards import GuardConfig
from tidespec.speculative.policy.speedup import Profile
from tidespec.stats import StepStats

FLAT = Profile(target_latency={1: 0.010, 64: 0.010}, draft_cost={"default": 0.0, "suffix": 0.0, "eagle3": 0.004})


def _epoch(gate: ModelGate, goodput: float, batch: int = 1) -> bool:
    """One epoch's steps at ``goodput`` tokens/s; returns the arm it ran."""
    arm = gate.allows(batch)
    for _ in range(gate.epoch_steps):
        gate.record(StepStats(num_decode_seqs=batch, num_emitted_tokens=2, total_time=2 / goodput))
    return arm


def test_the_gate_hand_traced() -> None:
    """The module docstring's example: in / out / in / out at 150, 160, 140, 155 tokens/s; then in explored at 145
    and out at 160, and the schedule in, out, in, out | in | out, out | in | out x 4 | in | out x 8 | in."""
    gate = ModelGate(epoch_steps=4, washout=1, warm=1, min_pairs=3, ema=0.3)
    arms = [_epoch(gate, g) for g in (150, 160, 140, 155)]
    assert arms == [True, False, True, False]
    diff = gate.stats()["gate_diff_b1"]
    assert diff == pytest.approx(0.7 * (0.7 * math.log(150 / 160) + 0.3 * math.log(140 / 160))
                                 + 0.3 * math.log(140 / 155))
    assert round(diff, 3) == -0.090
    assert _epoch(gate, 145) is True  # explored at once
    assert gate.stats()["gate_diff_b1"] == pytest.approx(0.7 * diff + 0.3 * math.log(145 / 155))
    arms = [_epoch(gate, 160 if not gate.allows(1) else 145) for _ in range(17)]
    assert arms == [False, False, True] + [False] * 4 + [True] + [False] * 8 + [True]
    stats = gate.stats()
    assert stats["gate_epochs_in_b1"] == 6 and stats["gate_epochs_out_b1"] == 16 and stats["gate_diff_b1"] < 0


def test_a_model_drafter_that_pays_stays_in_and_one_that_starts_paying_is_found_again() -> None:
    gate = ModelGate(epoch_steps=2, washout=0, warm=0, min_pairs=3, ema=0.3, max_wait=4)
    arms = [_epoch(gate, 200 if gate.allows(1) else 150) for _ in range(30)]
    assert arms[-10:].count(True) >= 8  # in, the other arm explored one epoch in five
    assert gate.stats()["gate_diff_b1"] == pytest.approx(math.log(200 / 150))
    for _ in range(12):  # traffic changes: now out pays
        _epoch(gate, 120 if gate.allows(1) else 150)
    arms = [_epoch(gate, 120 if gate.allows(1) else 150) for _ in range(10)]
    assert arms.count(False) >= 8
    for _ in range(12):  # and back
        _epoch(gate, 200 if gate.allows(1) else 150)
    assert [_epoch(gate, 200 if gate.allows(1) else 150) for _ in range(10)].count(True) >= 8


def test_an_epochs_first_and_last_steps_are_not_measured() -> None:
    """An epoch's first ``washout`` steps still pay for the arm before (caches, taps, catch-up), its last ``warm``
    steps, before an epoch in, for the model drafters' taps: neither counts."""
    gate = ModelGate(epoch_steps=5, washout=2, warm=1, min_pairs=1)
    warming = []
    for arm_steps in ([0.030, 0.030, 0.010, 0.010, 0.030], [0.050, 0.050, 0.020, 0.020, 0.090]):
        for seconds in arm_steps:  # in at 100 tokens/s, out at 50, each slower in the steps not measured
            gate.allows(1)
            warming.append(gate.warming())
            gate.record(StepStats(num_decode_seqs=1, num_emitted_tokens=1, total_time=seconds))
    assert gate.stats()["gate_diff_b1"] == pytest.approx(math.log(100 / 50))
    assert warming == [False] * 9 + [True]  # out's last step, before in (the alternation's next arm)
    with pytest.raises(ValueError, match="washout"):
        ModelGate(epoch_steps=4, washout=2, warm=2)


def test_the_gate_keeps_each_batch_size_bucket_apart_and_ignores_prompt_steps() -> None:
    gate = ModelGate(epoch_steps=2, washout=0, warm=0)
    for _ in range(4):
        gate.record(StepStats(num_decode_seqs=1, num_prefill_tokens=64, num_emitted_tokens=1, total_time=0.05))
        gate.record(StepStats(num_decode_seqs=0, num_prefill_tokens=64, total_time=0.05))
        gate.record(StepStats(num_decode_seqs=1, num_emitted_tokens=1, total_time=0.0))
    assert gate.stats() == {} or gate.stats()["gate_epochs_in_b1"] == 0
    _epoch(gate, 100, batch=4)
    assert gate.allows(4) is False and gate.allows(1) is True  # bucket 4 alternated; bucket 1 untouched
    assert gate.keeps_out() is False  # the planned bucket (the last asked) is 1
    with pytest.raises(ValueError, match="epoch_steps"):
        ModelGate(epoch_steps=0)


def _policy(**kw: object) -> AnalyticPolicy:
    return AnalyticPolicy(FLAT, 4, drafters=("suffix", "eagle3"), shadowed=frozenset({"suffix"}), per_sequence=True,
                          **kw)  # type: ignore[arg-type]


def test_a_gated_policy_routes_and_probes_the_model_drafter_only_in_its_epochs() -> None:
    """EAGLE-3 accepts 3 of 4 (eq. 5 sends every sequence without an offer to it) but its steps take four times
    plain's: the gate measures that, keeps it out (no route, no probe, its taps need not linger), and hands it
    the taps in the steps before an epoch in."""
    policy = _policy(gate=True, probe_every=4)
    assert policy.gate is not None
    for _ in range(30):
        policy.observe(StepStats(num_decode_seqs=1, drafter_outcomes={"eagle3": [(4, 4, 3)]},
                                 shadow_outcomes={"suffix": [(4, 4, 0)]}))
    names: list[tuple[bool, str, bool, bool, bool]] = []
    for _ in range(400):
        before = policy.num_probes
        name, gamma = policy.plan_drafters(PlanInput(1, 0.1, [SeqState(1, 0.0, 100)], ("suffix", "eagle3")))[1]
        names.append((policy.gate.allows(1), name if gamma else "none", policy.num_probes > before,
                      policy.priced_out("eagle3"), policy.probe_due("eagle3")))
        policy.observe(StepStats(num_decode_seqs=1, total_time=0.040 if gamma else 0.010, num_emitted_tokens=1,
                                 spec_lens={1: gamma}, shadow_outcomes={"suffix": [(4, 4, 0)]}))
    out = [n for n in names if not n[0]]
    assert out and {n[1] for n in out} == {"none"} and not any(n[2] for n in out)  # no route, no probe
    assert all(n[3] for n in out)  # priced out: its taps stop lingering
    assert any(n[4] for n in out)  # but warmed before an epoch in
    assert {n[1] for n in names if n[0]} == {"eagle3"}
    stats = policy.stats()
    assert stats["gate_diff_b1"] < 0 and stats["gate_epochs_out_b1"] > 2 * stats["gate_epochs_in_b1"]
    assert not _policy(gate=False).stats().keys() & {"gate_in_b1"}


def test_epochs_out_do_not_reset_the_count_to_a_probe_of_a_model_drafter_priced_below_none() -> None:
    """EAGLE-3 accepted nothing (priced below none: no route; a probe costs more than 64 steps' budget, suffix
    predicting far more) and the gate alternates epochs of 16 steps in and out:
    the steps out do not count towards a probe, nor restart the count, so it is probed once 64 steps in have passed,
    and within the next epoch in after a swap (before: the count restarted every epoch out and never reached 64)."""
    policy = _policy(gate=True, probe_every=64)
    gate = policy.gate = ModelGate(min_pairs=10**6)  # alternates for good
    for _ in range(30):
        policy.observe(StepStats(num_decode_seqs=1, drafter_outcomes={"eagle3": [(4, 4, 0)]},
                                 shadow_outcomes={"suffix": [(4, 4, 4)]}))
    probes: list[tuple[int, int]] = []  # (plan, steps in so far) of each probe
    steps_in = 0

    def plan(i: int) -> None:
        nonlocal steps_in
        before = policy.num_probes
        allowed = gate.allows(1)
        _, gamma = policy.plan_drafters(PlanInput(1, 0.1, [SeqState(1, 0.0, 100)], ("suffix", "eagle3")))[1]
        steps_in += allowed
        if policy.num_probes > before:
            probes.append((i, steps_in))
        else:
            assert gamma == 0  # priced below none: never routed
        policy.observe(StepStats(num_decode_seqs=1, total_time=0.010, num_emitted_tokens=1, spec_lens={1: gamma},
                                 shadow_outcomes={"suffix": [(4, 4, 4)]}))

    for i in range(300):
        plan(i)
    assert [n for _, n in probes] == [64, 128]  # every 64 steps in, over 300 plans (150 of them out)
    policy.drafter_changed("eagle3")
    swapped_at = steps_in
    for i in range(300, 340):
        plan(i)
    assert len(probes) == 3 and probes[2][1] - swapped_at == 8  # the swapped head: probed 8 steps in after the swap


def test_the_gate_is_per_sequence_only_and_on_by_default_in_the_config() -> None:
    assert PolicyConfig().gate_model_drafters is True
    assert AnalyticPolicy(FLAT, 4, gate=True).gate is None  # one drafter, no router: nothing to gate


def test_gated_per_sequence_drafting_gives_plain_decodings_tokens_with_the_model_drafter_in_and_out() -> None:
    model = tiny_llama(48, layers=3, seed=2, scale=3.0)
    tok = tiny_tokenizer(48)
    cache = CacheConfig(max_model_len=96, max_num_seqs=4)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15, 16, 12, 13, 14, 15, 16, 12], [3, 30, 17]]
    params = SamplingParams(max_tokens=32, ignore_eos=True)

    def outputs(engine: LLMEngine) -> list[list[int]]:
        ids = [engine.add_request(p, params) for p in prompts]
        done = run_to_completion(engine)
        return [done[i].token_ids for i in ids]

    plain = outputs(LLMEngine(model, tok, EngineConfig(cache=cache)))
    spec = SpecConfig(drafter="suffix,draft-model", num_speculative_tokens=3)
    drafter = build_drafter(spec, model, 4, 96)
    assert isinstance(drafter, MultiDrafter)
    profile = Profile(target_latency={1: 0.010, 64: 0.010}, draft_cost={"default": 0.0, "suffix": 0.0,
                                                                         "draft-model": 0.001})
    policy = make_policy("analytic", PolicyOptions(gamma_max=3, profile=profile, guards=GuardConfig(gamma_max=3),
                                                   drafters=tuple(drafter.members), shadowed=drafter.shadowed,
                                                   per_sequence=True, gate=True))
    inner = policy.inner  # type: ignore[attr-defined]
    inner.gate = ModelGate(epoch_steps=3, washout=1, warm=1, min_pairs=2)
    plans: list[tuple[bool, set[str]]] = []

    def plan(inp: PlanInput, orig: Any = inner.plan_drafters) -> dict[int, tuple[str, int]]:
        out = orig(inp)
        plans.append((inner.gate.keeps_out(), {name for name, gamma in out.values() if gamma > 0}))
        return out

    inner.plan_drafters = plan
    engine = LLMEngine(model, tok, EngineConfig(cache=cache, spec=spec), drafter=drafter, policy=policy)
    assert outputs(engine) == plain
    assert any(out for out, _ in plans) and any(not out for out, _ in plans)
    assert not any("draft-model" in names for out, names in plans if out)
    assert any("draft-model" in names for out, names in plans if not out)
