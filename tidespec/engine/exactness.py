"""The production guard of losslessness: re-decode finished greedy requests plainly and compare.

Why this exists: the engine promises that greedy output with speculation and batching is exactly
plain decoding's output of the prompt alone (README, Guarantees). Tests check that on chosen
prompts; a server meets prompts, lengths and batch mixes no test saw. ``ExactnessChecker``
(``serve --exactness-check RATE``) samples a fraction of finished greedy requests and, in the
engine's idle time only, decodes each again the way a plain engine would serve it alone -- prompt
chunks of the engine's token budget, then one row per forward, through the engine's own forward
path (the compiled step, CUDA graphs or eager, as the engine runs it) in a KV slot of the
engine's cache -- and compares the tokens one by one. A mismatch is logged with the request id,
the position and the gap between the re-decode's two best logits there (a near-tie points at
rounding, a wide gap at a bug), and counted (``tidespec:exactness_checks_total{result}``).

It never delays a request: work runs in ``tick`` calls of a bounded time, only while no request
is running or waiting; a check holds one KV slot and gives it up (restarting later) when a request
waits for one. Pending checks are bounded; over the bound they are dropped and counted.

Worked example (an engine served 3 greedy requests, rate 1.0)::

    checker = ExactnessChecker(engine, rate=1.0)    # listens to finished requests
    ...                                              # serve; then, while the engine is idle:
    while checker.tick(budget_s=0.05): pass
    checker.counts        # {"match": 3, "mismatch": 0, "dropped": 0, "abandoned": 0}
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tidespec.engine.engine import LLMEngine
from tidespec.engine.logits import LogitsProcessing
from tidespec.engine.observer import EngineObserver
from tidespec.engine.scheduler import PrefillChunk, ScheduledBatch
from tidespec.engine.sequence import Sequence
from tidespec.sampling import SamplingParams, StructuredOutputs, row_argmax
from tidespec.speculative.api import DraftProposal
from tidespec.structured.grammar import GrammarMatcher

log = logging.getLogger(__name__)

RESULTS = ("match", "mismatch", "dropped", "abandoned")


@dataclass
class Mismatch:
    """Where a served greedy output left the plain re-decode."""

    request_id: str
    position: int  # index into the generated tokens
    served_token: int
    plain_token: int
    top2_gap: float  # plain logit[best] - logit[second best] at that position


@dataclass
class _Check:
    """One request being re-decoded: where it stands."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    slot: int | None = None
    prefilled: int = 0  # prompt tokens in the slot
    position: int = 0  # generated tokens compared so far
    logits: torch.Tensor | None = None  # [V] the logits that predict output_ids[position]
    shadow: Sequence | None = field(default=None, repr=False)
    structured: StructuredOutputs | None = None  # a constrained request's constraint: plain decoding masks too
    grammar: GrammarMatcher | None = field(default=None, repr=False)
    processing: LogitsProcessing | None = field(default=None, repr=False)  # its bias and penalties, as served


