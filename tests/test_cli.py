"""The CLI turns bad input into one-line ``error: ...`` messages with exit code 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_hf_model, write_tiny_checkpoint
from tidespec import demo
from tidespec.cli import main
from tidespec.demo import main as demo_main


@pytest.mark.parametrize("argv,needle", [
    (["generate", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["generate", "hi", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["generate", "hi", "--model", "/nonexistent/model"], "/nonexistent/model"),
    (["generate", "hi", "--num-speculative-tokens", "-2"], "num_speculative_tokens"),
    (["generate", "hi", "--drafter", "ngram", "--ngram-min", "5", "--ngram-max", "2"], "ngram_min"),
    (["generate", "hi", "--threads", str(2**64)], "threads must be <= 4096"),
    (["generate", "hi", "--drafter", "suffix", "--suffix-max-tree-tokens", "-1"], "suffix_max_tree_tokens"),
    (["generate", "hi", "--drafter", "suffix", "--suffix-factor", "0"], "suffix_factor must be > 0"),
    (["generate", "hi", "--max-num-seqs", str(10**20), "--no-row-invariant"], "lower --max-num-seqs or --max-model-len"),
    (["generate", "hi", "--kv-cache-memory-mb", str(10**20)], "memory available; lower it"),
    # slots of --max-model-len (a target that is not row-invariant); the paged cache takes what memory holds
    (["generate", "hi", "--max-num-seqs", str(10**7), "--no-row-invariant"], "of memory is available; lower --max-num-seqs"),
    (["generate", "hi", "--max-num-seqs", str(10**7), "--kv-overcommit", "--no-row-invariant"],
     "out of memory; lower --max-num-seqs"),
    (["bench", "load", "--threads", "0"], "threads must be in [1, 4096]"),
    (["generate", "hi", "--drafter", "bogus"], "unknown drafter 'bogus': drafter must be one of none, draft-model"),
    (["serve", "--drafter", "suffix,bogus"], "unknown drafter 'bogus'"),
    (["generate", "hi", "--drafter-modules", "no_such_module_xyz", "--drafter", "x"], "cannot import"),
    (["synth-prompts", "--out", "never-written.jsonl", "--count", "1", "--threads", str(2**64)],
     "threads must be <= 4096"),
    (["train-drafter", "--signal-dir", "s", "--publish-root", "p", "--threads", str(2**64)], "threads must be <= 4096"),
])
def test_bad_input_gives_one_line_error(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("argv", [["generate", "hi"], ["bench", "anchor"], ["bench", "profile"],
                                  ["bench", "spec"], ["bench", "decode"]])
@pytest.mark.parametrize("device,needle", [("cuda", "CUDA is not available"), ("cuda:x", "bad device")])
def test_a_device_this_machine_lacks_is_a_one_line_error(argv, device, needle, capsys):
    assert main([*argv, "--device", device]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv", [["generate", "hi", "--suffix-factor", "nan"],
                                  ["generate", "hi", "--guard-temperature", "inf"],
                                  ["bench", "spec", "--suffix-min-prob=-inf"], ["serve", "--online-poll-s", "nan"],
                                  ["serve", "--header-timeout", "nan"], ["bench", "load", "--duration", "inf"],
                                  ["bench", "serve", "--timeout", "nan"]])
def test_a_float_flag_must_be_finite(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "must be a finite number" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["bench", "spec"], ["bench", "anchor"], ["bench", "load"], ["bench", "serve"]])
def test_an_output_directory_that_cannot_be_written_is_refused_before_the_run(command, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exc:
        main([*command, "--out", str(tmp_path / "file" / "x")])
    assert exc.value.code == 2 and "argument --out: cannot write to" in capsys.readouterr().err
    # a writable one passes the check and is not left behind by it: the run fails on another flag
    assert main(["bench", "spec", "--out", str(tmp_path / "a" / "b"), "--drafters", "bogus"]) == 2
    assert "unknown drafter" in capsys.readouterr().err and not (tmp_path / "a").exists()


@pytest.mark.parametrize("command", [["synth-prompts"], ["mine-prompts"]])
def test_a_prompt_file_that_cannot_be_written_is_refused_before_the_prompts_are_made(command, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main([*command, "--out", str(tmp_path / "file" / "x.jsonl"), "--count", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --out: cannot write to") and len(err.splitlines()) == 1


@pytest.mark.parametrize("text", ['{"bad json', "[1, 2]", '{"version": 999}', '{"version": 1}'])
def test_a_profile_that_is_not_one_is_a_one_line_error(text, tmp_path, capsys):
    bad = tmp_path / "profile.json"
    bad.write_text(text)
    argv = ["generate", "hi", "--drafter", "suffix", "--policy", "analytic", "--profile", str(bad)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {bad} is not a tidespec profile") and len(err.splitlines()) == 1


def test_non_model_file_is_one_line_error(tmp_path, capsys):
    junk = tmp_path / "weights.gguf"
    junk.write_text("not a model")
    assert main(["generate", "hi", "--model", str(junk)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1


@pytest.mark.integration
def test_prompt_longer_than_context_is_one_line_error(capsys):
    assert main(["generate", "word " * 200, "--max-model-len", "64", "--max-tokens", "8"]) == 2
    err = capsys.readouterr().err.strip()
    # a first load may print the one-time GGUF conversion progress before; the error is one line, last
    last = err.splitlines()[-1]
    assert last.startswith("error: ") and "exceeds the context" in last
    assert "Traceback" not in err and sum(line.startswith("error: ") for line in err.splitlines()) == 1


@pytest.mark.integration
def test_generate_prints_text_and_acceptance(capsys):
    assert main(["generate", "def add(a, b):\n    return a + b\n\ndef sub(a, b):", "--max-tokens", "16",
                 "--drafter", "ngram", "--max-model-len", "256", "--max-num-seqs", "1"]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip()
    assert "tok/s" in cap.err and "drafter ngram" in cap.err


@pytest.mark.slow  # 13 s of cold compile; --compile through the engine is checked in tests/models/test_compiled.py
def test_generate_with_compile_prints_the_warm_up_time(capsys, tmp_path: Path) -> None:
    """On a tiny checkpoint: what is tested is the CLI's report; compiling the embedded model takes
    minutes on 2 cores, and the exactness matrix's compiled cells pay that already."""
    hf, _ = tiny_hf_model("llama", torch.float32)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    assert main(["generate", "w5 w6 w7", "--model", str(ckpt), "--max-tokens", "8", "--compile",
                 "--max-model-len", "64", "--max-num-seqs", "1"]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip() and "[compiled the decode step in " in cap.err


@pytest.mark.parametrize("args, message", [
    (["--shift-workload", "nosuch"], "workload nosuch not found"),
    (["--shift-requests", "81"], "asks 81 requests of workload ru_topics, which has 80"),
    (["--shift-requests", "0"], "--shift-requests >= 1"),
])
def test_the_demo_checks_part_2s_trace_before_it_starts(args: list[str], message: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A bad trace for part 2 is a one-line error at once, not a traceback after part 1's minute."""
    with pytest.raises(SystemExit) as exc:
        demo_main(["--part", "online", *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_demo_runs_the_fastest_exact_path_that_starts_in_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: w4a8 eager (measured the fastest whole demo on 2 cores), saying how to compile; float32 on a CPU
    whose kernels cannot run w4a8, saying why; a path asked for is run as asked."""
    monkeypatch.setattr(demo, "a8_error", lambda: None)
    path, why = demo.choose_path("auto")
    assert path == "w4a8" and "--path w4a8+compile" in why
    monkeypatch.setattr(demo, "a8_error", lambda: "this CPU has no AVX512-VNNI")
    path, why = demo.choose_path("auto")
    assert path == "float32" and "no AVX512-VNNI" in why
    assert demo.choose_path("w4a8+compile") == ("w4a8+compile", "asked (--path)")


def test_the_demo_counts_each_drafters_share_of_the_sequence_steps() -> None:
    steps = [{"decode_seqs": 2, "by_drafter": {"suffix": 2, "eagle3": 0}},
             {"decode_seqs": 2, "by_drafter": {"suffix": 0, "eagle3": 1}},
             {"decode_seqs": 0, "by_drafter": {}}]  # a prefill step: no sequence-step
    assert demo.drafter_shares(steps) == {"eagle3": 0.25, "none": 0.25, "suffix": 0.5}
    assert demo.drafter_shares([]) == {}
