"""Online rounds for Medusa heads (``online/training/medusa_rounds.py``): rows, the walk, a round that
publishes better heads, one that does not publish worse ones, and ``train-drafter --drafter medusa``."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import run_to_completion, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.files import latest_version
from tidespec.models.medusa.heads import MedusaConfig, MedusaHeads, latest_published, load_published, publish_heads
from tidespec.online.store import SignalShard, SignalStore
from tidespec.online.training.config import TrainerConfig, TrainerConfigError
from tidespec.online.training.medusa import final_hidden
from tidespec.online.training.medusa_rounds import MedusaTrainer, medusa_runs, walk_blocks
from tidespec.sampling import SamplingParams

V = 48


@pytest.fixture(scope="module")
def model():
    return tiny_llama(V, layers=2, seed=3, scale=3.0)


def _sequences(model, count: int, offset: int) -> list[list[int]]:
    """The target's greedy continuations (24 tokens) of ``count`` short prompts."""
    prompts = [[(7 * i + j + offset) % (V - 1) + 1 for j in range(3 + i % 4)] for i in range(count)]
    cfg = EngineConfig(cache=CacheConfig(max_model_len=64, max_num_seqs=8), spec=SpecConfig())
    engine = LLMEngine(model, tiny_tokenizer(V), cfg)
    ids = [engine.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in prompts]
    done = run_to_completion(engine)
    return [p + done[i].token_ids for p, i in zip(prompts, ids)]


def _shard(model, sequences: list[list[int]], first_seq: int) -> SignalShard:
    """Every position of ``sequences`` but the last as captured rows with the final hidden states."""
    hidden, tokens, nexts, seqs, pos = [], [], [], [], []
    for n, ids in enumerate(sequences):
        h = final_hidden(model, ids)  # [L, H]
        hidden.append(h[:-1])
        tokens += ids[:-1]
        nexts += ids[1:]
        seqs += [first_seq + n] * (len(ids) - 1)
        pos += list(range(len(ids) - 1))
    rows = len(tokens)
    return SignalShard(taps=torch.zeros(rows, 0), token_ids=torch.tensor(tokens), next_token_ids=torch.tensor(nexts),
                       seq_ids=torch.tensor(seqs), positions=torch.tensor(pos), hidden=torch.cat(hidden).float())


def _config(tmp_path, **kw) -> TrainerConfig:
    base = {"signal_dir": str(tmp_path / "signals"), "publish_root": str(tmp_path / "root"), "drafter": "medusa",
            "min_signals": 1, "epochs": 100.0, "medusa_lr": 1e-2, "heldout_frac": 0.25,
            "judge_min_sequences": 4, "gamma": 3, "progress": False}
    return TrainerConfig(**{**base, **kw})


def test_rows_are_labelled_with_the_tokens_each_head_drafts() -> None:
    """Positions 4, 5, 6, 9 of one sequence (next tokens 11, 12, 13, 14), 2 heads: a run 4..6 whose row 4
    teaches head 1 the token after 12 (13) and head 2 the one after that (past the run: -1)."""
    shard = SignalShard(taps=torch.zeros(4, 0), token_ids=torch.tensor([1, 2, 3, 4]),
                        next_token_ids=torch.tensor([11, 12, 13, 14]), seq_ids=torch.tensor([7, 7, 7, 7]),
                        positions=torch.tensor([4, 5, 6, 9]), hidden=torch.arange(8.0).reshape(4, 2))
    runs = medusa_runs([shard], num_heads=2)[7]
    assert [r.num_rows for r in runs] == [3, 1]
    assert runs[0].labels.tolist() == [[12, 13], [13, -1], [-1, -1]] and runs[1].labels.tolist() == [[-1, -1]]
    assert runs[0].hidden[:, 0].tolist() == [0.0, 2.0, 4.0]
    cut = medusa_runs([shard], num_heads=2, max_len=2)[7]
    assert [r.labels.tolist() for r in cut] == [[[12, 13], [13, -1]], [[-1, -1]], [[-1, -1]]]
    assert medusa_runs([SignalShard(taps=torch.zeros(1, 0), token_ids=torch.tensor([1]),
                                    next_token_ids=torch.tensor([2]), seq_ids=torch.tensor([1]),
                                    positions=torch.tensor([0]))], 2) == {}  # no hidden states: nothing


