"""The draft-trainer process: data preparation (hand-traced), a round that learns and publishes,
the offline bootstrap, and 2-process gloo DDP through ``torchrun`` producing a drafter the engine loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_hf_model, tiny_llama, tiny_tokenizer, write_tiny_checkpoint
from tidespec.config import CacheConfig, CollectionConfig, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.files import latest_version
from tidespec.models.eagle3.checkpoint import import_eagle3, load_version, publish
from tidespec.models.families.decoder import DecoderModel
from tidespec.models.kernels import linear
from tidespec.models.loading.loader import load_model
from tidespec.online.capture import CaptureBuffer
from tidespec.online.collection import SelectiveCollector
from tidespec.online.serving.attach import OnlineConfig
from tidespec.online.serving.launch import start_trainer_process
from tidespec.online.signals import TRAINER_STATE_NAME, SignalCollector
from tidespec.online.store import SignalShard, SignalStore
from tidespec.online.training.config import TrainerConfig, TrainerConfigError
from tidespec.online.training.data import cut_segment, heldout_keys, segments_by_sequence, split_heldout
from tidespec.online.training.eagle3_train import SignalSegment
from tidespec.online.training.judge import PairedJudgement
from tidespec.online.training.process import capture_from_workload, distill_from_workload, export_latest, train_drafter
from tidespec.online.training.rounds import Awaiting, DraftTrainer
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.eagle3 import Eagle3DrafterConfig, build_eagle3_drafter

V = 48
LAYERS = 8
REPO = Path(__file__).resolve().parents[2]


def seg(start: int, n: int, width: int = 2) -> SignalSegment:
    """Segment whose taps/tokens encode their position (tap row p = [p, p], token p = p)."""
    pos = torch.arange(start, start + n)
    return SignalSegment(pos[:, None].double().repeat(1, width), torch.arange(start, start + n + 1), None, start)


def test_cut_segment_hand_traced() -> None:
    pieces = cut_segment(seg(10, 5), 2)
    assert [(p.start_position, p.num_positions) for p in pieces] == [(10, 2), (12, 2), (14, 1)]
    assert pieces[1].token_ids.tolist() == [12, 13, 14]  # tokens of its positions + the next one
    assert pieces[1].taps[:, 0].tolist() == [12.0, 13.0]


def test_segments_by_sequence_and_split_hand_traced() -> None:
    def shard(seq: list[int], pos: list[int]) -> SignalShard:
        p = torch.tensor(pos)
        return SignalShard(taps=p[:, None].float().repeat(1, 2), token_ids=p * 10, next_token_ids=p * 10 + 10,
                           seq_ids=torch.tensor(seq), positions=p)

    # seq 7 spans two shards (positions 3, 4 | 5) and repeats position 4; seq 9 has a hole
    by_seq = segments_by_sequence([shard([7, 7, 9, 9], [3, 4, 0, 1]), shard([7, 7, 9], [4, 5, 3])], max_len=8)
    assert sorted(by_seq) == [7, 9]
    assert [(s.start_position, s.token_ids.tolist()) for s in by_seq[7]] == [(3, [30, 40, 50, 60])]
    assert [(s.start_position, s.num_positions) for s in by_seq[9]] == [(0, 2), (3, 1)]
    assert {s.seq_id for s in by_seq[7]} == {7} and {s.seq_id for s in by_seq[9]} == {9}  # a judgement's samples
    assert [s.seq_id for s in cut_segment(by_seq[7][0], 2)] == [7, 7]
    train, held = split_heldout({3: [seg(0, 4)], 8: [seg(0, 5)], 9: [seg(0, 6)], 12: [seg(0, 7)]}, 0.5)
    assert [s.num_positions for s in train] == [4, 6] and [s.num_positions for s in held] == [5, 7]
    assert heldout_keys([3, 8, 9, 12, 20], 0.34) == {9}  # every third
    assert heldout_keys([3, 8, 9, 12, 20], 0.1, min_keys=2) == {8, 20}  # at least two, spread out
    assert heldout_keys([3, 8, 9, 12, 20], 0.1, min_keys=4) == {8, 20}  # never more than half
    assert heldout_keys(list(range(20)), 0.1, min_keys=4) == {4, 9, 14, 19}
    assert heldout_keys(list(range(40)), 0.1, min_keys=4) == {9, 19, 29, 39}  # every tenth is already four
    train, held = split_heldout({3: [seg(0, 10)]}, 0.2)  # one sequence: its tail is held out
    assert [(s.start_position, s.num_positions) for s in train] == [(0, 8)]
    assert [(s.start_position, s.num_positions) for s in held] == [(8, 2)]
    assert held[0].token_ids.tolist() == [8, 9, 10]


def test_replay_takes_newest_consumed_shards_within_budget(tmp_path: Path, model: DecoderModel) -> None:
    """Consumed shards of 3, 5 and 4 rows (oldest first), replay_rows 9 -> the 4- and 5-row shards;
    the pending shard is never replayed."""
    store = SignalStore(tmp_path / "s", 1 << 30)
    taps_dim = 3 * model.cfg.hidden_size
    ids = []
    for seq, n in enumerate((3, 5, 4, 6)):
        p = torch.arange(n)
        ids.append(store.append(SignalShard(taps=torch.zeros(n, taps_dim), token_ids=p, next_token_ids=p + 1,
                                            seq_ids=torch.full((n,), seq), positions=p.clone())))
    cfg = TrainerConfig(signal_dir=str(tmp_path / "s"), publish_root=str(tmp_path / "p"), replay_rows=9,
                        progress=False)
    trainer = DraftTrainer(cfg, model.cfg, model.embed_tokens)
    trainer.state.last_shard_id = ids[2]
    pending = trainer.pending_signals()
    assert [i.shard_id for i in pending] == [ids[3]]
    assert [i.shard_id for i in trainer.replay_signals(pending)] == [ids[2], ids[1]]


def test_trainer_config_validation(tmp_path: Path) -> None:
    with pytest.raises(TrainerConfigError, match="signal-dir"):
        TrainerConfig()
    with pytest.raises(TrainerConfigError, match="heldout_frac"):
        TrainerConfig(signal_dir="s", publish_root="p", heldout_frac=1.0)
    with pytest.raises(TrainerConfigError, match="needs --from-workload"):
        TrainerConfig(signal_dir="s", capture_only=True)
    with pytest.raises(TrainerConfigError, match="needs --topk"):
        TrainerConfig(signal_dir="s", publish_root="p", samples=2)
    with pytest.raises(TrainerConfigError, match="weight_decay"):
        TrainerConfig(signal_dir="s", publish_root="p", weight_decay=-1.0)
    with pytest.raises(TrainerConfigError, match="needs the target model"):
        DraftTrainer(TrainerConfig(signal_dir=str(tmp_path / "s"), publish_root=str(tmp_path / "p"),
                                   init_from_target="layer"), tiny_llama(V).cfg, tiny_llama(V).embed_tokens)


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    # unit-scale weights: the target's greedy text is learnable from a few hundred positions
    return tiny_llama(V, layers=LAYERS, seed=2, scale=1.0)


def engine_acceptance(model: DecoderModel, drafter, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    cfg = EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=4),
                       spec=SpecConfig(num_speculative_tokens=4 if drafter is not None else 0))
    engine = LLMEngine(model, tiny_tokenizer(V), cfg, drafter=drafter)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    drafts = accepted = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
                drafts += o.stats.num_drafts
                accepted += o.stats.num_accepted_tokens
    return [done[i] for i in ids], (accepted + drafts) / max(1, drafts)


def _workload(tmp_path: Path) -> tuple[Path, list[list[int]]]:
    """32 random prompts of 3-7 round-tripping words as a completion workload file."""
    gen = torch.Generator().manual_seed(0)
    workload = tmp_path / "w.jsonl"
    tok = tiny_tokenizer(V)
    words = [t for t in range(3, V) if tok.encode(f"t{t}") == [t]]  # ids whose text round-trips
    prompts = [[words[int(i)] for i in torch.randint(0, len(words), (int(torch.randint(3, 8, (1,), generator=gen)),),
                                                     generator=gen)] for _ in range(32)]
    workload.write_text("".join(json.dumps({"id": f"r{i}", "domain": "code", "kind": "completion",
                                            "prompt": " ".join(f"t{t}" for t in p)}) + "\n"
                                for i, p in enumerate(prompts)))
    return workload, prompts


def test_distilled_round_from_workload_with_target_init_learns(model: DecoderModel, tmp_path: Path) -> None:
    workload, prompts = _workload(tmp_path)
    sig, root = tmp_path / "signals", tmp_path / "drafter"
    cfg = TrainerConfig(signal_dir=str(sig), publish_root=str(root), from_workload=str(workload), samples=2, topk=8,
                        temperature=1.0, max_tokens=40, max_steps=120, batch_segments=8, lr=3e-3, gamma=4,
                        heldout_frac=0.25, lr_schedule="cosine", warmup_steps=10, weight_decay=0.01,
                        init_from_target="layer", progress=False)
    rows = distill_from_workload(model, tiny_tokenizer(V), cfg)
    shards = [sh for _, sh in SignalStore(sig, 1 << 30).iter_shards()]
    assert rows == sum(sh.num_signals for sh in shards) > 2000
    assert all(sh.topk_ids is not None and sh.topk_ids.shape[1] == 8 for sh in shards)
    r = DraftTrainer(cfg, model.cfg, model.embed_tokens, target=model).run(once=True)[0]
    assert r.published_version == 1 and r.candidate_accept_len > r.baseline_accept_len + 0.3, r
    dcfg = Eagle3DrafterConfig(max_num_seqs=4, max_model_len=96)
    plain, _ = engine_acceptance(model, None, prompts[:4])
    assert engine_acceptance(model, build_eagle3_drafter(model, root, cfg=dcfg), prompts[:4])[0] == plain


def test_once_round_from_workload_learns_and_publishes(model: DecoderModel, tmp_path: Path) -> None:
    workload, prompts = _workload(tmp_path)
    sig, root = tmp_path / "signals", tmp_path / "drafter"
    stats = capture_from_workload(model, tiny_tokenizer(V), str(workload), sig, max_tokens=40, progress=False)
    assert stats["num_captured"] > 1200 and stats["num_dropped"] == 0
    cfg = TrainerConfig(signal_dir=str(sig), publish_root=str(root), max_steps=120, batch_segments=8, lr=3e-3,
                        gamma=4, heldout_frac=0.25, progress=False)
    trainer = DraftTrainer(cfg, model.cfg, model.embed_tokens)
    results = trainer.run(once=True)
    assert len(results) == 1
    r = results[0]
    assert r.published_version == 1 and latest_version(root) == 1
    assert r.candidate_accept_len > r.baseline_accept_len + 0.3, r
    state = json.loads((root / TRAINER_STATE_NAME).read_text())
    assert state["last_shard_id"] == SignalStore(sig, 1 << 30).list_shards()[-1].shard_id
    assert state["rounds"][0]["published_version"] == 1
    assert 0.0 <= state["rounds"][0]["alpha_train"] < state["rounds"][0]["alpha_eval"] <= 1.0
    assert load_version(root, 1).metrics["heldout_accept_len"] == pytest.approx(r.candidate_accept_len)
    assert trainer.run_round(min_signals=1) is None  # every shard consumed

    # the engine serves the published version losslessly, with a better acceptance than version 0
    test_prompts = prompts[:4]
    plain, _ = engine_acceptance(model, None, test_prompts)
    dcfg = Eagle3DrafterConfig(max_num_seqs=4, max_model_len=96)
    fresh_out, fresh_len = engine_acceptance(model, build_eagle3_drafter(model, None, cfg=dcfg), test_prompts)
    trained = build_eagle3_drafter(model, root, cfg=dcfg)
    assert trained.version == 1
    trained_out, trained_len = engine_acceptance(model, trained, test_prompts)
    assert fresh_out == plain and trained_out == plain
    assert trained_len > fresh_len + 0.3, (fresh_len, trained_len)

    # --export-dir: the newest version as one checkpoint in bfloat16, which the engine takes as is
    export = tmp_path / "export"
    assert export_latest(root, export, model.cfg, torch.bfloat16) == 1
    cfg_x, sd_x = import_eagle3(export, model.cfg)
    pub = load_version(root, 1)
    assert cfg_x == pub.config
    for name, t in pub.state_dict.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert sd_x[name].dtype == want.dtype and torch.equal(sd_x[name], want), name
    exported = build_eagle3_drafter(model, export, cfg=dcfg)
    assert engine_acceptance(model, exported, test_prompts)[0] == plain
    with pytest.raises(TrainerConfigError, match="nothing valid is published"):
        export_latest(tmp_path / "empty", tmp_path / "x", model.cfg, torch.float32)


@pytest.mark.slow  # two trainer processes (24 s); make test trains, judges and publishes in one
def test_two_process_gloo_ddp_publishes_a_drafter_the_engine_loads(tmp_path: Path) -> None:
    hf, _ = tiny_hf_model("llama", torch.float32, seed=3, num_hidden_layers=LAYERS)
    with torch.no_grad():  # halved weights: greedy text the head can learn from a few hundred rows
        for name, p in hf.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(0.5)
    loaded = load_model(str(write_tiny_checkpoint(hf, tmp_path / "target")))
    ours, tok, ckpt = loaded.model, loaded.tokenizer, loaded.path
    sig, root = tmp_path / "signals", tmp_path / "drafter"

    # capture signals from the target through the engine (taps-only drafter, collection forced)
    drafter = build_eagle3_drafter(ours, None, cfg=Eagle3DrafterConfig(max_num_seqs=4, max_model_len=96))
    engine = LLMEngine(ours, tok, EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=4),
                                                spec=SpecConfig(num_speculative_tokens=2)), drafter=drafter)
    buf = CaptureBuffer(SignalStore(sig, 1 << 30), 4096, 256, taps_dim=drafter.head.cfg.tap_size)
    SignalCollector(engine, buf, SelectiveCollector(CollectionConfig(force=True))).hook_into(engine)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (5,), generator=gen).tolist() for _ in range(16)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    plain: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        plain.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    buf.close()
    assert buf.num_captured > 200

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "tidespec.online.training.cli", "train-drafter", "--model", str(ckpt), "--signal-dir", str(sig),
           "--publish-root", str(root), "--once", "--max-steps", "100", "--batch-segments", "2", "--lr", "3e-3",
           "--gamma", "2", "--heldout-frac", "0.25", "--threads", "1", "--no-progress", "--backend", "gloo"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "published v1" in proc.stdout
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("v")) == ["v1"]  # only rank 0 published
    pub = load_version(root, 1, ours.cfg)
    assert pub.metrics["world_size"] == 2
    assert pub.metrics["heldout_accept_len"] > pub.metrics["baseline_accept_len"] + 0.5

    # the engine loads it and stays lossless
    loaded = build_eagle3_drafter(ours, root, cfg=Eagle3DrafterConfig(max_num_seqs=4, max_model_len=96))
    assert loaded.version == 1
    engine = LLMEngine(ours, tok, EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=4),
                                                spec=SpecConfig(num_speculative_tokens=2)), drafter=loaded)
    ids = [engine.add_request(p, params) for p in prompts]
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        got.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [got[i] for i in ids] == [plain[f"req-{k}"] for k in range(len(prompts))]


def test_start_trainer_process_runs_the_cli_and_logs(tmp_path: Path) -> None:
    online = OnlineConfig(publish_root=str(tmp_path / "drafter"), signal_dir=str(tmp_path / "signals"))
    proc = start_trainer_process(online, model=str(tmp_path / "no-such-model"), draft_vocab=0, nice=7)
    # niced below the parent, so serving on a shared CPU goes first (read while it imports torch)
    assert os.getpriority(os.PRIO_PROCESS, proc.pid) == os.getpriority(os.PRIO_PROCESS, 0) + 7
    assert proc.wait(timeout=120) == 2  # flags parsed; the missing model is a one-line user error
    log = (tmp_path / "drafter" / "trainer.log").read_text()
    assert log.startswith("error: ") and "no-such-model" in log and "Traceback" not in log


def test_only_a_trainer_that_runs_the_target_measures_its_kernels(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Online rounds read the target's LM-head rows only: the trainer child measures no matmul kernels (it
    did, in the idle gaps serving gave it); the capture-only bootstrap runs the target's forwards and does."""
    tuned: list[int] = []
    monkeypatch.setattr(linear, "tune_linears", lambda model: tuned.append(1) or {})
    hf, _ = tiny_hf_model("llama", torch.float32, num_hidden_layers=4)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "model")
    online = TrainerConfig(signal_dir=str(tmp_path / "empty"), publish_root=str(tmp_path / "drafter"),
                           model=str(ckpt), once=True, progress=False)
    assert train_drafter(online) == [] and tuned == []
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"id": "r0", "domain": "code", "kind": "completion", "prompt": "w3 w5 w7"}) + "\n")
    capture = TrainerConfig(signal_dir=str(tmp_path / "signals"), model=str(ckpt), from_workload=str(workload),
                            capture_only=True, samples=1, max_tokens=2, progress=False)
    assert train_drafter(capture) == [] and tuned == [1]


