"""Training prompts the trainer makes for itself: self-instructed chat queries and mined code prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import tiny_llama, tiny_tokenizer
from tidespec.cli import main as cli_main
from tidespec.online.prompts.codemine import mine_functions, prompts_from_source, python_files
from tidespec.online.prompts.selfinstruct import OverlapFilter, pre_query_text, synth_prompts
from tidespec.online.training.config import MinePromptsConfig, SynthPromptsConfig, TrainerConfigError
from tidespec.workloads.loader import load_workload, write_workload

VOCAB = 64


def _chat_tokenizer():  # a tiny word-level tokenizer with a template: "t1 <message> t0" per message
    tok = tiny_tokenizer(VOCAB)
    tok.chat_template = "{% for m in messages %}t1 {{ m['content'] }} t0 {% endfor %}"
    return tok


def test_pre_query_text_is_the_template_up_to_the_users_message(embedded) -> None:
    pre = pre_query_text(embedded.tokenizer)
    assert pre.endswith("<|im_start|>user\n") and "<|im_start|>system" in pre
    steered = pre_query_text(embedded.tokenizer, "You write Python.")
    assert "You write Python." in steered and steered.endswith("<|im_start|>user\n")
    assert pre_query_text(_chat_tokenizer()) == "t1 "
    with pytest.raises(TrainerConfigError, match="no chat template"):
        pre_query_text(tiny_tokenizer(VOCAB))


def test_overlap_filter_drops_repeats_and_held_out_runs() -> None:
    gate = OverlapFilter(["Write a haiku about the sea at night"], 5)
    assert not gate.admit("Please write a haiku about the sea")  # shares "write a haiku about the"
    assert gate.admit("Write a limerick")
    assert not gate.admit("write a LIMERICK!")  # a repeat, case and punctuation aside
    assert not gate.admit("  ")


def test_synth_prompts_keeps_finished_unique_queries_deterministically(tmp_path: Path) -> None:
    model, tok = tiny_llama(VOCAB, layers=2, seed=1), _chat_tokenizer()
    cfg = SynthPromptsConfig(out=str(tmp_path / "q.jsonl"), count=6, max_query_tokens=96, min_words=2,
                             temperature=1.0, progress=False)
    recs = synth_prompts(model, tok, cfg)
    assert len(recs) == 6 and len({r.prompt for r in recs}) == 6
    assert all(r.kind == "chat" and r.domain == "self_instruct" and len(r.prompt.split()) >= 2 for r in recs)
    assert [r.prompt for r in synth_prompts(model, tok, cfg)] == [r.prompt for r in recs]  # seeded
    write_workload(recs, cfg.out)
    assert [r.prompt for r in load_workload(cfg.out)] == [r.prompt for r in recs]
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"id": "h", "domain": "chat", "kind": "chat", "prompt": recs[2].prompt}) + "\n")
    again = synth_prompts(model, tok, SynthPromptsConfig(**{**cfg.__dict__, "exclude_workload": str(held),
                                                            "exclusion_ngram": 1000}))
    assert recs[2].prompt not in [r.prompt for r in again] and len(again) == 6
    # queries cut at the token limit are dropped; the attempt cap ends the search with fewer records
    cut = synth_prompts(model, tok, SynthPromptsConfig(out=cfg.out, count=6, max_query_tokens=1, min_words=1,
                                                       max_attempts=12, progress=False))
    assert len(cut) < 6


def test_synth_prompts_config_refuses_bad_values() -> None:
    with pytest.raises(TrainerConfigError, match="--out"):
        SynthPromptsConfig()
    with pytest.raises(TrainerConfigError, match="temperature"):
        SynthPromptsConfig(out="x", temperature=0.0)
    with pytest.raises(TrainerConfigError, match="top_p"):
        SynthPromptsConfig(out="x", top_p=0.0)
    assert SynthPromptsConfig(out="x", count=10).attempts == 40


SOURCE = '''
import os


def clamp(x: float, lo: float, hi: float) -> float:
    """Limit x to the closed interval from lo to hi."""
    return max(lo, min(hi, x))


@staticmethod
def joined(parts: list[str]) -> str:
    """Join the parts with the platform's path separator, in order."""
    return os.sep.join(parts)


def short():
    """Too short."""
    return 1


def undocumented():
    return 2


def only_doc():
    """A docstring and nothing else, like an abstract stub."""


class Box:
    def size(self) -> int:
        """A method: its class is not in the prompt, so it is skipped."""
        return 0
'''


def test_prompts_from_source_stop_at_the_docstring() -> None:
    got = prompts_from_source(SOURCE)
    assert got == [('def clamp(x: float, lo: float, hi: float) -> float:\n'
                    '    """Limit x to the closed interval from lo to hi."""\n'),
                   ('def joined(parts: list[str]) -> str:\n'
                    '    """Join the parts with the platform\'s path separator, in order."""\n')]
    assert prompts_from_source("def broken(:\n") == []
    assert prompts_from_source(SOURCE, max_chars=60) == []


def test_mine_functions_samples_dedupes_and_excludes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "a.py").write_text(SOURCE)
    (src / "pkg" / "b.py").write_text(SOURCE)  # the same functions again: dropped as repeats
    (src / "pkg" / "c.py").write_text('def area(r):\n    """Area of a circle of radius r, in square units."""\n'
                                      '    return 3.14159 * r * r\n')
    (src / "site-packages").mkdir()
    (src / "site-packages" / "d.py").write_text(SOURCE.replace("clamp", "clip"))
    assert [p.name for p in python_files([str(src)], ("site-packages",))] == ["a.py", "b.py", "c.py"]
    cfg = MinePromptsConfig(out=str(tmp_path / "m.jsonl"), source=str(src), count=10, progress=False)
    recs = mine_functions(cfg)
    # b.py repeats a.py; an explicit source is mined whole (site-packages is skipped only by default)
    assert sorted(r.prompt.split("(")[0] for r in recs) == ["def area", "def clamp", "def clip", "def joined"]
    assert all(r.kind == "completion" and r.domain == "code_mined" for r in recs)
    assert [r.prompt for r in mine_functions(cfg)] == [r.prompt for r in recs]  # seeded sample
    held = tmp_path / "held.jsonl"
    area = 'def area(r):\n    """Area of a circle of radius r, in square units."""\n'
    held.write_text(json.dumps({"id": "h", "domain": "code", "kind": "completion", "prompt": area}) + "\n")
    excluded = mine_functions(MinePromptsConfig(**{**cfg.__dict__, "exclude_workload": str(held)}))
    assert len(excluded) == 3 and not any("area" in r.prompt for r in excluded)
    assert len(mine_functions(MinePromptsConfig(**{**cfg.__dict__, "count": 2}))) == 2


def test_mine_prompts_command_writes_a_workload_and_never_overwrites(tmp_path: Path, capsys) -> None:
    (tmp_path / "a.py").write_text(SOURCE)
    out = tmp_path / "m.jsonl"
    assert cli_main(["mine-prompts", "--out", str(out), "--source", str(tmp_path / "a.py"), "--no-progress"]) == 0
    assert len(load_workload(out)) == 2
    before = out.read_text()
    assert cli_main(["mine-prompts", "--out", str(out), "--source", str(tmp_path / "a.py")]) == 2
    assert "exists" in capsys.readouterr().err and out.read_text() == before
    assert cli_main(["mine-prompts", "--out", str(tmp_path / "n.jsonl"), "--source", str(tmp_path / "nope")]) == 2
