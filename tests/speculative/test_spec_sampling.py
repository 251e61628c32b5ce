"""Sampled speculative decoding has exactly the target's distribution (chi-squared tests).

The exact distribution of the first 3 generated tokens is computed from the tiny target itself
(V^3 cells); speculative samples of each configuration are tested against it. Both sampled
verifiers are covered: rejection sampling (requests without a seed; their generators are seeded
from a counter here so the test is deterministic) and the seeded race (``verify_seeded``). The same
test must fail when a verifier is broken on purpose (recovered token drawn from p instead of the
residual; every draft accepted; one race noise reused for every position), which shows it has the
power to catch the bugs it guards against.

Sample sizes are what each test's power needs, computed from the noncentral chi-squared
distribution of the test statistic on the distribution it samples (``sample_size``; Cohen's effect
size w, w^2 = the sum over cells of (q - p)^2 / p; alpha = 0.001 per test, so that the ~30 tests
together raise a false alarm for about 3 % of seed choices):

* ``W_SUBTLE`` = 0.1 (Cohen's "small" effect) with power 0.99 for every configuration of
  ``make test``: 5,000 samples at temperature 0.7 (9 cells), 7,000 at temperature 1.0;
  ``make test`` samples three of the ten pairs (``FAST_CASES``), the other seven at the same size and
  every pair at ``W_LONG`` are in ``make test-slow`` (each pair costs 12-24 s of pure engine steps:
  all ten took a sixth of ``make test``);
* ``W_BROKEN`` = 0.42 with power 0.9999 for the verifiers broken on purpose, whose deviations
  measured at 20,000 samples were w^2 = 0.18-0.64 (w >= 0.42): 500 samples;
* ``W_LONG`` = 0.055 with power 0.99 in ``make test-slow``: 15,500 / 24,000 samples (every
  configuration ran 20,000 at alpha 0.01 before).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2, chisquare, ncx2

import tidespec.speculative.verify as verify_mod
from tests.helpers import seed_generators_from_counter, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.llm import build_drafter
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.sampling import SamplingParams, target_probs
from tidespec.speculative.drafters.draft_model import DraftModelOptions
from tidespec.speculative.drafters.eagle3_options import Eagle3Options

V = 6
PROMPT = [3, 0, 1, 3, 0, 2, 3, 0, 4, 3, 0, 5, 3]
ALPHA = 0.001  # per test; the seeds are fixed, so a test's outcome is too
# the least deviation (Cohen's w) each test is sized to catch, and the power it must have against it
W_SUBTLE, W_BROKEN, W_LONG = 0.1, 0.42, 0.055
POWER, POWER_BROKEN = 0.99, 0.9999
# the first seed of unseeded requests' generators. It was 1,000,003 until the sample sizes above
# replaced 20,000 for every test: plain sampling itself (no drafter) then drew p = 0.0005 at 7,000
# samples from it, a false alarm of the harness (bases 2, 3, 5, 7 and 11 million: p = 0.16-0.88)
SEED_BASE = 2_000_003
SLOTS = 2_000
# generation runs to 5 tokens so the first verification step may draft gamma = 3 (a branching tree);
# the test looks at the first 3, whose distribution is unaffected by where generation stops
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def model():
    return tiny_llama(V, layers=2, seed=4, scale=1.5)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    # "3 0" is followed by 1, 2, 4 and 5: the suffix drafter's tree branches there, and this tiny
    # model continues the pattern often enough that n-gram/suffix drafts are accepted
    return list(PROMPT)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(V)


def exact_distribution(model, prompt: list[int], params: SamplingParams) -> dict[tuple[int, int, int], float]:
    """P(t1, t2, t3 | prompt) under plain sampling with ``params``."""
    def probs(ctx: list[int]) -> torch.Tensor:
        kv = KVCache.for_model(model.cfg, 1, 32, torch.float64)
        out = model(torch.tensor(ctx), BatchLayout.build([len(ctx)], [0], [0]), kv,
                    logits_rows=torch.tensor([len(ctx) - 1]))
        return target_probs(out.logits, params)[0]

    dist: dict[tuple[int, int, int], float] = {}
    p1 = probs(prompt)
    for a in range(V):
        if p1[a] == 0:
            continue
        p2 = probs(prompt + [a])
        for b in range(V):
            if p2[b] == 0:
                continue
            p3 = probs(prompt + [a, b])
            for c in range(V):
                if p3[c] > 0:
                    dist[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return dist


def sample_first3(model, tok, prompt: list[int], spec: SpecConfig, params: SamplingParams,
                  monkeypatch: pytest.MonkeyPatch, seeded: bool = True,
                  n: int = 0) -> tuple[list[tuple[int, ...]], int, int]:
    """``n`` samples of the first 3 tokens (0: ``sample_size`` for ``W_SUBTLE``), accepted draft
    tokens, and how many proposals branched.

    ``seeded``: request i has seed i (the race path); else no seed (rejection sampling), with the
    request and draft generators seeded from a counter so the test is deterministic."""
    n = n or sample_size(exact_distribution(model, prompt, params), W_SUBTLE)
    seed_generators_from_counter(monkeypatch, SEED_BASE)
    cfg = EngineConfig(cache=CacheConfig(max_model_len=32, max_num_seqs=SLOTS), spec=spec,
                       scheduler=SchedulerConfig(max_num_batched_tokens=SLOTS * 12))
    drafter = build_drafter(spec, model, SLOTS, 32)
    e = LLMEngine(model, tok, cfg, drafter=drafter)
    branching = 0
    if drafter is not None:
        inner = drafter.propose

        def counting_propose(inputs):
            nonlocal branching
            proposal = inner(inputs)
            branching += sum(d.is_tree for d in proposal.drafts.values())
            return proposal

        drafter.propose = counting_propose  # type: ignore[method-assign]
    samples: list[tuple[int, ...]] = []
    accepted = 0
    for i in range(n):
        e.add_request(prompt, SamplingParams(temperature=params.temperature, top_p=params.top_p,
                                             seed=i if seeded else None,
                                             max_tokens=MAX_TOKENS, ignore_eos=True))
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                samples.append(tuple(o.token_ids[:3]))
                accepted += o.stats.num_accepted_tokens
    return samples, accepted, branching


def pooled_cells(dist: dict[tuple[int, int, int], float], n: int) -> tuple[list[tuple[int, int, int]],
                                                                           list[tuple[int, int, int]]]:
    """The cells tested on their own at ``n`` samples (expected count >= 5), and those pooled into one."""
    return [k for k in dist if dist[k] * n >= 5], [k for k in dist if dist[k] * n < 5]


def chi2_power(dist: dict[tuple[int, int, int], float], n: int, w: float) -> float:
    """The probability that the test at ``n`` samples rejects (p < ALPHA) a sample whose distribution
    deviates from ``dist`` by Cohen's effect size ``w`` (w^2 = sum over cells of (q - p)^2 / p): the
    noncentral chi-squared with the test's degrees of freedom and noncentrality n w^2.

    Example: this module's target at temperature 1.0 (33 cells tested and 1 pooled at 7,000 samples), w = 0.1:
    n = 7,000 -> 0.990, n = 6,500 -> 0.980."""
    big, small = pooled_cells(dist, n)
    df = len(big) + (1 if small else 0) - 1
    return float(ncx2.sf(chi2.isf(ALPHA, df), df, n * w * w))


def sample_size(dist: dict[tuple[int, int, int], float], w: float, power: float = POWER, step: int = 500) -> int:
    """The fewest samples, in steps of ``step``, whose test rejects a deviation of ``w`` from
    ``dist`` with at least ``power`` (``chi2_power``).

    Example: this module's target at temperature 1.0, w = 0.1 -> 7,000; w = 0.42, power 0.9999 -> 500."""
    n = step
    while chi2_power(dist, n, w) < power:
        n += step
    return n


