"""``tidespec bench learn`` on a tiny target: nested shares, one fixed held-out split, the fit."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import tiny_llama, tiny_tokenizer
from tidespec.bench.learn.calibration import calibration_report, judge_calibration, parse_windows
from tidespec.bench.learn.run import (
    LearnBenchConfig,
    fit_log2,
    load_sequences,
    parse_fractions,
    replot,
    run_learn_bench,
    vocab_coverage,
)
from tidespec.config import ConfigError
from tidespec.models.eagle3.checkpoint import import_eagle3
from tidespec.models.eagle3.head import Eagle3Config
from tidespec.models.loading.loader import LoadedModel
from tidespec.online.training.data import heldout_keys
from tidespec.online.training.eagle3_train import SignalSegment
from tidespec.online.training.judge import HeadWalk
from tidespec.online.training.process import capture_from_workload

V = 48


def test_heldout_keys_and_fit_hand_traced() -> None:
    assert heldout_keys([12, 3, 9, 8, 20], 0.34) == {9}
    assert heldout_keys([3, 8, 9, 12, 20], 0.1) == {20}
    assert heldout_keys([3, 8, 9, 12], 0.5) == {8, 12}
    fit = fit_log2([1000, 2000, 4000], [1.3, 1.4, 1.5], 2.5)
    assert fit["per_doubling"] == pytest.approx(0.1)
    assert fit["rows_for_target"] == pytest.approx(4000 * 2 ** 10)
    flat = fit_log2([1000, 2000], [1.5, 1.4], 2.5)
    assert flat["per_doubling"] < 0 and flat["rows_for_target"] is None
    assert fit_log2([1000, 1000], [1.3, 1.4], 2.5)["per_doubling"] is None
    assert parse_fractions("1,0.25,0.5,0.25") == (0.25, 0.5, 1.0)


def test_vocab_coverage_hand_traced() -> None:
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[5, 9]] = True
    seg = SignalSegment(taps=torch.zeros(3, 6), token_ids=torch.tensor([1, 5, 7, 9]))
    # the text continues with 5, 7, 9; the vocabulary holds 5 and 9
    assert vocab_coverage(SimpleNamespace(t2d=t2d), [seg]) == pytest.approx(2 / 3)  # type: ignore[arg-type]
    assert math.isnan(vocab_coverage(SimpleNamespace(t2d=t2d), []))  # type: ignore[arg-type]


def test_config_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        LearnBenchConfig(signal_dirs=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="not a directory"):
        LearnBenchConfig(signal_dirs=str(tmp_path), eval_dirs=str(tmp_path / "missing"))
    for kw, msg in [({"fractions": "0,1"}, "in \\(0, 1\\]"), ({"fractions": "a"}, "comma-separated numbers"),
                    ({"evals": 0}, "evals"), ({"heldout_frac": 1.0}, "heldout_frac"),
                    ({"steps": 0, "epochs": 0.0}, "epochs"), ({"steps": 5, "per_share_epochs": True}, "not both"),
                    ({"judge_windows": "0,2"}, "judge_windows"), ({"judge_draws": 0}, "judge_draws")]:
        with pytest.raises(ConfigError, match=msg):
            LearnBenchConfig(signal_dirs=str(tmp_path), **kw)


def _capture(model, tmp_path: Path, name: str, seed: int) -> Path:
    gen = torch.Generator().manual_seed(seed)
    tok = tiny_tokenizer(V)
    words = [t for t in range(3, V) if tok.encode(f"t{t}") == [t]]
    lines = []
    for i in range(16):
        n = int(torch.randint(3, 8, (1,), generator=gen))
        p = [words[int(j)] for j in torch.randint(0, len(words), (n,), generator=gen)]
        lines.append(json.dumps({"id": f"{name}{i}", "domain": "code", "kind": "completion",
                                 "prompt": " ".join(f"t{t}" for t in p)}) + "\n")
    workload = tmp_path / f"{name}.jsonl"
    workload.write_text("".join(lines))
    sig = tmp_path / f"{name}-signals"
    capture_from_workload(model, tok, str(workload), sig, max_tokens=40, progress=False)
    return sig


def test_learning_curve_on_two_stores(tmp_path: Path) -> None:
    model = tiny_llama(V, layers=8, seed=2, scale=1.0)
    a, b = _capture(model, tmp_path, "a", 0), _capture(model, tmp_path, "b", 1)
    scored = _capture(model, tmp_path, "c", 2)  # scored, never trained on
    by_key, store_rows, store_of = load_sequences([str(a), str(b)], 256)
    # both stores' sequences (16 prompts each; a prompt may end at once on EOS), re-keyed 0, 1, ...
    n = len(by_key)
    assert sorted(by_key) == list(range(n)) and 30 <= n <= 32
    na = store_of.count(0)
    assert store_of == [0] * na + [1] * (n - na) and 15 <= na <= 16
    assert sum(store_rows) == sum(s.num_positions for segs in by_key.values() for s in segs)

    target = LoadedModel(model, tiny_tokenizer(V), model.cfg, "tiny")
    # 20 passes over each share's own segments (one segment per sequence here: all are < 256 positions)
    cfg = LearnBenchConfig(signal_dirs=f"{a},{b}", fractions="0.25,1", epochs=20, per_share_epochs=True, evals=2,
                           heldout_frac=0.25, draft_vocab=0, lr=3e-3, batch_segments=8, export_dir=str(tmp_path / "x"),
                           eval_dirs=str(scored), judge_windows="1,2,3,64", judge_draws=20)
    doc = run_learn_bench(cfg, target, tmp_path / "out", command="test", progress=False, log=lambda _: None)
    exported = import_eagle3(tmp_path / "x", model.cfg)[0]  # the full share's head, as a checkpoint
    assert exported == Eagle3Config.for_target(model.cfg)
    held = n // 4  # every 4th sequence
    assert doc["heldout_sequences"] == held
    small, full = doc["curves"]
    assert small["sequences"] == round(0.25 * (n - held)) and full["sequences"] == n - held
    assert small["rows"] < full["rows"]
    assert (small["steps"], full["steps"]) == (math.ceil(20 * small["sequences"] / 8), math.ceil(20 * (n - held) / 8))
    half = round(full["steps"] / 2)
    assert [p["step"] for p in full["points"]] == [0, half, full["steps"]]
    assert full["points"][0]["train_loss"] is None and full["points"][-1]["train_loss"] > 0
    # the fresh heads are the same model on the same held-out rows
    assert small["points"][0]["heldout_accept_len"] == pytest.approx(full["points"][0]["heldout_accept_len"])
    # training helps both shares; the fit is the line through their best held-out scores
    for c in (small, full):
        assert c["best_accept_len"] > c["points"][0]["heldout_accept_len"] + 0.3
        assert c["best_accept_len"] == max(p["heldout_accept_len"] for p in c["points"])
        # the served estimate (the same chains walked as a server meets them) is reported beside it
        assert all(1.0 <= p["heldout_walk_len"] <= 1 + doc["config"]["gamma"] for p in c["points"])
        assert c["final_walk_len"] == c["points"][-1]["heldout_walk_len"]
    slope = (full["best_accept_len"] - small["best_accept_len"]) / math.log2(full["rows"] / small["rows"])
    assert doc["fit"]["per_doubling"] == pytest.approx(slope)
    walk_slope = (full["best_walk_len"] - small["best_walk_len"]) / math.log2(full["rows"] / small["rows"])
    assert doc["fit_walk"]["per_doubling"] == pytest.approx(walk_slope)
    # the last head per source: each store's held-out sequences, then every sequence of the scored-only store
    src_a, src_b, src_c = doc["sources"]
    assert [s["split"] for s in doc["sources"]] == ["held out", "held out", "scored only"]
    assert src_a["sequences"] == sum(1 for k in heldout_keys(list(by_key), 0.25) if k < na)
    assert src_a["sequences"] + src_b["sequences"] == held
    assert src_a["rows"] + src_b["rows"] == doc["heldout_rows"]
    scored_only, scored_rows, _ = load_sequences([str(scored)], 256)
    assert (src_c["sequences"], src_c["rows"]) == (len(scored_only), sum(scored_rows))
    assert all(s["coverage"] == 1.0 and 1.0 <= s["walk_len"] <= 1 + doc["config"]["gamma"] for s in doc["sources"])
    saved = json.loads((tmp_path / "out" / "bench_learn.json").read_text())
    assert saved["command"] == "test" and len(saved["curves"]) == 2
    assert (tmp_path / "out" / "learn.png").stat().st_size > 0
    readme = tmp_path / "out" / "README.md"
    assert "per doubling" in readme.read_text() and "walked as served" in readme.read_text()
    assert "scored only" in readme.read_text() and "100.0 %" in readme.read_text()
    # the judgement check: windows of held-out requests against the gain over all of them
    judge = doc["judge"]
    assert judge["requests"] == held and judge["truth_gain"] > 0.1 and judge["confidence"] == 0.9
    assert [w["window"] for w in judge["windows"]] == [1, 2, 3]  # 64 is more than half the requests
    one = judge["windows"][0]
    assert one["requests"]["unbounded"] == 1.0 and one["requests"]["median_width"] is None  # one request: no spread
    assert one["blocks"]["unbounded"] < 1.0  # its blocks resampled as if independent give an interval
    assert one["both"]["unbounded"] == 1.0  # the trainer's: none
    assert all(0.0 <= w[way][k] <= 1.0 for w in judge["windows"] for way in ("blocks", "requests")
               for k in ("covered", "published", "unbounded"))
    assert "Judgement check" in readme.read_text()
    readme.unlink()
    again = replot(tmp_path / "out")  # re-rendered from bench_learn.json alone
    assert again["curves"][1]["rows"] == full["rows"] and "per doubling" in readme.read_text()
    with pytest.raises(ConfigError, match="a bench learn output directory"):
        replot(tmp_path)


def test_init_from_a_trained_head_fine_tunes_it_and_widens_its_vocabulary(tmp_path: Path) -> None:
    model = tiny_llama(V, layers=8, seed=2, scale=1.0)
    store = _capture(model, tmp_path, "a", 0)
    target = LoadedModel(model, tiny_tokenizer(V), model.cfg, "tiny")
    with pytest.raises(ConfigError, match="not both"):
        LearnBenchConfig(signal_dirs=str(store), init_from=str(tmp_path), init_from_target="lm_head")

    def run(name: str, **kw: object) -> dict:
        cfg = LearnBenchConfig(signal_dirs=str(store), fractions="1", evals=1, heldout_frac=0.25, lr=3e-3,
                               batch_segments=8, export_dir=str(tmp_path / name), **kw)  # type: ignore[arg-type]
        return run_learn_bench(cfg, target, tmp_path / f"{name}-out", progress=False, log=lambda _: None)

    first = run("first", steps=6, draft_vocab=16)
    # the same split: the fine-tune starts where the first run ended, not from a fresh head
    again = run("again", steps=1, draft_vocab=16, init_from=str(tmp_path / "first"))
    start, end = again["curves"][0]["points"][0], first["curves"][0]["points"][-1]
    assert start["heldout_accept_len"] == pytest.approx(end["heldout_accept_len"])
    assert start["heldout_walk_len"] == pytest.approx(end["heldout_walk_len"])
    assert "| fresh |" in (tmp_path / "first-out" / "README.md").read_text()
    assert "| start (fine-tuned from its checkpoint) |" in (tmp_path / "again-out" / "README.md").read_text()
    wide = run("wide", steps=1, draft_vocab=24, init_from=str(tmp_path / "first"))
    old_cfg, old_state = import_eagle3(tmp_path / "first", model.cfg)
    new_cfg, new_state = import_eagle3(tmp_path / "wide", model.cfg)
    assert (old_cfg.draft_vocab_size, new_cfg.draft_vocab_size) == (16, 24)
    assert bool((old_state["t2d"] <= new_state["t2d"]).all()) and int(new_state["t2d"].sum()) == 24
    assert wide["sources"][0]["coverage"] >= first["sources"][0]["coverage"]
    # grown to 2 layers: the new block starts as the identity, so the held-out start is unchanged
    deep = run("deep", steps=1, draft_vocab=16, head_layers=2, init_from=str(tmp_path / "first"))
    assert deep["curves"][0]["points"][0]["heldout_accept_len"] == pytest.approx(end["heldout_accept_len"])
    assert import_eagle3(tmp_path / "deep", model.cfg)[0].num_layers == 2
    with pytest.raises(ConfigError, match="no valid EAGLE-3 checkpoint"):
        run("none", steps=1, init_from=str(tmp_path / "empty-root"))


def test_domains_select_the_rows_of_a_mixed_store(tmp_path: Path) -> None:
    """A serving store mixes workloads in one shard: ``--domains`` learns from and scores one of them."""
    from tidespec.online.store import SignalShard, SignalStore

    store = SignalStore(tmp_path / "s", 1 << 30)
    pos = torch.tensor([0, 1, 2, 0, 1, 0])
    shard = SignalShard(taps=torch.arange(6.0)[:, None].repeat(1, 3), token_ids=pos, next_token_ids=pos + 1,
                        seq_ids=torch.tensor([1, 1, 1, 2, 2, 3]), positions=pos,
                        domain_ids=torch.tensor([0, 0, 0, 1, 1, 0]), domains=["code", "medical"])
    store.append(shard)
    medical = shard.in_domains(frozenset({"medical"}))
    assert medical.num_signals == 2 and medical.seq_ids.tolist() == [2, 2] and medical.taps[:, 0].tolist() == [3, 4]
    assert medical.row_domains() == ["medical", "medical"] and medical.domains == ["code", "medical"]
    assert shard.in_domains(frozenset({"code", "medical"})) is shard
    by_key, rows, _ = load_sequences([str(tmp_path / "s")], 256, frozenset({"medical"}))
    assert rows == [2] and [s.num_positions for segs in by_key.values() for s in segs] == [2]
    by_key, rows, _ = load_sequences([str(tmp_path / "s")], 256)
    assert rows == [6] and len(by_key) == 3
    with pytest.raises(ConfigError, match="no signals in .* of domains legal"):
        load_sequences([str(tmp_path / "s")], 256, frozenset({"legal"}))


def test_the_learning_rate_defaults_to_the_trainers_for_what_the_shares_start_from(tmp_path: Path) -> None:
    from tidespec.online.training.config import TrainerConfig

    assert LearnBenchConfig(signal_dirs=str(tmp_path)).peak_lr == TrainerConfig.lr  # fresh heads
    assert LearnBenchConfig(signal_dirs=str(tmp_path), init_from="ckpt").peak_lr == TrainerConfig.finetune_lr
    assert LearnBenchConfig(signal_dirs=str(tmp_path), init_from="ckpt", lr=1e-3).peak_lr == 1e-3
    with pytest.raises(ConfigError, match="lr must be >= 0"):
        LearnBenchConfig(signal_dirs=str(tmp_path), lr=-1.0)


def test_judge_calibration_hand_built() -> None:
    """Eight requests of three blocks each; the trained head gains one token in each block of the
    even requests and none in the odd ones: over all requests the gain is 12 / 24 = +0.5 tokens per
    step. Windows of one request show no spread when requests are resampled; windows of two to
    four do; five is more than half the requests and is skipped."""
    blocks = [(1, 1)] * 24
    gains = [(1, 2) if (i // 3) % 2 == 0 else (1, 1) for i in range(24)]
    groups = [i // 3 for i in range(24)]
    base = HeadWalk(rows=96, blocks=blocks, groups=groups, row_sum=0, row_count=0)
    cand = HeadWalk(rows=96, blocks=gains, groups=groups, row_sum=0, row_count=0)
    cal = judge_calibration(base, cand, parse_windows("5,1,2,4"), 50, 0.9, seed=3)
    assert cal["requests"] == 8 and cal["truth_gain"] == pytest.approx(0.5)
    assert [w["window"] for w in cal["windows"]] == [1, 2, 4]
    one, two, four = cal["windows"]
    assert one["mean_blocks"] == 3.0 and one["requests"]["unbounded"] == 1.0
    # one request's blocks agree with each other: over blocks the interval is a point (+1 or 0), never the truth
    assert one["blocks"]["covered"] == 0.0 and one["blocks"]["unbounded"] == 0.0
    assert 0.0 < one["blocks"]["published"] < 1.0  # the even requests "publish"
    assert four["requests"]["unbounded"] == 0.0 and four["requests"]["covered"] > one["blocks"]["covered"]
    assert two["requests"]["median_width"] is not None
    # the trainer's interval spans both: no interval where requests give none, else covered whenever either is
    assert one["both"]["unbounded"] == 1.0
    for w in (two, four):
        assert w["both"]["covered"] >= max(w["blocks"]["covered"], w["requests"]["covered"])
        assert w["both"]["published"] <= min(w["blocks"]["published"], w["requests"]["published"])
    lines = calibration_report(cal)
    assert "gain +0.500" in lines[0] and lines[-1].count("\n") == 4  # header, rule, three windows
    with pytest.raises(ValueError, match=">= 1"):
        parse_windows("0,2")
