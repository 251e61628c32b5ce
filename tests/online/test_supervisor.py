"""The supervised trainer child: a ``kill -9`` is reaped, logged, counted and restarted; a child that
keeps dying is given up on and signal capture stops; ``close()`` never restarts.

The children are cheap stand-ins (``python -c "import time; time.sleep(60)"``, or one that exits at
once) and the backoffs are tens of milliseconds, so each test takes about a second.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, CollectionConfig, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.errors import ConfigError
from tidespec.online.serving.attach import OnlineConfig, OnlineTraining, attach_online_training
from tidespec.online.serving.supervisor import RestartPolicy, TrainerSupervisor, describe_exit
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.eagle3 import Eagle3DrafterConfig, build_eagle3_drafter

LOGGER = "tidespec.online.serving.supervisor"
SLEEPER = "import time; time.sleep(60)"
FAST = RestartPolicy(max_restarts=3, backoff_s=0.05, backoff_max_s=0.2, healthy_s=60.0)


class Children:
    """A ``start`` callable that starts ``python -c code`` and keeps every child it started (and
    the thread that started it)."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.procs: list[subprocess.Popen[bytes]] = []
        self.threads: list[str] = []

    def __call__(self) -> subprocess.Popen[bytes]:
        self.threads.append(threading.current_thread().name)
        proc = subprocess.Popen([sys.executable, "-c", self.code], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def sleepers() -> Iterator[Children]:
    children = Children(SLEEPER)
    yield children
    children.kill_all()


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def reaped(pid: int) -> bool:
    """True when ``pid`` is no child of ours any more (a zombie would still be one)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_kill_9_is_reaped_logged_counted_and_restarted(sleepers: Children, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    log_path = tmp_path / "trainer.log"
    sup = TrainerSupervisor(sleepers, FAST, log_path=log_path)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        sup.start()
        first = sup.pid
        assert first is not None and sup.state()["state"] == "running"
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: sup.state()["restarts"] == 1 and sup.running)
    state = sup.state()
    assert state["deaths"] == 1 and state["last_exit"] == "SIGKILL" and state["pid"] not in (None, first)
    assert sleepers.procs[0].returncode == -signal.SIGKILL and reaped(first)  # no zombie left behind
    deaths = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(deaths) == 1
    msg = deaths[0].getMessage()
    assert f"pid {first} died (SIGKILL)" in msg and "restart 1 of 3" in msg and str(log_path) in msg

    second = sleepers.procs[1]
    sup.close(timeout=5)
    assert second.returncode == -signal.SIGTERM and reaped(second.pid)
    time.sleep(3 * FAST.backoff_max_s)
    assert len(sleepers.procs) == 2 and sup.state()["state"] == "stopped"  # close() never restarts
    # both started by the thread that waits on them: PR_SET_PDEATHSIG follows the forking thread
    assert sleepers.threads == ["tidespec-trainer-supervisor"] * 2


def test_a_child_that_keeps_dying_is_given_up_on(caplog: pytest.LogCaptureFixture) -> None:
    children = Children("raise SystemExit(3)")
    gone: list[str] = []
    policy = RestartPolicy(max_restarts=2, backoff_s=0.02, backoff_max_s=0.05, healthy_s=60.0)
    sup = TrainerSupervisor(children, policy, on_give_up=gone.append)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sup.start()
        wait_for(lambda: sup.state()["state"] == "failed")
    state = sup.state()
    assert (state["restarts"], state["deaths"], state["last_exit"], state["pid"]) == (2, 3, "exit 3", None)
    assert gone == ["failed"]
    assert [p.returncode for p in children.procs] == [3, 3, 3] and all(reaped(p.pid) for p in children.procs)
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING, logging.WARNING, logging.ERROR]
    assert "giving up after 2 restarts" in caplog.records[-1].getMessage()
    sup.close()
    assert len(children.procs) == 3


def test_close_interrupts_the_backoff_and_never_restarts() -> None:
    children = Children("raise SystemExit(1)")
    sup = TrainerSupervisor(children, RestartPolicy(backoff_s=30.0, backoff_max_s=30.0)).start()
    wait_for(lambda: sup.state()["state"] == "restarting")
    t0 = time.monotonic()
    sup.close(timeout=5)
    assert time.monotonic() - t0 < 2.0
    assert len(children.procs) == 1 and sup.state()["state"] == "stopped"


def test_a_healthy_run_resets_the_failure_count() -> None:
    """With one restart allowed, a child that runs past ``healthy_s`` before each death is restarted
    again and again; the same child dying at once would be given up on at its second death."""
    children = Children("import time; time.sleep(0.3); raise SystemExit(1)")
    sup = TrainerSupervisor(children, RestartPolicy(max_restarts=1, backoff_s=0.02, healthy_s=0.1)).start()
    try:
        wait_for(lambda: sup.state()["restarts"] >= 2)
        assert sup.state()["state"] != "failed"
    finally:
        sup.close()
        children.kill_all()


def test_a_clean_exit_is_not_restarted_and_a_failed_first_start_raises() -> None:
    children = Children("pass")
    gone: list[str] = []
    sup = TrainerSupervisor(children, FAST, on_give_up=gone.append).start()
    wait_for(lambda: sup.state()["state"] == "exited")
    assert gone == ["exited"] and sup.state()["deaths"] == 0 and sup.state()["last_exit"] == "exit 0"
    sup.close()
    assert len(children.procs) == 1

    def broken() -> subprocess.Popen[bytes]:
        raise FileNotFoundError("no such trainer")

    failing = TrainerSupervisor(broken, FAST)
    with pytest.raises(FileNotFoundError, match="no such trainer"):
        failing.start()
    assert failing.state()["state"] == "failed"


def test_restart_policy() -> None:
    policy = RestartPolicy(backoff_s=1.0, backoff_max_s=60.0)
    assert [policy.delay(n) for n in (1, 2, 3, 6, 7, 10_000)] == [1.0, 2.0, 4.0, 32.0, 60.0, 60.0]
    assert (describe_exit(-9), describe_exit(1), describe_exit(0)) == ("SIGKILL", "exit 1", "exit 0")
    with pytest.raises(ConfigError):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ConfigError):
        RestartPolicy(backoff_s=0.0)


# ----------------------------------------------------------------------------------------------
# wired into online training
# ----------------------------------------------------------------------------------------------


def online_training(tmp_path: Path) -> tuple[LLMEngine, OnlineTraining]:
    """A tiny EAGLE-3 engine with online training attached, collecting all the time."""
    model = tiny_llama(48, layers=8, seed=2, scale=3.0)
    drafter = build_eagle3_drafter(model, None, cfg=Eagle3DrafterConfig(max_num_seqs=2, max_model_len=64,
                                                                         tree_depth=2, tree_top_k=2))
    engine = LLMEngine(model, tiny_tokenizer(48), EngineConfig(cache=CacheConfig(max_model_len=64, max_num_seqs=2),
                                                               spec=SpecConfig(num_speculative_tokens=2)),
                       drafter=drafter)
    cfg = OnlineConfig(publish_root=str(tmp_path / "drafter"), signal_dir=str(tmp_path / "signals"),
                       capture_capacity_rows=1024, capture_flush_rows=64, collection=CollectionConfig(force=True))
    return engine, attach_online_training(engine, cfg, start=False)


def generate(engine: LLMEngine) -> None:
    engine.add_request([5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def test_online_training_shows_a_dead_trainer_and_stops_capture_when_it_is_gone(
        tmp_path: Path, sleepers: Children, caplog: pytest.LogCaptureFixture) -> None:
    engine, online = online_training(tmp_path)
    assert online.state()["trainer"] is None and not online.state()["trainer_running"]
    online.supervise_trainer(sleepers, RestartPolicy(max_restarts=0, backoff_s=0.05))
    st = online.state()
    assert st["trainer_running"] and st["trainer"]["state"] == "running" and st["collection_enabled"]
    generate(engine)
    captured = online.capture.stats()["num_captured"]
    assert captured > 0

    with caplog.at_level(logging.WARNING):
        os.kill(sleepers.procs[0].pid, signal.SIGKILL)
        wait_for(lambda: online.state()["trainer"]["state"] == "failed")
    st = online.state()
    assert not st["trainer_running"] and st["trainer"]["deaths"] == 1 and st["trainer"]["last_exit"] == "SIGKILL"
    assert not st["collection_enabled"]  # nobody would train on them: no more signals
    assert online.health()["trainer"]["state"] == "failed" and not online.health()["collection_enabled"]
    assert any("signal capture stops" in r.getMessage() for r in caplog.records)
    generate(engine)
    assert online.capture.stats()["num_captured"] == captured
    online.close()
    assert online.state()["trainer"]["state"] == "stopped"


def test_health_and_metrics_show_the_trainer_dying_restarting_and_given_up_on(tmp_path: Path,
                                                                              sleepers: Children) -> None:
    """``/health`` stays 200 (serving goes on without training) and says what the trainer does;
    ``/metrics`` has ``trainer_up`` and the death and restart counters."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from tidespec.server.app import ServerConfig, create_app

    def metrics(client: TestClient) -> dict[str, float]:
        fams = text_string_to_metric_families(client.get("/metrics").text)
        return {s.name: s.value for f in fams for s in f.samples
                if s.name.startswith("tidespec:trainer_") and not s.name.endswith("_created")
                and s.name != "tidespec:trainer_paused"}  # no governor here: never paused (test_governor)

    engine, online = online_training(tmp_path)
    online.supervise_trainer(sleepers, RestartPolicy(max_restarts=1, backoff_s=0.05))
    with TestClient(create_app(engine, ServerConfig(served_model_name="tiny"), online=online)) as client:
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["online"]["trainer"]["state"] == "running"
        assert health["online"]["collection_enabled"] and health["online"]["drafter_version"] == 0
        assert metrics(client) == {"tidespec:trainer_up": 1.0, "tidespec:trainer_deaths_total": 0.0,
                                   "tidespec:trainer_restarts_total": 0.0}

        os.kill(sleepers.procs[0].pid, signal.SIGKILL)
        wait_for(lambda: online.state()["trainer"]["restarts"] == 1 and online.state()["trainer_running"])
        assert client.get("/health").json()["online"]["trainer"]["last_exit"] == "SIGKILL"
        assert metrics(client) == {"tidespec:trainer_up": 1.0, "tidespec:trainer_deaths_total": 1.0,
                                   "tidespec:trainer_restarts_total": 1.0}

        os.kill(sleepers.procs[1].pid, signal.SIGKILL)
        wait_for(lambda: online.state()["trainer"]["state"] == "failed")
        r = client.get("/health")
        assert r.status_code == 200
        trainer = r.json()["online"]["trainer"]
        assert (trainer["state"], trainer["deaths"], trainer["restarts"]) == ("failed", 2, 1)
        assert not r.json()["online"]["collection_enabled"]
        assert metrics(client) == {"tidespec:trainer_up": 0.0, "tidespec:trainer_deaths_total": 2.0,
                                   "tidespec:trainer_restarts_total": 1.0}
    online.close()
