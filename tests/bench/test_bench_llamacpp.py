"""``tidespec bench decode --compare``: parsing and validation of the engine list, finding the GGUF
behind the target, the one-line notices when llama.cpp cannot run (llama-cpp-python missing,
target not a GGUF) with tidespec's own results still produced, and a run through llama.cpp's API
(a stand-in ``llama_cpp`` module: the library is optional). No test asserts a speed."""

from __future__ import annotations

import argparse
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_llama, tiny_tokenizer
from tidespec.bench.cli import register
from tidespec.bench.common.report import identical_prefix
from tidespec.bench.decode import llamacpp as llamacpp_mod
from tidespec.bench.decode import run as decode_mod
from tidespec.bench.decode.llamacpp import open_llamacpp, target_gguf
from tidespec.bench.decode.run import DecodeBenchConfig, parse_compare, run_decode_bench
from tidespec.config import ConfigError, ModelConfig
from tidespec.models.loading.loader import LoadedModel, converted_dir_for, resolve_embedded_gguf


def _tiny_target() -> LoadedModel:
    model = tiny_llama(dtype=torch.float32)
    return LoadedModel(model=model, tokenizer=tiny_tokenizer(64), config=model.cfg, path="")


def _workload(tmp_path: Path, n: int = 2) -> Path:
    lines = [json.dumps({"id": f"r{i}", "domain": "test", "kind": "completion",
                         "prompt": " ".join(f"t{20 + i + j}" for j in range(5))}) for i in range(n)]
    path = tmp_path / "wl.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(28))
    return path


# ----------------------------------------------------------------------------- --compare parsing


def test_parse_compare_and_config_validation() -> None:
    assert parse_compare(None) == ()
    assert parse_compare("hf,llamacpp") == ("hf", "llamacpp")
    assert parse_compare(" llamacpp , hf ") == ("llamacpp", "hf")
    with pytest.raises(ConfigError, match="comma-separated"):
        parse_compare(" , ")
    assert DecodeBenchConfig(compare=("llamacpp", "hf", "llamacpp")).compare == ("llamacpp", "hf")
    assert DecodeBenchConfig().compare == ()
    with pytest.raises(ConfigError, match="unknown --compare engine 'vllm'; choose from hf, llamacpp"):
        DecodeBenchConfig(compare=("hf", "vllm"))


def test_cli_compare_flag_is_validated_before_any_model_loads(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="tidespec")
    register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["bench", "decode", "--model", str(tmp_path / "missing"), "--compare", "hf,llama"])
    with pytest.raises(ConfigError, match="unknown --compare engine 'llama'"):
        ns.func(ns)
    ok = parser.parse_args(["bench", "decode", "--compare", "hf,llamacpp"])
    assert parse_compare(ok.compare) == ("hf", "llamacpp")


# ----------------------------------------------------------------------------- finding the GGUF


def test_target_gguf_resolution(tmp_path: Path) -> None:
    embedded = resolve_embedded_gguf()
    assert target_gguf(None, None) == (embedded, "")
    assert target_gguf(None, str(converted_dir_for(embedded))) == (embedded, "")  # the loaded conversion
    gguf, reason = target_gguf(None, str(tmp_path))  # a target loaded from somewhere else
    assert gguf is None and "not loaded from a GGUF file" in reason
    fake = _fake_gguf(tmp_path)
    assert target_gguf(str(fake), None) == (fake, "")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}", encoding="utf-8")
    gguf, reason = target_gguf(str(ckpt), None)
    assert gguf is None and reason == f"the target {ckpt} is not a GGUF file (llama.cpp runs GGUF files only)"


def test_identical_prefix() -> None:
    assert identical_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert identical_prefix([5], [6]) == 0
    assert identical_prefix([1, 2], [1, 2]) == 2


# ----------------------------------------------------------------------------- the notices


