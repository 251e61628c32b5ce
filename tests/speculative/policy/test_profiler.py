"""Start-up profiler: shapes swept in interleaved passes, medians that shrug off one slow pass."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_llama
from tidespec.models.eagle3.checkpoint import fresh_head
from tidespec.models.execution import executor as executor_module
from tidespec.models.execution.executor import ExecutorOptions, ForwardExecutor, executor_key, prepare_target
from tidespec.models.execution.graphs import GraphStep
from tidespec.models.quant.quantize import QuantizedLinear, quantize_model
from tidespec.speculative.drafters.draft_model import DraftModelDrafter
from tidespec.speculative.drafters.eagle3 import Eagle3Drafter, Eagle3DrafterConfig
from tidespec.speculative.drafters.multi import MultiDrafter
from tidespec.speculative.drafters.suffix import SuffixDrafter
from tidespec.speculative.policy import profiler
from tidespec.speculative.policy.profiler import ProfilerConfig, drafter_signature, measure_profile, profile_key_for


def test_profile_grid_is_swept_in_passes_and_a_slow_pass_does_not_move_the_median(monkeypatch) -> None:
    """Three passes over a 2 x 2 grid (plus two single-sequence lengths); the second pass runs
    'during a slow spell' (10x). Every shape's value is the median of its three samples — the
    normal time — and the calls go warm-up, pass, pass, pass (interleaved), not shape by shape."""
    cfg = ProfilerConfig(batch_sizes=(1, 2), tokens_per_seq=(1, 2), single_seq_tokens=(1, 4), passes=3)
    grid = [(1, 1), (1, 2), (2, 1), (2, 2)]
    per_pass = len(grid) + len(cfg.single_seq_tokens)
    calls: list[tuple[int, int]] = []

    def scripted(forward, device, vocab_size, batch, n, context, repeats, target_s, gen, warm_up=True):
        timed = len(calls) - 1  # calls before this one, minus the warm-up
        calls.append((batch, n))
        slow = 10.0 if per_pass <= timed < 2 * per_pass else 1.0
        return [0.001 * batch * n * slow]

    monkeypatch.setattr(profiler, "forward_samples", scripted)
    prof = measure_profile(tiny_llama(32, layers=1, seed=0), None, cfg)
    assert calls[0] == (2, 2)  # the warm-up: the largest shape
    assert calls[1:] == (grid + [(1, 1), (1, 4)]) * 3
    for b, q in grid:
        assert prof.verify_latency[(b, q)] == pytest.approx(0.001 * b * q)
    assert prof.target_latency == pytest.approx({1: 0.001, 4: 0.004})
    with pytest.raises(ValueError, match="passes"):
        ProfilerConfig(passes=0)


def test_forward_samples_times_a_real_forward_within_its_budget() -> None:
    model = tiny_llama(32, layers=1, seed=0)
    cfg = ProfilerConfig(batch_sizes=(1,), tokens_per_seq=(1, 3), single_seq_tokens=(1,), passes=2, repeats=2)
    prof = measure_profile(model, None, cfg)
    assert set(prof.verify_latency) == {(1, 1), (1, 3)}
    assert all(t > 0 for t in prof.verify_latency.values())
    forward = profiler.executor_forward(ForwardExecutor(model, ExecutorOptions(), 1, 40))
    times = profiler.forward_samples(forward, model.device, 32, 1, 2, 8, repeats=5, target_s=0.0, gen=torch.Generator())
    assert len(times) == 1  # a zero budget still times one forward
    times = profiler.forward_samples(forward, model.device, 32, 1, 2, 8, repeats=3, target_s=100.0,
                                     gen=torch.Generator())
    assert len(times) == 3 and all(t > 0 for t in times)


def test_the_profile_of_an_engine_on_cuda_graphs_times_the_graph_step() -> None:
    """On a GPU the engine replays CUDA graphs, so the profile times ``GraphStep`` (here its static
    block without capture) and is cached under a key of its own."""
    model = tiny_llama(32, layers=1, seed=0)
    cfg = ProfilerConfig(batch_sizes=(1, 2), tokens_per_seq=(1, 3), single_seq_tokens=(1,), passes=1)
    replayed: list[int] = []
    real_call = GraphStep.__call__

    def counting(self, *args, **kw):
        replayed.append(1)
        return real_call(self, *args, **kw)

    options = ExecutorOptions()
    eager_key = profile_key_for(model, None, executor_key(model, options, prepare_target(model, options)), cfg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GraphStep, "__call__", counting)
        mp.setattr(executor_module, "uses_graphs", lambda device, enforce_eager: True)  # a GPU's engine
        prof = measure_profile(model, None, cfg)
        graphs_key = profile_key_for(model, None, executor_key(model, options, prepare_target(model, options)), cfg)
    assert len(replayed) >= 5 and all(t > 0 for t in prof.verify_latency.values())
    assert prof.key == graphs_key != eager_key


def test_the_profile_times_the_kernels_the_engine_runs() -> None:
    """The engine makes its target's kernels row-invariant; the profile used to be measured before
    that, on the other kernels, and cached under a key that did not say which. Now the profiler's
    executor prepares the target as the engine's does, and the key names the kernels and the mode."""
    model = tiny_llama(32, layers=1, seed=1)
    cfg = ProfilerConfig(batch_sizes=(1,), tokens_per_seq=(1,), single_seq_tokens=(1,), passes=1)
    assert not model.row_invariant
    prof = measure_profile(model, None, cfg)
    assert model.row_invariant  # measured on the row-invariant kernels, as the engine will run them
    exact = executor_key(model, ExecutorOptions(), prepare_target(model, ExecutorOptions()))
    assert exact["executor"] == "eager" and exact["row_invariance"].startswith("row invariance: exact")
    assert prof.key == profile_key_for(model, None, exact, cfg)
    loose = ExecutorOptions(row_invariant=False)
    assert profile_key_for(model, None, executor_key(model, loose, prepare_target(model, loose)), cfg) != prof.key
    compiled = ExecutorOptions(compile=True)
    assert executor_key(model, compiled, prepare_target(model, compiled))["executor"] == "compiled-every-forward"


