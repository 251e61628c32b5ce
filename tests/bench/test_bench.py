"""Tests of the benchmark suite: workload parsing and errors, the report helpers (hand-traced),
byte counts of the bandwidth ceiling, and smoke runs of every bench on tiny models that check
the files and the structure of the results (never wall-clock numbers)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import tiny_hf_model, tiny_llama, tiny_tokenizer, write_tiny_checkpoint
from tidespec.bench.cli import register
from tidespec.bench.common.report import command_line, markdown_table, percentile, summarize
from tidespec.bench.decode.run import DecodeBenchConfig, RequestRecord, run_decode_bench, wave_indices
from tidespec.bench.profile.run import ProfileConfig, kv_bytes_per_token, run_profile, weight_bytes_per_token
from tidespec.bench.spec import run as spec_bench
from tidespec.bench.spec.run import HeadVariant, SpecBenchConfig, _pooled_tpot, run_spec_bench
from tidespec.config import ConfigError, DraftVocabConfig, EngineConfig, ModelConfig, SpecConfig
from tidespec.llm import build_engine
from tidespec.models.eagle3.checkpoint import export_eagle3, fresh_head
from tidespec.models.loading.loader import LoadedModel, load_model
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.eagle3_options import Eagle3Options, eagle3_options
from tidespec.workloads.loader import (
    WorkloadError,
    load_prompts,
    load_workload,
    prefix_text,
    prompt_token_ids,
    resolve_workload_path,
    write_workload,
)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _rec(i: int, prompt: str, kind: str = "completion") -> str:
    return json.dumps({"id": f"r{i}", "domain": "test", "kind": kind, "prompt": prompt, "source": "unit",
                       "license": "CC0"})


# ----------------------------------------------------------------------------- workloads


def test_workload_loads_in_order_with_limit_and_blank_lines(tmp_path: Path) -> None:
    f = _write(tmp_path / "w.jsonl", [_rec(0, "t3 t4"), "", _rec(1, "hi", "chat"), _rec(2, "t5")])
    recs = load_workload(f)
    assert [r.id for r in recs] == ["r0", "r1", "r2"]
    assert [r.line for r in recs] == [1, 3, 4]
    assert recs[1].kind == "chat" and recs[0].license == "CC0"
    assert [r.id for r in load_workload(f, limit=2)] == ["r0", "r1"]


@pytest.mark.parametrize("line, message", [
    ('{"id": "a", "domain": "d", "kind": "completion"', "w.jsonl:2: bad JSON"),
    ('{"id": "a", "domain": "d", "kind": "completion"}', "w.jsonl:2: missing key(s) prompt"),
    ('{"id": "a", "domain": "d", "kind": "poem", "prompt": "x"}', "w.jsonl:2: unknown kind 'poem'"),
    ('{"id": "r0", "domain": "d", "kind": "chat", "prompt": "x"}', "w.jsonl:2: duplicate id 'r0'"),
    ('{"id": 7, "domain": "d", "kind": "chat", "prompt": "x"}', "w.jsonl:2: 'id' must be a string"),
    ('{"id": "a", "domain": "d", "kind": "chat", "prompt": "  "}', "w.jsonl:2: empty prompt"),
    ('[1, 2]', "w.jsonl:2: expected a JSON object"),
])
def test_workload_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    f = _write(tmp_path / "w.jsonl", [_rec(0, "ok"), line])
    with pytest.raises(WorkloadError) as exc:
        load_workload(f)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)
    assert isinstance(exc.value, ConfigError)  # the CLI prints it as one line


def test_a_records_system_text_comes_before_its_prompt(tmp_path: Path) -> None:
    """``system``: a chat's system message, a completion's leading text; kept by write_workload."""
    tok = tiny_tokenizer(64)
    lines = [json.dumps({"id": "c", "domain": "d", "kind": "completion", "prompt": "t5 t6", "system": "t3 t4 "}),
             json.dumps({"id": "h", "domain": "d", "kind": "chat", "prompt": "hi", "system": "be brief"})]
    comp, chat = load_workload(_write(tmp_path / "w.jsonl", lines))
    assert comp.text == "t3 t4 t5 t6" and prompt_token_ids(comp, tok) == tok.encode("t3 t4 t5 t6")
    assert chat.messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    write_workload([comp, chat], tmp_path / "again.jsonl")
    assert [r.system for r in load_workload(tmp_path / "again.jsonl")] == ["t3 t4 ", "be brief"]
    bad = json.dumps({"id": "x", "domain": "d", "kind": "chat", "prompt": "x", "system": 3})
    with pytest.raises(WorkloadError, match="'system' must be a string"):
        load_workload(_write(tmp_path / "b.jsonl", [bad]))


def test_a_shared_prefix_text_has_the_tokens_asked_for(embedded: LoadedModel) -> None:
    tok = embedded.tokenizer
    text = prefix_text("code", tok, 200)
    assert abs(len(tok.encode(text, add_special_tokens=False)) - 200) <= 8  # cut at 200, re-tokenized
    with pytest.raises(WorkloadError, match="fewer than"):
        prefix_text("code", tok, 10**6)
    recs = load_workload("shared_prefix")
    assert len({r.system for r in recs if r.kind == "chat"}) == 1 and len({r.system for r in recs}) == 2


def test_workload_missing_empty_and_bad_limit(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="not found"):
        load_workload(tmp_path / "nope.jsonl")
    with pytest.raises(WorkloadError, match="no records"):
        load_workload(_write(tmp_path / "e.jsonl", ["", "  "]))
    with pytest.raises(WorkloadError, match="limit must be >= 1"):
        load_workload(_write(tmp_path / "w.jsonl", [_rec(0, "x")]), limit=0)


def test_builtin_workloads_ship_with_sources_and_licenses() -> None:
    sizes = {"code": 16, "chat": 48, "code_unseen": 32, "drafter_boot": 150, "code_extra": 72, "zh_chat": 16,
             "shared_prefix": 16, "zh_topics": 80, "ru_topics": 80, "es_topics": 64, "ar_topics": 64,
             "sql_help": 16, "cooking": 16, "home_repair": 16}
    for name, size in sizes.items():
        path = resolve_workload_path(name)
        assert path.parent.name == "workloads" and path.name == f"{name}.jsonl"
        recs = load_workload(name)
        assert len(recs) == size
        assert all(r.source and r.license for r in recs)
        assert all(r.license.startswith(("MIT", "Apache-2.0", "PSF-2.0", "CC0-1.0")) for r in recs)
    assert {r.kind for r in load_workload("code")} == {"completion", "chat"}
    # the shipped drafter's evaluation set holds no prompt it was trained on
    boot = {r.prompt for r in load_workload("drafter_boot")}
    unseen = {r.prompt for r in load_workload("code_unseen")}
    extra = {r.prompt for r in load_workload("code_extra")}
    assert not boot & unseen and not extra & (boot | unseen)


def test_prompt_tokenization_completion_and_chat(tmp_path: Path) -> None:
    tok = tiny_tokenizer(64)
    f = _write(tmp_path / "w.jsonl", [_rec(0, "t3 t4 t5"), _rec(1, "t6 t7", "chat")])
    recs = load_workload(f)
    assert prompt_token_ids(recs[0], tok) == [3, 4, 5]
    with pytest.raises(WorkloadError, match="no chat template"):
        prompt_token_ids(recs[1], tok)
    tok.chat_template = "{% for m in messages %}t9 {{ m['content'] }} t20 {% endfor %}{% if add_generation_prompt %}t21{% endif %}"
    assert prompt_token_ids(recs[1], tok) == [9, 6, 7, 20, 21]
    prompts = load_prompts(f, tok, limit=1)
    assert len(prompts) == 1 and prompts[0].token_ids == [3, 4, 5] and prompts[0].record.id == "r0"


# ----------------------------------------------------------------------------- report helpers


def test_percentile_hand_traced() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5  # midway between the 2nd and 3rd value
    assert percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)  # rank 0.9 * 3 = 2.7 -> 3 + 0.7
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)  # rank 8.1 -> 9 + 0.1
    assert percentile([5.0], 10) == 5.0
    assert percentile([1.0, float("nan"), 3.0], 50) == 2.0  # NaN ignored
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    s = summarize([3.0, 1.0, 2.0])
    assert (s["min"], s["p50"], s["max"], s["mean"], s["n"]) == (1.0, 2.0, 3.0, 2.0, 3.0)


def test_markdown_table_and_command_line() -> None:
    text = markdown_table(["name", "tok/s", "x"], [["a", 31.25, 2], ["b", float("nan"), None]])
    assert text.splitlines() == ["| name | tok/s | x |", "|---|---:|---:|", "| a | 31.2 | 2 |", "| b | - | - |"]
    with pytest.raises(ValueError):
        markdown_table(["a"], [[1, 2]])
    assert command_line(["/usr/bin/tidespec", "bench", "decode", "--workload", "my file.jsonl"]) == \
        "tidespec bench decode --workload 'my file.jsonl'"


def test_wave_indices_cycle_prompts() -> None:
    assert wave_indices(3, 2) == [[0, 1], [2, 0]]
    assert wave_indices(2, 4) == [[0, 1, 0, 1]]
    assert wave_indices(3, 1) == [[0], [1], [2]]


def test_bytes_per_token_hand_counted() -> None:
    model = tiny_llama(dtype=torch.float32)  # vocab 64, hidden 32, inter 64, 2 layers, 4 heads, 2 kv, hd 8, untied
    per_layer = 32 + 32 + (32 + 16 + 16) * 32 + 32 * 32 + 2 * 64 * 32 + 32 * 64  # norms, qkv, o, gate|up, down
    elements = 32 + 64 * 32 + 32 + 2 * per_layer  # one embedding row, lm_head, final norm, layers
    assert weight_bytes_per_token(model) == 4 * elements == 82688
    assert kv_bytes_per_token(model, 200) == 2 * 2 * 2 * 8 * 200 * 4


# ----------------------------------------------------------------------------- smoke runs


def _tiny_target(dtype: torch.dtype = torch.float32) -> LoadedModel:
    model = tiny_llama(dtype=dtype)
    return LoadedModel(model=model, tokenizer=tiny_tokenizer(64), config=model.cfg, path="")


def _hf_target(tmp_path: Path, dtype: torch.dtype) -> LoadedModel:
    hf, _ = tiny_hf_model("llama", torch.float32)
    return load_model(str(write_tiny_checkpoint(hf, tmp_path / "ckpt")), dtype=dtype)


def _workload(tmp_path: Path, prefix: str = "t", n: int = 3) -> Path:
    # ids 20..49 (in the tiny tokenizers t1 is a special token, so "t1x" would split)
    prompts = [" ".join(f"{prefix}{20 + (i * 7 + j) % 30}" for j in range(6 + 2 * i)) for i in range(n)]
    return _write(tmp_path / "wl.jsonl", [_rec(i, p) for i, p in enumerate(prompts)])


def test_decode_bench_smoke_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = DecodeBenchConfig(workload=str(_workload(tmp_path)), limit=3, batch_sizes=(1, 2), max_tokens=6)
    out = tmp_path / "out"
    doc = run_decode_bench(cfg, _tiny_target(), out_dir=out, command="tidespec bench decode --test")
    assert (out / "plot.png").stat().st_size > 0 and (out / "table.md").is_file()
    saved = json.loads((out / "results.json").read_text())
    assert saved["command"] == "tidespec bench decode --test"
    assert saved["machine"]["torch_threads"] >= 1 and saved["machine"]["dtype"] == "float32"
    rows = {r["batch_size"]: r for r in doc["rows"]}
    assert rows[1]["requests"] == 3 and rows[2]["requests"] == 4  # 2 waves of 2, prompts cycled
    assert rows[1]["output_tokens"] == 3 * 6 and rows[2]["output_tokens"] == 4 * 6  # EOS ignored
    assert all(r["tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 for r in doc["rows"])
    assert all(r["ttft_ms"]["p50"] > 0 and r["tpot_ms"]["p90"] >= r["tpot_ms"]["p50"] for r in doc["rows"])
    assert "throughput_ratio_largest_vs_batch1" in doc["headline"]
    printed = capsys.readouterr().out
    assert "Command: `tidespec bench decode --test`" in printed and "| tidespec | 2 | 4 |" in printed


def test_decode_bench_compare_hf(tmp_path: Path) -> None:
    target = _hf_target(tmp_path, torch.float32)
    cfg = DecodeBenchConfig(workload=str(_workload(tmp_path, "w", 2)), batch_sizes=(1,), max_tokens=5,
                            compare=("hf",))
    doc = run_decode_bench(cfg, target, out_dir=tmp_path / "out", echo=False)
    hf = [r for r in doc["rows"] if r["engine"] == "hf-transformers"]
    assert len(hf) == 1 and hf[0]["output_tokens"] == 2 * 5
    assert doc["headline"]["vs_hf_with_prefill"] > 0 and doc["headline"]["vs_hf_decode_only"] > 0
    assert len(doc["requests"]["hf"]) == 2
    assert len(hf[0]["identical_prefix_vs_tidespec"]["per_prompt"]) == 2
    assert hf[0]["decode_tokens_per_s_vs_tidespec_b1"] > 0 and doc["skipped"] == {}


def test_decode_bench_compare_hf_needs_a_checkpoint(tmp_path: Path) -> None:
    cfg = DecodeBenchConfig(workload=str(_workload(tmp_path)), batch_sizes=(1,), max_tokens=4, compare=("hf",))
    with pytest.raises(ConfigError, match="HF checkpoint"):
        run_decode_bench(cfg, _tiny_target(), out_dir=tmp_path / "out", echo=False)


def test_spec_bench_smoke_lossless_and_hf(tmp_path: Path) -> None:
    target = _hf_target(tmp_path, torch.float64)  # float64: speculation must reproduce plain exactly
    cfg = SpecBenchConfig(workload=str(_workload(tmp_path, "w", 2)), drafters=("none", "ngram", "suffix", "draft-model"),
                          gammas=(1, 3), max_tokens=8, compare_hf=True, hf_pld_tokens=(2,))
    out = tmp_path / "out"
    doc = run_spec_bench(cfg, target, model_config=ModelConfig(dtype="float64"), out_dir=out, echo=False)
    assert (out / "plot.png").stat().st_size > 0 and (out / "results.json").is_file()
    labels = [c["label"] for c in doc["configs"]]
    assert labels == ["plain", "ngram g=1", "ngram g=3", "suffix g=1", "suffix g=3", "draft-model g=1",
                      "draft-model g=3"]
    assert doc["configs"][0]["speedup"] == 1.0 and doc["configs"][0]["tpot_speedup"] == 1.0
    for c in doc["configs"]:
        assert c["mismatches"] == 0, c["label"]
        assert c["mean_ttft_ms"] > 0 and c["tpot_ms"] > 0 and c["tpot_speedup"] > 0
        assert c["output_tokens"] == 2 * 8 and len(c["per_request"]) == 2
        assert c["per_request_speedup"]["min"] <= c["per_request_speedup"]["p50"] <= c["per_request_speedup"]["max"]
        assert all(x["speedup"] < 1.0 for x in c["losses"])
    dm = [c for c in doc["configs"] if c["drafter"] == "draft-model"]
    assert all(c["num_drafts"] > 0 and c["mean_acceptance_length"] >= 1.0 for c in dm)
    assert [h["label"] for h in doc["hf"]] == ["hf plain", "hf prompt-lookup k=2"]
    assert doc["hf"][0]["speedup"] == 1.0 and "hf_pld_speedup" in doc["headline"]
    assert doc["headline"]["total_mismatches"] == 0


def test_pooled_tpot_by_hand() -> None:
    """Time per output token after the first, pooled over the requests (a one-token request adds nothing)."""
    recs = [RequestRecord(0, "a", 3, 11, 0.1, 1.1), RequestRecord(1, "b", 3, 6, 0.2, 0.7),
            RequestRecord(2, "c", 3, 1, 0.3, 0.3)]
    assert _pooled_tpot(recs) == pytest.approx(1.5 / 15)
    assert math.isnan(_pooled_tpot(recs[2:]))


def test_spec_bench_compares_eagle3_heads_in_one_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str | None] = []  # the head directory each engine was built with
    vocab_modes: list[str] = []  # and its draft-vocabulary mode

    def build(econf: Any, **kw: Any) -> Any:
        built.append(eagle3_options(econf.spec).dir if econf.spec.drafter == "eagle3" else None)
        vocab_modes.append(econf.spec.vocab.mode)
        return build_engine(econf, **kw)

    monkeypatch.setattr(spec_bench, "build_engine", build)
    hf, _ = tiny_hf_model("llama", torch.float32, num_hidden_layers=4)  # EAGLE-3 taps need >= 3 layers
    target = load_model(str(write_tiny_checkpoint(hf, tmp_path / "ckpt")), dtype=torch.float64)
    heads = {"d1": fresh_head(target.model.cfg, None, torch.float64, seed=1),
             "d2-gated": fresh_head(target.model.cfg, None, torch.float64, seed=2, num_layers=2, fusion="gated")}
    for name, head in heads.items():
        export_eagle3(head, tmp_path / name)
    cfg = SpecBenchConfig(workload=str(_workload(tmp_path, "w", 2)), drafters=("none", "eagle3"), gammas=(2,),
                          max_tokens=6, eagle3_heads=tuple(f"{n}={tmp_path / n}" for n in heads),
                          eagle3_quantizations=("none", "int8"))
    workload = str(_workload(tmp_path, "w", 2))  # --draft-vocab-mode static: the EAGLE-3 configurations only
    base = SpecConfig(vocab=DraftVocabConfig(mode="static", corpus=workload))
    doc = run_spec_bench(cfg, target, model_config=ModelConfig(dtype="float64"), spec_base=base,
                         out_dir=tmp_path / "out", echo=False)
    assert vocab_modes == ["off"] + ["static"] * 4
    assert [c["label"] for c in doc["configs"]] == ["plain", "eagle3[d1 none] g=2", "eagle3[d1 int8] g=2",
                                                    "eagle3[d2-gated none] g=2", "eagle3[d2-gated int8] g=2"]
    dirs = [None] + [str(tmp_path / n) for n in heads for _ in range(2)]
    assert [c["eagle3_head"] for c in doc["configs"]] == dirs and built == dirs
    assert [c["eagle3_quantization"] for c in doc["configs"]] == [None, "none", "int8", "none", "int8"]
    plain, *spec = doc["configs"]
    assert plain["draft_ms_per_step"] == 0.0 and math.isnan(plain["draft_ms_per_draft_token"])
    for c in spec:
        assert c["mismatches"] == 0 and c["num_draft_tokens"] > 0, c["label"]
        assert c["draft_ms_per_draft_token"] > 0 and c["verify_ms_per_step"] > 0 and c["steps"] > 0
    assert "| eagle3[d2-gated int8] g=2 |" in (tmp_path / "out" / "table.md").read_text()


def test_spec_bench_eagle3_heads_are_checked(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    with pytest.raises(ConfigError, match="add eagle3 to --drafters"):
        SpecBenchConfig(drafters=("none", "suffix"), eagle3_heads=(str(tmp_path / "a"),))
    with pytest.raises(ConfigError, match="is not a directory"):
        SpecBenchConfig(drafters=("eagle3",), eagle3_heads=(f"x={tmp_path / 'missing'}",))
    with pytest.raises(ConfigError, match="names must differ"):
        SpecBenchConfig(drafters=("eagle3",), eagle3_heads=(f"x={tmp_path / 'a'}", f"x={tmp_path / 'a'}"))
    with pytest.raises(ConfigError, match="distinct values of none, int8, int4"):
        SpecBenchConfig(drafters=("eagle3",), eagle3_quantizations=("int8", "int3"))
    a = HeadVariant(str(tmp_path / "a"), str(tmp_path / "a"))
    cfg = SpecBenchConfig(drafters=("eagle3", "suffix"), gammas=(1, 3), eagle3_heads=(str(tmp_path / "a"),))
    assert cfg.grid() == [("plain", 0, None), ("eagle3", 1, a), ("eagle3", 3, a), ("suffix", 1, None),
                          ("suffix", 3, None)]
    cfg = SpecBenchConfig(drafters=("eagle3",), gammas=(2,), eagle3_heads=(f"h={tmp_path / 'a'}",),
                          eagle3_quantizations=("none", "int8"))
    assert [v for _, _, v in cfg.grid()] == [None, HeadVariant("h none", str(tmp_path / "a"), "none"),
                                             HeadVariant("h int8", str(tmp_path / "a"), "int8")]
    cfg = SpecBenchConfig(drafters=("eagle3",), gammas=(4,), eagle3_min_draft_probs=(0.0, 0.3))
    assert [v for _, _, v in cfg.grid()] == [None, HeadVariant("p>=0", None, None, 0.0),
                                             HeadVariant("p>=0.3", None, None, 0.3)]
    with pytest.raises(ConfigError, match="min-draft-probs"):
        SpecBenchConfig(drafters=("eagle3",), eagle3_min_draft_probs=(0.3, 1.0))
    with pytest.raises(ConfigError, match="add eagle3 to --drafters"):
        SpecBenchConfig(drafters=("suffix",), eagle3_min_draft_probs=(0.3,))
    cfg = SpecBenchConfig(drafters=("eagle3",), gammas=(4,), eagle3_shapes=("chain", "tree"))
    assert [v for _, _, v in cfg.grid()] == [None, HeadVariant("chain", tree=False), HeadVariant("tree", tree=True)]
    with pytest.raises(ConfigError, match="distinct values of chain, tree"):
        SpecBenchConfig(drafters=("eagle3",), eagle3_shapes=("chain", "bush"))


def test_spec_bench_compares_chains_and_trees_in_one_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--eagle3-shapes chain,tree``: EAGLE-3 as chains and as trees of the same gamma, interleaved;
    the other drafters keep the command line's shape; every output is plain decoding's."""
    trees: list[tuple[str, bool]] = []  # (drafter, tree) each engine was built with

    def build(econf: Any, **kw: Any) -> Any:
        trees.append((econf.spec.drafter, econf.spec.tree))
        return build_engine(econf, **kw)

    monkeypatch.setattr(spec_bench, "build_engine", build)
    hf, _ = tiny_hf_model("llama", torch.float32, num_hidden_layers=4)
    target = load_model(str(write_tiny_checkpoint(hf, tmp_path / "ckpt")), dtype=torch.float64)
    export_eagle3(fresh_head(target.model.cfg, None, torch.float64, seed=1), tmp_path / "head")
    cfg = SpecBenchConfig(workload=str(_workload(tmp_path, "w", 2)), drafters=("none", "suffix", "eagle3"),
                          gammas=(3,), max_tokens=8, eagle3_shapes=("chain", "tree"))
    doc = run_spec_bench(cfg, target, model_config=ModelConfig(dtype="float64"),
                         spec_base=SpecConfig(options={"eagle3": Eagle3Options(dir=str(tmp_path / "head"))}),
                         out_dir=tmp_path / "out", echo=False)
    assert trees == [("none", False), ("suffix", False), ("eagle3", False), ("eagle3", True)]
    assert [c["label"] for c in doc["configs"]] == ["plain", "suffix g=3", "eagle3[chain] g=3", "eagle3[tree] g=3"]
    assert all(c["mismatches"] == 0 for c in doc["configs"])