def chi2_pvalue(samples: list[tuple[int, ...]], dist: dict[tuple[int, int, int], float]) -> float:
    """Goodness of fit; cells with expected count < 5 are pooled; an impossible sample -> p = 0."""
    n = len(samples)
    counts = {k: 0 for k in dist}
    for s in samples:
        if s not in counts:
            return 0.0
        counts[s] += 1
    big, small = pooled_cells(dist, n)
    obs = [counts[k] for k in big] + ([sum(counts[k] for k in small)] if small else [])
    exp = [dist[k] * n for k in big] + ([sum(dist[k] for k in small) * n] if small else [])
    scale = sum(obs) / sum(exp)  # guard float rounding of the total
    return float(chisquare(obs, [x * scale for x in exp]).pvalue)


# setting 0 runs seeded requests (race verification), setting 1 unseeded ones (rejection sampling)
SETTINGS = [SamplingParams(temperature=0.7, top_p=0.9, seed=0), SamplingParams(temperature=1.0, top_p=0.9)]
CASES = [("ngram", False), ("suffix", False), ("suffix", True), ("draft-model", False), ("draft-model", True),
         ("medusa", False)]
# (setting, drafter, tree) of make test: the seeded race on a branching tree (a race never reads the
# draft probabilities, so one drafter shows it), rejection sampling on point-mass drafts and on a tree of
# drafts with probabilities; the other pairs (the draft model's chain among them) in make test-slow
FAST_CASES = {(0, "suffix", True), (1, "ngram", False), (1, "draft-model", True), (1, "medusa", False)}


