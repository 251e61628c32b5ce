"""Penalties, logit_bias, min_tokens and log-probabilities stay exact under speculation.

Greedy output with a penalty or a bias is the same tokens with every drafter (n-gram, suffix chain
and tree, draft model, EAGLE-3 chain and tree, the controller switching between them), alone and
batched, and each token's log-probability and top log-probabilities are the same bits; plain
decoding follows vLLM's formulas (checked against a step-by-step reference over full forwards);
sampled output with penalties has the penalised distribution (chi-squared, the harness of
``tests/speculative/test_spec_sampling.py``); the prompt's log-probabilities equal a full forward's,
chunked or not, and are computed in full on a prompt the prefix cache holds.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    EVERY_DRAFTER,
    ScriptedPolicy,
    full_logits,
    run_to_completion,
    seed_generators_from_counter,
    spec_drafter,
    switching_drafters,
)
from tests.speculative.test_spec_sampling import ALPHA, W_SUBTLE, chi2_pvalue, sample_size
from tidespec.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from tidespec.engine.engine import LLMEngine, RequestError
from tidespec.engine.output import RequestOutput
from tidespec.sampling import SamplingParams, SamplingParamsError, StructuredOutputs, target_probs
from tidespec.speculative.drafters.draft_model import DraftModelOptions

MAX_TOKENS = 32
MAX_LEN = 256
TOP = 4


def one(tok, ch: str) -> int:
    return tok.encode(ch)[0]


@pytest.fixture(scope="module")
def jobs(tok) -> list[tuple[list[int], SamplingParams]]:
    """Prompts that invite repetition, each with a penalty (or none), all with log-probabilities."""
    lp = {"max_tokens": MAX_TOKENS, "logprobs": TOP}
    return [
        (tok.encode("abcabcabcabcabcab"), SamplingParams(frequency_penalty=0.7, **lp)),
        (tok.encode("hello hello hello hello hel"), SamplingParams(presence_penalty=1.2, **lp)),
        (tok.encode("xyzxyzxyzxyzxyzx"), SamplingParams(repetition_penalty=1.5, **lp)),
        (tok.encode("the cat the cat the cat the"), SamplingParams(
            logit_bias={one(tok, "t"): -100.0, one(tok, " "): 2.5}, min_tokens=30, **lp)),
        (tok.encode("aaaa bbbb aaaa bbbb aaaa"), SamplingParams(
            frequency_penalty=-0.4, presence_penalty=0.5, repetition_penalty=1.2, **lp)),
        (tok.encode("one two one two one two one"), SamplingParams(**lp)),  # log-probabilities alone
    ]


def run(model, tok, spec: SpecConfig, jobs, slots: int, policy=None) -> tuple[list[RequestOutput], LLMEngine]:
    """The final outputs of ``jobs``, ``slots`` in flight (1: each alone)."""
    cfg = EngineConfig(cache=CacheConfig(max_model_len=MAX_LEN, max_num_seqs=slots), spec=spec)
    e = LLMEngine(model, tok, cfg, drafter=spec_drafter(spec, model, slots, MAX_LEN), policy=policy)
    ids = [e.add_request(p, params) for p, params in jobs]
    done = run_to_completion(e)
    return [done[i] for i in ids], e


def view(outs: list[RequestOutput]) -> list[tuple[list[int], list]]:
    return [(o.token_ids, o.logprobs) for o in outs]


@pytest.fixture(scope="module")
def plain(model, tok, jobs) -> list[RequestOutput]:
    return run(model, tok, SpecConfig(), jobs, slots=1)[0]


def reference(model, prompt: list[int], params: SamplingParams, eos: int = 0) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with vLLM's penalty formulas over full forwards: the tokens and, per position,
    the processed logits they were chosen from. Written out here, apart from ``engine.logits``."""
    out: list[int] = []
    rows = []
    for _ in range(params.max_tokens):
        x = full_logits(model, prompt + out)[-1].clone()  # [V] float64
        for t, b in params.logit_bias.items():
            x[t] += b
        if len(out) < params.min_tokens:
            x[eos] = float("-inf")
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=x.shape[0]).double()
        seen = (counts > 0) | (torch.bincount(torch.tensor(prompt), minlength=x.shape[0]) > 0)
        rp = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
        x = x - counts * params.frequency_penalty - (counts > 0).double() * params.presence_penalty
        rows.append(x)
        out.append(int(x.argmax()))
        if out[-1] == eos:
            break
    return out, rows