def test_capture_only_bootstrap_fills_the_store_and_trains_nothing(tmp_path: Path) -> None:
    hf, _ = tiny_hf_model("llama", torch.float32, num_hidden_layers=4)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "model")
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"id": f"r{i}", "domain": "code", "kind": "completion",
                                            "prompt": f"w{3 + i} w{5 + i} w{7 + i}"}) + "\n" for i in range(3)))
    cfg = TrainerConfig(signal_dir=str(tmp_path / "signals"), model=str(ckpt), from_workload=str(workload),
                        capture_only=True, samples=2, topk=4, max_tokens=6, progress=False)
    assert train_drafter(cfg) == []
    shards = [sh for _, sh in SignalStore(tmp_path / "signals", 1 << 30).iter_shards()]
    assert sum(sh.num_signals for sh in shards) > 0 and all(sh.topk_ids is not None for sh in shards)
    assert sorted({int(s) for sh in shards for s in sh.seq_ids}) == list(range(6))  # 3 prompts x 2 samples


def test_a_published_version_is_judged_paired_on_the_rows_captured_after_it(model: DecoderModel,
                                                                             tmp_path: Path) -> None:
    """Round 1 publishes v1; no round runs until v1 is judged on rows captured after it (test, then
    train): v1 against the head it replaced, both on the same rows, kept. Then a version that loses
    on the rows after it is reverted: the head it replaced is published again."""
    workload, _ = _workload(tmp_path)
    lines = workload.read_text().splitlines(keepends=True)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("".join(lines[:16]))
    second.write_text("".join(lines[16:]))
    sig, root, tok = tmp_path / "signals", tmp_path / "drafter", tiny_tokenizer(V)
    capture_from_workload(model, tok, str(first), sig, max_tokens=40, progress=False)
    cfg = TrainerConfig(signal_dir=str(sig), publish_root=str(root), max_steps=120, batch_segments=8, lr=3e-3,
                        gamma=4, heldout_frac=0.5, min_signals=1, served_judge_rows=200, progress=False)
    trainer = DraftTrainer(cfg, model.cfg, model.embed_tokens)
    fresh = trainer.current
    r = trainer.run_round()
    assert r is not None and r.published_version == 1
    assert trainer.awaiting is not None and trainer.awaiting.parent is fresh
    round_end = trainer.state.last_shard_id
    assert trainer.run_round() is None and trainer.state.judgements == []  # no rows after v1 yet

    capture_from_workload(model, tok, str(second), sig, max_tokens=40, progress=False)
    second_rows = sum(i.num_signals for i in trainer.pending_signals())
    r2 = trainer.run_round()  # judges v1 first, then trains on the same rows
    (j,) = trainer.state.judgements
    assert j["version"] == 1 and j["replaced_version"] == 0 and j["reverted_as"] is None
    assert j["judged_rows"] == second_rows >= 200 and j["accept_len"] > j["replaced_accept_len"] + 0.3, j
    assert r2 is not None and r2.parent_version == 1  # the judged rows then trained the next round
    assert json.loads((root / TRAINER_STATE_NAME).read_text())["judgements"] == [j]

    # a version that loses on the rows after it: say the fresh head had been published in place of
    # the newest trained one; judged on the rows after round 1, the trained head is published again
    best, best_version = trainer.current, trainer.current_version
    newest = latest_version(root)
    trainer.awaiting = Awaiting(newest, best, best_version, round_end)
    trainer.current = fresh
    j2 = trainer.judge_served()
    assert j2 is not None and j2["reverted_as"] == newest + 1 == latest_version(root)
    assert j2["accept_len"] < j2["replaced_accept_len"] and trainer.awaiting is None
    restored = load_version(root, newest + 1)
    assert restored.metrics["reverts"] == newest and restored.metrics["restores"] == best_version
    assert trainer.current is best and trainer.current_version == newest + 1
    assert all(torch.equal(t, best.state_dict()[k].to(t.dtype)) for k, t in restored.state_dict.items())


