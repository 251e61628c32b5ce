"""The exactness matrix, fast subset: every CPU path (float32, bfloat16, int8, int4, w4a8, w8a8; eager
and ``--compile``) and every drafter (each on at least one path) give exactly the path's plain greedy
decoding of each prompt alone, one request at a time and all at once, plain decoding batched and on
prefix hits gives it too, and the target's rows have the same bits in verifications, batches and
prompt chunks as decoded alone (``tidespec bench exactness``'s cells and row probe; the full
matrix -- 24 prompts x 256 tokens, every path x every drafter -- is ``make exactness``).

What keeps it cheap without checking less:

* one ``PathRun`` per path (its target, plain engine, row probe and references), built once and
  shared by that path's cells; ``--dist loadgroup`` sends a path's cells to one worker;
* the prompts are where plain decoding comes closest to a tie (``near_ties.py``, stored in
  ``near_ties.json``): each starts ``near_ties.LEAD`` = 8 tokens before its near-tie, so the path's
  ``NEAR_TIES`` = 2 closest near-ties x 16 tokens decode through the near-tie (the 9th token) and 7
  tokens after it, where 256 tokens found differences before (4 prompts x 32 tokens until 2026-12-03:
  the tokens after the 16th met no near-tie of the selection; ``make test-slow``'s whole-model runs
  keep all four);
* the compiled paths run the embedded model's first ``LAYERS_COMPILED`` layers (its real weights:
  every kernel, fusion and graph a layer runs, a layer's output feeding the next; a cold compile of
  the three graphs took 25 s on 2 layers, 34 s on 4, minutes on all 30). They are in ``make
  test-slow`` (``COMPILED_IN_MAKE_TEST`` is empty: on CI's empty cache one compiled path cost 130 s of
  g++), with every compiled path on the whole model (``test_compiled_paths_on_the_whole_model``);
  ``make test`` compiles one tiny engine (``tests/models/test_compiled.py``).

Its teeth: ``--break-row-invariance MODE`` builds every engine of the subset with one half of row
invariance removed, and the subset must then fail (``make test-slow`` checks that it does):
``library-gemm`` as ``--no-row-invariant`` (projections on the library GEMM chosen per row count,
attention on SDPA), ``attention`` (the exact attention kernel removed: SDPA over the padded block,
which the old row padding of queries and keys guarded; projections still invariant) and
``projections`` (projections on the library kernels, attention still exact). Without row-invariant
kernels the row probe alone also fails (``test_without_row_invariant_kernels_rows_depend_on_the_batch``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.speculative.near_ties import stored_prompts
from tidespec.bench.exactness.run import (
    DRAFTERS,
    QUANT_PATHS,
    ExactnessBenchConfig,
    PathRun,
    exact,
    parse_path,
    row_probe,
    table,
    target_model,
)
from tidespec.config import CacheConfig, ConfigError, EngineConfig, ModelConfig
from tidespec.llm import build_engine
from tidespec.models.execution import executor, invariance
from tidespec.models.kernels.linear import Linear
from tidespec.models.loading.loader import LoadedModel, load_model
from tidespec.models.quant.a8 import a8_error
from tidespec.models.quant.quantize import QuantizedLinear
from tidespec.workloads.loader import load_prompts

pytestmark = pytest.mark.integration
LAYERS_COMPILED = 2
MAX_TOKENS = 16  # the near-tie is the 9th token (module docstring)
# path -> the drafter configurations checked on it; every configuration of bench exactness's DRAFTERS
# is on at least one path (on a compiled path EAGLE-3 drafts with a fresh head: the shipped one reads
# layers the truncated target lacks)
PATHS: dict[str, tuple[str, ...]] = {
    "float32": ("suffix", "eagle3-tree"),
    "bfloat16": ("eagle3",),
    "int8": ("ngram", "suffix,eagle3+analytic", "suffix,eagle3+per-sequence"),  # the analytic policy: SLOW_CELLS
    "int4": ("suffix", "eagle3"),  # EAGLE-3 chains in make test (the bfloat16 path is in make test-slow)
    "w4a8": ("suffix", "draft-model"),
    "w8a8": ("ngram", "medusa"),
    "float32+compile": ("suffix",),
    "bfloat16+compile": ("suffix",),  # its graphs round like eager code (emulate_precision_casts); else probe 0/48
    "int8+compile": ("ngram",),
    "int4+compile": ("suffix",),
    "w4a8+compile": ("suffix", "draft-model"),
    "w8a8+compile": ("ngram",),
}
# the compiled paths make test runs on the first layers (the module docstring); make test-slow runs all of
# them on the whole model
COMPILED_IN_MAKE_TEST: tuple[str, ...] = ()
SUBSET = [p for p in PATHS if not parse_path(p)[2] or p in COMPILED_IN_MAKE_TEST]
# make test-slow: the analytic policy profiles its costs before its first step (37 s on CI's empty cache);
# make test checks the controller switching drafters mid-request under a scripted policy
# (tests/speculative/test_embedded_lossless.py)
SLOW_CELLS = {("int8", "suffix,eagle3+analytic"), ("int8", "suffix,eagle3+per-sequence")}
WHOLE_MODEL_EXTRA = {"float32+compile": ("eagle3-tree",)}  # make test-slow's compiled paths: the shipped head over
# the compiled step's taps (tests/models/test_compiled.py checks EAGLE-3 over compiled taps in make test-slow too)
BREAKS = ("library-gemm", "attention", "projections")
# the row probe's prompts: the first of each (53-96 tokens; the code workload's first, 207 tokens, took half
# the probe's time: every probe prompt is prefilled five times)
PROBE_WORKLOADS = ("chat", "zh_chat", "multilingual")
# near-tie prompts a path decodes in make test: the closest two of near_ties.json's four (their prompts
# are 65-384 tokens, each prefilled again by every cell: prefill, not decoding, is most of a path's time)
NEAR_TIES = 2


# eager paths in make test-slow only: bfloat16's setup alone took 60 s on CI's empty cache on a CPU without native
# bfloat16 (an AMD EPYC, Zen 3), where make test ran 40 s past its budget (2026-12-07); its rows' bits are checked
# in make test by tests/models/test_rows.py and tests/models/test_families.py
SLOW_PATHS = frozenset({"bfloat16"})


def _marks(path: str) -> list[pytest.MarkDecorator]:
    marks = [pytest.mark.xdist_group(f"exact-{path}")] + ([pytest.mark.slow] if path in SLOW_PATHS else [])
    if parse_path(path)[1] in ("w4a8", "w8a8"):
        marks.append(pytest.mark.skipif(a8_error() is not None, reason=f"no w4a8/w8a8 kernels: {a8_error()}"))
    return marks


def config(path: str, whole: bool = False) -> ExactnessBenchConfig:
    """The subset's settings for ``path`` (``whole``: a compiled path on the whole model too)."""
    layers = LAYERS_COMPILED if parse_path(path)[2] and not whole else 0
    return ExactnessBenchConfig(max_tokens=MAX_TOKENS, max_num_seqs=4, paths=path, drafters=";".join(PATHS[path]),
                                layers=layers)