def test_open_llamacpp_not_installed_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # ``import llama_cpp`` raises ImportError
    runner, notice = open_llamacpp(_fake_gguf(tmp_path), "", n_ctx=64, n_threads=1, n_batch=64)
    assert runner is None and "\n" not in notice
    assert notice.startswith("llama.cpp comparison skipped: llama-cpp-python is not installed")
    assert "pip install llama-cpp-python==0.3.36" in notice
    runner, notice = open_llamacpp(None, "the target x is not a GGUF file", n_ctx=64, n_threads=1, n_batch=64)
    assert runner is None and notice == "llama.cpp comparison skipped: the target x is not a GGUF file"


def test_decode_bench_without_llamacpp_still_reports_tidespec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    fake = _fake_gguf(tmp_path)
    monkeypatch.setattr(decode_mod, "target_gguf", lambda model, loaded: (fake, ""))
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    cfg = DecodeBenchConfig(workload=str(_workload(tmp_path)), batch_sizes=(1, 2), max_tokens=4,
                            compare=("llamacpp",))
    out = tmp_path / "out"
    doc = run_decode_bench(cfg, _tiny_target(), out_dir=out, command="x")
    assert [(r["engine"], r["batch_size"]) for r in doc["rows"]] == [("tidespec", 1), ("tidespec", 2)]
    assert doc["rows"][0]["output_tokens"] == 2 * 4 and "llamacpp" not in doc["requests"]
    notice = doc["skipped"]["llamacpp"]
    assert notice.startswith("llama.cpp comparison skipped: llama-cpp-python is not installed")
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if "llama" in line] == [notice]  # one line, no traceback
    assert f"- {notice}" in captured.out and "| tidespec | 1 | 2 |" in captured.out
    assert json.loads((out / "results.json").read_text())["skipped"] == {"llamacpp": notice}


def test_decode_bench_llamacpp_on_a_non_gguf_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = DecodeBenchConfig(workload=str(_workload(tmp_path)), batch_sizes=(1,), max_tokens=3, compare=("llamacpp",))
    doc = run_decode_bench(cfg, _tiny_target(), out_dir=tmp_path / "out", echo=False)
    assert [r["engine"] for r in doc["rows"]] == ["tidespec"]
    assert "not loaded from a GGUF file" in doc["skipped"]["llamacpp"]
    assert doc["skipped"]["llamacpp"] in capsys.readouterr().err


# ----------------------------------------------------------------------------- a llama.cpp run


class _FakeLlama:
    """Stands in for ``llama_cpp.Llama`` (the library is optional and absent in CI): records how it
    was built and driven; greedy generation = the prompt's last token plus 1, 2, 3, ..."""

    built: list["_FakeLlama"] = []

    def __init__(self, **kwargs: object) -> None:
        self.kwargs = kwargs
        self.resets = 0
        self.n_batch = kwargs["n_batch"]
        _FakeLlama.built.append(self)

    def n_ctx(self) -> object:
        return self.kwargs["n_ctx"]

    def reset(self) -> None:
        self.resets += 1

    def generate(self, tokens: list[int], **sampling: object) -> Iterator[int]:
        assert sampling["temp"] == 0.0 and sampling["top_k"] == 1 and sampling["repeat_penalty"] == 1.0
        step = 0
        while True:  # never stops by itself, like llama.cpp's generator
            step += 1
            yield tokens[-1] + step