def test_the_walk_follows_a_greedy_server() -> None:
    """The module docstring's example: accepted 2, 0, 1, 2, 0, 0 -> rows 0 and 3 visited, 6 tokens in 2 steps;
    in blocks of 3 each block starts again at its first row."""
    assert walk_blocks([2, 0, 1, 2, 0, 0], block_rows=32) == [(2, 6)]
    assert walk_blocks([2, 0, 1, 2, 0, 0], block_rows=3) == [(1, 3), (1, 3)]
    assert walk_blocks([0, 0, 0], block_rows=2) == [(2, 2), (1, 1)]


def test_a_round_publishes_heads_that_draft_more_and_never_worse_ones(model, tmp_path) -> None:
    """Zero heads published as v1 (each repeats the target's next token); captured rows of 24 sequences, 12
    requests each served twice (a tiny random target's text does not generalise across prompts, so the
    held-out sequences' twins are in the training split, as repeated traffic is): the round fine-tunes the
    heads, the held-out walk gains and v2 is published, loads and fits the target;
    a second round (training on its new rows and, replayed, the first round's) whose candidate cannot gain
    (training rate tiny, the judgement demands a gain) publishes nothing."""
    root = tmp_path / "root"
    zero = MedusaHeads(MedusaConfig(model.cfg.hidden_size, 3, list(range(V)), V)).double()
    assert publish_heads(root, zero, {"bootstrap": "zero"}) == 1
    store = SignalStore(tmp_path / "signals", 1 << 30)
    twice = [seq for seq in _sequences(model, 12, 0) for _ in range(2)]  # twins side by side: one held out
    store.append(_shard(model, twice, first_seq=100))
    trainer = MedusaTrainer(_config(tmp_path), model)
    assert trainer.current_version == 1
    result = trainer.run_round()
    assert result is not None and result.published_version == 2, result
    assert result.candidate_accept_len > result.baseline_accept_len + 0.3, result
    assert latest_version(root) == 2
    heads, metrics = load_published(root, 2)
    assert metrics["parent_version"] == 1 and metrics["drafter"] == "medusa" and heads.cfg.num_heads == 3
    state = json.loads((root / "trainer_state.json").read_text())
    assert state["rounds"][0]["published_version"] == 2 and state["rounds"][0]["alpha_eval"] > 0
    assert latest_published(root, model.cfg.hidden_size, V)[0] == 2
    assert latest_published(root, model.cfg.hidden_size + 1, V) is None  # heads for another target: refused

    store.append(_shard(model, _sequences(model, 24, 5), first_seq=200))
    again = MedusaTrainer(_config(tmp_path, medusa_lr=1e-9, epochs=1.0, min_gain=0.05), model)
    assert again.current_version == 2
    first_rows = result.num_train_rows
    result = again.run_round()
    assert result is not None and result.published_version is None, result
    assert result.num_train_rows > first_rows + 300  # the first round's rows replayed beside the new ones
    assert latest_version(root) == 2
    assert again.run_round() is None  # every shard consumed: nothing new to train on


def test_train_drafter_medusa_bootstraps_from_a_workload_and_exports(tmp_path, capsys) -> None:
    """``tidespec train-drafter --drafter medusa --from-workload``: captured with hidden states, one round,
    the heads published and exported; a torchrun-free, tap-free path; its refusals are one line."""
    from tests.helpers import tiny_hf_model, write_tiny_checkpoint
    from tidespec.cli import main

    hf, _ = tiny_hf_model("llama", torch.float32)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    out = tmp_path / "export"
    args = ["train-drafter", "--drafter", "medusa", "--model", str(ckpt), "--from-workload", "code",
            "--workload-limit", "8", "--max-tokens", "16", "--signal-dir", str(tmp_path / "sig"),
            "--publish-root", str(tmp_path / "root"), "--once", "--no-progress", "--heldout-frac", "0.25",
            "--judge-confidence", "0", "--epochs", "2", "--export-dir", str(out)]
    assert main(args) == 0
    assert "round 1:" in capsys.readouterr().out
    assert latest_version(tmp_path / "root") == 1 and MedusaHeads.load(out).cfg.hidden_size == hf.config.hidden_size
    with pytest.raises(TrainerConfigError, match="no --lora, no --topk"):
        _config(tmp_path, topk=4)