@pytest.fixture(scope="session")
def bases(embedded) -> dict[str, LoadedModel]:
    """The float models quantized copies are made from: the embedded float32 one, bfloat16 on demand."""
    return {"float32": embedded}


def _broken(mode: str | None, mp: pytest.MonkeyPatch) -> None:
    """Remove one half of row invariance from every engine built while ``mp`` holds (``BREAKS``)."""
    if mode == "attention":
        def gone() -> str:
            return "removed by --break-row-invariance attention"
        mp.setattr(executor, "exact_attention_error", gone)
        mp.setattr(invariance, "exact_attention_error", gone)
    elif mode == "projections":
        real = executor.make_row_invariant

        def library_projections(model: torch.nn.Module, budget: int) -> invariance.InvarianceReport:
            report = real(model, budget)
            for m in model.modules():
                if isinstance(m, Linear):
                    m.set_invariant("", 0)  # the kernel measured fastest per row count, whole calls
                elif isinstance(m, QuantizedLinear):
                    m.own_kernel, m.row_limit = False, 0  # PyTorch's kernel, whole calls
            return report
        mp.setattr(executor, "make_row_invariant", library_projections)


@pytest.fixture(scope="module")
def built() -> dict[str, PathRun]:
    """The ``PathRun`` of the path whose tests run now: one path at a time, since a path's tests run
    one after another (its ``xdist_group``; ``tests/conftest.py`` keeps a group's tests together)."""
    return {}