def test_plain_decoding_applies_vllm_penalties_and_logprobs(model, tok, jobs, plain) -> None:
    """Tokens as the written-out formulas choose them; log-probabilities the reference's log-softmax
    (float32, to its rounding: a full forward and the engine's cached steps differ in the last bits)."""
    for (prompt, params), got in zip(jobs, plain):
        want, rows = reference(model, prompt, params)
        assert got.token_ids == want
        assert got.logprobs is not None and len(got.logprobs) == len(want)
        for t, row, lp in zip(want, rows, got.logprobs):
            ref = torch.log_softmax(row.float(), -1)
            assert lp.token_id == t and lp.logprob == pytest.approx(float(ref[t]), abs=1e-4)
            assert [i for i, _ in lp.top] == ref.topk(TOP).indices.tolist()
    assert len(plain[3].token_ids) >= 30, "min_tokens: no end of sequence before 30 tokens"
    assert one(tok, "t") not in plain[3].token_ids, "a bias of -100 bans the token"


def test_penalties_change_the_output(model, tok, jobs, plain) -> None:
    """Otherwise the exactness tests below would not show that penalties are applied in verification."""
    bare = run(model, tok, SpecConfig(), [(p, SamplingParams(max_tokens=MAX_TOKENS)) for p, _ in jobs[:5]], 1)[0]
    assert sum(b.token_ids != o.token_ids for b, o in zip(bare, plain[:5])) >= 4


CASES = EVERY_DRAFTER
SLOW = {"eagle3-tree"}  # a tree's row paths are exercised by suffix-tree in make test; EAGLE-3's in make test-slow


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_every_drafter_alone_and_batched_gives_plain_tokens_and_logprob_bits(model, tok, jobs, plain, name) -> None:
    alone, _ = run(model, tok, CASES[name], jobs, slots=1)
    assert view(alone) == view(plain)
    batched, e = run(model, tok, CASES[name], jobs, slots=4)
    assert view(batched) == view(plain)
    steps = list(e.history)
    assert sum(s.num_draft_tokens for s in steps) > 0, "the drafter never proposed: verification not exercised"
    assert sum(s.num_rejected for s in steps) > 0, "drafts must be rejected too for the test to bite"


def test_the_controller_switching_drafters_gives_plain_tokens_and_logprob_bits(model, tok, jobs, plain) -> None:
    spec = SpecConfig(drafter="suffix,eagle3,draft-model,ngram", num_speculative_tokens=4,
                      options={"draft-model": DraftModelOptions(layers=1)})
    got, _ = run(model, tok, spec, jobs, slots=4, policy=ScriptedPolicy(switching_drafters))
    assert view(got) == view(plain)


def test_penalties_compose_with_a_constraint(model, tok) -> None:
    """A grammar mask and a penalty together, verified by suffix: the plain tokens and bits."""
    job = [(tok.encode("abab-12x abab-12x abab-1"), SamplingParams(
        max_tokens=MAX_TOKENS, frequency_penalty=0.9, logprobs=2, structured=StructuredOutputs(regex="(ab)+-[0-9]{2,9}x")))]
    want, _ = run(model, tok, SpecConfig(), job, slots=1)
    got, e = run(model, tok, SpecConfig(drafter="suffix", num_speculative_tokens=4), job, slots=1)
    assert view(got) == view(want)
    assert sum(s.num_accepted_tokens for s in e.history) > 0


def test_prompt_logprobs_equal_a_full_forward_chunked_or_cached(model, tok) -> None:
    prompt = tok.encode("the quick brown fox jumps over the lazy dog")
    params = SamplingParams(max_tokens=2, prompt_logprobs=3)
    ref = torch.log_softmax(full_logits(model, prompt).float(), -1)  # [L, V]
    cfg = EngineConfig(cache=CacheConfig(max_model_len=MAX_LEN, max_num_seqs=2),
                       scheduler=SchedulerConfig(max_num_batched_tokens=16))  # the prompt in 3 chunks
    e = LLMEngine(model, tok, cfg)
    for wave in range(2):  # the second wave's prompt is in the prefix cache: it must be computed anyway
        rid = e.add_request(prompt, params)
        out = run_to_completion(e)[rid]
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        for i in range(1, len(prompt)):
            assert got[i].token_id == prompt[i]
            assert got[i].logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)
            assert [t for t, _ in got[i].top] == ref[i - 1].topk(3).indices.tolist()
        assert out.stats.num_cached_tokens == 0, f"wave {wave}: a prompt whose log-probabilities are asked is computed"
    plain = e.add_request(prompt, SamplingParams(max_tokens=2))
    assert run_to_completion(e)[plain].stats.num_cached_tokens > 0, "other requests still reuse it"