def test_served_capture_trains_publishes_and_swaps_in_between_steps(model, tmp_path) -> None:
    """The whole loop on a tiny target: an engine drafts with Medusa heads from a publish root seeded with
    zero heads (``--online-training``'s start), captures rows of final hidden states (no taps) while it
    serves, a trainer round on them publishes v2, the updater loads it off the step and the engine
    swaps it in between steps; every output equals plain decoding's, before and after the swap; a
    broken v3 is refused in one line and serving goes on with v2."""
    from tidespec.llm import build_engine
    from tidespec.online.serving.attach import OnlineConfig, attach_online_training
    from tidespec.speculative.drafters.medusa import MedusaOptions

    root = tmp_path / "root"
    options = MedusaOptions(dir=str(root), heads=3, vocab=V)
    spec = SpecConfig(drafter="medusa", num_speculative_tokens=3, options={"medusa": options})
    config = EngineConfig(cache=CacheConfig(max_model_len=64, max_num_seqs=4), spec=spec)
    config.online.enabled = True
    engine = build_engine(config, model=model, tokenizer=tiny_tokenizer(V))
    assert latest_version(root) == 1 and engine.drafter.version == 1 and engine.drafter.versioned
    online = OnlineConfig.from_engine_config(config)
    assert online.drafter == "medusa" and not online.lora and online.collection.bootstrap  # seeded: collect
    online.capture_flush_rows = 64
    attached = attach_online_training(engine, online, start=False)
    prompts = [[(7 * i + j) % (V - 1) + 1 for j in range(3 + i % 4)] for i in range(12)]
    plain = _sequences(model, 12, 0)

    def serve() -> list[list[int]]:  # every request twice, side by side: one twin held out, one trained on
        twins = [p for p in prompts for _ in range(2)]
        ids = [engine.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in twins]
        done = run_to_completion(engine)
        return [p + done[i].token_ids for p, i in zip(twins, ids)][::2]

    assert serve() == plain
    attached.capture.close()
    shards = [s for _, s in SignalStore(online.signal_dir, 1 << 30).iter_shards()]
    assert shards and all(s.taps.shape[1] == 0 and s.hidden is not None for s in shards)
    result = MedusaTrainer(_config(tmp_path, signal_dir=online.signal_dir, publish_root=str(root)), model).run_round()
    assert result is not None and result.published_version == 2, result
    assert attached.updater.poll_once() == 2 and engine.drafter.version == 1  # parked, not yet swapped
    engine.step()  # an idle step runs the between-steps hooks
    assert engine.drafter.version == 2 and attached.state()["swaps"] == 1
    assert serve() == plain
    (root / "v3").mkdir()
    (root / "v3" / "medusa_config.json").write_text("{")
    (root / "v3" / "medusa_heads.safetensors").write_bytes(b"")
    (root / "LATEST").write_text("3\n")
    assert attached.updater.poll_once() is None and 3 in attached.updater.refused
    assert serve() == plain and engine.drafter.version == 2
    attached.close()


