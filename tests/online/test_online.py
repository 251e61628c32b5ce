"""Online EAGLE-3 glue: capture rows are the right (position, token, label, taps), capture never
blocks the engine, drafter versions swap in between steps losslessly, bad versions are refused."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import SlowStore, tiny_llama
from tidespec.config import CacheConfig, CollectionConfig, EngineConfig, OnlineTrainingConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.engine.observer import Hooks
from tidespec.files import LATEST_NAME, latest_version
from tidespec.models.eagle3.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    DrafterCheckpointError,
    export_eagle3,
    fresh_head,
    is_seed,
    load_version,
    publish,
    seed_root,
)
from tidespec.models.eagle3.head import Eagle3Head
from tidespec.models.families.decoder import DecoderModel
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.online.capture import CaptureBuffer
from tidespec.online.collection import SelectiveCollector
from tidespec.online.serving.attach import OnlineConfig, OnlineConfigError, attach_online_training, budget_shortfall
from tidespec.online.signals import TRAINER_STATE_NAME, SignalCollector
from tidespec.online.store import SignalShard, SignalStore
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.eagle3 import Eagle3DrafterConfig, build_eagle3_drafter
from tidespec.speculative.drafters.eagle3_options import Eagle3Options
from tidespec.speculative.policy.static import StaticPolicy
from tidespec.stats import RequestStats

V = 48
LAYERS = 8  # EAGLE-3 taps (2, 4, 5): distinct without the tiny-model fallback
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15, 16, 12, 13, 14], [3, 3, 3, 3]]
MAX_TOKENS = 20
SLEEP_S = SlowStore.sleep_s


def make_engine(model: DecoderModel, tok, drafter=None, gamma: int = 3, tree: bool = False,
                slots: int = 4) -> LLMEngine:
    cfg = EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=slots),
                       spec=SpecConfig(num_speculative_tokens=gamma if drafter is not None else 0, tree=tree))
    return LLMEngine(model, tok, cfg, drafter=drafter)


def drafter_cfg() -> Eagle3DrafterConfig:
    return Eagle3DrafterConfig(max_num_seqs=4, max_model_len=96, tree_depth=3, tree_top_k=2)


def run(engine: LLMEngine, prompts: list[list[int]], labels: list[str | None] | None = None,
        between=None) -> tuple[list[list[int]], int]:
    """Greedy outputs in prompt order and the number of draft tokens; ``between(step)`` runs
    after every step."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    labels = labels or [None] * len(prompts)
    ids = [engine.add_request(p, params, label=lab) for p, lab in zip(prompts, labels)]
    done: dict[str, list[int]] = {}
    drafted = 0
    step = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
                drafted += o.stats.num_draft_tokens
        step += 1
        if between is not None:
            between(step)
    return [done[i] for i in ids], drafted


@pytest.fixture(scope="module")
def plain(model: DecoderModel, tok) -> list[list[int]]:
    return run(make_engine(model, tok), PROMPTS)[0]


def random_head(model: DecoderModel, seed: int, draft_vocab: int | None = None) -> Eagle3Head:
    head = fresh_head(model.cfg, draft_vocab, model.dtype, seed=seed)
    with torch.no_grad():  # larger weights: drafts depend visibly on the inputs
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(seed))
    return head


