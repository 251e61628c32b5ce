"""The measured matmul kernels of ``Linear``: each computes F.linear's product, and tuning picks,
caches and reuses a kernel per row count."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig, ModelConfig
from tidespec.llm import build_engine
from tidespec.models.execution import invariance
from tidespec.models.kernels import linear
from tidespec.models.kernels.linear import STRATEGIES, TUNED_ROWS, Linear, tune_linears


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 64, 65])
@pytest.mark.parametrize("n_out", [64, 63, 400])
def test_every_kernel_computes_the_same_product(name: str, rows: int, n_out: int, two_threads: None) -> None:
    """Forced to one kernel for every row count (pad2 and split fall back where they cannot run:
    more than one row, widths not divisible by the thread count; beyond 64 rows F.linear), the
    layer equals F.linear with bias; an in-place weight update is seen by the cached blocks."""
    gen = torch.Generator().manual_seed(rows + n_out)
    lin = Linear(48, n_out, bias=True).double()
    lin.choice = tuple(name if (name != "pad2" or r == 1) and (name != "split" or n_out % 2 == 0) else "linear"
                       for r in range(1, TUNED_ROWS[-1] + 1))
    lin.tuned_threads = 2
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, 48, generator=gen, dtype=torch.float64))
        lin.bias.copy_(torch.randn(n_out, generator=gen, dtype=torch.float64))
    x = torch.randn(rows, 48, generator=gen, dtype=torch.float64)
    with torch.inference_mode():
        got = lin.forward(x)
        assert got.shape == (rows, n_out)
        torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=0, atol=1e-12)
        with torch.no_grad():
            lin.weight.mul_(2.0)
        torch.testing.assert_close(lin.forward(x), F.linear(x, lin.weight, lin.bias), rtol=0, atol=1e-12)


def test_tuning_measures_once_then_reads_the_cached_plan(tmp_path: Path, two_threads: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama(vocab_size=64, layers=2, dtype=torch.float32)
    plan = tune_linears(model, repeats=1, cache_dir=tmp_path)
    # qkv and the LM head are both 64 x 32 here: one group, timed over the 3 matrices in turn
    assert set(plan) == {"64x32:float32", "32x32:float32", "128x32:float32", "32x64:float32"}
    for kernels in plan.values():
        assert len(kernels) == TUNED_ROWS[-1] and set(kernels) <= set(STRATEGIES)
        assert "pad2" not in kernels[1:]  # padding to two only ever serves a single row
        assert "tall4" not in kernels[:2]  # chunks of four: from three rows
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.choice == tuple(plan["64x32:float32"]) and qkv.tuned_threads == 2
    assert len(list(tmp_path.glob("*.json"))) == 1

    def fail(*args: object) -> list[str]:
        raise AssertionError("measured again although the plan is cached")

    monkeypatch.setattr(linear, "_measure", fail)
    again = tiny_llama(vocab_size=64, layers=2, dtype=torch.float32)
    assert tune_linears(again, repeats=1, cache_dir=tmp_path) == plan


def test_a_layer_tuned_for_other_thread_counts_uses_f_linear(two_threads: None) -> None:
    lin = Linear(8, 6, bias=False).double()
    lin.choice = ("split",) * 4
    lin.tuned_threads = 3  # 6 % 2 == 0 would allow a split on 2 threads; the 3-block plan must not be used
    x = torch.randn(2, 8, dtype=torch.float64)
    assert torch.equal(lin.forward(x), F.linear(x, lin.weight))


@pytest.mark.skipif(not linear.mkl_packing_available(), reason="this PyTorch build has no MKL packed sgemm")
@pytest.mark.parametrize("rows", [1, 4, 17, 64])
def test_the_mkl_packed_kernel_tracks_the_weight(rows: int, two_threads: None) -> None:
    """fp32 only (a float64 layer forced to "mkl" runs F.linear, above): MKL's packed product equals
    F.linear up to summation order, and a weight written in place is packed again."""
    gen = torch.Generator().manual_seed(rows)
    lin = Linear(48, 96, bias=True)
    lin.choice = ("mkl",) * TUNED_ROWS[-1]
    lin.tuned_threads = 2
    x = torch.randn(rows, 48, generator=gen)
    with torch.inference_mode():
        torch.testing.assert_close(lin.forward(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.weight.mul_(-3.0)
        torch.testing.assert_close(lin.forward(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        copied = copy.deepcopy(lin)  # the opaque packed weight stays behind; the copy packs its own
        torch.testing.assert_close(copied.forward(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("row_invariant", [True, False])
def test_only_engines_without_row_invariance_measure_the_plan(row_invariant: bool, tmp_path: Path, two_threads: None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-row-count plan serves forwards that are not row-invariant (``--no-row-invariant``, GPU
    engines, a separate draft model): a row-invariant engine does not measure it (20 s for
    SmolLM2-135M on 2 cores from a cold cache, for nothing), one without row invariance measures it at
    the thread count it runs."""
    calls: list[int] = []

    def spy(root: torch.nn.Module) -> dict[str, list[str]]:
        calls.append(torch.get_num_threads())
        return tune_linears(root, repeats=1, cache_dir=tmp_path)

    monkeypatch.setattr(invariance, "tune_linears", spy)
    model = tiny_llama(vocab_size=64, layers=2, dtype=torch.float32)
    config = EngineConfig(model=ModelConfig(row_invariant=row_invariant, threads=2),
                          cache=CacheConfig(max_model_len=64, max_num_seqs=2))
    build_engine(config, model=model, tokenizer=tiny_tokenizer(64))
    qkv = model.layers[0].self_attn.qkv_proj
    if row_invariant:
        assert calls == [] and qkv.choice == () and qkv.invariant
    else:
        assert calls == [2] and len(qkv.choice) == TUNED_ROWS[-1] and qkv.tuned_threads == 2 and not qkv.invariant