def test_a_round_widens_the_draft_vocabulary_by_the_tokens_its_rows_lack(model: DecoderModel, tmp_path: Path) -> None:
    """A 16-token head (ids 0..15); the round's rows hold 20 three times, 21 twice, 22 once and 3 (its
    own) five times -> 20 and 21 join (22 is seen once), most frequent first, within --widen-vocab and
    --max-draft-vocab; the head's own rows stay as they were."""
    cfg = TrainerConfig(signal_dir=str(tmp_path / "s"), publish_root=str(tmp_path / "p"), draft_vocab=16,
                        widen_vocab=8, progress=False)
    trainer = DraftTrainer(cfg, model.cfg, model.embed_tokens, target=model)
    head = trainer.current
    assert head.cfg.draft_vocab_size == 16 and head.t2d[:16].all() and not head.t2d[16:].any()
    tokens = torch.tensor([20, 20, 20, 21, 21, 22, 3, 3, 3, 3, 3])
    rows = [SignalSegment(torch.zeros(len(tokens) - 1, head.cfg.tap_size, dtype=torch.float64), tokens, None, 0)]
    wide = trainer._widened(head, rows)
    assert wide.cfg.draft_vocab_size == 18
    assert wide.t2d[[20, 21]].all() and not wide.t2d[22] and wide.t2d[:16].all()
    own = torch.arange(16)
    assert torch.equal(wide.output_rows(own, model.lm_head.weight), head.lm_head.weight[own])
    trainer.cfg.widen_vocab = 1  # room for the most frequent one only
    assert trainer._widened(head, rows).t2d[20] and trainer._widened(head, rows).cfg.draft_vocab_size == 17
    trainer.cfg.widen_vocab, trainer.cfg.max_draft_vocab = 8, 16  # no room: the head as it is
    assert trainer._widened(head, rows) is head
    trainer.cfg.max_draft_vocab, trainer.cfg.widen_vocab = 64, 0  # off
    assert trainer._widened(head, rows) is head