def full_taps(model: DecoderModel, ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """[len, 3H] target taps of a whole sequence in one prefill."""
    kv = KVCache.for_model(model.cfg, 1, 128, model.dtype)
    out = model(torch.tensor(ids), BatchLayout.build([len(ids)], [0], [0]), kv, tap_layers=layers)
    assert out.taps is not None
    return out.taps


def rows_of(shards: list[SignalShard]) -> dict[str, torch.Tensor]:
    return {n: torch.cat([getattr(s, n) for s in shards])
            for n in ("taps", "token_ids", "next_token_ids", "seq_ids", "positions")}


# ----------------------------------------------------------------------------------------------
# capture
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capture_prompt", [True, False])
def test_capture_pushes_position_token_label_and_taps(model: DecoderModel, tok, capture_prompt: bool) -> None:
    drafter = build_eagle3_drafter(model, None, cfg=drafter_cfg())
    engine = make_engine(model, tok, drafter)
    buf = CaptureBuffer(None, 4096, 64, taps_dtype=torch.float64)
    collector = SignalCollector(engine, buf, SelectiveCollector(CollectionConfig(force=True)),
                                capture_prompt=capture_prompt, salt=3)
    collector.hook_into(engine)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    outs, drafted = run(engine, prompts, labels=["code", "chat"])
    assert drafted > 0
    buf.flush()
    shards = buf.drain()
    rows = rows_of(shards)
    assert set(rows["seq_ids"].tolist()) == {3 << 40 | 0, 3 << 40 | 1}
    assert {d for s in shards for d in s.row_domains()} == {"code", "chat"}
    for k, (prompt, out) in enumerate(zip(prompts, outs)):
        full = prompt + out
        mine = rows["seq_ids"] == (3 << 40 | k)
        pos = rows["positions"][mine]
        order = pos.argsort()
        pos = pos[order]
        toks, labels, taps = rows["token_ids"][mine][order], rows["next_token_ids"][mine][order], rows["taps"][mine][order]
        first = 0 if capture_prompt else len(prompt) - 1
        # every final position exactly once, up to the last step before the request finished
        assert pos.tolist() == list(range(first, first + len(pos)))
        assert len(pos) >= MAX_TOKENS - 5
        assert toks.tolist() == [full[p] for p in pos.tolist()]
        assert labels.tolist() == [full[p + 1] for p in pos.tolist()]
        assert torch.allclose(taps, full_taps(model, full, drafter.tap_layers)[pos], atol=1e-9)
    # hand-checked: the prefill of request 0 ([5, 6, 7, 8] -> first output token o0)
    mine = rows["seq_ids"] == (3 << 40)
    by_pos = {int(p): (int(t), int(lab)) for p, t, lab in
              zip(rows["positions"][mine], rows["token_ids"][mine], rows["next_token_ids"][mine])}
    o0 = outs[0][0]
    if capture_prompt:
        assert [by_pos[p] for p in range(4)] == [(5, 6), (6, 7), (7, 8), (8, o0)]
    else:
        assert 2 not in by_pos and by_pos[3] == (8, o0)


def test_no_capture_while_collection_is_off(model: DecoderModel, tok) -> None:
    engine = make_engine(model, tok, build_eagle3_drafter(model, None, cfg=drafter_cfg()))
    buf = CaptureBuffer(None, 1024, 64)
    selective = SelectiveCollector(CollectionConfig(n_init=1))  # off until a shift is detected
    collector = SignalCollector(engine, buf, selective)
    collector.hook_into(engine)
    run(engine, PROMPTS[:2])
    assert buf.num_captured == 0 and collector.num_skipped_rows > 0
    assert selective.state()["num_requests"] == 2  # both requests drafted and fed their acceptance


def test_the_collector_follows_the_learned_drafters_own_acceptance(model: DecoderModel, tok) -> None:
    """Beside the suffix drafter a request's served acceptance is mostly suffix's: Algorithm 1 (and the
    alpha stored with the rows, which judges a round) reads the learned drafter's own, and a request it
    drafted nothing for tells it nothing."""
    engine = make_engine(model, tok, build_eagle3_drafter(model, None, cfg=drafter_cfg()))
    selective = SelectiveCollector(CollectionConfig(n_init=1))
    collector = SignalCollector(engine, CaptureBuffer(None, 1024, 64), selective, learned="eagle3")
    mixed = RequestStats()
    for drafter, drafted, kept in (("suffix", 4, 4), ("suffix", 4, 4), ("eagle3", 2, 0)):
        mixed.add_accepted(drafted, kept, drafter)
    assert mixed.acceptance() == 0.8 and mixed.acceptance("eagle3") == 0.0 and mixed.acceptance("medusa") is None
    suffix_only = RequestStats()
    suffix_only.add_accepted(4, 4, "suffix")
    for stats in (mixed, suffix_only):
        collector.on_finish(SimpleNamespace(stats=stats))  # type: ignore[arg-type]
    assert selective.state()["num_requests"] == 1 and selective.state()["alpha_short"] == 0.0


def test_capture_never_blocks_the_engine_with_a_slow_store(model: DecoderModel, tok, tmp_path: Path) -> None:
    def step_times(with_capture: bool) -> tuple[list[float], CaptureBuffer | None]:
        engine = make_engine(model, tok, build_eagle3_drafter(model, None, cfg=drafter_cfg()))
        buf = None
        if with_capture:
            buf = CaptureBuffer(SlowStore(tmp_path / "sig", 1 << 30), 48, 16, taps_dim=3 * model.cfg.hidden_size)
            SignalCollector(engine, buf, SelectiveCollector(CollectionConfig(force=True))).hook_into(engine)
        times: list[float] = []
        engine.add_observer(Hooks(step_end=lambda s: times.append(s.total_time)))
        run(engine, PROMPTS * 2)
        return times, buf

    base, _ = step_times(False)
    slow, buf = step_times(True)
    assert buf is not None
    stats = buf.stats()
    assert stats["num_dropped"] > 0  # the ring filled while the store was sleeping
    assert stats["num_captured"] > 0
    # a blocking push would put SLEEP_S into several steps; allow generous scheduling noise
    p90 = sorted(slow)[int(0.9 * len(slow))]
    assert p90 < SLEEP_S / 2, (p90, statistics.median(base))
    assert statistics.median(slow) < 3 * statistics.median(base) + 0.02
    buf.close()


# ----------------------------------------------------------------------------------------------
# drafter versions
# ----------------------------------------------------------------------------------------------


def online_cfg(tmp_path: Path) -> OnlineConfig:
    return OnlineConfig(publish_root=str(tmp_path / "drafter"), signal_dir=str(tmp_path / "signals"),
                        capture_capacity_rows=2048, capture_flush_rows=64,
                        collection=CollectionConfig(force=True))


@pytest.mark.parametrize("tree,quantization", [(False, "none"), (True, "none"), (False, "int8")])
def test_greedy_equals_plain_across_a_drafter_swap(model: DecoderModel, tok, plain: list[list[int]],
                                                   tmp_path: Path, tree: bool, quantization: str) -> None:
    """int8: the poller builds the new version's drafting copy; the swap installs that very copy."""
    cfg = online_cfg(tmp_path)
    assert publish(cfg.publish_root, random_head(model, 1), {"note": "v1"}) == 1
    drafter = build_eagle3_drafter(model, cfg.publish_root,
                                   cfg=dataclasses.replace(drafter_cfg(), quantization=quantization))
    assert drafter.version == 1
    engine = make_engine(model, tok, drafter, gamma=4, tree=tree)
    heard: list[str] = []  # what the policy is told (``policy.api.drafter_changed``)
    engine.policy = StaticPolicy(4)
    engine.policy.drafter_changed = heard.append  # type: ignore[attr-defined]
    online = attach_online_training(engine, cfg, start=False)
    swapped_at: list[int] = []
    prepared: list[object] = []

    def between(step: int) -> None:
        if step == 4:  # mid-generation: publish v2, the poller loads it, the next step swaps it in
            publish(cfg.publish_root, random_head(model, 2), {"note": "v2"})
            assert online.updater.poll_once() == 2
            assert drafter.version == 1  # not yet: only between steps
            prepared.append(online.updater._pending_served)
        if drafter.version == 2 and not swapped_at:
            swapped_at.append(step)
            assert engine.has_unfinished_requests()

    outs, drafted = run(engine, PROMPTS, between=between)
    assert outs == plain
    assert drafted > 0
    assert swapped_at == [5] and heard == ["eagle3"]
    assert drafter.served is (prepared[0] if quantization != "none" else drafter.head) and drafter.served is not None
    state = online.state()
    assert state["drafter_version"] == 2 and state["swaps"] == 1 and state["collection_enabled"]
    assert state["captured"] > 0 and state["dropped"] == 0
    online.close()
    store = SignalStore(cfg.signal_dir, 1 << 30)
    assert {i.drafter_version for i in store.list_shards()} == {1, 2}  # shards never mix versions


def test_background_poller_swaps_without_help(model: DecoderModel, tok, tmp_path: Path) -> None:
    cfg = online_cfg(tmp_path)
    cfg.poll_s = 0.02
    engine = make_engine(model, tok, build_eagle3_drafter(model, cfg.publish_root, cfg=drafter_cfg()))
    online = attach_online_training(engine, cfg)
    assert online.drafter.version == 0
    publish(cfg.publish_root, random_head(model, 5), {})
    deadline = time.monotonic() + 10
    while online.drafter.version != 1 and time.monotonic() < deadline:
        engine.step()  # an idle step still runs the between-steps hooks
        time.sleep(0.01)
    assert online.drafter.version == 1
    online.close()


def serving_version_1(model: DecoderModel, tok, tmp_path: Path):  # -> (root, drafter, engine, OnlineTraining)
    """An engine serving drafter version 1 from a fresh publish root, its updater not polling by itself."""
    cfg = online_cfg(tmp_path)
    root = Path(cfg.publish_root)
    publish(root, random_head(model, 1), {})
    drafter = build_eagle3_drafter(model, root, cfg=drafter_cfg())
    engine = make_engine(model, tok, drafter, gamma=4)
    return root, drafter, engine, attach_online_training(engine, cfg, start=False)


def test_partial_and_invalid_versions_are_refused_and_serving_continues(
        model: DecoderModel, tok, plain: list[list[int]], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root, drafter, engine, online = serving_version_1(model, tok, tmp_path)
    up = online.updater

    # a trainer killed mid-write leaves a temp dir: never considered
    partial = root / ".tmp-v2-deadbeef"
    export_eagle3(random_head(model, 2), partial)
    (partial / WEIGHTS_NAME).write_bytes((partial / WEIGHTS_NAME).read_bytes()[:100])
    assert up.poll_once() is None and drafter.version == 1

    # a complete-looking v2 whose weights file is truncated (copied by hand, disk full, ...)
    shutil.copytree(partial, root / "v2")
    (root / LATEST_NAME).write_text("2\n")
    # a v3 for another target (hidden size 16)
    other = tiny_llama(V, layers=LAYERS, hidden_size=16, head_dim=4)
    export_eagle3(fresh_head(other.cfg, None, torch.float64), root / "v3")
    # a v4 with non-finite weights
    bad = random_head(model, 4)
    with torch.no_grad():
        bad.fc.weight[0, 0] = float("nan")
    export_eagle3(bad, root / "v4")
    (root / LATEST_NAME).write_text("4\n")
    with caplog.at_level(logging.WARNING, logger="tidespec.online.serving.attach"):
        for version in (2, 3, 4):
            (root / LATEST_NAME).write_text(f"{version}\n")
            assert up.poll_once() is None
    assert sorted(up.refused) == [2, 3, 4]
    for version, reason in ((2, "unreadable"), (3, "hidden_size"), (4, "non-finite")):
        assert any(f"refusing EAGLE-3 drafter version {version}" in r.getMessage() and reason in r.getMessage()
                   for r in caplog.records), version
    outs, _ = run(engine, PROMPTS)
    assert outs == plain and drafter.version == 1  # still serving v1

    # a good v5 after the bad ones is accepted
    assert publish(root, random_head(model, 5), {}) == 5
    assert up.poll_once() == 5
    engine.step()
    assert drafter.version == 5
    online.close()

    # at start-up: a root whose only versions are invalid -> logged, fresh head; a bad plain dir -> error
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tidespec.online.serving.attach"):
        shutil.rmtree(root / "v1")
        shutil.rmtree(root / "v5")
        (root / LATEST_NAME).unlink()
        fresh = build_eagle3_drafter(model, root, cfg=drafter_cfg())
    assert fresh.version == 0
    assert sum("refusing EAGLE-3 drafter version" in r.getMessage() for r in caplog.records) == 3
    with pytest.raises(DrafterCheckpointError, match="non-finite"):
        build_eagle3_drafter(model, root / "v4", cfg=drafter_cfg())


def test_a_version_refused_while_half_copied_is_taken_once_its_files_arrive(
        model: DecoderModel, tok, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A v2 copied by hand (or over a slow network) is polled before its weights are complete: it is
    refused once, not re-logged while nothing changes, and loaded once the rest of the weights lands.
    A newer valid version supersedes a refused one for good."""
    root, drafter, engine, online = serving_version_1(model, tok, tmp_path)
    up = online.updater
    full = tmp_path / "full-v2"
    export_eagle3(random_head(model, 2), full)
    weights = (full / WEIGHTS_NAME).read_bytes()

    (root / "v2").mkdir()
    shutil.copy(full / CONFIG_NAME, root / "v2" / CONFIG_NAME)
    (root / "v2" / WEIGHTS_NAME).write_bytes(weights[:len(weights) // 2])  # the copy is half way
    (root / LATEST_NAME).write_text("2\n")
    with caplog.at_level(logging.WARNING, logger="tidespec.online.serving.attach"):
        assert up.poll_once() is None and up.poll_once() is None
    assert sorted(up.refused) == [2] and online.state()["refused_versions"] == [2]
    assert sum("refusing EAGLE-3 drafter version 2" in r.getMessage() for r in caplog.records) == 1

    (root / "v2" / WEIGHTS_NAME).write_bytes(weights)  # the copy completes
    assert up.poll_once() == 2
    engine.step()
    assert drafter.version == 2 and up.refused == {}

    # a refused v3 superseded by a valid v4 is not taken when its files arrive later
    (root / "v3").mkdir()
    shutil.copy(full / CONFIG_NAME, root / "v3" / CONFIG_NAME)
    (root / LATEST_NAME).write_text("3\n")
    assert up.poll_once() is None and sorted(up.refused) == [3]
    assert publish(root, random_head(model, 4), {}) == 4
    assert up.poll_once() == 4
    engine.step()
    shutil.copy(full / WEIGHTS_NAME, root / "v3" / WEIGHTS_NAME)
    (root / LATEST_NAME).write_text("3\n")  # even pointed at again
    assert up.poll_once() is None
    engine.step()
    assert drafter.version == 4
    online.close()


def test_trainer_rounds_drive_selective_collection(model: DecoderModel, tok, tmp_path: Path) -> None:
    cfg = online_cfg(tmp_path)
    cfg.collection = CollectionConfig(bootstrap=True)
    engine = make_engine(model, tok, build_eagle3_drafter(model, None, cfg=drafter_cfg()))
    online = attach_online_training(engine, cfg, start=False)
    assert online.state()["collection_enabled"]
    root = Path(cfg.publish_root)
    root.mkdir(parents=True, exist_ok=True)
    (root / TRAINER_STATE_NAME).write_text(
        '{"last_shard_id": null, "rounds": [{"round": 1, "alpha_train": 0.1, "alpha_eval": 0.3}]}')
    online.updater.poll_once()
    assert online.selective.state()["deployments"] == 1 and online.state()["collection_enabled"]
    (root / TRAINER_STATE_NAME).write_text(
        '{"last_shard_id": null, "rounds": [{"round": 1, "alpha_train": 0.1, "alpha_eval": 0.3},'
        ' {"round": 2, "alpha_train": 0.3, "alpha_eval": 0.25}]}')
    online.updater.poll_once()
    assert not online.state()["collection_enabled"]  # a round that did not improve stops collection
    online.close()


def test_online_config_from_engine_config(tmp_path: Path) -> None:
    def engine_config(eagle3_dir: str | None) -> EngineConfig:
        return EngineConfig(spec=SpecConfig(drafter="eagle3", options={"eagle3": Eagle3Options(dir=eagle3_dir)}),
                            online=OnlineTrainingConfig(signal_budget_mb=64, poll_s=1.5, capture_prompt=True,
                                                        collect=CollectionConfig(epsilon=0.05, n_init=4,
                                                                                 n_threshold=100, lambda_short=0.5,
                                                                                 lambda_long=0.9)))

    cfg = OnlineConfig.from_engine_config(engine_config(str(tmp_path / "root")))
    assert cfg.signal_dir == str(tmp_path / "root" / "signals") and cfg.signal_budget_bytes == 64 << 20
    assert cfg.capture_prompt
    assert cfg.collection.bootstrap  # nothing published yet: collect from the start
    assert cfg.collection.n_threshold == 100 and cfg.poll_s == 1.5
    with pytest.raises(OnlineConfigError, match="eagle3-dir"):
        OnlineConfig.from_engine_config(engine_config(None))
    with pytest.raises(OnlineConfigError, match="capture_flush_rows"):
        OnlineConfig(publish_root="a", signal_dir="b", capture_capacity_rows=4, capture_flush_rows=8)


def test_online_training_on_the_embedded_model_starts_from_its_shipped_head(model: DecoderModel, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty ``--eagle3-dir`` publish root with ``--online-training``: the shipped head is published
    there as v1 (once; never over a version), the engine drafts with it, and collection starts on
    (the head never saw this traffic); a version trained on that root ends the bootstrap."""
    from tidespec import llm

    shipped = tmp_path / "shipped"
    export_eagle3(random_head(model, 3), shipped)
    monkeypatch.setattr(llm, "shipped_head_for", lambda cfg: shipped)
    root = tmp_path / "root"
    spec = SpecConfig(drafter="suffix,eagle3", options={"eagle3": Eagle3Options(dir=str(root))})
    assert llm.with_shipped_head(spec, model.cfg, online=False) == spec and not root.exists()  # serving only
    assert llm.with_shipped_head(spec, model.cfg, online=True) == spec
    assert latest_version(root) == 1 and is_seed(root)
    assert load_version(root, 1).metrics["bootstrap"] == str(shipped)
    assert seed_root(root, shipped, model.cfg) is None and latest_version(root) == 1  # never over a version
    online = OnlineConfig.from_engine_config(EngineConfig(spec=spec, online=OnlineTrainingConfig(enabled=True)))
    assert online.collection.bootstrap  # collection starts on: nothing here was trained on this traffic
    publish(root, random_head(model, 4), {"heldout_accept_len": 1.5})
    assert not is_seed(root)
    assert not OnlineConfig.from_engine_config(EngineConfig(spec=spec, online=OnlineTrainingConfig(
        enabled=True))).collection.bootstrap
    with pytest.raises(DrafterCheckpointError, match="holds no valid EAGLE-3 drafter"):
        seed_root(tmp_path / "other", tmp_path / "empty-root", model.cfg)


def test_a_signal_budget_smaller_than_one_round_is_warned_at_start(model: DecoderModel, tok, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """SmolLM2-135M's 3 x 576 bfloat16 taps need ~54 MiB for a 16,384-row round: 32 MiB cannot hold
    it (training would silently never run), 64 MiB can. Attaching with too small a budget logs it."""
    big = CollectionConfig(n_threshold=16384)
    small = OnlineConfig(publish_root="p", signal_dir="s", signal_budget_bytes=32 << 20, collection=big)
    msg = budget_shortfall(small, taps_dim=3 * 576)
    assert msg is not None and "32 MiB" in msg and "16384 rows" in msg and "--signal-budget-mb" in msg
    assert budget_shortfall(OnlineConfig(publish_root="p", signal_dir="s", signal_budget_bytes=64 << 20,
                                         collection=big), 3 * 576) is None

    cfg = online_cfg(tmp_path)
    assert publish(cfg.publish_root, random_head(model, 1), {"note": "v1"}) == 1
    tiny_budget = OnlineConfig(publish_root=cfg.publish_root, signal_dir=cfg.signal_dir, signal_budget_bytes=1024,
                               collection=CollectionConfig(n_threshold=64))
    engine = make_engine(model, tok, build_eagle3_drafter(model, cfg.publish_root, cfg=drafter_cfg()), gamma=2,
                         tree=False)
    with caplog.at_level(logging.WARNING, logger="tidespec.online.serving.attach"):
        attach_online_training(engine, tiny_budget, start=False)
    assert any("training will never run" in r.getMessage() for r in caplog.records)