def test_a_round_widens_the_draft_vocabulary_by_the_tokens_its_rows_need(model, tmp_path) -> None:
    """Tokens of the round's rows outside the heads' vocabulary seen twice or more join it, most frequent
    first, up to --widen-vocab; the blocks are unchanged (the output rows are the target's own)."""
    from tidespec.online.training.medusa_rounds import MedusaRun

    trainer = MedusaTrainer(_config(tmp_path, widen_vocab=2), model)
    heads = MedusaHeads(MedusaConfig(model.cfg.hidden_size, 2, list(range(10)), V)).double()
    torch.nn.init.normal_(heads.blocks[0].weight)
    labels = torch.tensor([[20, -1], [20, 1], [21, 2], [20, 3], [21, -1], [22, -1], [23, 5], [23, 6], [23, 7]])
    run = MedusaRun(0, torch.zeros(labels.shape[0], model.cfg.hidden_size), labels)
    wide = trainer._widened(heads, [run])
    assert wide.cfg.vocab_ids == list(range(10)) + [20, 23]  # 20 and 23 three times each; 21 twice is past room
    assert torch.equal(wide.blocks[0].weight, heads.blocks[0].weight)
    assert trainer._widened(wide, [MedusaRun(0, run.hidden[:1], labels[:1])]) is wide  # once: nothing joins


def test_the_served_judgement_reverts_heads_that_lose_on_the_rows_after_them(model, tmp_path) -> None:
    """A published version is judged against the heads it replaced on the rows captured after its round,
    before any further round: trained heads against the zero ones they replaced are kept; heads that lose
    (random blocks, against trained ones) are reverted by publishing the replaced heads again, which servers
    swap in like any other version."""
    from tidespec.online.training.rounds import Awaiting

    root = tmp_path / "root"
    publish_heads(root, MedusaHeads(MedusaConfig(model.cfg.hidden_size, 3, list(range(V)), V)).double(), {})
    store = SignalStore(tmp_path / "signals", 1 << 30)
    twice = [seq for seq in _sequences(model, 12, 0) for _ in range(2)]
    store.append(_shard(model, twice, first_seq=100))
    trainer = MedusaTrainer(_config(tmp_path, judge_min_sequences=2), model)
    assert trainer.run_round().published_version == 2 and trainer.awaiting is not None  # v2 awaits its judgement
    store.append(_shard(model, twice, first_seq=150))
    kept = trainer.judge_served()  # v2 against the zero heads on the rows after it: kept
    assert kept is not None and kept["reverted_as"] is None and trainer.current_version == 2, kept
    good = trainer.current
    bad = MedusaHeads(MedusaConfig(model.cfg.hidden_size, 3, list(range(V)), V)).double()
    for block in bad.blocks:
        torch.nn.init.normal_(block.weight, std=3.0)
    trainer.current, trainer.current_version = bad, publish_heads(root, bad, {"round": 2})  # as if v3 were published
    trainer.awaiting = Awaiting(3, good, 2, store.list_shards()[-1].shard_id)
    assert trainer.run_round() is None  # no rows after v3 yet: it waits, and no round runs
    store.append(_shard(model, twice, first_seq=200))
    judgement = trainer.judge_served()
    assert judgement is not None and judgement["reverted_as"] == 4, judgement
    assert latest_version(root) == 4 and load_published(root, 4)[1]["reverts"] == 3
    assert trainer.current_version == 4 and trainer.awaiting is None
    assert json.loads((root / "trainer_state.json").read_text())["judgements"][-1]["reverted_as"] == 4


def test_seeding_a_root_publishes_the_starting_heads_once(model, tmp_path) -> None:
    """``--online-training``'s start: an empty root gets the heads a server starts from as v1 (zero heads off
    the embedded model), seeding again publishes nothing (processes seed under a lock), a heads directory
    is refused in one line."""
    import threading

    from tidespec.errors import ConfigError
    from tidespec.speculative.drafters.medusa import MedusaOptions, seed_medusa_root

    options = MedusaOptions(dir=str(tmp_path / "root"), heads=2, vocab=V)
    got: list[int | None] = []
    threads = [threading.Thread(target=lambda: got.append(seed_medusa_root(options, model))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got, key=str) == [1, None, None] and latest_version(tmp_path / "root") == 1
    assert load_published(tmp_path / "root", 1)[1]["bootstrap"] == "zero"
    MedusaHeads(MedusaConfig(model.cfg.hidden_size, 2, [1, 2], V)).save(tmp_path / "heads")
    with pytest.raises(ConfigError, match="holds one set of heads"):
        seed_medusa_root(MedusaOptions(dir=str(tmp_path / "heads")), model)
