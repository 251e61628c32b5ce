"""The EAGLE-3 head's step compiled for a CPU (``models/eagle3/compiled.py``, ``--compile`` without CUDA
graphs) drafts what the eager head drafts, and a head swapped in with the same shape keeps its graphs.

Float64 tiny head: the catch-ups (ragged, slots not in order, more rows than one) and the chain steps
run compiled; the drafts equal the eager drafter's, the logits where drafting starts and the K/V
written agree to 1e-5 (inductor's kernels round at float32 level). After ``load_state`` with other weights of the
same configuration, the same compiled step drafts what an eager drafter with those weights drafts:
the weights are read at each call, not baked into the graphs. After the warm-up nothing is traced again.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from tests.helpers import capture
from tests.speculative.test_eagle3 import VOCAB, tiny_head, tiny_target
from tests.speculative.test_eagle3_graphs import advance, same_head_state
from tidespec.sampling import SamplingParams
from tidespec.speculative.api import DraftInput, Observation
from tidespec.speculative.drafters.eagle3 import Eagle3Drafter, Eagle3DrafterConfig

TOL = 1e-5  # inductor's generated kernels round at float32 level, even over float64 (as test_eagle3_graphs's)


@pytest.mark.slow  # its own graphs: 28 s on CI's empty cache (as the GPU graphs' compiled bodies, make test-slow)
def test_the_compiled_head_drafts_what_the_eager_head_drafts_before_and_after_a_swap() -> None:
    target = tiny_target()
    head = tiny_head(target)
    eager, compiled = (Eagle3Drafter(head, target.embed_tokens, Eagle3DrafterConfig(
        max_num_seqs=6, max_model_len=200, min_draft_prob=0.05, compile=c)) for c in (False, True))
    assert compiled.warm_up(4) > 0 and eager.warm_up(4) == 0.0
    graphs = counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(5)
    seqs = {s: torch.randint(0, VOCAB, (60,), generator=gen).tolist() for s in (0, 1, 2)}
    taps = {s: capture(target, ids, eager.tap_layers) for s, ids in seqs.items()}
    cached = {0: 12, 1: 5, 2: 9}
    for d in (eager, compiled):
        d.observe([Observation(s, seqs[s][:c + 1], c, taps[s][:c]) for s, c in cached.items()])
    step = compiled._steps.steps[0]
    for round_, accepted in enumerate(([1, 3, 2], [2, 1, 4], [4, 2, 1], [1, 1, 1])):
        if round_ == 2:  # online training publishes other weights of the same shape
            torch.manual_seed(9)
            state = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v
                     for k, v in head.state_dict().items()}
            for d in (eager, compiled):  # a drafting copy of its own, as a quantized head's swap brings
                d.load_state(1, state, served=d._built(head.cfg, state))
            assert compiled.served is not compiled.head
        inputs = [DraftInput(s, seqs[s][:c + 1], 4, SamplingParams()) for s, c in cached.items()]
        want, got = eager.propose(inputs).drafts, compiled.propose(inputs).drafts
        assert len(want) == 3 and {s: d.token_ids for s, d in got.items()} == {s: d.token_ids for s, d in want.items()}
        same_head_state(eager, compiled, cached, TOL)
        advance(eager, compiled, seqs, taps, cached, accepted)
    assert compiled._steps.steps == [step] and step.num_compiled >= 8  # the swap kept the graphs; catch-ups and chains
    assert not step.serves(tiny_head(target, draft_vocab=32), compiled.kv)  # another configuration: a step of its own
    assert counters["stats"]["unique_graphs"] == graphs  # the warm-up traced every shape class the drafts used
    assert not eager._steps.steps


@pytest.mark.slow  # a second configuration's graphs: about 30 s on CI's empty cache
def test_a_head_of_another_vocabulary_gets_its_own_step_and_a_rollback_finds_the_first() -> None:
    """A round that widened the draft vocabulary publishes a head the compiled step does not fit: it drafts
    through a step of its own, what an eager drafter with that head drafts; rolled back, the first head
    drafts through its first step again, without tracing anything new."""
    target = tiny_target()
    head, other = tiny_head(target), tiny_head(target, seed=3, draft_vocab=VOCAB - 8)
    eager, compiled = (Eagle3Drafter(head, target.embed_tokens, Eagle3DrafterConfig(
        max_num_seqs=6, max_model_len=200, compile=c)) for c in (False, True))
    compiled.warm_up(4)
    first = compiled._steps.steps[0]
    gen = torch.Generator().manual_seed(6)
    seqs = {s: torch.randint(0, VOCAB, (60,), generator=gen).tolist() for s in (0, 1)}
    taps = {s: capture(target, ids, eager.tap_layers) for s, ids in seqs.items()}
    cached = {0: 10, 1: 7}
    for d in (eager, compiled):
        d.observe([Observation(s, seqs[s][:c + 1], c, taps[s][:c]) for s, c in cached.items()])
    graphs = 0
    for round_, accepted in enumerate(([1, 3], [2, 1], [3, 2])):
        if round_ in (0, 2):  # the swap, then a rollback to the first head
            back = head if round_ else other
            for d in (eager, compiled):
                d.load_state(round_ + 1, {k: v.clone() for k, v in back.state_dict().items()}, back.cfg)
        if round_ == 2:
            graphs = counters["stats"]["unique_graphs"]
        inputs = [DraftInput(s, seqs[s][:c + 1], 4, SamplingParams()) for s, c in cached.items()]
        want, got = eager.propose(inputs).drafts, compiled.propose(inputs).drafts
        assert len(want) == 2 and {s: d.token_ids for s, d in got.items()} == {s: d.token_ids for s, d in want.items()}
        advance(eager, compiled, seqs, taps, cached, accepted)
        if round_ == 1:
            assert compiled._steps.steps[0] is not first and compiled._steps.steps[0].fits(compiled.served)
    assert compiled._steps.steps[0] is first and compiled._steps.num_built == 2
    assert counters["stats"]["unique_graphs"] == graphs  # the rollback traced nothing