def test_decode_bench_runs_llamacpp_through_its_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison drives ``Llama`` with tidespec's threads, resets it per prompt, takes exactly
    ``max_tokens`` greedy tokens and reports them next to tidespec's rows."""
    fake_module = types.ModuleType("llama_cpp")
    fake_module.Llama = _FakeLlama  # type: ignore[attr-defined]
    fake_module.__version__ = "fake"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp", fake_module)
    monkeypatch.setattr(llamacpp_mod, "probe_default_kernels", lambda gguf, ids, timeout_s=0.0: "")
    gguf = _fake_gguf(tmp_path)
    monkeypatch.setattr(decode_mod, "target_gguf", lambda model, loaded: (gguf, ""))
    _FakeLlama.built.clear()
    cfg = DecodeBenchConfig(workload=str(_workload(tmp_path)), batch_sizes=(1,), max_tokens=4, compare=("llamacpp",),
                            warmup=False)
    doc = run_decode_bench(cfg, _tiny_target(), model_config=ModelConfig(), out_dir=tmp_path / "out", echo=False)
    assert doc["skipped"] == {}
    (llm,) = _FakeLlama.built
    assert llm.kwargs["model_path"] == str(gguf) and llm.kwargs["n_threads"] == torch.get_num_threads()
    assert llm.resets == 2  # one per prompt: no prefix reuse
    row = next(r for r in doc["rows"] if r["engine"] == "llama.cpp")
    assert row["batch_size"] == 1 and row["requests"] == 2 and row["output_tokens"] == 2 * 4
    assert row["tokens_per_s_vs_tidespec_b1"] > 0 and doc["headline"]["vs_llamacpp_decode_only"] > 0
    reqs = doc["requests"]["llamacpp"]
    assert [r["output_tokens"] for r in reqs] == [4, 4]
    assert all(0 <= r["identical_prefix_vs_tidespec"] <= 4 for r in reqs)
    assert row["identical_prefix_vs_tidespec"]["per_prompt"] == [r["identical_prefix_vs_tidespec"] for r in reqs]


def test_extra_buffer_types_are_off_only_while_constructing() -> None:
    from types import SimpleNamespace

    from tidespec.bench.decode.llamacpp import _without_extra_buffer_types

    def defaults() -> SimpleNamespace:
        return SimpleNamespace(use_extra_bufts=True, n_gpu_layers=0)

    module = SimpleNamespace(llama_cpp=SimpleNamespace(llama_model_default_params=defaults))
    with _without_extra_buffer_types(module):
        params = module.llama_cpp.llama_model_default_params()
        assert params.use_extra_bufts is False and params.n_gpu_layers == 0
    assert module.llama_cpp.llama_model_default_params is defaults
    with pytest.raises(RuntimeError), _without_extra_buffer_types(module):
        raise RuntimeError("load failed")
    assert module.llama_cpp.llama_model_default_params is defaults


def test_probe_reports_a_failing_load_in_one_line(tmp_path: Path) -> None:
    """The child fails on the fake file (or, without llama-cpp-python, on the import): one line."""
    from tidespec.bench.decode.llamacpp import probe_default_kernels

    note = probe_default_kernels(_fake_gguf(tmp_path), [1, 2])
    assert note.startswith("a probe with llama.cpp's default kernels failed: ") and "\n" not in note


# ----------------------------------------------------------------------------- batches and long prompts


def test_lengthened_prompts_keep_their_own_tokens_last() -> None:
    from tidespec.workloads.loader import Prompt, WorkloadRecord, lengthened

    def prompt(i: int, ids: list[int]) -> Prompt:
        return Prompt(WorkloadRecord(id=f"p{i}", domain="d", kind="completion", prompt="x"), ids)

    prompts = [prompt(0, [1, 2]), prompt(1, [3]), prompt(2, [4, 5, 6])]
    assert [p.token_ids for p in lengthened(prompts, 4)] == [[5, 6, 1, 2], [6, 1, 2, 3], [3, 4, 5, 6]]
    assert [p.token_ids for p in lengthened(prompts, 2)] == [[1, 2], [2, 3], [5, 6]]  # longer: its last tokens
    long = lengthened(prompts, 11)
    assert [len(p.token_ids) for p in long] == [11] * 3 and long[1].token_ids[-1] == 3
    assert [p.record.id for p in long] == ["p0", "p1", "p2"]
    assert lengthened([prompt(0, [7, 8])], 5)[0].token_ids == [8, 7, 8, 7, 8]  # alone: itself as context
    with pytest.raises(ConfigError, match="prompt tokens must be >= 0"):
        DecodeBenchConfig(prompt_tokens=-1)