def test_a_lineage_from_a_trained_head_fine_tunes_at_finetune_lr(model: DecoderModel, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds whose versions descend from a trained head (published as v1 before the trainer starts, as
    the server does with the shipped head) train at --finetune-lr; a lineage the trainer started from
    a fresh head keeps --lr in every round, and remembers that across restarts."""
    workload, _ = _workload(tmp_path)
    sig = tmp_path / "signals"
    capture_from_workload(model, tiny_tokenizer(V), str(workload), sig, max_tokens=20, progress=False)
    rates: list[float | None] = []
    monkeypatch.setattr(DraftTrainer, "train_head",
                        lambda self, head, train, seed, on_step=None, lr=None: rates.append(lr) or 1.0)

    def trainer(root: Path) -> DraftTrainer:
        cfg = TrainerConfig(signal_dir=str(sig), publish_root=str(root), min_signals=1, lr=3e-3, finetune_lr=2e-4,
                            served_judge_rows=0, progress=False)
        return DraftTrainer(cfg, model.cfg, model.embed_tokens)

    fresh = trainer(tmp_path / "fresh")
    assert fresh.run_round() is not None and fresh.state.fresh_start and rates == [3e-3]
    publish(tmp_path / "fresh", fresh.current, {})  # v1 of a lineage that started fresh
    fresh.state.last_shard_id = None  # the same rows again, now from v1
    assert fresh.run_round() is not None and fresh.current_version == 1 and rates == [3e-3, 3e-3]
    again = trainer(tmp_path / "fresh")  # a restart reads the lineage from trainer_state.json
    again.state.last_shard_id = None
    assert again.state.fresh_start and again.run_round() is not None and rates[-1] == 3e-3

    shipped = tmp_path / "shipped"
    publish(shipped, fresh.current, {})  # v1: a trained head, before the trainer ever ran
    tuned = trainer(shipped)
    assert tuned.run_round() is not None and not tuned.state.fresh_start and rates[-1] == 2e-4


def test_a_round_on_few_rows_trains_at_least_min_steps(model: DecoderModel, tmp_path: Path) -> None:
    """Three short segments, batch 8, 2 epochs: the passes alone make 1 step; --min-steps 5 makes 5;
    --max-steps still sets the count exactly (below --min-steps too)."""
    cfg = TrainerConfig(signal_dir=str(tmp_path / "s"), publish_root=str(tmp_path / "p"), draft_vocab=16,
                        batch_segments=8, epochs=2.0, min_steps=5, progress=False)
    trainer = DraftTrainer(cfg, model.cfg, model.embed_tokens, target=model)
    width = trainer.current.cfg.tap_size
    rows = [SignalSegment(torch.randn(6, width, dtype=torch.float64), torch.randint(0, 16, (7,)), None, 0)
            for _ in range(3)]

    def steps_of(**changes: int) -> int:
        for name, value in changes.items():
            setattr(trainer.cfg, name, value)
        seen: list[int] = []
        trainer.train_head(trainer.current.train(), rows, seed=0, on_step=lambda step, loss: seen.append(step))
        return len(seen)

    assert steps_of() == 5
    assert steps_of(min_steps=0) == 1
    assert steps_of(max_steps=3, min_steps=5) == 3
    with pytest.raises(TrainerConfigError, match="min_steps must be >= 0"):
        TrainerConfig(signal_dir="s", publish_root="p", min_steps=-1)


def test_an_unpublished_round_that_gained_is_where_the_next_round_trains_on_from(
        model: DecoderModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 1 gains on average but not beyond its interval: not published, carried; round 2 trains on
    from that candidate. A round that lost on average is not carried; a publication ends the carry;
    --no-carry-unpublished starts every round from the published head."""
    workload, _ = _workload(tmp_path)
    sig, root = tmp_path / "signals", tmp_path / "drafter"
    capture_from_workload(model, tiny_tokenizer(V), str(workload), sig, max_tokens=20, progress=False)
    starts: list[object] = []  # the head each round trained, and its output weights before training

    def train(self: DraftTrainer, head: object, train: object, seed: int, on_step: object = None,
              lr: object = None) -> float:
        starts.append((head, head.lm_head.weight.detach().clone()))
        with torch.no_grad():
            head.lm_head.weight += 1.0  # "training": each round moves its head by 1
        return 1.0

    monkeypatch.setattr(DraftTrainer, "train_head", train)
    gains = iter([(1.0, 1.2, -0.1), (1.0, 0.9, -0.3), (1.0, 1.1, -0.1), (1.0, 1.5, 0.2)])  # base, cand, low

    def judge(self: DraftTrainer, base: object, cand: object, rows: object) -> PairedJudgement:
        b, c, low = next(gains)
        return PairedJudgement(10, 1, 2, b, c, b, c, low, c - b + 0.1, 0.9)

    monkeypatch.setattr(DraftTrainer, "_judge", judge)
    publish(root, DraftTrainer(TrainerConfig(signal_dir=str(sig), publish_root=str(tmp_path / "x"), progress=False),
                               model.cfg, model.embed_tokens).current, {})  # v1: a trained head
    cfg = TrainerConfig(signal_dir=str(sig), publish_root=str(root), min_signals=1, widen_vocab=0,
                        served_judge_rows=0, progress=False)
    trainer = DraftTrainer(cfg, model.cfg, model.embed_tokens)

    def again() -> None:
        trainer.state.last_shard_id = None  # the same rows once more
        assert trainer.run_round() is not None

    v1 = trainer.current.lm_head.weight.detach().clone()
    again()  # gained 0.2 on average, interval below 0: carried
    assert trainer.current_version == 1 and trainer.carry is starts[0][0]
    again()  # trains on from round 1's candidate (v1 + 1); lost on average: nothing carried
    assert starts[1][0] is not starts[0][0] and torch.equal(starts[1][1], v1 + 1.0)
    assert trainer.carry is None
    again()  # from v1 again; gained: carried
    assert torch.equal(starts[2][1], v1)
    again()  # trains on from it, and is published: the carry ends there
    assert torch.equal(starts[3][1], v1 + 1.0)
    assert trainer.current_version == 2 and trainer.carry is None
    trainer.cfg.carry_unpublished = False
    gains = iter([(1.0, 1.2, -0.1)])
    again()
    assert trainer.carry is None
