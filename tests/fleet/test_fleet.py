"""``tidespec fleet`` end to end on a local Ray cluster: 2 replicas + 1 trainer behind one ingress.

Through the real command line and a third-party client (the OpenAI SDK, which retries): a trace
that shifts between two kinds of prompts runs until both replicas report the same drafter version
above 0 (the trainer read both replicas' signals from the one store and published it; each
replica swapped it in); every output equals plain decoding of its prompt alone, before, during and
after the swaps; then one replica is killed (SIGKILL) mid-trace: no request is lost (the client
retries), and Ray Serve brings up a new replica, which serves the published version; then the
trainer is killed, and Ray Serve starts a new one (with a new trainer child). Needs Ray
(``make test-fleet``); ``make test`` leaves it out.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers import processes_mentioning, tiny_hf_model, write_tiny_checkpoint
from tidespec.bench.serve.run import free_port
from tidespec.config import EngineConfig, ModelConfig
from tidespec.files import latest_version
from tidespec.llm import LLM
from tidespec.online.store import SignalStore
from tidespec.sampling import SamplingParams

pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.fleet

MAX_TOKENS = 24
REPLICA_PROC = "ServeReplica:tidespec:FleetReplica"  # Ray's process titles of a replica, of the trainer
TRAINER_PROC = "ServeReplica:tidespec:FleetTrainer"


def _trainer_children(root: Path) -> list[int]:
    """Pids of ``train-drafter`` children publishing into ``root``."""
    return [p for p in processes_mentioning(str(root)) if p in processes_mentioning("train-drafter")]


def _prompt(i: int) -> str:
    """Request ``i`` of the trace: two kinds of prompts, the kind switching every 16 requests."""
    base = 3 if (i // 16) % 2 == 0 else 50
    return " ".join(f"w{base + (i * 7 + j * 3) % 40}" for j in range(6))


class Trace:
    """Sends the trace through the ingress and checks every output against plain decoding."""

    def __init__(self, url: str, plain: LLM) -> None:
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=8, timeout=60)
        self.plain = plain
        self.expected: dict[str, str] = {}
        self.latest: dict[str, int] = {}  # replica -> drafter version of its last response
        self.sent = 0

    def send(self) -> tuple[str, int]:
        prompt = _prompt(self.sent)
        self.sent += 1
        raw = self.client.completions.with_raw_response.create(
            model="ckpt", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        body = raw.http_response.json()
        replica, version = raw.headers["x-tidespec-replica"], int(body["drafter_version"])
        if prompt not in self.expected:
            self.expected[prompt] = self.plain.generate([prompt], SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0].text
        assert body["choices"][0]["text"] == self.expected[prompt], (self.sent, replica, version)
        self.latest[replica] = version
        return replica, version

    def until(self, done, deadline_s: float, what: str) -> None:
        deadline = time.monotonic() + deadline_s
        while not done():
            assert time.monotonic() < deadline, f"{what}: not within {deadline_s} s ({self.latest}, {self.sent} sent)"
            self.send()


def test_fleet_trains_one_drafter_for_both_replicas_and_survives_a_replica_kill(tmp_path: Path) -> None:
    hf, _ = tiny_hf_model("qwen2", torch.float32)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    root = tmp_path / "drafter"
    plain = LLM(EngineConfig(model=ModelConfig(model=str(ckpt), threads=1)))
    args = ["--model", str(ckpt), "--drafter", "eagle3", "--eagle3-dir", str(root), "--online-training",
            "--num-speculative-tokens", "3", "--collect-n-threshold", "300", "--online-poll-s", "0.5",
            "--threads", "1", "--max-num-seqs", "4", "--health-check-s", "2",
            "--trainer-args", "--threads 1 --poll-s 0.5 --max-steps 80 --lr 3e-3 --heldout-frac 0.25"]
    with running_fleet(args, tmp_path) as url:
        trace = Trace(url, plain)
        # 1. learning: both replicas serve the same drafter version above 0
        trace.until(lambda: len(trace.latest) == 2 and len(set(trace.latest.values())) == 1
                    and min(trace.latest.values()) >= 1, 300, "both replicas on one new version")
        version = min(trace.latest.values())
        first = set(trace.latest)
        # 2. a replica dies mid-trace: the client's retries lose nothing, Ray brings a new one up
        victims = processes_mentioning(REPLICA_PROC)
        assert len(victims) == 2, victims
        os.kill(victims[0], signal.SIGKILL)
        for _ in range(8):
            trace.send()
        trace.until(lambda: bool(set(trace.latest) - first), 180, "a new replica after the kill")
        newcomer = (set(trace.latest) - first).pop()
        assert trace.latest[newcomer] >= version  # it loaded the published version when it started
        assert len(processes_mentioning(REPLICA_PROC)) == 2
        for _ in range(8):
            trace.send()
        # 3. the trainer dies: Ray Serve starts a new one, with a new trainer child; serving goes on
        trainers, children = processes_mentioning(TRAINER_PROC), set(_trainer_children(root))
        assert len(trainers) == 1 and children, (trainers, children)
        os.kill(trainers[0], signal.SIGKILL)
        trace.until(lambda: processes_mentioning(TRAINER_PROC) not in ([], trainers)
                    and bool(set(_trainer_children(root)) - children), 180, "a new trainer after the kill")
    assert latest_version(root) is not None and latest_version(root) >= version
    assert "published v1" in (root / "trainer.log").read_text(encoding="utf-8", errors="replace")
    # both replicas captured into the one store: rows of two serving processes (distinct salts)
    store = SignalStore(root / "signals", 1 << 30)
    salts = {int(s) >> 40 for info in store.list_shards() for s in store.read(info.shard_id).seq_ids.unique()}
    assert len(salts) >= 2, salts


def test_fleet_ingress_has_the_servers_routes_errors_and_streams(tmp_path: Path) -> None:
    """Without online training: two replicas, no trainer; the ingress answers as ``tidespec serve``
    does (OpenAI error objects, server-sent events, an API key) and both replicas serve."""
    hf, _ = tiny_hf_model("qwen2", torch.float32)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    args = ["--model", str(ckpt), "--drafter", "ngram", "--threads", "1", "--max-num-seqs", "4", "--api-key", "k"]
    with running_fleet(args, tmp_path) as url:
        auth = {"Authorization": "Bearer k"}
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
        bad = httpx.post(f"{url}/v1/completions", headers=auth, timeout=30,
                         json={"model": "ckpt", "prompt": "w3", "max_tokens": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=60)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="w3", max_tokens=2)
        stream = client.completions.create(model="ckpt", prompt="w3 w4", max_tokens=6, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
        replicas = {httpx.get(f"{url}/health", timeout=30).headers["x-tidespec-replica"] for _ in range(40)}
        assert len(replicas) == 2


@contextmanager
def running_fleet(args: list[str], tmp_path: Path) -> Iterator[str]:
    """``tidespec fleet --replicas 2 ARGS`` on a free port, its ingress URL once /health answers;
    SIGTERM on exit, which must end it with status 0 and take its replicas with it."""
    port = free_port()
    cmd = [sys.executable, "-m", "tidespec.fleet.cli", "fleet", "--replicas", "2", "--port", str(port), *args]
    log_path = tmp_path / "fleet.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc, log_path)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
    deadline = time.monotonic() + 30
    while processes_mentioning(REPLICA_PROC) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_mentioning(REPLICA_PROC), "replicas outlived the fleet"


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 240) -> None:
    """Until /health answers 200 through the ingress; fails with the log's tail if the fleet exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise AssertionError("the fleet did not become ready: " + log_path.read_text(errors="replace")[-3000:])
