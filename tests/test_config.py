"""The configuration tree: nested sections, the same CLI flags and defaults as before the nesting."""

from __future__ import annotations

import argparse

import pytest
import torch

from tidespec.cli import build_parser
from tidespec.config import EngineConfig, ModelConfig, OnlineTrainingConfig, SpecConfig
from tidespec.errors import ConfigError
from tidespec.flags import flag_defaults
from tidespec.models.quant.a8 import a8_error
from tidespec.server.cli import register as register_serve
from tidespec.speculative.drafters.eagle3_options import Eagle3Options, eagle3_options, head_quantization
from tidespec.speculative.drafters.ngram import NgramOptions
from tidespec.speculative.registry import add_engine_args, check_config, engine_config_from_args

# Every engine flag and its default as the flat SpecConfig (34 fields) had them, plus those added since
# (--quantization, --quant-group-size, --compile, --trainer-max-restarts, --trainer-backoff-max-s, --capture-idle-share,
# --drafter-device); nesting the config
# must not rename a flag or move a default (deliberate moves: --draft-vocab-core 4096 -> 0 = auto and
# --draft-vocab-buffer 256 -> 512, after the size sweep in docs/benchmarks/learning.md).
FLAGS = {
    '--model': None, '--dtype': 'float32', '--device': 'cpu', '--threads': 0, '--quantization': 'none',
    '--quant-group-size': 32, '--compile': False, '--enforce-eager': False, '--row-invariant': True,
    '--cuda-invariance': 'fixed-shape', '--max-model-len': 2048,
    '--max-num-seqs': 32, '--kv-overcommit': False, '--enable-prefix-caching': True, '--prefix-cache-mb': 1024,
    '--kv-cache-memory-mb': 0,
    '--block-size': 16, '--max-num-batched-tokens': 512, '--max-waiting': 0, '--drafter': 'none',
    '--drafter-modules': '',
    '--num-speculative-tokens': 4, '--tree': False, '--grammar-drafts': True, '--prediction-tokens': 16, '--drafter-device': '', '--ngram-min': 1, '--ngram-max': 4,
    '--suffix-max-tree-tokens': 20000, '--suffix-min-prob': 0.1, '--suffix-factor': 1.0, '--draft-model': None,
    '--draft-layers': 0, '--tree-top-k': 2, '--policy': 'static', '--profile': None, '--guard-kv-usage': 0.9,
    '--guard-temperature': 2.0, '--per-sequence': False, '--trim-drafts': True, '--measured-routes': False,
    '--gate-model-drafters': True,
    '--eagle3-dir': None, '--eagle3-draft-vocab': 0, '--eagle3-tree-depth': 5,
    '--eagle3-tree-top-k': 4, '--eagle3-dtype': 'auto', '--eagle3-min-draft-prob': 0.4,
    '--eagle3-quantization': 'auto', '--medusa-dir': None, '--medusa-heads': 4, '--medusa-vocab': 8192,
    '--medusa-top-k': 2,
    '--draft-vocab-mode': 'off', '--draft-vocab-core': 0, '--draft-vocab-buffer': 512,
    '--draft-vocab-max-insert': 32, '--draft-vocab-min-residency': 8,
    '--draft-vocab-corpus': 'drafter_boot,code_extra', '--online-training': False, '--signal-dir': None, '--signal-budget-mb': 2048,
    '--online-poll-s': 2.0, '--trainer-device': None, '--trainer-args': '', '--trainer-nice': 0,
    '--trainer-share': 0.02, '--rollback-min-drafts': 0, '--online-lora': True,
    '--trainer-max-restarts': 5, '--trainer-backoff-max-s': 60.0, '--capture-idle-share': 0.25,
    '--collect-force': False, '--collect-prompt': False, '--collect-bootstrap': False, '--collect-epsilon': 0.02,
    '--collect-n-init': 20, '--collect-n-threshold': 512, '--collect-lambda-short': 0.9,
    '--collect-lambda-long': 0.99, '--json-whitespace': 'compact',
}


def _flags(parser: argparse.ArgumentParser) -> dict[str, object]:
    return {a.option_strings[0]: a.default for a in parser._actions
            if a.option_strings and a.option_strings[0] in FLAGS}


def test_engine_flags_and_defaults_unchanged() -> None:
    """Every flag, the drafters' own among them (declared with each drafter since issue 80), is where it was."""
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)
    assert {a.option_strings[0]: a.default for a in engine._actions} == FLAGS
    assert set(flag_defaults(EngineConfig)) < set(FLAGS)  # the config tree's own, the drafters' options apart
    sub = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert _flags(sub["generate"]) == FLAGS and _flags(sub["profile"]) == FLAGS
    serve = argparse.ArgumentParser()
    register_serve(serve.add_subparsers())
    serve_flags = _flags(serve._subparsers._group_actions[0].choices["serve"])  # type: ignore[union-attr]
    assert serve_flags == {**FLAGS, "--max-waiting": 256}  # the server bounds its queue (HTTP 429 past it)


def test_flags_land_in_their_sections() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args([
        "--drafter", "eagle3", "--ngram-min", "2", "--draft-layers", "3", "--tree-top-k", "5", "--policy", "hybrid",
        "--guard-kv-usage", "0.5", "--eagle3-dir", "runs/d", "--online-training", "--collect-prompt",
        "--collect-n-init", "7", "--online-poll-s", "0.5"]))
    ngram, draft_model = cfg.spec.options["ngram"], cfg.spec.options["draft-model"]
    assert cfg.spec.drafter == "eagle3" and ngram.min == 2 and ngram.max == 4
    assert draft_model.layers == 3 and draft_model.tree_top_k == 5
    assert cfg.policy.name == "hybrid" and cfg.policy.guard_kv_usage == 0.5
    assert eagle3_options(cfg.spec).dir == "runs/d" and cfg.online.enabled and cfg.online.capture_prompt
    assert cfg.online.collect.n_init == 7 and cfg.online.poll_s == 0.5


@pytest.mark.parametrize("build", [
    lambda: SpecConfig(options={"ngram": NgramOptions(min=3, max=2)}),
    lambda: EngineConfig(spec=SpecConfig(drafter="ngram"), online=OnlineTrainingConfig(enabled=True)),
    lambda: SpecConfig(options={"not a name": NgramOptions()}),
    # the rules of a drafter's options that read other sections: its DrafterKind.check, before anything loads
    lambda: check_config(EngineConfig(model=ModelConfig(device="cuda"), spec=SpecConfig(
        drafter="eagle3", options={"eagle3": Eagle3Options(quantization="int8")}))),
    lambda: check_config(EngineConfig(spec=SpecConfig(drafter="eagle3"), online=OnlineTrainingConfig(enabled=True))),
    lambda: check_config(EngineConfig(spec=SpecConfig(drafter="ngram", options={"ngram": Eagle3Options()}))),
])
def test_sections_validate_on_construction(build) -> None:
    with pytest.raises(ConfigError):
        build()


def test_eagle3_quantization_auto_is_int8_on_a_cpu_only() -> None:
    """The head drafts with int8 weights on a CPU by default (bound by reading them there); a CUDA
    head stays float unless asked, and asking there is a one-line configuration error (above)."""
    assert head_quantization("auto", torch.device("cpu")) == ("w8a8" if a8_error() is None else "int8")
    assert head_quantization("auto", torch.device("cuda", 0)) == "none"
    assert head_quantization("int4", torch.device("cpu")) == "int4"
    EngineConfig(model=ModelConfig(device="cuda"), spec=SpecConfig(drafter="eagle3"))  # auto: fine anywhere