def test_a_drafter_that_reads_taps_is_fed_them_while_timed() -> None:
    """EAGLE-3 drafts from the target's hidden states: timed without them it proposed nothing and
    its drafting cost came out as ~0.01 ms. The profiler now observes random taps first, so every
    timed step drafts and the catch-up table covers re-ingesting lagging positions."""
    from tidespec.speculative.drafters.eagle3 import Eagle3DrafterConfig, build_eagle3_drafter

    model = tiny_llama(64, layers=4, seed=2)
    drafter = build_eagle3_drafter(model, None, cfg=Eagle3DrafterConfig(max_num_seqs=8, max_model_len=512))
    drafted: list[int] = []
    real_propose = drafter.propose

    def counting(inputs):
        proposal = real_propose(inputs)
        drafted.append(proposal.num_draft_tokens)
        return proposal

    drafter.propose = counting  # type: ignore[method-assign]
    cfg = ProfilerConfig(batch_sizes=(1,), tokens_per_seq=(1, 2), single_seq_tokens=(1,), context=32, passes=1,
                         catchup_tokens=(1, 8), catchup_batches=(1, 2), draft_batches=(3,))
    prof = measure_profile(model, drafter, cfg)
    assert drafted and all(n > 0 for n in drafted)  # every timed step drafted a token
    assert 3 in drafted  # a step of the batch-3 row drafted for all three sequences
    assert prof.draft_cost["eagle3"] > 0 and set(prof.catchup) == {(1, 1), (8, 1), (1, 2), (8, 2)}
    # D0(b): b = 1 always measured, the default's row is the first drafter's
    assert set(prof.draft_batch_cost) == {("eagle3", 1), ("eagle3", 3), ("default", 1), ("default", 3)}
    assert prof.draft_batch_cost[("eagle3", 1)] == prof.draft_cost["eagle3"]
    assert all(v > 0 for v in prof.draft_batch_cost.values())