def _sampling_cases() -> list:
    """``(setting, drafter, tree, w)`` for every setting x configuration x sample size, ids as
    ``1-suffix-True-0.1``; ``W_LONG`` and the pairs outside ``FAST_CASES`` marked slow."""
    out = []
    for setting in range(len(SETTINGS)):
        for drafter, tree in CASES:
            for w in (W_SUBTLE, W_LONG):
                slow = w == W_LONG or (setting, drafter, tree) not in FAST_CASES
                out.append(pytest.param(setting, drafter, tree, w, marks=[pytest.mark.slow] if slow else [],
                                        id=f"{setting}-{drafter}-{tree}-{'long' if w == W_LONG else w}"))
    return out


@pytest.mark.parametrize("setting,drafter,tree,w", _sampling_cases())
def test_speculative_sampling_matches_target(model, tok, prompt, drafter, tree, setting, w, monkeypatch):
    params = SETTINGS[setting]
    dist = exact_distribution(model, prompt, params)
    n = sample_size(dist, w)
    spec = SpecConfig(drafter=drafter, num_speculative_tokens=3, tree=tree,
                      options={"draft-model": DraftModelOptions(layers=1, tree_top_k=2)})
    samples, accepted, branching = sample_first3(model, tok, prompt, spec, params, monkeypatch, params.seed is not None,
                                                 n)
    assert accepted > n // 20, "too few accepted drafts: the test would not exercise verification"
    if tree:
        assert branching > n // 40, "too few branching trees: the test would not exercise sibling rejection"
    p = chi2_pvalue(samples, dist)
    assert p > ALPHA, f"speculative samples deviate from the target distribution (chi2 p={p:.2e}, {n} samples)"