@pytest.fixture
def path_run(path: str, built: dict[str, PathRun], bases: dict[str, LoadedModel], request: pytest.FixtureRequest,
             monkeypatch: pytest.MonkeyPatch) -> PathRun:
    """``path``'s ``PathRun`` on its near-tie prompts, built on two threads as served by the first of
    its tests and shared by the rest (``--break-row-invariance``: every engine they build is broken)."""
    mode = request.config.getoption("--break-row-invariance")
    _broken(mode, monkeypatch)
    if path not in built:
        built.clear()  # the previous path's engines and quantized target go
        dtype = parse_path(path)[0]
        if dtype not in bases:
            bases[dtype] = load_model(None, dtype=getattr(torch, dtype))
        short = [p for w in PROBE_WORKLOADS for p in load_prompts(w, bases[dtype].tokenizer, limit=1)]
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            built[path] = PathRun(config(path), path, stored_prompts(path)[:NEAR_TIES] or short,
                                  {(d, "none"): m for d, m in bases.items()}, row_invariant=mode != "library-gemm",
                                  probe_prompts=[p.token_ids for p in short])
        finally:
            torch.set_num_threads(before)
    return built[path]


@pytest.mark.parametrize("path", [pytest.param(p, marks=_marks(p)) for p in SUBSET])
def test_plain_decoding_batched_and_on_prefix_hits_equals_alone_with_rows_of_the_same_bits(path_run: PathRun,
                                                                                        two_threads) -> None:
    cells = path_run.plain_cells()
    doc = {"paths": [path_run.entry]}
    assert exact(doc), table(doc)
    assert "plain+prefix/batched" in cells, "prefix caching was off: the path is not row-invariant"
    assert cells["plain+prefix/batched"]["prefix_hit_tokens"] > 0, cells["plain+prefix/batched"]
    probe = path_run.entry["row_probe"]
    assert probe["identical"] == probe["rows"], table(doc)
    assert path_run.entry["invariance"]["exact"], path_run.entry["invariance"]


@pytest.mark.parametrize("path,drafter", [pytest.param(p, d, marks=_marks(p) + ([pytest.mark.slow] if (p, d) in SLOW_CELLS
                                                                                  else []))
                                          for p in SUBSET for d in PATHS[p]])
def test_drafter_alone_and_batched_equals_plain_decoding_alone(path_run: PathRun, drafter: str, two_threads) -> None:
    cells = path_run.drafter_cells(drafter)
    doc = {"paths": [{**path_run.entry, "cells": cells}]}
    assert exact(doc), table(doc)
    assert path_run.entry["invariance"]["exact"], path_run.entry["invariance"]


@pytest.mark.slow  # a compile (COMPILED_IN_MAKE_TEST); float32 only: w4a8's graphs round its activations otherwise
@pytest.mark.parametrize("path", [pytest.param("float32+compile", marks=_marks("float32+compile"))])
def test_compiled_graphs_give_the_eager_text(path_run: PathRun, two_threads) -> None:
    """float32 + compile: the graphs give eager code's greedy text, each near-tie prompt alone, on the
    embedded model's first layers (``tests/models/test_compiled.py`` checks all 30 in ``make test-slow``)."""
    cell = path_run.eager_cell()
    assert cell["identical"] == cell["total"], cell["divergences"]


def test_every_path_and_drafter_is_in_the_subset() -> None:
    """float32 and bfloat16, and each weight quantization, eager and compiled (make test: every eager
    path and ``COMPILED_IN_MAKE_TEST``; make test-slow: every compiled one on the whole model); every
    drafter configuration in make test. gguf is not among them: on the embedded Q4_1 file it is w4a8's
    weights bit for bit, and on K-quants it speculates exactly in tests/models/test_gguf_blocks.py."""
    expected = {("float32", "none"), ("bfloat16", "none")} | {("float32", q) for q in QUANT_PATHS if q != "gguf"}
    for compiled in (False, True):
        assert {parse_path(p)[:2] for p in PATHS if parse_path(p)[2] == compiled} == expected
    assert {p for p in PATHS if not parse_path(p)[2]} <= set(SUBSET)
    assert {d for p in SUBSET for d in PATHS[p]} == set(DRAFTERS)  # the controller's cell: make test-slow