def test_a_drafter_is_timed_within_the_engines_context_and_sequences(caplog) -> None:
    """An EAGLE-3 head sized for short requests (a benchmark's, 64 tokens here) timed on the default
    200-token context has no room to draft: it proposed nothing, a D0 of a few microseconds, and the
    controller priced its drafting as free. Fitted to the engine's limits, every timed step drafts,
    the catch-up lags fit in the context, and no batch exceeds the head's sequence slots."""
    from tidespec.speculative.drafters.eagle3 import Eagle3DrafterConfig, build_eagle3_drafter

    fitted = ProfilerConfig().fitted(180, 4)
    assert (fitted.context, fitted.catchup_tokens, fitted.draft_batches, fitted.catchup_batches) == (
        131, (1, 8, 32), (1, 4), (1, 4))
    assert ProfilerConfig().fitted(4096, 64) == ProfilerConfig()  # a server's limits change nothing
    model = tiny_llama(64, layers=4, seed=2)
    grid = {"batch_sizes": (1,), "tokens_per_seq": (1, 2), "single_seq_tokens": (1,), "passes": 1}
    counts: dict[str, list[int]] = {}
    for name, cfg in (("default", ProfilerConfig(**grid)), ("fitted", ProfilerConfig(**grid).fitted(64, 2))):
        drafter = build_eagle3_drafter(model, None, cfg=Eagle3DrafterConfig(max_num_seqs=2, max_model_len=64))
        real_propose, drafted = drafter.propose, counts.setdefault(name, [])

        def counting(inputs, real_propose=real_propose, drafted=drafted):
            proposal = real_propose(inputs)
            drafted.append(proposal.num_draft_tokens)
            return proposal

        drafter.propose = counting  # type: ignore[method-assign]
        with caplog.at_level("WARNING"):
            caplog.clear()
            prof = measure_profile(model, drafter, cfg)
        warned = "proposed nothing" in caplog.text
        assert warned == (name == "default")
    assert not any(counts["default"])  # the bug: no room, no draft, D0 a no-op's time
    assert counts["fitted"] and all(counts["fitted"])
    assert {b for _, b in prof.draft_batch_cost} == {1} and {b for _, b in prof.catchup} == {1}


def test_profile_key_tells_eagle3_heads_of_another_shape_dtype_or_quantization_apart() -> None:
    """A cached profile (D0, catch-up) belongs to one head: a deeper or half-precision head, or a
    draft model of other layers, must not read it."""
    model = tiny_llama(48, layers=4, seed=0)
    keys = set()
    for layers, dtype, quant in [(1, torch.float64, "none"), (2, torch.float64, "none"), (1, torch.bfloat16, "none"),
                                 (1, torch.float64, "int8"), (1, torch.float64, "int4")]:
        head = fresh_head(model.cfg, None, dtype, num_layers=layers)
        keys.add(profile_key_for(model, Eagle3Drafter(head, model.embed_tokens,
                                                      Eagle3DrafterConfig(quantization=quant)), {}))
    keys |= {profile_key_for(model, DraftModelDrafter(model.truncated(k), max_num_seqs=1, max_model_len=16), {})
             for k in (1, 2)}
    assert len(keys) == 7
    multi = MultiDrafter([SuffixDrafter(), Eagle3Drafter(fresh_head(model.cfg, None, torch.float64),
                                                         model.embed_tokens)], shadow_gamma=2)
    assert set(drafter_signature(multi)) == {"eagle3"}


def test_profile_key_tells_cpus_apart(monkeypatch) -> None:
    """A cache directory that outlives a machine (a copied home, a moved VM) must not hand one CPU's
    measured costs to another: the key holds the CPU's model name."""
    model = tiny_llama(48, layers=2, seed=0)
    monkeypatch.setattr(profiler, "cpu_name", lambda: "AMD EPYC 9R14")
    amd = profile_key_for(model, SuffixDrafter(), {})
    assert profile_key_for(model, SuffixDrafter(), {}) == amd  # stable on one machine
    monkeypatch.setattr(profiler, "cpu_name", lambda: "Intel(R) Xeon(R) Platinum 8488C")
    assert profile_key_for(model, SuffixDrafter(), {}) != amd


def test_profile_key_tells_the_quantized_kernels_apart() -> None:
    """tidespec's int4/int8 kernels give PyTorch's bits at another cost per row count: a profile measured
    with one set of kernels must not be read for the other."""
    model = tiny_llama(48, layers=2, seed=0, dtype=torch.float32)
    quantize_model(model, "int8")
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    keys = set()
    for own in (True, False):
        for layer in layers:
            layer.own_kernel = own
        keys.add(profile_key_for(model, SuffixDrafter(), {}))
    assert len(keys) == 2
