"""On a GPU: the CUDA graphs replay the eager forward, and speculation stays lossless on CUDA.

Marked ``cuda`` and skipped where no GPU is (``make test`` runs on CPUs only); run on a lent GPU
with ``python -m pytest -m cuda tests/cuda``. Float32 with TF32 off, so a greedy token can only
differ between two kernels at a near-tie, which these sharp random models do not have.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_to_completion, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.llm import build_drafter
from tidespec.models.execution.graphs import GraphStep
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.draft_model import DraftModelOptions

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

V = 48
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15, 16, 12, 13, 14, 15, 16, 12], [3, 3, 3, 3]]


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_graph_replay_equals_eager_forward():
    model = tiny_llama(64, layers=2, seed=1, dtype=torch.float32).to("cuda")
    eager_kv = KVCache.for_model(model.cfg, 6, 300, torch.float32, "cuda")
    graph_kv = KVCache.for_model(model.cfg, 6, 300, torch.float32, "cuda", spare_slot=True)
    step = GraphStep(model, graph_kv, tap_layers=(0, 1), max_q=4)
    step.warm_up()
    assert len(step.graphs) == 4 * 4 * 2  # batches 1, 2, 4, 6 x rows 1..4 x keys 256, 300
    gen = torch.Generator().manual_seed(0)
    ctx = {1: 9, 3: 20, 4: 5}
    for slot, n in ctx.items():
        ids = torch.randint(2, 64, (n,), generator=gen).cuda()
        for kv in (eager_kv, graph_kv):
            model(ids, BatchLayout.build([n], [0], [slot], device="cuda"), kv)
    for _ in range(3):  # three replays in a row: inputs really are re-read
        slots, q_lens = [3, 1, 4], [1, 4, 2]
        tokens = torch.randint(2, 64, (sum(q_lens),), generator=gen).tolist()
        ctx_lens = [ctx[s] for s in slots]
        layout = BatchLayout.build(q_lens, ctx_lens, slots, device="cuda")
        want = model(torch.tensor(tokens, device="cuda"), layout, eager_kv, tap_layers=(0, 1))
        got = step(tokens, q_lens, ctx_lens, slots, tap_layers=(0, 1))
        assert got is not None and got.taps is not None
        torch.testing.assert_close(got.logits, want.logits)
        torch.testing.assert_close(got.taps, want.taps)
        for s, q in zip(slots, q_lens):
            ctx[s] += q
    assert step.num_replayed == 3


def _generate(model, spec: SpecConfig, graphs: bool = True) -> list[list[int]]:
    cfg = EngineConfig(model=ModelConfig(device="cuda", dtype="float32", enforce_eager=not graphs),
                       cache=CacheConfig(max_model_len=96, max_num_seqs=4), spec=spec)
    drafter = build_drafter(spec, model, 4, 96) if spec.drafter != "none" else None
    engine = LLMEngine(model, tiny_tokenizer(V), cfg, drafter=drafter)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done = run_to_completion(engine)
    if graphs:
        assert engine.executor.graphs is not None and engine.executor.graphs.num_replayed > 0
    return [done[i].token_ids for i in ids]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(V, layers=3, seed=2, scale=3.0, dtype=torch.float32).to("cuda")


@pytest.fixture(scope="module")
def plain(model):
    return _generate(model, SpecConfig())


def test_graphs_equal_eager_plain_decoding(model, plain):
    assert _generate(model, SpecConfig(), graphs=False) == plain


@pytest.mark.parametrize("drafter,tree", [("ngram", False), ("suffix", False), ("suffix", True),
                                          ("draft-model", False), ("draft-model", True), ("eagle3", False),
                                          ("eagle3", True)])
@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_speculation_equals_plain_on_cuda(model, plain, drafter, tree, gamma):
    spec = SpecConfig(drafter=drafter, num_speculative_tokens=gamma, tree=tree,
                      options={"draft-model": DraftModelOptions(layers=1, tree_top_k=2)})
    assert _generate(model, spec) == plain


def test_fixed_shape_graphs_give_verification_rows_the_decode_rows_bits_in_bfloat16():
    """Row invariance on CUDA: with fixed-shape graphs a sequence's 5-row verification and a tree
    give its rows exactly the bits a decode step gives them, in bfloat16 (where the usual graphs,
    one per row count, round them differently)."""
    model = tiny_llama(512, layers=2, seed=3, dtype=torch.bfloat16, hidden_size=256, intermediate_size=512,
                       num_heads=4, num_kv_heads=2, head_dim=64).to("cuda")
    kv = KVCache.for_model(model.cfg, 4, 400, torch.bfloat16, "cuda", spare_slot=True)
    step = GraphStep(model, kv, tap_layers=(), max_q=5, fixed_shape=True, prompt_rows=64)
    step.warm_up()
    assert {r for _, r, _ in step.graphs} == {8, 16, 32, 64} and {k for _, _, k in step.graphs} == {400}
    prompt = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.inference_mode():
        model(torch.tensor(prompt, device="cuda"), BatchLayout.build([40], [0], [0], device="cuda"), kv)
    cont = [7, 8, 9, 10, 11]
    decoded = []
    for i, t in enumerate(cont):  # plain decoding, one row a forward (K/V at 40 + i rewritten alike below)
        out = step([t], [1], [40 + i], [0])
        assert out is not None
        decoded.append(out.logits[0].clone())
    ver = step(cont, [5], [40], [0])
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    branch = step(cont[:3], [3], [40], [0], depths=[[0, 1, 1]], masks=[tree])
    assert ver is not None and branch is not None and step.num_declined == 0
    assert all(torch.equal(ver.logits[i], decoded[i]) for i in range(5))
    assert torch.equal(branch.logits[0], decoded[0]) and torch.equal(branch.logits[1], decoded[1])


def test_row_attention_kernel_matches_sdpa_and_gives_a_row_the_same_bits_in_any_call():
    """The fixed-order kernel (``models/kernels/row_attention.py``): close to SDPA over the same mask, and a
    row's output bit for bit the same alone, in a 4-row block, beside another sequence, over more keys."""
    from tidespec.models.execution.graphs import CHAIN
    from tidespec.models.kernels.attention import attend_padded
    from tidespec.models.kernels.row_attention import block_mask, row_attention
    gen = torch.Generator(device="cpu").manual_seed(0)
    k, v = (torch.randn(3, 3, 1024, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    q = torch.randn(8, 9, 64, generator=gen).to("cuda", torch.bfloat16)
    t = lambda *xs: torch.tensor(xs, device="cuda")
    ctx, lim, bits, offs = t(300, 40), t(0, 1, 2, 3, 0, 1, 2, 0), t(*[CHAIN] * 4, 0b1, 0b11, 0b101, CHAIN), \
        t(300, 301, 302, 303, 40, 41, 42, 0)
    full = row_attention(q, k, v, ctx, lim, bits, offs, rows=4, keys=512)
    want = attend_padded(q, None, block_mask(ctx, lim, bits, offs, 4, 512, None), k[:2, :, :512], v[:2, :, :512])
    torch.testing.assert_close(full.float(), want.float(), atol=2e-2, rtol=2e-2)
    one = row_attention(q[:1].contiguous(), k, v, ctx[:1], lim[:1], bits[:1], offs[:1], rows=1, keys=1024)
    three = row_attention(q[:3].contiguous(), k, v, ctx[:1], lim[:3], bits[:3], offs[:3], rows=3, keys=512)
    assert torch.equal(one[0], full[0]) and all(torch.equal(three[i], full[i]) for i in range(3))


@pytest.mark.parametrize("drafter,tree", [("suffix", False), ("eagle3", True)])
def test_row_attention_engines_in_bfloat16_speculate_and_batch_like_plain_alone(drafter, tree):
    """``--cuda-invariance row-attention``: the usual graphs (row counts, key buckets) with the
    fixed-order kernel; greedy speculation and batching give plain decoding's tokens alone."""
    model = tiny_llama(V, layers=3, seed=2, scale=3.0, dtype=torch.bfloat16, hidden_size=128,
                       intermediate_size=256, head_dim=32).to("cuda")
    mc = ModelConfig(device="cuda", dtype="bfloat16", cuda_invariance="row-attention")

    def run(spec: SpecConfig, prompts: list[list[int]]) -> list[list[int]]:
        cfg = EngineConfig(model=mc, cache=CacheConfig(max_model_len=96, max_num_seqs=4), spec=spec)
        engine = LLMEngine(model, tiny_tokenizer(V), cfg,
                           drafter=build_drafter(spec, model, 4, 96) if spec.drafter != "none" else None)
        assert engine.executor.graphs is not None and engine.executor.graphs.row_kernel
        ids = [engine.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in prompts]
        done = run_to_completion(engine)
        return [done[i].token_ids for i in ids]
    alone = [run(SpecConfig(), [p])[0] for p in PROMPTS]
    spec = SpecConfig(drafter=drafter, num_speculative_tokens=3, tree=tree)
    assert run(SpecConfig(), PROMPTS) == alone and run(spec, PROMPTS) == alone


@pytest.mark.parametrize("drafter,tree", [("eagle3", False), ("eagle3", True), ("draft-model", False)])
def test_dovetail_placement_target_on_cpu_drafter_on_cuda(drafter, tree):
    target = tiny_llama(V, layers=3, seed=2, scale=3.0, dtype=torch.float32)
    spec = SpecConfig(drafter=drafter, num_speculative_tokens=3, tree=tree, drafter_device="cuda",
                      options={"draft-model": DraftModelOptions(layers=1, tree_top_k=2)})
    cfg = EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=4), spec=spec)
    outs = []
    for s in (SpecConfig(), spec):
        drafter_obj = build_drafter(s, target, 4, 96) if s.drafter != "none" else None
        engine = LLMEngine(target, tiny_tokenizer(V), EngineConfig(cache=cfg.cache, spec=s), drafter=drafter_obj)
        ids = [engine.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in PROMPTS]
        done = run_to_completion(engine)
        outs.append([done[i].token_ids for i in ids])
    assert outs[0] == outs[1]