def test_profile_smoke(tmp_path: Path) -> None:
    cfg = ProfileConfig(ns=(1, 2, 4), batch_sizes=(1, 2), context=16, repeats=2, target_s=0.01, bandwidth_mib=8)
    out = tmp_path / "out"
    doc = run_profile(cfg, _tiny_target(), out_dir=out, command="x", echo=False)
    assert (out / "plot.png").stat().st_size > 0
    assert [(r["batch_size"], r["n"]) for r in doc["rows"]] == [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4)]
    assert all(r["ratio_to_n1"] == 1.0 for r in doc["rows"] if r["n"] == 1)
    assert all(1 <= r["repeats"] <= 2 for r in doc["rows"])
    assert doc["bandwidth_gb_s"] > 0 and doc["ceiling_tokens_per_s"] > 0
    assert doc["weight_bytes_per_token"] == 82688
    assert doc["forwards"].startswith("serving's")  # the row-invariant kernels over a paged cache, as serving runs


def test_profile_without_row_invariance_times_one_slot_per_sequence(tmp_path: Path) -> None:
    cfg = ProfileConfig(ns=(1, 2), batch_sizes=(1, 2), context=16, repeats=2, target_s=0.01, bandwidth_mib=8)
    doc = run_profile(cfg, _tiny_target(), model_config=ModelConfig(row_invariant=False), out_dir=tmp_path,
                      command="x", echo=False)
    assert doc["forwards"] == "one cache slot per sequence (no row invariance)"
    assert "Forwards: one cache slot" in (tmp_path / "table.md").read_text()
    with pytest.raises(ConfigError, match="--no-row-invariant"):
        run_profile(dataclasses.replace(cfg, compare_untuned=True), _tiny_target(), out_dir=tmp_path, command="x",
                    echo=False)