def test_bad_bias_and_penalties_are_one_line_errors(model, tok) -> None:
    e = LLMEngine(model, tok, EngineConfig(cache=CacheConfig(max_model_len=MAX_LEN, max_num_seqs=1)))
    with pytest.raises(RequestError) as err:
        e.add_request("ab", SamplingParams(logit_bias={len(tok) + 5: 1.0}))
    assert err.value.param == "logit_bias"
    for kw, param in [({"presence_penalty": 2.5}, "presence_penalty"), ({"repetition_penalty": 0.0},
                      "repetition_penalty"), ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
                      ({"logit_bias": {3: 101.0}}, "logit_bias"), ({"logprobs": 21}, "logprobs")]:
        with pytest.raises(SamplingParamsError) as perr:
            SamplingParams(**kw)
        assert perr.value.param == param and "\n" not in str(perr.value)


def test_seeded_sampling_with_penalties_is_the_same_with_every_drafter(model, tok, jobs) -> None:
    sampled = [(p, SamplingParams(temperature=0.9, seed=11 + i, max_tokens=24, frequency_penalty=0.5,
                                  repetition_penalty=1.1, logprobs=2)) for i, (p, _) in enumerate(jobs)]
    want, _ = run(model, tok, SpecConfig(), sampled, slots=1)
    for name in ("suffix", "draft-model"):
        got, _ = run(model, tok, CASES[name], sampled, slots=4)
        assert view(got) == view(want), name


CHI_REGEX = "[abc]{2}"


def exact_penalised(model, tok, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(t1, t2 | prompt) of plain sampling under ``CHI_REGEX``'s mask and ``params``' penalties (the
    second letter's logits penalised by the first): the second is the one verification decides."""
    letters = [tok.encode(ch)[0] for ch in "abc"]
    mask = torch.full((len(tok),), float("-inf"), dtype=torch.float64)
    mask[letters] = 0.0

    def probs(ctx: list[int], out: list[int]) -> torch.Tensor:
        x = full_logits(model, ctx + out)[-1] + mask
        for t in out:
            x[t] -= params.frequency_penalty
        x[list(set(out))] -= params.presence_penalty
        return target_probs(x.unsqueeze(0), params)[0]

    dist: dict[tuple[int, ...], float] = {}
    p1 = probs(prompt, [])
    for a in letters:
        p2 = probs(prompt, [a])
        for b in letters:
            dist[(a, b)] = float(p1[a] * p2[b])
    return dist


def test_sampled_output_with_penalties_has_the_penalised_distribution(model, tok, monkeypatch) -> None:
    """Rejection sampling with the draft model's own (unpenalised) probabilities corrects to the
    penalised target."""
    seed_generators_from_counter(monkeypatch, 4_000_037)
    prompt = tok.encode("abcabcabcabcabcab")
    params = SamplingParams(temperature=1.0, frequency_penalty=1.5, presence_penalty=0.5)
    dist = exact_penalised(model, tok, prompt, params)
    n = sample_size(dist, W_SUBTLE)
    slots = 1000
    spec = SpecConfig(drafter="draft-model", num_speculative_tokens=3,
                      options={"draft-model": DraftModelOptions(layers=1)})
    cfg = EngineConfig(cache=CacheConfig(max_model_len=32, max_num_seqs=slots), spec=spec,
                       scheduler=SchedulerConfig(max_num_batched_tokens=slots * 24))
    e = LLMEngine(model, tok, cfg, drafter=spec_drafter(spec, model, slots, 32))
    structured = StructuredOutputs(regex=CHI_REGEX)
    for _ in range(n):
        e.add_request(prompt, SamplingParams(temperature=1.0, frequency_penalty=1.5, presence_penalty=0.5,
                                             max_tokens=3, structured=structured))
    samples = [tuple(o.token_ids[:2]) for o in run_to_completion(e).values()]
    assert sum(s.num_accepted_tokens for s in e.history) > 0, "no draft was accepted: verification not exercised"
    assert chi2_pvalue(samples, dist) > ALPHA
