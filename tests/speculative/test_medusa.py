"""Medusa: heads trained on a tiny target's own outputs draft what it accepts; greedy output equals plain
decoding alone and batched, chains and trees; the tree keeps the likeliest paths; checkpoints round-trip
and a misfit is a one-line error. (Sampling: the chi-square test in test_spec_sampling.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_to_completion, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.errors import ConfigError
from tidespec.llm import build_drafter
from tidespec.models.medusa.heads import MedusaConfig, MedusaConfigError, MedusaHeads
from tidespec.online.training.medusa import MedusaTrainConfig, final_hidden, train_medusa
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.medusa import MedusaDrafter, MedusaOptions
from tidespec.speculative.policy.profiler import _DraftClock
from tidespec.speculative.registry import check_config

V = 48
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [3, 4], [20, 21, 22], [30, 31], [40, 41, 42], [1, 2, 3]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(V, layers=2, seed=3, scale=3.0)


def _run(model, spec: SpecConfig, prompts: list[list[int]], slots: int, max_tokens: int = 20):
    cfg = EngineConfig(cache=CacheConfig(max_model_len=64, max_num_seqs=slots), spec=spec)
    engine = LLMEngine(model, tiny_tokenizer(V), cfg, drafter=build_drafter(spec, model, slots, 64))
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    done = run_to_completion(engine)
    return ([done[i].token_ids for i in ids], sum(o.stats.num_draft_tokens for o in done.values()),
            sum(o.stats.num_accepted_tokens for o in done.values()))


@pytest.fixture(scope="module")
def trained(model, tmp_path_factory):
    """Heads trained on the target's greedy continuations of the prompts below and 16 more (what
    ``train-medusa`` does); a unit test of the mechanism, so the test prompts are among them."""
    prompts = PROMPTS + [[(7 * i + j) % (V - 1) + 1 for j in range(3 + i % 4)] for i in range(16)]
    outs, _, _ = _run(model, SpecConfig(), prompts, slots=8, max_tokens=24)
    sequences = [(p + o, len(p)) for p, o in zip(prompts, outs)]
    heads, report = train_medusa(model, sequences, MedusaTrainConfig(heads=3, vocab=V, epochs=40, lr=3e-3,
                                                                     batch_rows=64, held_out=0.2), progress=print)
    path = tmp_path_factory.mktemp("medusa")
    heads.save(path)
    return path, report


def test_training_teaches_the_heads_what_the_target_writes(model, trained) -> None:
    """Trained heads get more of their drafts accepted than zero-initialised ones (each of which repeats
    the target's next-token guess) on the same requests."""
    path, report = trained
    assert set(report) == {"before", "after"} and len(report["after"]) == 3
    accepted = {}
    for name, options in (("zero", MedusaOptions(heads=3)), ("trained", MedusaOptions(dir=str(path)))):
        spec = SpecConfig(drafter="medusa", num_speculative_tokens=3, options={"medusa": options})
        accepted[name] = _run(model, spec, PROMPTS, slots=4)[2]
    assert accepted["trained"] > 1.5 * accepted["zero"], accepted


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("slots", [1, 4])
def test_trained_heads_are_accepted_and_greedy_equals_plain(model, trained, tree: bool, slots: int) -> None:
    path, _ = trained
    plain, _, _ = _run(model, SpecConfig(), PROMPTS, slots)
    spec = SpecConfig(drafter="medusa", num_speculative_tokens=3, tree=tree,
                      options={"medusa": MedusaOptions(dir=str(path), top_k=2)})
    got, drafted, accepted = _run(model, spec, PROMPTS, slots)
    assert got == plain
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_the_tree_keeps_the_likeliest_paths() -> None:
    """The module docstring's example: head 1 a .6 / a' .35, head 2 b .5 / b' .4, gamma 3 -> [a, a', b]."""
    heads = MedusaHeads(MedusaConfig(hidden_size=4, num_heads=2, vocab_ids=[10, 11, 12, 13]))
    drafter = MedusaDrafter(heads, torch.zeros(16, 4), vocab_size=16, top_k=2)
    probs = torch.tensor([[0.6, 0.35, 0.03, 0.02], [0.5, 0.4, 0.05, 0.05]])
    draft = drafter._tree(probs.log(), 3)
    assert draft.token_ids == [10, 11, 10] and draft.parent_indices == [-1, -1, 0]
    assert drafter._tree(probs.log(), 4).parent_indices == [-1, -1, 0, 0]  # then a -> b' (.24), not a' -> b (.175)


def test_a_sequence_without_an_observed_last_row_is_cold(model) -> None:
    """Medusa drafts only from the hidden row that produced the sequence's last token."""
    heads = MedusaHeads(MedusaConfig(model.cfg.hidden_size, 2, list(range(V)), V))
    drafter = MedusaDrafter(heads, torch.randn(V, model.cfg.hidden_size), V)
    from tidespec.speculative.api import DraftInput, Observation
    ids = [5, 6, 7, 8]
    drafter.observe([Observation(0, ids, 3, None, 0, final_hidden(model, ids[:3]))])  # rows 0..2 -> token 8: ready
    drafter.observe([Observation(1, ids, 2, None, 0, final_hidden(model, ids[:2]))])  # a prompt chunk: not ready
    got = drafter.propose([DraftInput(0, ids, 2, SamplingParams()), DraftInput(1, ids, 2, SamplingParams()),
                           DraftInput(2, ids, 2, SamplingParams())])
    assert set(got.drafts) == {0} and got.cold == {1, 2} and got.drafts[0].num_tokens == 2


def test_the_profiler_times_medusa_drafting_with_hidden_states(model) -> None:
    heads = MedusaHeads(MedusaConfig(model.cfg.hidden_size, 3, list(range(V)), V))
    clock = _DraftClock(MedusaDrafter(heads, torch.randn(V, model.cfg.hidden_size), V), 0, torch.Generator(),
                        model.cfg.hidden_size)
    clock.step([[1, 2, 3, 4]], [0])
    assert clock.drafted == 1  # gamma 1: without hidden states it would be cold and time nothing


def test_checkpoints_round_trip_and_a_misfit_is_one_line(model, trained, tmp_path) -> None:
    path, _ = trained
    heads = MedusaHeads.load(path)
    assert heads.cfg.num_heads == 3 and heads.cfg.target_vocab_size == V
    other = tiny_llama(V, layers=1, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1)
    with pytest.raises(ConfigError, match="hidden size 32 and vocabulary 48, the target has 16"):
        build_drafter(SpecConfig(drafter="medusa", options={"medusa": MedusaOptions(dir=str(path))}), other, 1, 64)
    with pytest.raises(ConfigError, match="holds no Medusa heads"):
        build_drafter(SpecConfig(drafter="medusa", options={"medusa": MedusaOptions(dir=str(tmp_path))}), model, 1, 64)
    with pytest.raises(MedusaConfigError):
        MedusaConfig(hidden_size=8, num_heads=2, vocab_ids=[1, 1])
    with pytest.raises(ConfigError, match="drafts on the target's device"):
        check_config(EngineConfig(spec=SpecConfig(drafter="medusa", drafter_device="cuda")))


def test_train_medusa_writes_heads_the_drafter_loads(tmp_path, capsys) -> None:
    """``tidespec train-medusa`` end to end on a tiny checkpoint: continuations, training, the heads and
    their report written, then served by ``--medusa-dir``."""
    from tests.helpers import tiny_hf_model, write_tiny_checkpoint
    from tidespec.cli import main

    hf, _ = tiny_hf_model("llama", torch.float32)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    out = tmp_path / "heads"
    assert main(["train-medusa", "--model", str(ckpt), "--workloads", "code", "--limit", "4", "--max-tokens", "8",
                 "--epochs", "1", "--heads", "2", "--vocab", "16", "--exclude", "", "--out", str(out)]) == 0
    assert "held-out top-1 accuracy per head, after" in capsys.readouterr().out
    heads = MedusaHeads.load(out)
    assert heads.cfg.num_heads == 2 and (out / "report.json").is_file()
    assert main(["generate", "w5 w6 w7", "--model", str(ckpt), "--max-tokens", "8", "--drafter", "medusa",
                 "--medusa-dir", str(out)]) == 0


def test_medusa_beside_suffix_in_one_verification_equals_plain(model, trained) -> None:
    """Sequences of one batch drafted by suffix and by Medusa in the same step, the drafter switching
    per step and sequence (Medusa keeps observing every step, so it drafts whenever it is chosen)."""
    from tests.helpers import ScriptedPolicy

    path, _ = trained
    plain, _, _ = _run(model, SpecConfig(), PROMPTS, slots=4)
    spec = SpecConfig(drafter="suffix,medusa", num_speculative_tokens=3,
                      options={"medusa": MedusaOptions(dir=str(path))})
    policy = ScriptedPolicy(lambda step, i: (("suffix", "medusa")[(step + i) % 2], 1 + (step + 2 * i) % 3))
    cfg = EngineConfig(cache=CacheConfig(max_model_len=64, max_num_seqs=4), spec=spec)
    engine = LLMEngine(model, tiny_tokenizer(V), cfg, drafter=build_drafter(spec, model, 4, 64), policy=policy)
    ids = [engine.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in PROMPTS]
    done = run_to_completion(engine)
    assert [done[i].token_ids for i in ids] == plain
    mixed = [s for s in policy.seen if set(s.seq_drafters.values()) == {"suffix", "medusa"}]
    assert mixed, "no step verified both drafters' drafts together"
    medusa_accepted = sum(a for s in policy.seen for _, d, a in s.drafter_outcomes.get("medusa", []) if d)
    assert medusa_accepted > 0, "Medusa's drafts were never accepted beside suffix"