@pytest.mark.slow  # 18-36 s of cold compile; the compiled step itself is checked in tests/models/test_compiled.py
def test_profile_times_the_compiled_step_next_to_eager(tmp_path: Path) -> None:
    cfg = ProfileConfig(ns=(1, 3), batch_sizes=(1, 2), context=16, repeats=2, target_s=0.01, bandwidth_mib=8)
    doc = run_profile(cfg, _tiny_target(), model_config=ModelConfig(compile=True), out_dir=tmp_path, command="x",
                      echo=False)
    assert all(r["t_compiled_ms"] > 0 and r["compiled_speedup"] > 0 for r in doc["rows"])
    assert doc["compile_seconds"] > 0 and doc["batch1_compiled_fraction_of_ceiling"] > 0
    assert "Compiled decode step" in (tmp_path / "table.md").read_text()


def test_profile_on_cuda_graphs_times_the_graph_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the engine replays CUDA graphs the profile times them (here the static block, no capture)."""
    import tidespec.bench.profile.run as profile_mod
    monkeypatch.setattr(profile_mod, "uses_graphs", lambda device, enforce_eager: True)
    cfg = ProfileConfig(ns=(1, 3), batch_sizes=(1, 2), context=16, repeats=2, target_s=0.01, bandwidth_mib=8)
    doc = run_profile(cfg, _tiny_target(), out_dir=tmp_path, command="x", echo=False)
    assert doc["step"] == "CUDA graphs" and all(r["t_compiled_ms"] > 0 for r in doc["rows"])
    assert "CUDA graphs" in (tmp_path / "table.md").read_text()


def test_profile_times_untuned_kernels_next_to_the_measured_ones(tmp_path: Path) -> None:
    model = _tiny_target().model
    lin = model.layers[0].self_attn.qkv_proj
    lin.choice, lin.tuned_threads = ("tall",) * 4, torch.get_num_threads()
    cfg = ProfileConfig(ns=(1, 3), batch_sizes=(1,), context=16, repeats=2, target_s=0.01, bandwidth_mib=8,
                        compare_untuned=True)
    doc = run_profile(cfg, model, model_config=ModelConfig(row_invariant=False), out_dir=tmp_path, command="x",
                      echo=False)
    assert all(r["t_untuned_ms"] > 0 and r["kernel_speedup"] > 0 for r in doc["rows"])
    assert lin.choice == ("tall",) * 4  # restored after each untuned timing
    assert "`F.linear` instead of the kernels" in (tmp_path / "table.md").read_text()


def test_cli_runs_bench_decode_on_a_checkpoint(tmp_path: Path) -> None:
    hf, _ = tiny_hf_model("llama", torch.float32)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    parser = argparse.ArgumentParser(prog="tidespec")
    register(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "out"
    ns = parser.parse_args(["bench", "decode", "--model", str(ckpt), "--workload", str(_workload(tmp_path, "w", 2)),
                            "--batch-sizes", "1,2", "--max-tokens", "4", "--threads", "1", "--out", str(out)])
    threads = torch.get_num_threads()
    try:
        assert ns.func(ns) == 0
    finally:
        torch.set_num_threads(threads)
    saved = json.loads((out / "results.json").read_text())
    assert [r["batch_size"] for r in saved["rows"]] == [1, 2]
    assert saved["machine"]["torch_threads"] == 1
    bad = parser.parse_args(["bench", "decode", "--batch-sizes", "1,x"])
    with pytest.raises(ConfigError, match="batch-sizes"):
        bad.func(bad)
    spec_ns = parser.parse_args(["bench", "spec", "--drafters", "ngram,bogus"])
    with pytest.raises(ConfigError, match="unknown drafter"):
        spec_ns.func(spec_ns)
    assert not hasattr(spec_ns, "num_speculative_tokens") and spec_ns.ngram_max == 4


def test_spec_bench_can_end_requests_at_eos(tmp_path: Path) -> None:
    """--no-ignore-eos: each request ends at its first EOS, in plain and speculating configurations
    alike (same tokens), and HF's generate() stops there too; the report says so."""
    target = _hf_target(tmp_path, torch.float64)
    wl = str(_workload(tmp_path, "w", 2))
    engine = build_engine(EngineConfig(model=ModelConfig(dtype="float64")), target.model, target.tokenizer)
    engine.add_request(load_prompts(wl, target.tokenizer)[0].token_ids, SamplingParams(max_tokens=8, ignore_eos=True))
    plain0: list[int] = []
    while engine.has_unfinished_requests():
        plain0 = next(iter(o.token_ids for o in engine.step()), plain0)
    stop = plain0[2]  # the third generated token of the first prompt becomes the EOS
    n0 = plain0.index(stop) + 1
    for name in ("config.json", "generation_config.json"):  # the checkpoint's EOS, for tidespec and HF alike
        path = tmp_path / "ckpt" / name
        path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": stop}))
    target = load_model(str(tmp_path / "ckpt"), dtype=torch.float64)
    assert stop in target.model.cfg.eos_token_ids
    cfg = SpecBenchConfig(workload=wl, drafters=("none", "ngram", "suffix"), gammas=(3,), max_tokens=8,
                          compare_hf=True, hf_pld_tokens=(2,), ignore_eos=False)
    out = tmp_path / "b"
    doc = run_spec_bench(cfg, target, model_config=ModelConfig(dtype="float64"), out_dir=out, echo=False)
    for c in doc["configs"]:
        assert c["mismatches"] == 0, c["label"]
        assert c["per_request"][0]["output_tokens"] == n0, c["label"]
    assert [len(h["per_request"]) for h in doc["hf"]] == [2, 2]
    assert all(h["output_tokens"] < 2 * 8 for h in doc["hf"])  # HF's generate() stopped at the EOS too
    assert "ending at EOS" in (out / "table.md").read_text()
    assert doc["config"]["ignore_eos"] is False


