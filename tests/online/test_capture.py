"""CaptureBuffer: the hot-path push never blocks, drops are counted, flushed shards read back equal."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import SlowStore
from tidespec.online.capture import CaptureBuffer
from tidespec.online.store import SignalShard, SignalStore

WIDTH = 24  # k*H of the fake taps
SLEEP_S = SlowStore.sleep_s


class FlakyStore:
    """A sink whose first append fails."""

    def __init__(self) -> None:
        self.calls = 0
        self.shards: list[SignalShard] = []

    def append(self, shard: SignalShard) -> str:
        self.calls += 1
        if self.calls == 1:
            raise OSError("disk full")
        self.shards.append(shard)
        return str(self.calls)


def rows(seq_id: int, start: int, n: int) -> dict[str, object]:
    """Push arguments whose values encode (seq_id, position) so read-back can be checked."""
    pos = torch.arange(start, start + n)
    taps = (seq_id * 1000 + pos).to(torch.float32)[:, None] + torch.arange(WIDTH) / 8  # [n, WIDTH]
    return {"seq_id": seq_id, "positions": pos, "token_ids": (pos * 7 + seq_id).tolist(),
            "next_token_ids": pos * 7 + seq_id + 1, "taps": taps}


def concat(shards: list[SignalShard]) -> dict[str, torch.Tensor]:
    return {name: torch.cat([getattr(s, name) for s in shards])
            for name in ("taps", "token_ids", "next_token_ids", "seq_ids", "positions")}


def expected(pushed: list[dict[str, object]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {
        "taps": torch.cat([p["taps"] for p in pushed]).to(dtype),  # type: ignore[misc]
        "token_ids": torch.cat([torch.tensor(p["token_ids"]) for p in pushed]),
        "next_token_ids": torch.cat([p["next_token_ids"] for p in pushed]),  # type: ignore[misc]
        "seq_ids": torch.cat([torch.full((len(p["token_ids"]),), p["seq_id"]) for p in pushed]),  # type: ignore[arg-type]
        "positions": torch.cat([p["positions"] for p in pushed]),  # type: ignore[misc]
    }


def assert_rows_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_push_never_blocks_on_slow_store_and_drops_are_counted(tmp_path: Path) -> None:
    store = SlowStore(tmp_path, byte_budget=1 << 24)
    buf = CaptureBuffer(store, capacity_rows=64, flush_rows=32, taps_dim=WIDTH)
    pushed = [rows(seq_id=i % 5, start=4 * i, n=4) for i in range(100)]
    kept: list[dict[str, object]] = []
    t0 = time.perf_counter()
    for p in pushed:
        if buf.push(**p, domain="code"):  # type: ignore[arg-type]
            kept.append(p)
    elapsed = time.perf_counter() - t0
    # 100 pushes together take far less than one append of the slow store
    assert elapsed < 0.25 * SLEEP_S, f"100 pushes took {elapsed:.3f}s"
    st = buf.stats()
    assert st["num_pushes"] == 100
    assert st["num_dropped"] > 0 and st["num_dropped_pushes"] > 0
    assert st["num_captured"] + st["num_dropped"] == 400
    assert st["num_captured"] == 4 * len(kept) == buf.num_captured
    assert st["num_dropped"] == buf.num_dropped
    buf.close()
    st = buf.stats()
    assert st["num_flushed"] == st["num_captured"] and st["buffered"] == 0 and st["num_flush_errors"] == 0
    shards = [store.read(info.shard_id) for info in store.list_shards()]
    assert all(s.num_signals <= 32 for s in shards)
    assert_rows_equal(concat(shards), expected(kept, torch.bfloat16))
    assert all(s.domain == "code" for s in shards)


def test_ring_wraparound_round_trip_in_memory() -> None:
    buf = CaptureBuffer(None, capacity_rows=10, flush_rows=4, taps_dtype=torch.float32)
    pushed = []
    shards: list[SignalShard] = []
    for i in range(12):  # 36 rows through a 10-row ring
        p = rows(seq_id=i, start=i, n=3)
        assert buf.push(**p)  # type: ignore[arg-type]
        pushed.append(p)
        if i % 2:
            assert buf.flush(timeout=10)
            shards += buf.drain()
    assert buf.flush(timeout=10)
    shards += buf.drain()
    assert sum(s.num_signals for s in shards) == 36 and buf.stats()["num_discarded"] == 0
    assert_rows_equal(concat(shards), expected(pushed, torch.float32))
    buf.close()


def test_partial_shard_flushed_after_max_age() -> None:
    buf = CaptureBuffer(None, capacity_rows=100, flush_rows=50, max_shard_age_s=0.05)
    assert buf.push(**rows(seq_id=1, start=0, n=3))  # type: ignore[arg-type]
    deadline = time.time() + 10
    shards: list[SignalShard] = []
    while not shards and time.time() < deadline:
        time.sleep(0.02)
        shards = buf.drain()
    assert [s.num_signals for s in shards] == [3]
    buf.close()


def test_flush_cuts_partial_shard_and_close_drops_later_pushes() -> None:
    buf = CaptureBuffer(None, capacity_rows=100, flush_rows=8, max_shard_age_s=60)
    assert buf.push(**rows(seq_id=1, start=0, n=10))  # type: ignore[arg-type]
    assert buf.flush(timeout=10)
    assert [s.num_signals for s in buf.drain()] == [8, 2]
    buf.close()
    assert not buf.push(**rows(seq_id=1, start=10, n=2))  # type: ignore[arg-type]
    assert buf.stats()["num_dropped"] == 2


def test_undrained_memory_keeps_newest_shards_within_capacity() -> None:
    buf = CaptureBuffer(None, capacity_rows=10, flush_rows=4)
    for i in range(4):
        assert buf.push(**rows(seq_id=i, start=0, n=4))  # type: ignore[arg-type]
        assert buf.flush(timeout=10)
    shards = buf.drain()
    assert [int(s.seq_ids[0]) for s in shards] == [2, 3] and buf.stats()["num_discarded"] == 8
    buf.close()


def test_push_larger_than_capacity_is_dropped() -> None:
    buf = CaptureBuffer(None, capacity_rows=4, flush_rows=2)
    assert not buf.push(**rows(seq_id=1, start=0, n=5))  # type: ignore[arg-type]
    assert buf.stats()["num_dropped"] == 5 and buf.stats()["num_captured"] == 0
    buf.close()


def test_shards_never_mix_drafter_versions_and_keep_domains() -> None:
    buf = CaptureBuffer(None, capacity_rows=64, flush_rows=64, max_shard_age_s=60)
    buf.push(**rows(seq_id=1, start=0, n=3), domain="code", alpha=0.5)  # type: ignore[arg-type]
    buf.push(**rows(seq_id=2, start=0, n=2), domain="math", alpha=0.25)  # type: ignore[arg-type]
    buf.set_drafter_version(1)
    buf.push(**rows(seq_id=1, start=3, n=4), domain="code")  # type: ignore[arg-type]
    assert buf.flush(timeout=10)
    first, second = buf.drain()
    assert (first.num_signals, first.drafter_version, second.num_signals, second.drafter_version) == (5, 0, 4, 1)
    assert first.domain == "mixed" and first.row_domains() == ["code"] * 3 + ["math"] * 2
    assert second.domain == "code" and second.domains == ["code"]
    assert first.acceptance == {"mean_alpha": pytest.approx(0.4), "num_rows_with_alpha": 5.0}
    assert second.acceptance == {} and torch.isnan(second.alphas).all()
    buf.close()


def test_topk_round_trip(tmp_path: Path) -> None:
    store = SignalStore(tmp_path, byte_budget=1 << 20, taps_dtype="float16")
    buf = CaptureBuffer(store, capacity_rows=16, flush_rows=16, topk=2)
    ids = torch.tensor([[4, 5], [6, 7]])
    logits = torch.tensor([[1.5, 0.5], [2.0, -1.0]])
    p = rows(seq_id=9, start=0, n=2)
    assert buf.push(**p, topk_ids=ids, topk_logits=logits)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="topk"):
        buf.push(**p)  # type: ignore[arg-type]
    buf.close()
    (shard,) = [store.read(i.shard_id) for i in store.list_shards()]
    assert torch.equal(shard.topk_ids, ids) and torch.equal(shard.topk_logits, logits)
    assert torch.equal(shard.taps, p["taps"].to(torch.float16))  # type: ignore[union-attr]
    assert buf.taps_dtype == torch.float16  # follows the store


def test_store_failure_is_counted_and_flusher_survives() -> None:
    sink = FlakyStore()
    buf = CaptureBuffer(sink, capacity_rows=16, flush_rows=4)
    buf.push(**rows(seq_id=1, start=0, n=4))  # type: ignore[arg-type]
    assert buf.flush(timeout=10)
    buf.push(**rows(seq_id=1, start=4, n=4))  # type: ignore[arg-type]
    buf.close()
    st = buf.stats()
    assert (st["num_flush_errors"], st["num_lost"], st["num_flushed"], st["num_shards"]) == (1, 4, 4, 1)
    assert sink.shards[0].positions.tolist() == [4, 5, 6, 7]


def test_push_validation() -> None:
    buf = CaptureBuffer(None, capacity_rows=16, flush_rows=4)
    p = rows(seq_id=1, start=0, n=3)
    with pytest.raises(ValueError, match="shape"):
        buf.push(**{**p, "token_ids": [1, 2]})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="taps"):
        buf.push(**{**p, "taps": torch.zeros(3)})  # type: ignore[arg-type]
    assert buf.push(**p)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="width"):
        buf.push(**{**p, "taps": torch.zeros(3, WIDTH + 1)})  # type: ignore[arg-type]
    buf.close()
    with pytest.raises(ValueError):
        CaptureBuffer(None, capacity_rows=4, flush_rows=8)


def test_concurrent_pushes_and_drain_lose_nothing_that_was_captured() -> None:
    buf = CaptureBuffer(None, capacity_rows=4096, flush_rows=7, max_shard_age_s=0.01)
    collected: list[SignalShard] = []
    stop = threading.Event()

    def consumer() -> None:
        while not stop.is_set():
            collected.extend(buf.drain())
            time.sleep(0.001)

    t = threading.Thread(target=consumer)
    t.start()
    pushed = [rows(seq_id=i, start=0, n=1 + i % 5) for i in range(200)]
    for p in pushed:
        assert buf.push(**p)  # type: ignore[arg-type]
    buf.close()
    stop.set()
    t.join()
    collected.extend(buf.drain())
    assert_rows_equal(concat(collected), expected(pushed, torch.bfloat16))
