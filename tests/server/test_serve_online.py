"""``tidespec serve --online-training`` end to end, through the real command line.

A tiny checkpoint is served with the EAGLE-3 drafter and online training on. Requests are sent
until a response reports a drafter version above 0: the engine captured signals, the trainer
child process (started by ``serve``) trained and published a better head, and the engine swapped
it in between steps. ``/metrics`` must then report that version, and the publish root and signal
store must hold what the two processes wrote. Timing is not asserted beyond a generous deadline.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import torch

from tests.helpers import processes_mentioning, tiny_hf_model, write_tiny_checkpoint
from tidespec.bench.serve.run import free_port, launch_server, stop_server
from tidespec.files import latest_version
from tidespec.online.store import SignalStore


def test_serve_online_training_swaps_in_a_trained_drafter(tmp_path: Path) -> None:
    hf, _ = tiny_hf_model("qwen2", torch.float32)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    root = tmp_path / "drafter"
    port = free_port()
    args = (f"--model {ckpt} --drafter eagle3 --eagle3-dir {root} --online-training --num-speculative-tokens 3 "
            "--collect-n-threshold 300 --online-poll-s 0.5 --threads 1 --max-num-seqs 4 "
            "--trainer-args '--threads 1 --poll-s 0.5 --max-steps 80 --lr 3e-3 --heldout-frac 0.25'")
    proc = launch_server(args, port, None, timeout=120, log_path=tmp_path / "server.log")
    url = f"http://127.0.0.1:{port}"
    versions: list[str] = []
    try:
        deadline = time.monotonic() + 240
        i = 0
        while time.monotonic() < deadline:
            prompt = " ".join(f"w{3 + (i * 7 + j * 3) % 90}" for j in range(6))
            r = httpx.post(f"{url}/v1/completions", json={"model": "ckpt", "prompt": prompt, "max_tokens": 24,
                                                           "temperature": 0, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
            versions.append(r.json()["drafter_version"])
            if versions[-1] != "0":
                break
            i += 1
            if i % 8 == 0:
                time.sleep(2.0)  # serving idle: the trainer, paused while requests run, trains now
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        # the engine can swap a version in once its directory is renamed into place, before the trainer
        # (niced, on a busy CPU) has pointed LATEST at it and logged its round: wait for that log line
        trainer_log = _wait_for_text(root / "trainer.log", "published v1", 60.0)
    finally:
        stop_server(proc)
    log = (tmp_path / "server.log").read_text(encoding="utf-8", errors="replace")
    assert versions[0] == "0" and versions[-1] != "0", (versions, log[-2000:], trainer_log[-2000:])
    version = int(versions[-1])
    assert latest_version(root) is not None and latest_version(root) >= version >= 1
    assert f"tidespec:spec_decode_drafter_version {float(version)}" in metrics
    assert "tidespec:trainer_paused" in metrics
    assert SignalStore(root / "signals", 1 << 30).num_signals() >= 300
    assert "published v1" in trainer_log
    # the trainer child stops with the server (SIGTERM: app shutdown hook; a killed server: PDEATHSIG)
    deadline = time.monotonic() + 20
    while processes_mentioning(str(root)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_mentioning(str(root))



def _wait_for_text(path: Path, text: str, timeout_s: float) -> str:
    """``path``'s text once it contains ``text``, or as it stands after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
        if text in found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)