# the int8 control in make test-slow (13 s): one control shows the probe can fail
@pytest.mark.parametrize("quantization", ["none", pytest.param("int8", marks=pytest.mark.slow)])
def test_without_row_invariant_kernels_rows_depend_on_the_batch(embedded, quantization: str, two_threads,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the same probe on the engine without row-invariant kernels (SDPA, the library's
    kernels) finds rows whose bits depend on what else the forward holds. The projections run
    ``F.linear``, not the per-row-count plan ``--no-row-invariant`` measures (20 s on a cold cache):
    F.linear is one of the plan's kernels, and the control is about what the library kernels do."""
    monkeypatch.setattr(invariance, "tune_linears", lambda model: {})
    target = target_model("float32", quantization, {("float32", "none"): embedded})
    prompts = [p.token_ids for p in load_prompts("code", target.tokenizer, limit=2)]
    config = EngineConfig(model=ModelConfig(quantization=quantization, row_invariant=False),
                          cache=CacheConfig(max_model_len=512, max_num_seqs=4))
    engine = build_engine(config, model=target.model, tokenizer=target.tokenizer)
    probe = row_probe(engine, prompts)
    assert probe["identical"] < probe["rows"], probe


def test_paths_name_dtype_quantization_and_compile() -> None:
    assert parse_path("int4+compile") == ("float32", "int4", True)
    assert parse_path("bfloat16+int4") == ("bfloat16", "int4", False)
    assert parse_path("bfloat16+compile") == ("bfloat16", "none", True)
    assert parse_path("w4a8+compile") == ("float32", "w4a8", True)
    for bad in ("int5", "compile", "int4+x", "float16", "bfloat16+compile+compile"):
        with pytest.raises(ConfigError, match="unknown path"):
            ExactnessBenchConfig(paths=f"float32,{bad}")
    for profiled in ("suffix,eagle3+analytic", "suffix,eagle3+per-sequence"):
        with pytest.raises(ConfigError, match="layers"):
            ExactnessBenchConfig(paths="int8", drafters=profiled, layers=4)


@pytest.mark.slow
@pytest.mark.parametrize("path", [pytest.param(p, marks=_marks(p)) for p in PATHS if parse_path(p)[2]])
def test_compiled_paths_on_the_whole_model(path: str, bases: dict[str, LoadedModel], two_threads) -> None:
    """The compiled paths' cells on all 30 layers (the shipped EAGLE-3 head on them), the near-tie
    prompts of the truncated target's selection."""
    dtype = parse_path(path)[0]
    if dtype not in bases:
        bases[dtype] = load_model(None, dtype=getattr(torch, dtype))
    short = [p for w in PROBE_WORKLOADS for p in load_prompts(w, bases[dtype].tokenizer, limit=1)]
    run = PathRun(config(path, whole=True), path, stored_prompts(path) or short,
                  {(d, "none"): m for d, m in bases.items()}, probe_prompts=[p.token_ids for p in short])
    run.plain_cells()
    for drafter in PATHS[path] + WHOLE_MODEL_EXTRA.get(path, ()):
        run.drafter_cells(drafter)
    doc = {"paths": [run.entry]}
    assert exact(doc) and run.entry["row_probe"]["identical"] == run.entry["row_probe"]["rows"], table(doc)


@pytest.mark.slow
@pytest.mark.parametrize("mode", BREAKS)
def test_the_subset_fails_when_row_invariance_is_broken(mode: str) -> None:
    """The subset's teeth: with half of row invariance removed, its cells (not only the row probe
    and the invariance report) find outputs that differ from plain decoding alone."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                          "loadgroup", __file__, "-k", "plain_decoding or drafter_alone", "--break-row-invariance",
                          mode], check=False, capture_output=True, text=True, timeout=3600)
    assert run.returncode == 1, run.stdout[-4000:]
    lines = run.stdout.splitlines()
    failed_on_outputs = [line for line in lines if line.startswith("E ") and "**" in line]
    assert failed_on_outputs, run.stdout[-4000:]  # a cell of the table in bold: an output that differs
    print("\n".join(dict.fromkeys(failed_on_outputs)), *(line for line in lines if line.startswith("FAILED")
                                                          or " passed" in line or " failed" in line), sep="\n")