# make test-slow (17 s each): make test samples an EAGLE-3 head's drafts in float32 over a changing draft
# vocabulary (tests/speculative/test_dynamic_vocab.py); here its bfloat16 + int8 copy, with and without a floor
@pytest.mark.slow
@pytest.mark.parametrize("floor", [0.0, 0.4])
def test_a_bfloat16_eagle3_head_keeps_the_targets_distribution(tok, prompt, floor, monkeypatch):
    """``--eagle3-dtype bfloat16`` on a float64 target, drafting with int8 weights (the CPU default,
    ``--eagle3-quantization``): rejection sampling with the draft probabilities that copy computes
    (softmax in float32 over its bfloat16 logits) still samples the target's distribution, with and
    without chains that stop on the drawn drafts' probabilities (``--eagle3-min-draft-prob``, 0.4 by
    default). (Float heads: the dynamic-vocabulary sampling tests build their drafters unquantized.)"""
    model = tiny_llama(V, layers=3, seed=4, scale=1.5)  # EAGLE-3 taps need >= 3 layers
    torch.manual_seed(0)
    spec = SpecConfig(drafter="eagle3", num_speculative_tokens=3,
                      options={"eagle3": Eagle3Options(dtype="bfloat16", quantization="int8", min_draft_prob=floor)})
    drafter = build_drafter(spec, model, 1, 32)
    assert drafter.head.dtype == torch.bfloat16 and type(drafter.served.lm_head).__name__ == "Int8Linear"
    assert drafter.cfg.min_draft_prob == floor
    params = SETTINGS[1]
    samples, accepted, _ = sample_first3(model, tok, prompt, spec, params, monkeypatch, seeded=False)
    assert accepted > len(samples) // 20, "too few accepted drafts: the test would not exercise verification"
    p = chi2_pvalue(samples, exact_distribution(model, prompt, params))
    assert p > ALPHA, f"speculative samples deviate from the target distribution (chi2 p={p:.2e})"


# make test-slow: the harness's own null check (a harness that rejected the target's own samples would
# fail every speculative case of make test too)
@pytest.mark.slow
@pytest.mark.parametrize("seeded", [True, False])
def test_plain_sampling_matches_exact(model, tok, prompt, seeded, monkeypatch):
    """The harness itself: plain sampling (race draws or the generator) passes the same test."""
    params = SETTINGS[1]
    samples, _, _ = sample_first3(model, tok, prompt, SpecConfig(), params, monkeypatch, seeded)
    assert chi2_pvalue(samples, exact_distribution(model, prompt, params)) > ALPHA


def test_broken_verifier_is_caught(model, tok, prompt, monkeypatch):
    """Drawing the recovered token from p instead of the residual (p - q)+ biases the output;
    the chi-squared test must detect it."""
    monkeypatch.setattr(verify_mod, "residual_probs", lambda p, q, token: p)
    params = SETTINGS[1]
    spec = SpecConfig(drafter="ngram", num_speculative_tokens=3)
    samples, _, _ = sample_first3(model, tok, prompt, spec, params, monkeypatch, seeded=False, n=broken_size(model, prompt, params))
    assert chi2_pvalue(samples, exact_distribution(model, prompt, params)) < ALPHA


# make test-slow: the GPU's chain verifier forced on a CPU run (its broken variant below stays in make test,
# at 500 samples, and shows the path is taken)
@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_the_one_transfer_chain_verifier_matches_target(model, tok, prompt, drafter, monkeypatch):
    """The GPU's chain verifier (``verify_chain_sampled``: every row's draws up front, one host
    read), forced on here: point-mass drafts (n-gram) and drafts with probabilities (draft model)."""
    monkeypatch.setattr(verify_mod, "one_transfer", lambda logits: True)
    params = SETTINGS[1]
    spec = SpecConfig(drafter=drafter, num_speculative_tokens=3, options={"draft-model": DraftModelOptions(layers=1)})
    samples, accepted, _ = sample_first3(model, tok, prompt, spec, params, monkeypatch, seeded=False)
    assert accepted > len(samples) // 20
    assert chi2_pvalue(samples, exact_distribution(model, prompt, params)) > ALPHA


def test_a_broken_one_transfer_verifier_is_caught(model, tok, prompt, monkeypatch):
    """The same chain verifier drawing its fallbacks from p instead of the residuals: caught."""
    monkeypatch.setattr(verify_mod, "one_transfer", lambda logits: True)
    monkeypatch.setattr(verify_mod, "chain_residuals", lambda p, q, x: p)
    params = SETTINGS[1]
    samples, _, _ = sample_first3(model, tok, prompt, SpecConfig(drafter="ngram", num_speculative_tokens=3), params,
                                  monkeypatch, seeded=False, n=broken_size(model, prompt, params))
    assert chi2_pvalue(samples, exact_distribution(model, prompt, params)) < ALPHA