class ExactnessChecker(EngineObserver):
    """Re-decodes a sampled ``rate`` of finished greedy requests of ``engine``; see the module docstring."""

    def __init__(self, engine: LLMEngine, rate: float, max_pending: int = 64, seed: int = 0,
                 on_result: Callable[[str, Mismatch | None], None] | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"exactness-check rate must be in [0, 1], got {rate}")
        self.engine = engine
        self.rate = rate
        self.pending: deque[_Check] = deque()
        self.max_pending = max_pending
        self.counts = dict.fromkeys(RESULTS, 0)
        self.mismatches: deque[Mismatch] = deque(maxlen=100)
        self.on_result = on_result  # e.g. the server's metrics
        self._rng = random.Random(seed)
        self._current: _Check | None = None
        engine.add_observer(self)

    # ------------------------------------------------------------------ sampling finished requests
    def on_finish(self, seq: Sequence) -> None:
        """Queue a sample of the greedy requests that finished normally (an engine observer)."""
        if not seq.params.greedy or seq.finish_reason not in ("stop", "length") or not seq.output_ids:
            return
        if self.rate < 1.0 and self._rng.random() >= self.rate:
            return
        if len(self.pending) >= self.max_pending:
            self._count("dropped", None)
            return
        self.pending.append(_Check(seq.request_id, list(seq.prompt_ids), list(seq.output_ids),
                                   structured=seq.params.structured, processing=seq.processing))

    # ------------------------------------------------------------------ idle work
    def tick(self, budget_s: float = 0.02) -> bool:
        """Advance the checks by forwards until ``budget_s`` has passed (one forward at least);
        only call it while the engine is idle. True while checks remain."""
        eng = self.engine
        t_end = time.perf_counter() + budget_s
        while self._current is not None or self.pending:
            if eng.has_unfinished_requests():  # work arrived: stop; give the slot back if one is wanted
                if self._current is not None and eng.num_waiting and self._current.slot is not None:
                    self._release(self._current)
                    self.pending.appendleft(self._current)  # restart it later from the prompt
                    self._current = None
                    self._count("abandoned", None)
                return True
            if self._current is None:
                self._current = self.pending.popleft()
            if not self._advance(self._current):
                self._current = None
            if time.perf_counter() >= t_end:
                break
        return self._current is not None or bool(self.pending)

    def _advance(self, chk: _Check) -> bool:
        """One forward of ``chk``'s re-decode; False once it is decided (and its slot freed)."""
        eng = self.engine
        if chk.slot is None:
            chk.slot = eng.kv.allocate()
            if chk.slot is None:
                return True  # no free slot now: try again next tick
            chk.prefilled, chk.position, chk.logits = 0, 0, None
            chk.shadow = Sequence(-1, f"exactness-check:{chk.request_id}", chk.prompt_ids, SamplingParams(),
                                  torch.Generator(), None)  # type: ignore[arg-type]  # no detokenizer needed
            chk.shadow.slot = chk.slot
            chk.grammar = eng.grammars.matcher(chk.structured) if chk.structured is not None else None
        seq = chk.shadow
        assert seq is not None
        if chk.prefilled < len(chk.prompt_ids):  # a prompt chunk, as a plain engine schedules one alone
            n = min(len(chk.prompt_ids) - chk.prefilled, eng.scheduler.budget)
            seq.num_cached = chk.prefilled
            fwd = eng.runner.forward(ScheduledBatch(prefill=[PrefillChunk(seq, chk.prefilled, n)]), DraftProposal(),
                                     ())
            chk.prefilled += n
            if chk.prefilled == len(chk.prompt_ids):
                assert fwd.logits is not None
                chk.logits = fwd.logits[-1]
            return True
        assert chk.logits is not None
        logits = chk.logits if chk.grammar is None else chk.grammar.constrain(chk.logits.unsqueeze(0), [], None)[0]
        if chk.processing is not None:  # the served request's bias and penalties at this position
            logits = chk.processing.apply(logits.unsqueeze(0), chk.output_ids[:chk.position], [[]])[0]
        plain = int(row_argmax(logits))
        served = chk.output_ids[chk.position]
        if plain != served:
            top2 = torch.topk(logits.float(), 2).values
            self._decide(chk, Mismatch(chk.request_id, chk.position, served, plain, float(top2[0] - top2[1])))
            return False
        chk.position += 1
        if chk.grammar is not None:
            chk.grammar.advance([served])
        if chk.position == len(chk.output_ids):
            self._decide(chk, None)
            return False
        # one decode row: the served token just compared, on the prompt + the tokens before it
        seq.token_ids = chk.prompt_ids + chk.output_ids[:chk.position]
        seq.num_cached = len(seq.token_ids) - 1
        fwd = eng.runner.forward(ScheduledBatch(decode=[seq]), DraftProposal(), ())
        assert fwd.logits is not None
        chk.logits = fwd.logits[0]
        return True

    def _decide(self, chk: _Check, mismatch: Mismatch | None) -> None:
        self._release(chk)
        if mismatch is None:
            self._count("match", None)
            return
        self.mismatches.append(mismatch)
        log.error("exactness check: request %s left plain decoding at generated token %d (served %d, plain %d; "
                  "top-2 logit gap %.3g there)", mismatch.request_id, mismatch.position, mismatch.served_token,
                  mismatch.plain_token, mismatch.top2_gap)
        self._count("mismatch", mismatch)

    def _release(self, chk: _Check) -> None:
        if chk.slot is not None:
            self.engine.kv.free(chk.slot)
            chk.slot = None
            chk.shadow = None

    def _count(self, result: str, mismatch: Mismatch | None) -> None:
        self.counts[result] += 1
        if self.on_result is not None:
            self.on_result(result, mismatch)