def test_spec_bench_turns_resend_the_chat_and_stay_lossless_on_prefix_hits(tmp_path: Path) -> None:
    """--turns 3: two conversations of three chat records; turn k+1 resends turn k's prompt, plain's
    answer and the next question, so its prompt is longer and the prefix cache serves part of it;
    every speculating configuration emits plain's tokens in every turn."""
    target = _hf_target(tmp_path, torch.float64)
    target.tokenizer.chat_template = ("{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
                                      "{% if add_generation_prompt %}w5{% endif %}")
    questions = [" ".join(f"w{20 + (i * 7 + j) % 30}" for j in range(14)) for i in range(6)]
    wl = _write(tmp_path / "chat.jsonl", [_rec(i, q, "chat") for i, q in enumerate(questions)])
    cfg = SpecBenchConfig(workload=str(wl), limit=2, turns=3, drafters=("none", "ngram", "suffix"), gammas=(3,),
                          max_tokens=6)
    out = tmp_path / "out"
    doc = run_spec_bench(cfg, target, model_config=ModelConfig(dtype="float64"), out_dir=out, echo=False)
    assert doc["prompt_ids"] == ["r0", "r3", "r1", "r4", "r2", "r5"]  # conversation c asks records 3c .. 3c+2
    for c in doc["configs"]:
        assert c["mismatches"] == 0 and c["requests"] == 6, c["label"]
        turns = c["by_turn"]
        assert [t["turn"] for t in turns] == [1, 2, 3] and all(t["requests"] == 2 for t in turns)
        assert turns[0]["prompt_tokens"] < turns[1]["prompt_tokens"] < turns[2]["prompt_tokens"]
        assert turns[0]["cached_tokens"] == 0 and turns[2]["cached_tokens"] > 0, turns  # the resent history
        assert all(t["mismatches"] == 0 for t in turns)
    table = (out / "table.md").read_text()
    assert "in 3-turn chats" in table and "Per turn" in table
    completions = _write(tmp_path / "comp.jsonl", [_rec(0, "w20 w21")])
    with pytest.raises(ConfigError, match="needs chat records"):
        run_spec_bench(dataclasses.replace(cfg, workload=str(completions)), target,
                       model_config=ModelConfig(dtype="float64"), out_dir=tmp_path / "x", echo=False)
    with pytest.raises(ConfigError, match="turns"):
        SpecBenchConfig(turns=0)