def test_reused_race_noise_is_caught(model, tok, prompt, monkeypatch):
    """Seeded draws that reuse the first position's noise at every position (a counter that does
    not advance) keep each marginal exact but couple the tokens; the test must see it."""
    import tidespec.engine.decide as decide_mod
    real = verify_mod.seeded_draw

    def first_position_noise(probs, seed, position, *args):
        return real(probs, seed, 0, *args)

    monkeypatch.setattr(verify_mod, "seeded_draw", first_position_noise)
    monkeypatch.setattr(decide_mod, "seeded_draw", first_position_noise)
    params = SETTINGS[1]
    spec = SpecConfig(drafter="ngram", num_speculative_tokens=3)
    samples, _, _ = sample_first3(model, tok, prompt, spec, params, monkeypatch, seeded=True, n=broken_size(model, prompt, params))
    assert chi2_pvalue(samples, exact_distribution(model, prompt, params)) < ALPHA


def test_always_accept_is_caught(model, tok, prompt, monkeypatch):
    """A verifier that accepts every draft is not lossless; the test must see it."""
    def accept_all(draft, logits, params, generator):
        probs = target_probs(logits, params)
        last = torch.multinomial(probs[draft.num_tokens], 1, generator=generator).item()
        return verify_mod.VerifyResult(list(range(draft.num_tokens)), list(draft.token_ids) + [int(last)], True)

    import tidespec.engine.decide as decide_mod
    monkeypatch.setattr(decide_mod, "verify_sampled", accept_all)
    params = SETTINGS[1]
    samples, _, _ = sample_first3(model, tok, prompt, SpecConfig(drafter="ngram", num_speculative_tokens=3), params,
                                  monkeypatch, seeded=False, n=broken_size(model, prompt, params))
    assert chi2_pvalue(samples, exact_distribution(model, prompt, params)) < ALPHA


def test_exact_distribution_sums_to_one(model, prompt):
    for params in SETTINGS:
        dist = exact_distribution(model, prompt, params)
        assert abs(sum(dist.values()) - 1.0) < 1e-9
        assert len(dist) >= 3  # a non-degenerate distribution, or the test would prove little


def test_one_transfer_chain_verifier_hand_traced():
    """Certain outcomes: drafts the target is sure of are all accepted (then the bonus row's token);
    a draft the target gives probability 0 is rejected and the fallback comes from its residual."""
    from tidespec.speculative.api import SeqDraft
    sure = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])  # [n + 1 = 3, V = 3]
    gen = torch.Generator().manual_seed(0)
    got = verify_mod.verify_chain_sampled(SeqDraft([1, 2], None, None), sure, gen)
    assert (got.accepted, got.token_ids, got.bonus) == ([0, 1], [1, 2, 0], True)
    never = torch.tensor([[0.5, 0.0, 0.5], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # the drafter's probabilities for drafts 1, 0
    for _ in range(20):
        got = verify_mod.verify_chain_sampled(SeqDraft([1, 0], None, q), never, gen)
        assert got.accepted == [] and got.token_ids[0] in (0, 2) and not got.bonus



def broken_size(model, prompt: list[int], params: SamplingParams) -> int:
    """Samples for a verifier broken on purpose: enough to catch ``W_BROKEN`` with ``POWER_BROKEN``."""
    return sample_size(exact_distribution(model, prompt, params), W_BROKEN, POWER_BROKEN)


@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_the_sample_sizes_are_the_ones_stated(model, prompt, setting):
    """The sizes the module docstring states, and that they are the least with their power (500
    samples fewer would not have it)."""
    dist = exact_distribution(model, prompt, SETTINGS[setting])
    n = sample_size(dist, W_SUBTLE)
    assert n == (5_000, 7_000)[setting]
    assert chi2_power(dist, n, W_SUBTLE) >= POWER > chi2_power(dist, n - 500, W_SUBTLE)
    assert sample_size(dist, W_BROKEN, POWER_BROKEN) == 500
    assert sample_size(dist, W_LONG) == (15_500, 24_000)[setting]
