"""SignalStore: round trips, atomic appends, oldest-first eviction, one writer + concurrent readers."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

from tidespec.online.store import ShardGone, SignalShard, SignalStore, StoreError, shard_seq


def make_shard(n: int = 6, width: int = 12, fill: float | None = None, topk: int = 0,
               domains: list[str] | None = None, seed: int = 0) -> SignalShard:
    g = torch.Generator().manual_seed(seed)
    taps = torch.full((n, width), fill) if fill is not None else torch.randn(n, width, generator=g)  # [n, k*H]
    doms = domains or ["code"]
    return SignalShard(
        taps=taps,
        token_ids=torch.randint(0, 100, (n,), generator=g),
        next_token_ids=torch.randint(0, 100, (n,), generator=g),
        seq_ids=torch.full((n,), 3, dtype=torch.long),
        positions=torch.arange(n),
        domain_ids=torch.arange(n) % len(doms),
        alphas=torch.linspace(0.0, 1.0, n),
        topk_ids=torch.randint(0, 100, (n, topk), generator=g) if topk else None,
        topk_logits=torch.randn(n, topk, generator=g) if topk else None,
        domains=doms,
        drafter_version=2,
        acceptance={"mean_alpha": 0.5},
    )


def test_round_trip_bfloat16_default(tmp_path: Path) -> None:
    store = SignalStore(tmp_path, byte_budget=1 << 20)
    shard = make_shard(topk=3, domains=["code", "math"])
    sid = store.append(shard)
    back = store.read(sid)
    assert back.taps.dtype == torch.bfloat16
    assert torch.equal(back.taps, shard.taps.to(torch.bfloat16))
    for name in ("token_ids", "next_token_ids", "seq_ids", "positions", "domain_ids", "topk_ids"):
        assert torch.equal(getattr(back, name), getattr(shard, name)), name
    assert torch.allclose(back.alphas, shard.alphas)
    assert torch.allclose(back.topk_logits, shard.topk_logits)
    assert back.domains == ["code", "math"] and back.domain == "mixed"
    assert back.row_domains() == ["code", "math"] * 3
    assert back.drafter_version == 2 and back.acceptance == {"mean_alpha": 0.5}
    assert back.wall_time > 0
    assert store.num_signals() == 6 and store.total_bytes() == os.path.getsize(tmp_path / f"{sid}.safetensors")


@pytest.mark.parametrize("dtype,torch_dtype", [("float16", torch.float16), ("float32", torch.float32)])
def test_taps_dtype_configurable(tmp_path: Path, dtype: str, torch_dtype: torch.dtype) -> None:
    store = SignalStore(tmp_path, byte_budget=1 << 20, taps_dtype=dtype)
    shard = make_shard()
    back = store.read(store.append(shard))
    assert back.taps.dtype == torch_dtype
    assert torch.equal(back.taps, shard.taps.to(torch_dtype))
    assert back.topk_ids is None and back.topk_logits is None


def test_bfloat16_halves_bytes(tmp_path: Path) -> None:
    big = make_shard(n=64, width=256)
    b32 = SignalStore(tmp_path / "a", 1 << 24, taps_dtype="float32")
    b16 = SignalStore(tmp_path / "b", 1 << 24)
    b32.append(big)
    b16.append(big)
    assert b16.total_bytes() < 0.55 * b32.total_bytes()


def test_list_since_id_and_time(tmp_path: Path) -> None:
    store = SignalStore(tmp_path, byte_budget=1 << 20)
    ids = [store.append(make_shard(seed=i)) for i in range(4)]
    assert [shard_seq(i) for i in ids] == [0, 1, 2, 3]
    assert [s.shard_id for s in store.list_shards()] == ids
    assert [s.shard_id for s in store.list_shards(since=ids[1])] == ids[2:]
    assert store.list_shards(since=ids[3]) == []
    t1 = store.list_shards()[1].wall_time
    assert [s.shard_id for s in store.list_shards(since=t1)] == [i for i, s in zip(ids, store.list_shards())
                                                                 if s.wall_time > t1]
    info = store.list_shards()[0]
    assert info.num_signals == 6 and info.domain == "code" and info.drafter_version == 2


def test_explicit_wall_time_kept(tmp_path: Path) -> None:
    store = SignalStore(tmp_path, byte_budget=1 << 20)
    shard = make_shard()
    shard.wall_time = 1234.5
    sid = store.append(shard)
    assert store.list_shards()[0].wall_time == 1234.5
    assert store.read(sid).wall_time == 1234.5
    assert store.list_shards(since=1234.5) == [] and len(store.list_shards(since=1000.0)) == 1


def test_oldest_first_eviction_and_shard_gone(tmp_path: Path) -> None:
    probe = SignalStore(tmp_path / "probe", byte_budget=1 << 20)
    probe.append(make_shard())
    one = probe.total_bytes()
    store = SignalStore(tmp_path / "s", byte_budget=3 * one + one // 2)  # room for 3 shards
    ids = [store.append(make_shard(seed=i)) for i in range(5)]
    assert [s.shard_id for s in store.list_shards()] == ids[2:]
    assert store.total_bytes() <= store.byte_budget and store.num_signals() == 18
    with pytest.raises(ShardGone):
        store.read(ids[0])
    assert not (tmp_path / "s" / f"{ids[0]}.safetensors").exists()
    # listed, then evicted before reading: iter_shards skips it
    listed = store.list_shards()
    store.append(make_shard(seed=9))
    got = [info.shard_id for info in listed if info.shard_id in {i.shard_id for i, _ in store.iter_shards()}]
    assert got == ids[3:]


def test_oversized_shard_rejected(tmp_path: Path) -> None:
    store = SignalStore(tmp_path, byte_budget=256)
    with pytest.raises(ValueError, match="byte_budget"):
        store.append(make_shard(n=64, width=64))
    assert store.list_shards() == [] and [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []


def test_appends_leave_no_temp_files_and_valid_manifest(tmp_path: Path) -> None:
    store = SignalStore(tmp_path, byte_budget=1 << 20)
    for i in range(3):
        store.append(make_shard(seed=i))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in names if n.startswith(".tmp-")]
    doc = json.loads((tmp_path / "manifest.json").read_text())
    assert doc["next_seq"] == 3 and len(doc["shards"]) == 3
    # a half-written temp file (a crashed writer) is never listed, and cleanup removes it once old
    (tmp_path / ".tmp-deadbeef.safetensors").write_bytes(b"partial")
    assert len(store.list_shards()) == 3
    assert store.cleanup_orphans(min_age_s=3600) == 0
    assert store.cleanup_orphans(min_age_s=0.0) == 1
    assert len(store.list_shards()) == 3


def test_reopen_existing_store(tmp_path: Path) -> None:
    sid = SignalStore(tmp_path, byte_budget=1 << 20).append(make_shard())
    again = SignalStore(tmp_path, byte_budget=1 << 20)
    assert [s.shard_id for s in again.list_shards()] == [sid]
    assert shard_seq(again.append(make_shard())) == 1


def test_corrupt_manifest_raises(tmp_path: Path) -> None:
    store = SignalStore(tmp_path, byte_budget=1 << 20)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(StoreError):
        store.list_shards()


def test_shard_validation() -> None:
    good = make_shard()
    with pytest.raises(ValueError, match="token_ids"):
        SignalShard(taps=good.taps, token_ids=good.token_ids[:2], next_token_ids=good.next_token_ids,
                    seq_ids=good.seq_ids, positions=good.positions)
    with pytest.raises(ValueError, match="domain_ids"):
        SignalShard(taps=good.taps, token_ids=good.token_ids, next_token_ids=good.next_token_ids,
                    seq_ids=good.seq_ids, positions=good.positions, domain_ids=torch.full((6,), 1), domains=["a"])
    with pytest.raises(ValueError, match="together"):
        SignalShard(taps=good.taps, token_ids=good.token_ids, next_token_ids=good.next_token_ids,
                    seq_ids=good.seq_ids, positions=good.positions, topk_ids=torch.zeros(6, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="taps"):
        SignalShard(taps=torch.zeros(6), token_ids=good.token_ids, next_token_ids=good.next_token_ids,
                    seq_ids=good.seq_ids, positions=good.positions)
    with pytest.raises(ValueError):
        SignalStore(Path("/tmp"), byte_budget=0)


def _writer(root: str, budget: int, num: int) -> None:
    store = SignalStore(Path(root), byte_budget=budget)
    for i in range(num):
        store.append(make_shard(n=8, width=32, fill=float(i), seed=i))


def test_one_writer_several_readers(tmp_path: Path) -> None:
    """A writer process appends with a tiny budget (constant eviction) while this process reads:
    every read is either a complete, self-consistent shard or ShardGone."""
    store = SignalStore(tmp_path, byte_budget=1 << 20)
    store.append(make_shard(n=8, width=32, fill=-1.0))
    one = store.total_bytes()
    proc = multiprocessing.get_context("fork").Process(target=_writer, args=(str(tmp_path), 2 * one + one // 2, 40))
    proc.start()
    reads = gone = 0
    deadline = time.time() + 60
    while proc.is_alive() and time.time() < deadline:
        for info in store.list_shards():
            try:
                shard = store.read(info.shard_id)
            except ShardGone:
                gone += 1
                continue
            reads += 1
            assert shard.num_signals == 8 == info.num_signals
            assert torch.all(shard.taps == shard.taps[0, 0])  # never a torn or mixed shard
    proc.join(60)
    assert proc.exitcode == 0
    assert reads > 0
    final = store.list_shards()
    assert len(final) == 2 and store.total_bytes() <= 2 * one + one // 2
    assert [float(store.read(s.shard_id).taps[0, 0]) for s in final] == [38.0, 39.0]


def test_views_of_one_tensor_are_stored(tmp_path: Path) -> None:
    """Per-row tensors that are views of one buffer (token ids and their successors sliced from
    one sequence; taps sliced from a bigger capture buffer) are stored: safetensors refuses
    tensors that share memory, so the store copies views into storage of their own."""
    seq = torch.arange(20, 27)  # [7] one sequence's tokens
    big = torch.randn(10, 12)  # [10, k*H] a capture buffer; rows 2..7 are this shard's
    shard = SignalShard(taps=big[2:8], token_ids=seq[:-1], next_token_ids=seq[1:],
                        seq_ids=torch.zeros(6, dtype=torch.long), positions=torch.arange(6))
    store = SignalStore(tmp_path, byte_budget=1 << 20, taps_dtype="float32")
    back = store.read(store.append(shard))
    assert torch.equal(back.token_ids, seq[:-1]) and torch.equal(back.next_token_ids, seq[1:])
    assert torch.equal(back.taps, big[2:8])
    pos = torch.arange(6)  # one tensor given for two fields (tokens equal to their positions)
    same = SignalShard(taps=big[2:8], token_ids=pos, next_token_ids=pos + 1, seq_ids=torch.zeros(6, dtype=torch.long),
                       positions=pos)
    back = store.read(store.append(same))
    assert torch.equal(back.token_ids, pos) and torch.equal(back.positions, pos)