def test_sampling_on_cuda_runs_unseeded_and_seeded_is_reproducible(model):
    spec = SpecConfig(drafter="suffix", num_speculative_tokens=3)
    cfg = EngineConfig(model=ModelConfig(device="cuda", dtype="float32"),
                       cache=CacheConfig(max_model_len=96, max_num_seqs=4), spec=spec)
    runs = []
    for _ in range(2):
        engine = LLMEngine(model, tiny_tokenizer(V), cfg, drafter=build_drafter(spec, model, 4, 96))
        a = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True))
        b = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True))
        done = run_to_completion(engine)
        assert len(done[b].token_ids) == 16
        runs.append(done[a].token_ids)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("compile", [False, True])
def test_head_graphs_replay_the_eager_drafter_on_cuda(compile):
    from tests.helpers import capture
    from tests.speculative.test_eagle3 import VOCAB as HV
    from tests.speculative.test_eagle3 import tiny_head, tiny_target
    from tidespec.speculative.api import DraftInput, Observation
    from tidespec.speculative.drafters.eagle3 import Eagle3Drafter, Eagle3DrafterConfig

    target = tiny_target(torch.float32)
    head = tiny_head(target)
    gen = torch.Generator().manual_seed(4)
    seqs = {s: torch.randint(0, HV, (40,), generator=gen).tolist() for s in (0, 1, 2)}
    taps = {s: capture(target, ids, head.cfg.tap_layers).cuda() for s, ids in seqs.items()}
    target.to("cuda"), head.to("cuda")
    eager, graphed = (Eagle3Drafter(head, target.embed_tokens, Eagle3DrafterConfig(
        max_num_seqs=4, max_model_len=300, graphs=g, compile=compile)) for g in (False, True))
    assert graphed.warm_up(4) > 0 and graphed._graphs is not None
    captured = len(graphed._graphs.graphs)
    assert captured == 3 * 2 * (5 + 4)  # batches 1, 2, 4 x keys 256, 300 x (catch-ups of 1..5 rows + chains 1..4)
    cached = {0: 3, 1: 4, 2: 5}
    for d in (eager, graphed):
        d.observe([Observation(s, seqs[s][:c + 1], c, taps[s][:c]) for s, c in cached.items()])
    for accepted in ([1, 3, 2], [2, 1, 4], [4, 2, 1]):
        inputs = [DraftInput(s, seqs[s][:c + 1], 4, SamplingParams()) for s, c in cached.items()]
        want, got = eager.propose(inputs).drafts, graphed.propose(inputs).drafts
        assert {s: d.token_ids for s, d in got.items()} == {s: d.token_ids for s, d in want.items()}
        for (s, c), n in zip(list(cached.items()), accepted):
            for d in (eager, graphed):
                d.observe([Observation(s, seqs[s][:c + n + 1], n, taps[s][c:c + n])])
            cached[s] = c + n
    assert graphed._graphs.num_replayed == 3 * 2 and len(graphed._graphs.graphs) == captured


def test_bench_profile_and_the_policy_profiler_time_the_cuda_graphs(model, tmp_path):
    """``tidespec bench profile`` and the start-up profiler the analytic policy reads run on CUDA and
    time the captured graphs (each graph captured by its shape's untimed warm-up)."""
    from tidespec.bench.profile.run import ProfileConfig, run_profile
    from tidespec.speculative.policy.profiler import ProfilerConfig, measure_profile

    cfg = ProfileConfig(ns=(1, 3), batch_sizes=(1, 2), context=16, repeats=2, target_s=0.01, bandwidth_mib=8)
    doc = run_profile(cfg, model, out_dir=tmp_path, command="x", echo=False)
    assert doc["step"] == "CUDA graphs" and all(r["t_ms"] > 0 and r["t_compiled_ms"] > 0 for r in doc["rows"])
    assert doc["bandwidth_gb_s"] > 0 and (tmp_path / "plot.png").stat().st_size > 0
    prof = measure_profile(model, None, ProfilerConfig(batch_sizes=(1, 2), tokens_per_seq=(1, 3),
                                                       single_seq_tokens=(1,), passes=1))
    assert prof.verify_latency and all(t > 0 for t in prof.verify_latency.values())
