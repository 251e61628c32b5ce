"""Constrained decoding (structured outputs) stays exact under speculation.

Greedy constrained output equals plain constrained decoding for every drafter (n-gram, suffix chain
and tree, draft model, EAGLE-3 chain and tree, the controller switching between them), alone,
batched and on prefix hits, for a JSON schema, a regex, a choice, any JSON object and a forced tool
call (``tool_choice: required``); sampled
constrained output has the masked target's distribution (chi-squared, the harness of
``tests/speculative/test_spec_sampling.py``); and the grammar state rolls back over rejected drafts:
with the rollback broken on purpose the same comparison fails.
"""

from __future__ import annotations

import json
import re

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
from tidespec.engine.engine import LLMEngine
from tidespec.sampling import SamplingParams, StructuredOutputs, target_probs
from tidespec.speculative.drafters.draft_model import DraftModelOptions
from tidespec.structured.grammar import JSON_OPTIONS, GrammarCompiler, GrammarError, GrammarMatcher
from tidespec.structured.tool_calls import HermesParser, ToolSpec

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"},
                                           "ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "n", "ok", "tag"], "additionalProperties": False}
REGEX = r"(ab|cd)+-[0-9]{2,6}x"
CHOICES = ("alpha beta", "alpha gamma", "delta")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
# tool_choice required: a call of either tool in the hermes format, as the chat route forces it
TOOL_CALL = StructuredOutputs(grammar=HermesParser().grammar([ToolSpec("get_weather", WEATHER), ToolSpec(
    "get_time", {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}}, "required": ["tz"]})],
    True, JSON_OPTIONS["compact"]), field="tool_choice")
CONSTRAINTS = [StructuredOutputs(json=SCHEMA), StructuredOutputs(regex=REGEX), StructuredOutputs(choice=CHOICES),
               StructuredOutputs(json_object=True), TOOL_CALL]
TEXTS = ['Record: {"name": "Ann", "n": 5, "ok": true, "tag": "red"} and again {"name": "Ann", "n": 5, ',
         "abab-123x cdcd-4567x abab-123x cdab-99x abab-12",
         "alpha beta, alpha gamma, delta, alpha beta, alpha",
         '{"k": [1, 2, 3], "k": [1, 2, 3], "k": [1, 2, 3], "k": [1, 2,',
         ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call> '
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call> <tool_call>')]
MAX_TOKENS = 40
MAX_LEN = 256


@pytest.fixture(scope="module")
def jobs(tok) -> list[tuple[list[int], StructuredOutputs]]:
    return [(tok.encode(t), c) for t, c in zip(TEXTS, CONSTRAINTS)]


def run(model, tok, spec: SpecConfig, jobs, slots: int, waves: int = 1, policy=None,
        drafter=None) -> tuple[list[list[int]], LLMEngine]:
    """Greedy constrained outputs of ``jobs``, ``slots`` in flight (1: each alone); ``waves`` > 1 runs
    them again on the same engine (the prompts are then prefix-cache hits). Returns the last wave's."""
    cfg = EngineConfig(cache=CacheConfig(max_model_len=MAX_LEN, max_num_seqs=slots), spec=spec)
    drafter = drafter if drafter is not None else spec_drafter(spec, model, slots, MAX_LEN)
    e = LLMEngine(model, tok, cfg, drafter=drafter, policy=policy)
    outs: list[list[int]] = []
    for _ in range(waves):
        ids = [e.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, structured=c)) for p, c in jobs]
        done = run_to_completion(e)
        outs = [done[i].token_ids for i in ids]
    return outs, e


@pytest.fixture(scope="module")
def plain(model, tok, jobs) -> list[list[int]]:
    return run(model, tok, SpecConfig(), jobs, slots=1)[0]


def drafted_and_rejected(e: LLMEngine) -> tuple[int, int]:
    steps = list(e.history)
    return sum(s.num_draft_tokens for s in steps), sum(s.num_rejected for s in steps)


def test_plain_constrained_output_matches_its_constraint(tok, plain) -> None:
    """What the constraint admits is what comes out (where the output ended, not cut at max_tokens)."""
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in plain]
    ended = [ids[-1] == 0 for ids in plain]
    assert ended[1] and re.fullmatch(REGEX, texts[1])
    assert ended[2] and texts[2] in CHOICES
    for i in (0, 3):
        if ended[i]:
            assert isinstance(json.loads(texts[i]), dict)
        else:
            assert texts[i].lstrip().startswith("{")
    assert texts[4].startswith('<tool_call>\n{"name": "get_')
    if ended[4]:
        assert HermesParser().parse(texts[4]).calls