class _FakeRunner:
    """A ``LlamaCppRunner`` stand-in: greedy = the prompt's last token plus 1, 2, ...; records the waves."""

    def __init__(self) -> None:
        self.note, self.waves, self.closed = "", [], False

    def settings(self) -> dict[str, object]:
        return {"fake": True}

    def generate(self, ids: list[int], max_tokens: int) -> llamacpp_mod.LlamaCppRun:
        return llamacpp_mod.LlamaCppRun([ids[-1] + k for k in range(1, max_tokens + 1)], 0.01, 0.02)

    def generate_batch(self, prompts: list[list[int]], max_tokens: int) -> list[llamacpp_mod.LlamaCppRun]:
        self.waves.append(len(prompts))
        return [llamacpp_mod.LlamaCppRun([ids[-1] + k for k in range(1, max_tokens + 1)], 0.01 * (j + 1), 0.05)
                for j, ids in enumerate(prompts)]

    def close(self) -> None:
        self.closed = True


def test_llamacpp_runs_every_batch_size_wave_by_wave(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At batch B > 1 llama.cpp decodes each of our waves' prompts together, right after ours: a row per
    batch size, the headline per batch size (time to first token included), the runner freed at the end."""
    runner = _FakeRunner()
    monkeypatch.setattr(decode_mod, "open_llamacpp", lambda gguf, reason, **kw: (runner, ""))
    monkeypatch.setattr(decode_mod, "target_gguf", lambda model, loaded: (_fake_gguf(tmp_path), ""))
    cfg = DecodeBenchConfig(workload=str(_workload(tmp_path, n=3)), batch_sizes=(1, 2), max_tokens=4,
                            compare=("llamacpp",), warmup=False, prompt_tokens=9)
    doc = run_decode_bench(cfg, _tiny_target(), model_config=ModelConfig(), out_dir=tmp_path / "out", echo=False)
    assert [(r["engine"], r["batch_size"], r["requests"]) for r in doc["rows"]] == [
        ("tidespec", 1, 3), ("tidespec", 2, 4), ("llama.cpp", 1, 3), ("llama.cpp", 2, 4)]
    assert runner.waves == [2, 2] and runner.closed
    b2 = doc["rows"][3]
    assert b2["output_tokens"] == 4 * 4 and b2["wall_time_s"] == pytest.approx(2 * 0.05)
    assert b2["decode_tokens_per_s"] == pytest.approx(4 * 3 / (2 * (0.05 - 0.02)))
    assert [r["prompt_tokens"] for r in doc["requests"]["llamacpp-b2"]] == [9] * 4
    head = doc["headline"]
    assert {"vs_llamacpp_with_prefill", "vs_llamacpp_ttft", "vs_llamacpp_b2_decode_only", "vs_llamacpp_b2_ttft"} <= set(head)
    report = (tmp_path / "out" / "table.md").read_text()
    assert "tidespec / llama.cpp (llama-cpp-python, same GGUF) at batch 2:" in report


def test_real_llamacpp_batch_of_one_is_its_generate(tmp_path: Path) -> None:
    """With llama-cpp-python installed (not in CI): the batched path decodes a lone prompt exactly as
    ``Llama.generate`` does, and a batch of two gives each prompt its tokens and a first-token time."""
    pytest.importorskip("llama_cpp")
    runner, notice = open_llamacpp(resolve_embedded_gguf(), "", n_ctx=64, n_threads=1, n_batch=64, probe_ids=[1, 2, 3])
    assert runner is not None, notice
    try:
        a, b = list(range(100, 120)), list(range(300, 310))
        alone = runner.generate(a, 5)
        (one,) = runner.generate_batch([a], 5)
        assert one.token_ids == alone.token_ids
        two = runner.generate_batch([a, b], 5)
        assert [len(r.token_ids) for r in two] == [5, 5] and all(0 < r.ttft <= r.latency for r in two)
    finally:
        runner.close()
