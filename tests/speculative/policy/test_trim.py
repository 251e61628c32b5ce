"""Draft trimming (``speculative/policy/trim.py``): the batch's drafted tokens worth their rows, calibrated
per drafter; verification of what is left stays lossless."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_to_completion, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig, PolicyConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.engine.observer import Hooks
from tidespec.llm import build_drafter, build_trim
from tidespec.sampling import SamplingParams
from tidespec.speculative.api import DraftInput, SeqDraft
from tidespec.speculative.drafters.suffix import SuffixDrafter
from tidespec.speculative.policy.analytic import AnalyticPolicy
from tidespec.speculative.policy.factory import PolicyOptions, make_policy
from tidespec.speculative.policy.guards import GuardConfig, Guards
from tidespec.speculative.policy.speedup import Profile
from tidespec.speculative.policy.trim import DraftTrim, best_count, keep_tokens
from tidespec.stats import StepStats

# T(4, 1 + n / 4) = 10 ms + 1 ms per drafted row n (the module docstring's example); T(1, q) flat
ROWS = Profile(target_latency={1: 0.010, 64: 0.010}, draft_cost={"default": 0.0},
               verify_latency={(4, 1): 0.010, (4, 2): 0.014, (4, 3): 0.018, (1, 1): 0.010, (1, 5): 0.0101})


def test_the_best_count_is_the_module_docstrings_hand_traced_example() -> None:
    assert best_count([0.9, 0.5, 0.1], 4, 0, ROWS) == 2  # 0.400, 0.445, 0.450, 0.423 tokens per ms
    assert best_count([0.9, 0.5, 0.1], 4, 8, ROWS) == 2  # 8 fixed rows: the same marginal price
    assert best_count([0.2, 0.2], 4, 0, ROWS) == 0  # 4.2 / 11 < 4 / 10: plain decoding's rows only
    assert best_count([0.1, 0.05], 1, 0, ROWS) == 2  # at batch 1 a row is almost free here
    assert best_count([], 4, 0, ROWS) == 0


def test_a_chain_keeps_its_sure_head_and_the_batch_without_drafts_is_untouched() -> None:
    trim = DraftTrim(ROWS, explore_every=0)
    drafts = {1: SeqDraft([7, 8, 9], token_probs=[0.9, 0.5, 0.1]), 2: SeqDraft([3, 4])}
    assert trim.cut(drafts, {1: "suffix", 2: "draft-model"}, set(), 4) == 1
    assert drafts[1].token_ids == [7, 8] and drafts[1].token_probs == [0.9, 0.5]
    assert drafts[1].score == pytest.approx(1.4)
    assert drafts[2].token_ids == [3, 4]  # no probabilities: kept whole, its rows priced as fixed
    weak = {1: SeqDraft([7, 8], token_probs=[0.15, 0.12])}
    assert trim.cut(weak, {1: "suffix"}, set(), 4) == 2 and weak[1].token_ids == []
    assert trim.num_cut == 3 and trim.num_steps == 2


def test_a_tree_keeps_a_parent_closed_subtree_even_where_calibration_prefers_a_deeper_token() -> None:
    """Calibration that ranks a child's band above its parent's sibling's: the child is kept, its parent with
    it, the weaker sibling cut; a child never ranks above its own parent."""
    trim = DraftTrim(ROWS, explore_every=0)
    for _ in range(40):  # band 5 always rejected, band 4 always accepted
        trim.learn("suffix", False, SeqDraft([1], token_probs=[0.55]), [])
        trim.learn("suffix", False, SeqDraft([1], token_probs=[0.45]), [0])
    assert trim.calibrated("suffix", False, 0.55) < 0.1 and trim.calibrated("suffix", False, 0.45) > 0.9
    tree = SeqDraft([10, 11, 12, 13], [-1, -1, 0, 2], token_probs=[0.95, 0.55, 0.45, 0.45])
    drafts = {1: tree}
    trim.cut(drafts, {1: "suffix"}, set(), 4)
    assert drafts[1].token_ids == [10, 12, 13] and drafts[1].parent_indices is None  # a chain 10 -> 12 -> 13
    assert keep_tokens(tree, [0, 1, 2]).parent_indices == [-1, -1, 0]
    probs = torch.rand(4, 5)
    sampled = keep_tokens(SeqDraft([1, 2, 3, 4], draft_probs=probs, token_probs=[0.9, 0.8, 0.7, 0.6]), [0, 1])
    assert torch.equal(sampled.draft_probs, probs[:2])  # type: ignore[arg-type]


def test_calibration_is_learnt_per_drafter_and_greedy_or_sampled_and_exploration_keeps_drafts_whole() -> None:
    trim = DraftTrim(ROWS, explore_every=4)
    for _ in range(60):  # suffix's sure greedy tokens are accepted one time in ten
        trim.learn("suffix", False, SeqDraft([1, 2], token_probs=[1.0, 1.0]), [0] if _ % 5 == 0 else [])
    assert trim.calibrated("suffix", False, 1.0) < 0.3
    assert trim.calibrated("suffix", True, 1.0) == pytest.approx(0.95)  # sampled: not measured, trusted
    assert trim.calibrated("ngram", False, 1.0) == pytest.approx(0.95)
    cut = []
    for _ in range(8):
        drafts = {1: SeqDraft([1, 2], token_probs=[1.0, 1.0])}
        cut.append(trim.cut(drafts, {1: "suffix"}, set(), 4))
    assert cut == [2, 2, 2, 0] * 2  # every 4th step with something to cut verifies everything
    drafts = {1: SeqDraft([1, 2], token_probs=[1.0, 1.0])}
    assert trim.cut(drafts, {1: "suffix"}, {1}, 4) == 0  # sampled: its own calibration


def test_the_suffix_drafter_gives_each_token_its_path_probability() -> None:
    drafter = SuffixDrafter(min_prob=0.1)
    chain = drafter.propose([DraftInput(1, [1, 2, 3, 1, 2, 4, 1, 2], 4, SamplingParams())]).drafts[1]
    assert chain.token_ids == [4, 1] and chain.token_probs == [0.5, 0.5] and chain.score == pytest.approx(1.0)
    tree = drafter.propose([DraftInput(2, [1, 2, 3, 1, 2, 4, 1, 2], 4, SamplingParams(), tree=True)]).drafts[2]
    assert tree.token_ids == [4, 3] and tree.token_probs == [0.5, 0.5]


def test_trim_is_built_for_the_pricing_policies_only() -> None:
    analytic = make_policy("analytic", PolicyOptions(profile=ROWS))
    assert isinstance(build_trim(EngineConfig(policy=PolicyConfig(name="analytic")), analytic), DraftTrim)
    assert build_trim(EngineConfig(policy=PolicyConfig(name="analytic", trim_drafts=False)), analytic) is None
    static = make_policy("static", PolicyOptions(profile=ROWS))
    assert build_trim(EngineConfig(policy=PolicyConfig(name="static")), static) is None


V = 48
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15, 16, 12, 13, 14, 15, 16, 12], [3, 30, 17, 3]]


@pytest.mark.parametrize("tree", [False, True])
def test_trimmed_verification_gives_plain_decodings_tokens_alone_and_batched(tree: bool) -> None:
    """Rows dear enough at batch 4 that tokens are cut: every output equals plain decoding's."""
    model = tiny_llama(V, layers=3, seed=2, scale=3.0)
    tok = tiny_tokenizer(V)
    cache = CacheConfig(max_model_len=96, max_num_seqs=4)

    def outputs(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
        ids = [engine.add_request(p, SamplingParams(max_tokens=32, ignore_eos=True)) for p in prompts]
        done = run_to_completion(engine)
        return [done[i].token_ids for i in ids]

    plain = [outputs(LLMEngine(model, tok, EngineConfig(cache=cache)), [p])[0] for p in PROMPTS]
    spec = SpecConfig(drafter="suffix", num_speculative_tokens=4, tree=tree)
    steps: list[StepStats] = []

    def engine() -> LLMEngine:
        # a probe whenever the policy is off: every step drafts (the policy's own probes back off)
        policy = Guards(AnalyticPolicy(ROWS, 4, probe_every=1), GuardConfig(gamma_max=4))
        e = LLMEngine(model, tok, EngineConfig(cache=cache, spec=spec), drafter=build_drafter(spec, model, 4, 96),
                      policy=policy, trim=DraftTrim(ROWS, explore_every=3))
        e.add_observer(Hooks(step_end=steps.append))
        return e

    assert [outputs(engine(), [p])[0] for p in PROMPTS] == plain
    assert outputs(engine(), PROMPTS) == plain
    assert sum(s.num_trimmed for s in steps) > 0 and sum(s.num_accepted_tokens for s in steps) > 0
