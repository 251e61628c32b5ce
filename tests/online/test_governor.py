"""Training that yields to serving: the governor's decisions on a fake clock, the supervisor's
SIGSTOP/SIGCONT on a real child, and an engine whose steps pause the trainer until it goes idle."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import tiny_llama, tiny_tokenizer
from tests.online.test_supervisor import FAST, SLEEPER, Children
from tidespec.config import CacheConfig, ConfigError, EngineConfig, OnlineTrainingConfig
from tidespec.engine.engine import LLMEngine
from tidespec.online.serving.governor import GovernorConfig, TrainingGovernor
from tidespec.online.serving.supervisor import TrainerSupervisor
from tidespec.sampling import SamplingParams
from tidespec.stats import StepStats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Switch:
    """A stand-in trainer that records the governor's calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")


def _state(pid: int) -> str:
    """The process state letter from /proc (T = stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _stopped(pid: int, want: bool = True, timeout: float = 5.0) -> bool:
    """Whether the process reaches stopped (``want``) or not-stopped within ``timeout`` (signals
    are delivered asynchronously)."""
    deadline = time.monotonic() + timeout
    while (_state(pid) == "T") != want:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_governor_hand_traced_on_a_fake_clock() -> None:
    """Share 0.1 of a 2 s period: while steps come, the trainer runs 0.2 s of every 2 s; idle for
    idle_s -> it runs. Share 0: paused for as long as steps come."""
    clock, switch = Clock(), Switch()
    gov = TrainingGovernor(switch, GovernorConfig(share=0.1, idle_s=0.3, period_s=2.0), clock)
    timeline = []
    for k in range(40):  # 4 s of steps every 0.1 s, starting at t = 100.0 (a period boundary)
        clock.now = 100.0 + 0.1 * k
        gov.on_step_end(StepStats())
        gov.tick()
        timeline.append(gov.should_run(clock.now))
    assert timeline == ([True] * 2 + [False] * 18) * 2
    assert switch.calls == ["pause", "resume", "pause"]
    clock.now += 0.31  # no step for idle_s: serving is idle
    gov.tick()
    assert switch.calls[-1] == "resume" and not gov.state()["paused"]
    st = gov.state()
    assert st["pauses"] == 2 and st["paused_s"] == pytest.approx(1.8 + 2.01, abs=0.06)  # 100.2-102.0, 102.2-104.21
    long = TrainingGovernor(Switch(), GovernorConfig(share=0.0, idle_s=0.3), clock)
    long.on_step_start()
    assert not long.should_run(clock.now + 2.0)  # a step (a long prefill) still running is busy
    long.on_step_end()
    assert long.should_run(clock.now + 0.31)
    never = TrainingGovernor(Switch(), GovernorConfig(share=0.0), clock)
    never.on_step_end(StepStats())
    assert not never.should_run(clock.now) and never.should_run(clock.now + 1.0)
    always = TrainingGovernor(Switch(), GovernorConfig(share=1.0), clock)
    always.on_step_end(StepStats())
    assert always.should_run(clock.now)
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError):
            GovernorConfig(share=bad)
    with pytest.raises(ConfigError):
        OnlineTrainingConfig(trainer_share=2.0)


def test_supervisor_pause_stops_the_child_and_a_restart_stays_paused() -> None:
    children = Children(SLEEPER)
    sup = TrainerSupervisor(children, FAST).start()
    try:
        pid = sup.pid
        assert pid is not None and _state(pid) != "T"
        sup.pause()
        assert _stopped(pid) and sup.state()["paused"]
        sup.resume()
        assert _stopped(pid, want=False) and not sup.state()["paused"]
        sup.pause()
        children.procs[0].kill()  # dies while paused: the restart starts paused
        deadline = time.monotonic() + 10
        while len(children.procs) < 2 or sup.pid is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert _stopped(children.procs[1].pid)
    finally:
        sup.close(2.0)  # continues the stopped child so that it can act on SIGTERM
        children.kill_all()
    assert children.procs[1].returncode is not None


def test_engine_steps_pause_the_trainer_until_serving_is_idle() -> None:
    """A real child behind the governor: stopped while an engine decodes, running again once idle."""
    child = subprocess.Popen([sys.executable, "-c", SLEEPER])
    sup = TrainerSupervisor(lambda: child, FAST).start()
    gov = TrainingGovernor(sup, GovernorConfig(share=0.0, idle_s=0.2, tick_s=0.01)).start()
    model, tok = tiny_llama(64), tiny_tokenizer(64)
    engine = LLMEngine(model, tok, EngineConfig(cache=CacheConfig(max_model_len=256, max_num_seqs=2)))
    gov.attach(engine)
    try:
        engine.add_request([3, 4, 5], SamplingParams(max_tokens=200, ignore_eos=True))
        seen = set()
        while engine.has_unfinished_requests():
            engine.step()
            time.sleep(0.002)
            seen.add(_state(child.pid))
        assert "T" in seen  # stopped while serving
        assert _stopped(child.pid, want=False), "the trainer was not resumed once serving went idle"
        assert gov.state()["pauses"] >= 1 and gov.state()["paused_s"] > 0
    finally:
        gov.close()
        sup.close(2.0)


def test_collection_asks_for_taps_only_while_speculation_pays() -> None:
    """Where the policy predicts no speedup for any drafter, collection does not keep the taps on."""
    from types import SimpleNamespace

    from tidespec.config import CollectionConfig
    from tidespec.online.capture import CaptureBuffer
    from tidespec.online.collection import SelectiveCollector
    from tidespec.online.signals import SignalCollector, speculation_pays

    class Predicts:
        last_predicted_speedup = 1.3

    policy = Predicts()
    engine = SimpleNamespace(policy=policy)
    collector = SignalCollector(engine, CaptureBuffer(None, 64, 8), SelectiveCollector(CollectionConfig(force=True)))
    assert collector.wants_taps()
    policy.last_predicted_speedup = 1.0  # the controller went off: nothing pays at this load
    assert not collector.wants_taps()
    assert speculation_pays(None)  # no policy (static engine): always


def test_collection_captures_bursts_while_nothing_pays() -> None:
    """With ``idle_share``, a parked drafter still gets runs of rows: the first 16 of every 16 / share decode steps
    ask for the taps (and the final hidden states) when no drafter pays; steps without decode sequences do not
    count, and paying steps capture as before."""
    from types import SimpleNamespace

    from tidespec.config import CollectionConfig
    from tidespec.online.capture import CaptureBuffer
    from tidespec.online.collection import SelectiveCollector
    from tidespec.online.signals import IDLE_BURST_STEPS, SignalCollector
    from tidespec.stats import StepStats

    class Predicts:
        last_predicted_speedup = 1.0  # off: nothing pays

    policy = Predicts()
    engine = SimpleNamespace(policy=policy)
    collector = SignalCollector(engine, CaptureBuffer(None, 64, 8, hidden_dim=4),
                                SelectiveCollector(CollectionConfig(force=True)), idle_share=0.25)
    wanted = []
    for step in range(3 * 64):
        wanted.append((collector.wants_taps(), collector.wants_hidden()))
        collector.on_step_end(StepStats(step=step, num_decode_seqs=1))
        collector.on_step_end(StepStats(step=step, num_decode_seqs=0))  # a prefill-only step: not counted
    assert [w for w, _ in wanted] == ([True] * IDLE_BURST_STEPS + [False] * 48) * 3
    assert [h for _, h in wanted] == [w for w, _ in wanted]
    policy.last_predicted_speedup = 1.2  # a drafter pays again: every step captures, in a burst or not
    for step in range(IDLE_BURST_STEPS + 1):
        assert collector.wants_taps()
        collector.on_step_end(StepStats(step=step, num_decode_seqs=1))
    silent = SignalCollector(engine, CaptureBuffer(None, 64, 8), SelectiveCollector(CollectionConfig(force=True)))
    policy.last_predicted_speedup = 1.0
    assert not silent.wants_taps()  # idle_share 0 (the default): only while speculating pays
    with pytest.raises(ValueError, match="idle_share"):
        SignalCollector(engine, CaptureBuffer(None, 64, 8), SelectiveCollector(CollectionConfig()), idle_share=1.5)
