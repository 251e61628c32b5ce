"""Our ``DecoderModel`` must compute what transformers' reference models compute.

Random tiny configs of every supported family (Llama, Llama 3 rope scaling, Mistral sliding
window, Qwen2 q/k/v bias, Qwen3 q/k norm, SmolLM3 NoPE, OLMo 2, Granite, Phi-3 partial rotary
and LongRoPE, Gemma 3; ``tests/helpers.py``'s ``TINY_HF_ARCHS``) are compared position by position: a full prefill, and
a ragged batch where one sequence prefills while another continues from its KV cache. float32
must agree to 1e-4, float64 to 1e-10. The embedded SmolLM2-135M is compared with transformers
loading the same converted checkpoint.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.helpers import TINY_HF_ARCHS, full_logits, tiny_hf_model
from tidespec.models.families.decoder import DecoderModel, scale_logits
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.models.loading.loader import LoadedModel

ARCHS = sorted(TINY_HF_ARCHS)
TOL = {torch.float32: 1e-4, torch.float64: 1e-10}
def _hf_logits(hf: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V] in the model dtype


def _logits_in_model_dtype(model: DecoderModel, hidden: torch.Tensor) -> torch.Tensor:
    """``ModelOutput.logits`` are float32 by contract; the float64 check projects the (float64)
    final hidden state itself so float32 rounding cannot mask a 1e-10 discrepancy."""
    with torch.no_grad():
        return scale_logits(model.cfg, model.lm_head(hidden))


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_matches_hf(arch: str, dtype: torch.dtype, honest_hf_dtype: None) -> None:
    hf, ours = tiny_hf_model(arch, dtype)
    ids = _prompt(13, hf.config.vocab_size, seed=1)  # longer than Mistral's 6-token window
    ref = _hf_logits(hf, ids)
    assert ref.std() > 0.5, "reference logits too flat for the comparison to mean anything"
    kv = KVCache.for_model(ours.cfg, num_slots=1, max_len=len(ids), dtype=dtype)
    out = ours(torch.tensor(ids), BatchLayout.build([len(ids)], [0], [0]), kv)
    assert out.logits is not None
    assert (out.logits.double() - ref.double()).abs().max().item() < 1e-4
    got = _logits_in_model_dtype(ours, out.last_hidden)
    assert got.dtype == dtype
    assert (got - ref).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_batch_with_cache_matches_hf(arch: str, dtype: torch.dtype, honest_hf_dtype: None) -> None:
    """Sequence B (slot 0) has 5 cached tokens and continues with 4; sequence A (slot 2) prefills
    7 from scratch; both in one forward. Each must match HF run on that sequence alone."""
    hf, ours = tiny_hf_model(arch, dtype, seed=3)
    vocab = hf.config.vocab_size
    seq_a, seq_b = _prompt(7, vocab, seed=4), _prompt(9, vocab, seed=5)
    kv = KVCache.for_model(ours.cfg, num_slots=3, max_len=16, dtype=dtype)
    ours(torch.tensor(seq_b[:5]), BatchLayout.build([5], [0], [0]), kv, logits_rows=torch.tensor([], dtype=torch.int64))
    layout = BatchLayout.build(q_lens=[4, 7], ctx_lens=[5, 0], slots=[0, 2])
    out = ours(torch.tensor(seq_b[5:] + seq_a), layout, kv)  # T = 11 rows
    assert out.logits is not None and out.logits.shape == (11, vocab)
    got = _logits_in_model_dtype(ours, out.last_hidden)
    ref_b = _hf_logits(hf, seq_b)[5:]
    ref_a = _hf_logits(hf, seq_a)
    assert (got[:4] - ref_b).abs().max().item() < TOL[dtype]
    assert (got[4:] - ref_a).abs().max().item() < TOL[dtype]
    assert (out.logits[:4].double() - ref_b.double()).abs().max().item() < 1e-4


def test_comparison_detects_a_small_weight_error() -> None:
    """The 1e-4 float32 bound is tight enough to notice a 1e-3 change to a single weight."""
    hf, ours = tiny_hf_model("llama", torch.float32)
    ids = _prompt(8, hf.config.vocab_size, seed=2)
    with torch.no_grad():
        ours.layers[1].self_attn.qkv_proj.weight[0, 0] += 1e-3
    diff = (full_logits(ours, ids) - _hf_logits(hf, ids)).abs().max().item()
    assert diff > 1e-4


def test_tiny_hf_model_rejects_unknown_arch() -> None:
    with pytest.raises(KeyError, match="gpt2"):
        tiny_hf_model("gpt2", torch.float32)


# Short (12-20 tokens each): the 135M forward dominates this file's run time on a small CPU.
EMBEDDED_PROMPTS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to five."}],
    [{"role": "system", "content": "Code only."}, {"role": "user", "content": "def fib(n):\n    #"}],
]


@pytest.fixture(scope="module")
def embedded_hf_reference(embedded: LoadedModel) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        embedded.path, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.mark.integration
def test_embedded_matches_transformers(embedded: LoadedModel,
                                       embedded_hf_reference: transformers.PreTrainedModel) -> None:
    """The three chat prompts run as one ragged batch through our model; HF runs each alone."""
    prompts = [list(embedded.tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)) for p in EMBEDDED_PROMPTS]
    lens = [len(p) for p in prompts]
    kv = KVCache.for_model(embedded.config, num_slots=len(prompts), max_len=max(lens), dtype=torch.float32)
    layout = BatchLayout.build(q_lens=lens, ctx_lens=[0] * len(lens), slots=list(range(len(lens))))
    out = embedded.model(torch.tensor(sum(prompts, [])), layout, kv)
    assert out.logits is not None and out.logits.shape == (sum(lens), embedded.config.vocab_size)
    for got, ids in zip(out.logits.split(lens), prompts):
        ref = _hf_logits(embedded_hf_reference, ids)
        assert ref.std() > 1.0
        # logits up to ~30 after 30 float32 layers: the summation order of the projections (one fma
        # chain per output in exact_linear, blocked sums in MKL) moves them by up to ~1.2e-4
        assert (got - ref).abs().max().item() < 3e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_three_sequences_on_two_threads_match_hf(arch: str, honest_hf_dtype: None, two_threads: None) -> None:
    """Three sequences in one forward take the scatter (index_put) K/V write and the padded
    batched attention; each must still match HF alone to 1e-10 in float64."""
    hf, ours = tiny_hf_model(arch, torch.float64, seed=6)
    vocab = hf.config.vocab_size
    seqs = [_prompt(n, vocab, seed=10 + n) for n in (6, 9, 4)]
    kv = KVCache.for_model(ours.cfg, num_slots=4, max_len=16, dtype=torch.float64)
    ours(torch.tensor(seqs[1][:5]), BatchLayout.build([5], [0], [3]), kv, logits_rows=torch.tensor([], dtype=torch.int64))
    layout = BatchLayout.build(q_lens=[6, 4, 4], ctx_lens=[0, 5, 0], slots=[0, 3, 1])
    out = ours(torch.tensor(seqs[0] + seqs[1][5:] + seqs[2]), layout, kv)
    got = _logits_in_model_dtype(ours, out.last_hidden)
    refs = [_hf_logits(hf, seqs[0]), _hf_logits(hf, seqs[1])[5:], _hf_logits(hf, seqs[2])]
    assert (got - torch.cat(refs)).abs().max().item() < 1e-10