def test_decode_bench_prefills_every_batch_size_from_a_cold_prefix_cache(tmp_path: Path) -> None:
    """Every batch size runs the same prompts (after a warm-up on the first): without resetting the
    prefix cache, batch 2 would reuse the blocks batch 1 saved and skip most of its prefill."""
    prompts = [" ".join(f"t{20 + (i * 7 + j) % 30}" for j in range(40)) for i in range(3)]
    wl = _write(tmp_path / "long.jsonl", [_rec(i, p) for i, p in enumerate(prompts)])
    target = _tiny_target()
    cfg = DecodeBenchConfig(workload=str(wl), limit=3, batch_sizes=(1, 2), max_tokens=4)
    doc = run_decode_bench(cfg, target, out_dir=tmp_path / "out", echo=False)
    assert [r["cached_tokens"] for b in ("1", "2") for r in doc["requests"][b]] == [0] * 7
    engine = build_engine(EngineConfig(), target.model, target.tokenizer)  # the same prompts, no reset
    assert engine.prefix_cache is not None
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for _ in range(2):
        rid = engine.add_request(load_prompts(str(wl), target.tokenizer)[0].token_ids, params)
        while engine.has_unfinished_requests():
            out = {o.request_id: o for o in engine.step()}
    assert out[rid].stats.num_cached_tokens >= 32  # what the benchmark would have timed
