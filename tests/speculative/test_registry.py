"""The drafter registry: built-in drafters are found, and a drafter in one file outside the package
(``tests/speculative/toy_drafter.py``) is built, run under a controller and served losslessly with
no edit anywhere else."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from fastapi.testclient import TestClient

from tests.helpers import run_to_completion, tiny_llama, tiny_tokenizer
from tests.speculative.toy_drafter import BigramDrafter
from tidespec.cli import build_parser
from tidespec.commands import parse
from tidespec.config import CacheConfig, DraftVocabConfig, EngineConfig, SchedulerConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.errors import ConfigError
from tidespec.llm import attach_draft_vocab, build_engine, with_shipped_head
from tidespec.models.eagle3.checkpoint import shipped_bootstrap
from tidespec.models.target import output_matrix
from tidespec.sampling import SamplingParams
from tidespec.server.app import ServerConfig, create_app
from tidespec.speculative.drafters.draft_model import DraftModelOptions
from tidespec.speculative.drafters.eagle3_options import Eagle3Options, eagle3_options
from tidespec.speculative.drafters.multi import MultiDrafter
from tidespec.speculative.drafters.ngram import NgramOptions
from tidespec.speculative.registry import build_drafter, drafter_kinds, engine_config_from_args, kinds_for

V = 48
TOY = "tests.speculative.toy_drafter"
# prompts that repeat themselves, so a bigram table has something to follow, and some that do not
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15, 16, 12, 13, 14, 15, 16, 12], [3, 3, 3, 3],
           [20, 21, 20, 22, 20, 21], [30, 31, 32, 33, 34, 35, 36, 37]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(V, layers=3, seed=2, scale=3.0)  # sharp: it repeats itself, drafts get accepted


def test_the_builtin_drafters_are_found_with_their_traits() -> None:
    kinds = drafter_kinds()
    assert sorted(kinds) == ["draft-model", "eagle3", "grammar", "medusa", "ngram", "suffix"]
    assert {n for n, k in kinds.items() if k.model_free} == {"grammar", "ngram", "suffix"}
    assert {n for n, k in kinds.items() if k.stateful} == {"draft-model", "eagle3"}
    assert {n: k.prefix for n, k in kinds.items() if k.options} == {"ngram": "ngram", "suffix": "suffix",
                                                                     "draft-model": "", "eagle3": "eagle3",
                                                                     "medusa": "medusa"}
    assert kinds["grammar"].options is None and kinds["ngram"].options_of(SpecConfig()) == NgramOptions()
    assert "bigram" not in kinds and drafter_kinds((TOY,))["bigram"].cls is BigramDrafter


def test_a_drafter_in_one_file_brings_its_own_flags(model, capsys) -> None:
    """The toy declares ``BigramOptions``; ``--drafter-modules`` makes its ``--bigram-max-draft`` a flag of
    every engine command (the built-in drafters' flags are found the same way), validated like any other,
    and the built drafter gets the value. Without the module the flag is unknown."""
    parser = build_parser()
    argv = ["generate", "hi", "--drafter-modules", TOY, "--drafter", "suffix,bigram", "--bigram-max-draft", "2",
            "--suffix-factor", "2.0"]
    config = engine_config_from_args(parse(parser, argv))
    assert config.spec.options["bigram"].max_draft == 2 and config.spec.options["suffix"].factor == 2.0
    multi = build_drafter(config.spec, model, 2, 96)
    assert isinstance(multi, MultiDrafter) and multi.members["bigram"].max_draft == 2
    for bad in (argv[:5] + ["--bigram-max-draft", "-1"],  # its bound (Section's min=0)
                ["generate", "hi", "--drafter", "suffix", "--bigram-max-draft", "2"]):  # no module: no flag
        with pytest.raises((SystemExit, ConfigError)):
            engine_config_from_args(parse(build_parser(), bad))
    assert "--bigram-max-draft" in capsys.readouterr().err  # the unknown flag, named by argparse


def _generate(model, spec: SpecConfig, slots: int) -> tuple[list[list[int]], int, int]:
    cfg = EngineConfig(cache=CacheConfig(max_model_len=128, max_num_seqs=slots), spec=spec)
    engine = LLMEngine(model, tiny_tokenizer(V), cfg, drafter=build_drafter(spec, model, slots, 128))
    ids = [engine.add_request(p, SamplingParams(max_tokens=64, ignore_eos=True)) for p in PROMPTS]
    done = run_to_completion(engine)
    return ([done[i].token_ids for i in ids], sum(o.stats.num_draft_tokens for o in done.values()),
            sum(o.stats.num_accepted_tokens for o in done.values()))


@pytest.mark.parametrize("slots", [1, len(PROMPTS)])
def test_a_drafter_in_one_file_is_lossless_alone_and_batched(model, slots: int) -> None:
    plain, _, _ = _generate(model, SpecConfig(), slots)
    spec = SpecConfig(drafter="bigram", drafter_modules=TOY, num_speculative_tokens=4)
    got, drafted, accepted = _generate(model, spec, slots)
    assert got == plain
    assert drafted > 0 and accepted > 0, "the toy never drafted or was never right: nothing was verified"


def test_a_drafter_in_one_file_joins_a_multi_drafter_with_its_traits(model) -> None:
    spec = SpecConfig(drafter="suffix,bigram", drafter_modules=TOY, num_speculative_tokens=3)
    multi = build_drafter(spec, model, 2, 96)
    assert isinstance(multi, MultiDrafter) and tuple(multi.members) == ("suffix", "bigram")
    assert multi.shadowed == {"suffix", "bigram"} and not multi.stateful and not multi.versioned
    assert multi.tapped is None and multi.vocab is None and multi.version == 0


def test_a_drafter_in_one_file_is_served_losslessly(model) -> None:
    """The toy through the HTTP server: every completion's text equals a plain server's."""
    tok = tiny_tokenizer(V)
    prompts = [" ".join(f"t{i}" for i in p) for p in PROMPTS]

    def serve(spec: SpecConfig) -> tuple[list[str], int]:
        cfg = EngineConfig(cache=CacheConfig(max_model_len=128, max_num_seqs=4),
                           scheduler=SchedulerConfig(max_waiting=16), spec=spec)
        engine = build_engine(cfg, model=model, tokenizer=tok)
        texts, drafted = [], 0
        with TestClient(create_app(engine, ServerConfig(served_model_name="tiny"))) as client:
            for prompt in prompts:
                r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 48,
                                                         "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                texts.append(r.json()["choices"][0]["text"])
                drafted += r.json()["usage"].get("draft_tokens", 0)
        return texts, drafted

    plain, _ = serve(SpecConfig())
    toy, drafted = serve(SpecConfig(drafter="bigram", drafter_modules=TOY, num_speculative_tokens=4))
    assert toy == plain and drafted > 0


@pytest.mark.parametrize("spec,message", [
    (SpecConfig(drafter="bogus"), "unknown drafter 'bogus': drafter must be one of none, draft-model, eagle3, grammar, "
                                  "medusa, ngram, suffix"),
    (SpecConfig(drafter="ngram", drafter_modules="no_such_module_xyz"), "cannot import 'no_such_module_xyz'"),
    (SpecConfig(drafter="ngram", drafter_modules="tests.helpers"), "'tests.helpers' defines no DRAFTER"),
    (SpecConfig(drafter="bigram"), "unknown drafter 'bigram'"),  # defined, but its module not named
])
def test_unknown_drafters_and_modules_are_one_line_errors(spec: SpecConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as exc:
        kinds_for(spec)
    assert "\n" not in str(exc.value)


def test_a_draft_vocabulary_goes_to_the_member_whose_output_layer_can_take_it(model, tmp_path) -> None:
    """``Drafter.vocab_output`` decides who drafts over V_t: the toy (no output layer) cannot, so
    alone it is a one-line error; beside a draft model the draft model gets the vocabulary."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "c-1", "domain": "toy", "kind": "completion",
                                  "prompt": "t5 t6 t7 t5 t6 t8 t9 t5"}) + "\n")
    vc = DraftVocabConfig(mode="static", core=6, corpus=str(corpus))
    toy = build_drafter(SpecConfig(drafter="bigram", drafter_modules=TOY), model, 1, 128)
    assert toy.vocab_output(output_matrix(model)) is None
    with pytest.raises(ConfigError, match="output layer can draft over it"):
        attach_draft_vocab(toy, vc, model, tiny_tokenizer(V))
    both = build_drafter(SpecConfig(drafter="bigram,draft-model", drafter_modules=TOY,
                                    options={"draft-model": DraftModelOptions(layers=1)}), model, 1, 128)
    vocab = attach_draft_vocab(both, vc, model, tiny_tokenizer(V))
    assert vocab is not None and both.members["draft-model"].vocab is vocab and both.members["bigram"].vocab is None
    ids = vocab.snapshot.ids.tolist()
    assert len(ids) == 6 and {5, 6, 7, 8, 9} <= set(ids)  # the corpus's tokens make the core
    rows = both.members["draft-model"].vocab_output(output_matrix(model)).rows_for(torch.tensor([5, 9]))
    assert torch.equal(rows, output_matrix(model)[[5, 9]])  # layers=1 shares the target's LM head



@pytest.mark.integration
def test_eagle3_without_a_dir_is_the_shipped_head_only_where_it_fits(model, embedded) -> None:
    """``--drafter eagle3`` on the embedded model drafts with the shipped head (a fresh random one
    would draft nothing accepted); a target it does not fit keeps a fresh head; a given directory
    and a spec without EAGLE-3 stay as they are."""
    spec = SpecConfig(drafter="eagle3", num_speculative_tokens=3)
    boot = shipped_bootstrap()
    assert boot is not None
    assert eagle3_options(with_shipped_head(spec, embedded.model.cfg)).dir == str(boot)
    assert with_shipped_head(spec, model.cfg) is spec  # a tiny target: the head does not fit
    mine = dataclasses.replace(spec, options={"eagle3": Eagle3Options(dir="/somewhere/else")})
    assert with_shipped_head(mine, embedded.model.cfg) is mine
    plain = SpecConfig(drafter="suffix")
    assert with_shipped_head(plain, embedded.model.cfg) is plain
    engine = build_engine(EngineConfig(spec=spec, cache=CacheConfig(max_model_len=128, max_num_seqs=1)),
                          model=embedded.model, tokenizer=embedded.tokenizer)
    assert eagle3_options(engine.config.spec).dir == str(boot)