CASES = {
    **EVERY_DRAFTER,
    "grammar": SpecConfig(drafter="grammar", num_speculative_tokens=6),
    "suffix-without-grammar-drafts": SpecConfig(drafter="suffix", num_speculative_tokens=4, grammar_drafts=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_drafter_alone_batched_and_on_prefix_hits_equals_plain_constrained(model, tok, jobs, plain,
                                                                                 name) -> None:
    spec = CASES[name]
    alone, _ = run(model, tok, spec, jobs, slots=1)
    assert alone == plain
    batched, e4 = run(model, tok, spec, jobs, slots=4, waves=2)
    assert batched == plain
    assert sum(s.num_prefix_hit_tokens for s in e4.history) > 0, "the second wave should reuse the prompts"
    drafted, rejected = drafted_and_rejected(e4)
    assert drafted > 0, "the drafter never proposed: the test would not exercise verification"
    assert rejected > 0 or name == "grammar", "drafts must be rejected too for the test to bite (forced ones are not)"


def test_the_controller_switching_drafters_equals_plain_constrained(model, tok, jobs, plain) -> None:
    spec = SpecConfig(drafter="suffix,eagle3,draft-model,ngram", num_speculative_tokens=4,
                      options={"draft-model": DraftModelOptions(layers=1)})
    policy = ScriptedPolicy(switching_drafters)
    got, _ = run(model, tok, spec, jobs, slots=4, waves=2, policy=policy)
    assert got == plain
    assert {n for s in policy.seen for n, outs in s.drafter_outcomes.items() if outs} >= {"suffix", "ngram"}


def test_the_grammar_drafter_drafts_forced_tokens_and_is_counted_as_grammar(model, tok, jobs, plain) -> None:
    """The JSON schema forces its keys: drafted at no cost and accepted; the outcomes are the
    ``grammar`` drafter's (its /metrics series)."""
    got, e = run(model, tok, CASES["grammar"], jobs[:1], slots=1)
    assert got == plain[:1]
    outcomes = [o for s in e.history for o in s.drafter_outcomes.get("grammar", [])]
    assert sum(acc for _, _, acc in outcomes) >= 8  # e.g. `name":` `, "n":` `, "ok":` `, "tag":`
    none, _ = run(model, tok, CASES["suffix-without-grammar-drafts"], jobs[:1], slots=1)
    assert none == plain[:1]


def test_forced_tokens_come_first_and_a_model_free_drafter_continues_after_them() -> None:
    from tidespec.speculative.api import DrafterBase, DraftInput, DraftProposal, SeqDraft
    from tidespec.speculative.forced import compose, prepend

    assert prepend([1, 2], SeqDraft([7, 8], [-1, -1])).parent_indices == [-1, 0, 1, 1]
    assert prepend([1, 2], SeqDraft([7, 8])).token_ids == [1, 2, 7, 8]
    seen: list[DraftInput] = []

    class Echo(DrafterBase):
        name, model_free = "echo", True

        def propose(self, inputs):
            seen.extend(inputs)
            return DraftProposal({i.seq_id: SeqDraft([i.token_ids[-1]] * i.num_speculative_tokens) for i in inputs})

    params = SamplingParams()
    out = compose(Echo(), [DraftInput(1, [5, 6], 4, params), DraftInput(2, [5], 2, params),
                           DraftInput(3, [9], 3, params)], {1: [40, 41], 2: [50, 51, 52]})
    assert out.drafts[1].token_ids == [40, 41, 41, 41]  # echo drafted 2 more from the extended context
    assert out.drafts[2].token_ids == [50, 51]  # forced tokens trimmed to gamma; the drafter not asked
    assert out.drafts[3].token_ids == [9, 9, 9]  # nothing forced: the drafter alone
    assert [(i.seq_id, i.token_ids, i.num_speculative_tokens) for i in seen] == [(1, [5, 6, 40, 41], 2), (3, [9], 3)]


class _NoRollback:
    """A matcher whose rollback does nothing: the grammar state then keeps rejected drafts."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def rollback(self, n: int) -> bool:
        return True

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def test_the_grammar_state_rolls_back_over_rejected_drafts(model, tok, jobs, plain, monkeypatch) -> None:
    """The masks of a draft's rows are computed by consuming its tokens; without rolling them back
    the next step's masks start from drafts the target rejected, and the output changes."""
    real = GrammarCompiler.matcher

    def broken(self, spec):
        m = real(self, spec)
        m._m = _NoRollback(m._m)
        return m

    monkeypatch.setattr(GrammarCompiler, "matcher", broken)
    got, e = run(model, tok, CASES["suffix"], jobs, slots=4)
    assert drafted_and_rejected(e)[1] > 0
    assert got != plain


def test_masks_leave_the_matcher_where_it_was_even_when_they_fail(tok, monkeypatch) -> None:
    c = GrammarCompiler(tok, len(tok), [0])
    m = c.matcher(StructuredOutputs(choice=CHOICES))
    before = m.masks([], None)
    ids = tok.encode("alpha gamma")
    rows = m.masks(ids + [0], None)  # [len + 2, V]
    assert rows.shape == (len(ids) + 2, len(tok))
    assert all(bool(rows[j, t]) for j, t in enumerate(ids))  # each draft token allowed at its row
    assert rows[len(ids)].nonzero().flatten().tolist() == [0]  # after "alpha gamma": EOS only
    assert torch.equal(m.masks([], None), before)
    # a tree: "alpha beta" and "delta" branch from the root; "zz" is forbidden and never consumed
    a, d, z = tok.encode("a")[0], tok.encode("d")[0], tok.encode("z")[0]
    rows = m.masks([a, d, z], [-1, -1, 0])
    assert rows[1].any() and rows[2].any() and bool(rows[3].all())  # row under "z" unread: all allowed
    assert torch.equal(m.masks([], None), before)

    import tidespec.structured.grammar as grammar_mod

    real_fill = grammar_mod._fill

    def failing_fill(matcher, bits, row):
        if row == 2:
            raise RuntimeError("mask failed")
        real_fill(matcher, bits, row)

    monkeypatch.setattr(grammar_mod, "_fill", failing_fill)
    with pytest.raises(RuntimeError):
        m.masks(ids, None)
    monkeypatch.undo()
    assert torch.equal(m.masks([], None), before)


def test_a_constraint_the_library_refuses_is_a_one_line_error_naming_its_field(model, tok) -> None:
    e = LLMEngine(model, tok, EngineConfig(cache=CacheConfig(max_model_len=MAX_LEN, max_num_seqs=2)))
    for spec, field in ((StructuredOutputs(regex="[a-", field="guided_regex"), "guided_regex"),
                        (StructuredOutputs(json={"type": "nope"}, field="response_format"), "response_format"),
                        (StructuredOutputs(grammar='root ::= "a" missing', field="structured_outputs.grammar"),
                         "structured_outputs.grammar")):
        with pytest.raises(GrammarError) as err:
            e.add_request("x", SamplingParams(structured=spec))
        assert err.value.param == field and "\n" not in str(err.value) and str(err.value).startswith(field)
    assert not e.has_unfinished_requests()
    assert e.grammars.compiles == 0


def test_grammars_are_compiled_once_per_constraint(model, tok, jobs) -> None:
    e = LLMEngine(model, tok, EngineConfig(cache=CacheConfig(max_model_len=MAX_LEN, max_num_seqs=4)))
    for p, c in jobs + jobs:
        e.add_request(p, SamplingParams(max_tokens=2, structured=c))
    run_to_completion(e)
    assert e.grammars.compiles == len(jobs)


# ----------------------------------------------------------------------------- sampled
CHI_REGEX = "[abc]{2}"


def exact_constrained(model, tok, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(t1, t2 | prompt) of plain sampling under ``CHI_REGEX``'s mask: two letters of a, b, c (then
    only EOS). The second is the one verification decides (the first is sampled after the prompt)."""
    letters = [tok.encode(ch)[0] for ch in "abc"]
    mask = torch.full((len(tok),), float("-inf"), dtype=torch.float64)
    mask[letters] = 0.0

    def probs(ctx: list[int]) -> torch.Tensor:
        return target_probs((full_logits(model, ctx)[-1] + mask).unsqueeze(0), params)[0]

    dist: dict[tuple[int, ...], float] = {}
    p1 = probs(prompt)
    for a in letters:
        p2 = probs(prompt + [a])
        for b in letters:
            dist[(a, b)] = float(p1[a] * p2[b])
    return dist


# rejection sampling with the draft model's probabilities in make test; the seeded race with suffix's
# point-mass trees in make test-slow (its verifier is the unconstrained one, tested in test_seeded.py)
@pytest.mark.parametrize("drafter,seeded", [("draft-model", False),
                                            pytest.param("suffix", True, marks=pytest.mark.slow, id="suffix-seeded")])
def test_sampled_constrained_output_has_the_masked_distribution(model, tok, drafter, seeded, monkeypatch) -> None:
    seed_generators_from_counter(monkeypatch, 3_000_017)
    prompt = tok.encode("abcabcabcabcabcab")
    params = SamplingParams(temperature=1.0)
    dist = exact_constrained(model, tok, prompt, params)
    n = sample_size(dist, W_SUBTLE)
    slots = 1000
    spec = SpecConfig(drafter=drafter, num_speculative_tokens=3, options={"draft-model": DraftModelOptions(layers=1)})
    cfg = EngineConfig(cache=CacheConfig(max_model_len=32, max_num_seqs=slots), spec=spec,
                       scheduler=SchedulerConfig(max_num_batched_tokens=slots * 24))
    e = LLMEngine(model, tok, cfg, drafter=spec_drafter(spec, model, slots, 32))
    structured = StructuredOutputs(regex=CHI_REGEX)
    for i in range(n):
        e.add_request(prompt, SamplingParams(temperature=1.0, seed=i if seeded else None, max_tokens=3,
                                             structured=structured))
    samples = [tuple(o.token_ids[:2]) for o in run_to_completion(e).values()]
    assert sum(s.num_accepted_tokens for s in e.history) > 0, "no draft was accepted: verification not exercised"
    assert chi2_pvalue(samples, dist) > ALPHA


def test_matchers_are_independent_copies(tok) -> None:
    c = GrammarCompiler(tok, len(tok), [0])
    a, b = c.matcher(StructuredOutputs(choice=CHOICES)), c.matcher(StructuredOutputs(choice=CHOICES))
    assert isinstance(a, GrammarMatcher)
    a.advance(tok.encode("delta"))
    assert a.finished and not b.finished
