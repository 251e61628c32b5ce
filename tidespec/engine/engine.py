"""The engine step: continuous batching over one target, an optional drafter and a policy.

Why this exists: this is where scheduling, drafting, one batched target forward, lossless
verification, KV rollback, streaming and statistics meet — one step at a time, nothing else.
The step reads top to bottom (docs/architecture.md)::

    scheduler.admit()                          # waiting requests into free KV slots
    gammas   = plan(decoding seqs)             # policy + guards: each seq's gamma, decided once
    batch    = scheduler.schedule(gammas)      # decode seqs (1 + gamma tokens) + prefill chunks
    proposal = drafter.propose(...)            # chain or tree per speculating seq
    fwd      = runner.forward(batch, proposal) # ONE target forward: [last]+drafts, prefill chunks
    verify + commit the whole batch            # accepted path + bonus/recovered; KV kept or rolled back
    emit                                       # stop checks, detokenization, RequestOutput
    drafter.observe(...), observers' on_observations
    finish                                     # free slots, drafter.release, observers' on_finish
    StepStats -> policy.observe, history, observers' on_step_end

Code outside the engine follows the steps as an ``EngineObserver`` (``engine/observer.py``),
registered with ``add_observer``.

Worked example (``tidespec.llm.build_engine`` wires model, drafter and policy from a config)::

    engine = LLMEngine(model, tokenizer, EngineConfig(), drafter=NgramDrafter())
    engine.add_request("def fib(n):", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        outputs = engine.step()        # RequestOutput per sequence that advanced
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from tidespec.config import EngineConfig
from tidespec.engine.decide import Decision, count_draft, count_prediction, decide, predicted_drafts, prompt_logprobs
from tidespec.engine.detok import IncrementalDetokenizer
from tidespec.engine.logits import LogitsProcessing, TokenLogprob
from tidespec.engine.observer import EngineObserver
from tidespec.engine.output import RequestOutput, emit
from tidespec.engine.prefix_cache import build_prefix_cache
from tidespec.engine.runner import ForwardOutput, ModelRunner, Row, rows_of
from tidespec.engine.scheduler import PrefillChunk, Scheduler
from tidespec.engine.sequence import Sequence
from tidespec.errors import UserError
from tidespec.models.execution.executor import ExecutorOptions, ForwardExecutor
from tidespec.models.target import TargetModel
from tidespec.sampling import SamplingParams, make_generator
from tidespec.speculative.api import Drafter, DraftInput, DraftProposal, Observation, SeqDraft
from tidespec.speculative.drafters.multi import model_free_offers
from tidespec.speculative.forced import compose
from tidespec.speculative.policy import api as policy_api
from tidespec.speculative.policy.api import PlanInput, SeqState, SpeculationPolicy, plans_drafters, wants_offers
from tidespec.speculative.policy.trim import DraftTrim
from tidespec.speculative.prediction import PredictionDraft
from tidespec.stats import StepStats
from tidespec.structured.grammar import GrammarCompiler
from tidespec.threads import pin_threads

log = logging.getLogger(__name__)

ObserverT = TypeVar("ObserverT", bound=EngineObserver)

# Steps a drafter that reads the target's taps keeps getting them after it last drafted: a policy
# probing every few steps keeps it warm, one that parked it for longer gets plain decoding's work
# (no taps) and pays one cold step when it drafts again (``_want_taps``).
TAP_LINGER_STEPS = 8
DRAFT_ERROR_LOG_EVERY = 100  # a drafter that keeps failing logs its traceback once per this many failures


class RequestError(UserError, ValueError):
    """A request cannot be served as given (prompt too long, empty prompt); one-line message.
    ``param``: the request field at fault, as the API names it (``prompt``, ``max_tokens``, ...)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class _Advance:
    """What one scheduled sequence gained this step, after verification and KV commit."""

    seq: Sequence
    tokens: list[int]  # tokens to emit: accepted drafts + bonus/recovered, or a prompt's first token
    kept_rows: list[int]  # forward rows whose K/V is now final, in cache order
    start: int  # cache position of the first of them
    logprobs: list[TokenLogprob] | None = None  # of ``tokens``, when the request asked for them


class LLMEngine:
    """Continuous-batching engine over one target model, optional drafter and planner."""

    def __init__(self, model: TargetModel, tokenizer: PreTrainedTokenizerBase, config: EngineConfig,
                 drafter: Drafter | None = None, policy: SpeculationPolicy | None = None,
                 trim: DraftTrim | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.drafter = drafter
        self.policy = policy
        self.trim = trim  # drafted tokens cut where their rows cost more than they return (``policy/trim.py``)
        self.device = model.device
        cc = config.cache
        self.max_model_len = min(cc.max_model_len, model.cfg.max_position_embeddings)
        gamma = config.spec.num_speculative_tokens if drafter is not None else 0
        # how forwards run (graphs, compiled, eager) over which KV cache: shared with the profiler
        self.executor = ForwardExecutor(model, ExecutorOptions.of(config.model, config.scheduler.max_num_batched_tokens),
                                        cc.max_num_seqs, self.max_model_len, self._tap_layers(), 1 + gamma,
                                        overcommit=cc.kv_overcommit, kv_memory=cc.kv_cache_memory_mb * 2**20,
                                        block_size=cc.block_size)
        self.kv = self.executor.kv
        self.invariance = self.executor.invariance
        self.compile_seconds = self.executor.warm_up_seconds  # compiling the decode step or capturing the graphs
        self.runner = ModelRunner(self.executor)
        self.prefix_cache = build_prefix_cache(self.kv, cc, self.invariance, model.cfg.hidden_size,
                                               len(self._tap_layers()))
        self.scheduler = Scheduler(self.kv, config.scheduler.max_num_batched_tokens, config.scheduler.max_waiting,
                                   self._preempted, self._reused_blocks if self.kv.paged else None)
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._req_ids = itertools.count()
        self.step_count = 0
        # the intra-op threads of the thread that built the engine; a step re-pins them if another
        # thread's set_num_threads reached this one (tidespec.threads: measured in bench shift and serve)
        self.intraop_threads = torch.get_num_threads()
        self.component_errors = 0  # post-commit component failures (logged; the outputs were delivered)
        self.draft_errors = 0  # steps whose drafter raised in propose (logged; those sequences decoded plainly)
        self.last_stats = StepStats()
        self.history: deque[StepStats] = deque(maxlen=4096)
        self.observers: list[EngineObserver] = []  # add_observer / remove_observer; called in this order
        eos = list(model.cfg.eos_token_ids)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        # constrained requests' grammars, compiled once per constraint (the server compiles ahead, off this thread)
        self.grammars = GrammarCompiler(tokenizer, model.cfg.vocab_size, self.eos_ids, config.structured.json_whitespace)
        self.gamma_max = config.spec.num_speculative_tokens if drafter is not None else 0
        self.use_tree = config.spec.tree
        self._last_tapped_draft = -(1 << 30)  # step in which a tap-reading drafter last drafted

    # ----------------------------------------------------------------- requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, spec_tokens: int | None = None,
                    label: str | None = None) -> str:
        """Queue a request; raises ``RequestError``, ``GrammarError`` (a constraint that does not compile) or
        ``QueueFullError`` (nothing is queued then)."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("prompt is empty", param="prompt")
        limit = min(self.max_model_len, self.kv.capacity)
        if len(ids) + params.max_tokens > limit:
            # the prompt is at fault when it leaves no room for one token, else max_tokens
            what = "context length" if limit == self.max_model_len else "KV cache's capacity (--kv-cache-memory-mb)"
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the {what} {limit}",
                param="prompt" if len(ids) >= limit else "max_tokens")
        if spec_tokens is not None and spec_tokens < 0:
            raise RequestError(f"num_speculative_tokens must be >= 0, got {spec_tokens}",
                               param="num_speculative_tokens")
        rid = request_id if request_id is not None else f"req-{next(self._req_ids)}"
        if rid in self.seqs:
            raise RequestError(f"duplicate request id {rid}")
        vocab = self.model.cfg.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestError(f"logit_bias: token id {max(params.logit_bias)} is not below the vocabulary size "
                               f"{vocab}", param="logit_bias")
        grammar = self.grammars.matcher(params.structured) if params.structured is not None else None
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        processing = (LogitsProcessing(params, ids, vocab, stops, self.device) if params.processes_logits else None)
        prediction = (PredictionDraft(params.prediction, self.config.spec.prediction_tokens, ids)
                      if params.prediction else None)
        seq = Sequence(seq_id=next(self._ids), request_id=rid, prompt_ids=ids, params=params,
                       generator=make_generator(params.seed, self.device),
                       detok=IncrementalDetokenizer(self.tokenizer, ids), spec_override=spec_tokens, label=label,
                       grammar=grammar, processing=processing, prediction=prediction)
        seq.stats.arrival_time = time.perf_counter()
        self.scheduler.add(seq)
        self.seqs[rid] = seq
        return rid

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its KV slot; False if it is unknown or already finished."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block (as vLLM's ``LLM.reset_prefix_cache``); returns how many
        (0 without a prefix cache)."""
        return self.prefix_cache.reset() if self.prefix_cache is not None else 0

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def add_observer(self, observer: ObserverT) -> ObserverT:
        """Follow the steps from now on (``EngineObserver``); returns ``observer``. Call it between
        steps (on the engine's thread when a server runs it)."""
        self.observers.append(observer)
        return observer

    def remove_observer(self, observer: EngineObserver) -> None:
        """Stop calling ``observer`` (nothing when it is not registered)."""
        self.observers = [o for o in self.observers if o is not observer]

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        if torch.get_num_threads() != self.intraop_threads:
            pin_threads(self.intraop_threads)
        for observer in self.observers:
            observer.on_step_start(self)
        t0 = time.perf_counter()
        stats = StepStats(step=self.step_count)
        self.step_count += 1
        admitted = self.scheduler.admit()
        if self.prefix_cache is not None and admitted:
            self._reuse_prefixes(admitted, stats)
        gammas, chosen = self._plan(self.scheduler.decoding())
        predicted = predicted_drafts(self.scheduler.decoding(), gammas, chosen, self.config.spec.prediction_tokens,
                                     self.max_model_len)
        batch = self.scheduler.schedule(gammas)  # may lower gammas (KV blocks) and preempt
        chosen = {sid: name for sid, name in chosen.items() if gammas.get(sid, 0) > 0}
        stats.num_preempted = len(batch.preempted)
        if batch.empty:
            return []
        stats.taps = self._want_taps(chosen, bool(batch.prefill))  # before propose: a cold sequence needs them
        proposal = self._propose(batch.decode, gammas, chosen, predicted, stats)
        if self.trim is not None and not batch.prefill:
            stats.num_trimmed = self.trim.cut(proposal.drafts, chosen, {s.seq_id for s in batch.decode
                                                                        if not s.params.greedy}, len(batch.decode))
        t_verify = time.perf_counter()
        fwd = self.runner.forward(batch, proposal, self._tap_layers() if stats.taps else ())
        # every row verified and every first token sampled before any commit: a row that raises
        # leaves every sequence as it was before the step, so the step can be retried
        verified = [self._verify(seq, fwd) for seq in batch.decode]
        firsts = [self._first(c, fwd) for c in batch.prefill]
        advances = [self._commit_decode(seq, gammas[seq.seq_id], chosen.get(seq.seq_id), fwd, res, stats,
                                        seq.seq_id in predicted) for seq, res in zip(batch.decode, verified)]
        advances += [self._commit_prefill(chunk, first, fwd.rows[chunk.seq.seq_id], stats)
                     for chunk, first in zip(batch.prefill, firsts)]
        stats.verify_time = time.perf_counter() - t_verify  # target forward + verification + KV commit
        outputs = [emit(a.seq, a.tokens, self.eos_ids, self.max_model_len, a.logprobs) for a in advances if a.tokens]
        stats.num_emitted_tokens = sum(len(o.delta_token_ids) for o in outputs)
        # The tokens are committed: from here on the outputs are delivered whatever a component
        # (drafter, finish observer, policy) does; its failure is logged and counted, never raised
        # (losslessness does not depend on them: verification checks every draft).
        self._guarded("drafter observe", self._observe, advances, fwd)
        if self.prefix_cache is not None:
            self._guarded("prefix cache", self._cache_prompts, batch.prefill)
        for o in outputs:
            if o.finished:
                self._finish(self.seqs.pop(o.request_id), o.finish_reason)  # type: ignore[arg-type]
        self._guarded("step record", self._record, stats, batch.decode, len(batch.prefill), gammas, t0)
        return outputs

    def _guarded(self, what: str, fn: Callable[..., object], *args: object) -> None:
        """Run a post-commit component call; an exception is logged and counted, not raised."""
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - the step's tokens are committed; its outputs must still be delivered
            self.component_errors += 1
            log.exception("%s failed in step %d; the step's outputs are delivered", what, self.step_count - 1)

    # ----------------------------------------------------------------- step parts
    @property
    def drafter_names(self) -> tuple[str, ...]:
        """The drafters a policy may choose from: the drafter's members (a single drafter: itself)."""
        return tuple(self.drafter.members) if self.drafter is not None else ()

    def _plan(self, decode: list[Sequence]) -> tuple[dict[int, int], dict[int, str]]:
        """Each decoding sequence's gamma and drafter for this step, decided once: the policy (with
        its guards) or, without one, the configured gamma / per-request override with the first
        drafter; never past max_tokens or the context, never above gamma_max (what the drafter was
        configured for). Returns (gammas, drafter name of every sequence with gamma > 0)."""
        if self.drafter is None or not decode:
            return {s.seq_id: 0 for s in decode}, {}
        room = {s.seq_id: min(s.remaining_tokens, self.max_model_len - len(s.token_ids)) for s in decode}
        names = self.drafter_names
        if self.policy is not None:
            offers = self._offers(decode, room) if wants_offers(self.policy) else {}
            inp = PlanInput(len(decode), self.kv.usage(), [
                SeqState(s.seq_id, s.params.temperature, room[s.seq_id], s.spec_override, offers.get(s.seq_id, {}))
                for s in decode], names)
            if plans_drafters(self.policy):
                choices = self.policy.plan_drafters(inp)
            else:
                choices = {sid: (names[0], g) for sid, g in self.policy.plan(inp).items()}
        else:
            choices = {s.seq_id: (names[0], self.gamma_max if s.spec_override is None else s.spec_override)
                       for s in decode}
        gammas: dict[int, int] = {}
        chosen: dict[int, str] = {}
        for s in decode:
            name, gamma = choices.get(s.seq_id, (names[0], 0))
            gammas[s.seq_id] = max(0, min(gamma, self.gamma_max, room[s.seq_id] - 1))
            if gammas[s.seq_id] > 0:
                chosen[s.seq_id] = name
        return gammas, chosen

    def _offers(self, decode: list[Sequence], room: dict[int, int]) -> dict[int, dict[str, tuple[float, int]]]:
        """Per-sequence drafting (``speculative/policy/routing.py``): the model-free drafters' drafts of
        every sequence that may speculate (``offers``); the winner drafts them again in ``_drafted``."""
        assert self.drafter is not None
        inputs = [DraftInput(s.seq_id, s.token_ids, min(self.gamma_max, room[s.seq_id] - 1), s.params, self.use_tree,
                             len(s.prompt_ids)) for s in decode if s.spec_override != 0 and room[s.seq_id] > 1]
        return model_free_offers(self.drafter, inputs)

    def _tap_layers(self) -> tuple[int, ...]:
        return self.drafter.tap_layers if self.drafter is not None else ()

    def _want_taps(self, chosen: dict[int, str], prefill: bool) -> bool:
        """Whether this step computes and hands out the target's taps: in a step with prompt chunks
        (so a feature drafter always knows the prompt; next to a prefill's compute the copy is
        small), while a tap-reading drafter drafts (and ``TAP_LINGER_STEPS`` after, unless the policy
        priced it out: ``api.priced_out``), in the steps before the policy probes it (``api.probe_due``: the
        probe finds it with a context), or while an observer ``wants_taps``. Otherwise a decode step does exactly plain decoding's work; the
        drafter then restarts its context after the hole (``Drafter`` contract)."""
        if self.drafter is None or not self.drafter.tap_layers:
            return False
        tapped = self.drafter.tapped
        if any(name == tapped for name in chosen.values()):
            self._last_tapped_draft = self.step_count
        if prefill or self._last_tapped_draft == self.step_count:
            return True
        if self.policy is not None and policy_api.probe_due(self.policy, tapped or ""):
            return True  # a probe of it is due: it drafts from a context, not cold
        if self.step_count - self._last_tapped_draft <= TAP_LINGER_STEPS and not (
                self.policy is not None and policy_api.priced_out(self.policy, tapped or "")):
            return True
        return any(observer.wants_taps() for observer in self.observers)

    def _propose(self, decode: list[Sequence], gammas: dict[int, int], chosen: dict[int, str],
                 predicted: dict[int, list[int]], stats: StepStats) -> DraftProposal:
        """Drafts of the sequences with gamma > 0: a predicted output's (``predicted``), else from their
        chosen drafters, after the tokens a constrained sequence's grammar forces (``speculative/forced.py``).
        A sequence its drafter could not draft for yet (cold: no context after a step without taps) runs
        as gamma 0."""
        proposal = self._drafted(decode, gammas, chosen, predicted, stats)
        for sid, tokens in predicted.items():
            if gammas.get(sid, 0) > 0:  # the scheduler may have lowered it (KV blocks)
                proposal.drafts[sid] = SeqDraft(tokens[:gammas[sid]])
        return proposal

    def _drafted(self, decode: list[Sequence], gammas: dict[int, int], chosen: dict[int, str],
                 predicted: dict[int, list[int]], stats: StepStats) -> DraftProposal:
        """The drafters' drafts (``_propose``), of the sequences no prediction drafts for."""
        inputs = [DraftInput(s.seq_id, s.token_ids, gammas[s.seq_id], s.params, self.use_tree, len(s.prompt_ids),
                             chosen.get(s.seq_id)) for s in decode if gammas[s.seq_id] > 0 and s.seq_id not in predicted]
        if not inputs or self.drafter is None:
            return DraftProposal()
        t = time.perf_counter()
        try:
            forced = {s.seq_id: s.grammar.forced(gammas[s.seq_id]) for s in decode
                      if s.grammar is not None and gammas[s.seq_id] > 0 and self.config.spec.grammar_drafts}
            forced = {sid: f for sid, f in forced.items() if f}
            proposal = compose(self.drafter, inputs, forced) if forced else self.drafter.propose(inputs)
            for inp in inputs:  # a drafter may not exceed the gamma it was given (its KV rows were reserved)
                d = proposal.drafts.get(inp.seq_id)
                if d is not None and d.num_tokens > inp.num_speculative_tokens:
                    raise RuntimeError(f"drafter {self.drafter.name} proposed {d.num_tokens} > "
                                       f"{inp.num_speculative_tokens} tokens for sequence {inp.seq_id}")
        except Exception:  # drafts are optional: a drafter's failure must not fail the requests
            stats.draft_time = time.perf_counter() - t
            self.draft_errors += 1
            stats.num_draft_errors = len(inputs)
            if (self.draft_errors - 1) % DRAFT_ERROR_LOG_EVERY == 0:  # the first, then one in 100: no flood
                log.exception("drafter %s failed in step %d (%d failures so far); its %d sequence(s) decode "
                              "without drafts this step", self.drafter.name, self.step_count - 1, self.draft_errors,
                              len(inputs))
            for inp in inputs:
                gammas[inp.seq_id] = 0
                chosen.pop(inp.seq_id, None)
            stats.seq_drafters = dict(chosen)
            return DraftProposal()
        stats.draft_time = time.perf_counter() - t
        for sid in proposal.cold & gammas.keys():
            if sid not in proposal.drafts:
                gammas[sid] = 0
                chosen.pop(sid, None)
                stats.num_cold_drafts += 1
        stats.seq_drafters = dict(chosen)
        return proposal

    @staticmethod
    def _verify(seq: Sequence, fwd: ForwardOutput) -> Decision:
        """A decode sequence's draft checked against the target (or its next token sampled when it
        did not draft); changes nothing but the request's random stream."""
        row = fwd.rows[seq.seq_id]
        return decide(seq, fwd, row.logits_start, row.num, row.draft)

    @staticmethod
    def _first(chunk: PrefillChunk, fwd: ForwardOutput) -> Decision | None:
        """A prompt chunk's share of the step: the prompt's log-probabilities its rows give (when asked),
        and after the prompt's last chunk its first output token."""
        seq, row = chunk.seq, fwd.rows[chunk.seq.seq_id]
        if seq.wants_prompt_logprobs:
            prompt_logprobs(seq, fwd, row.logits_start, chunk.start, chunk.num_tokens)
        return decide(seq, fwd, row.last_logits, 1, None) if chunk.samples else None

    def _commit_decode(self, seq: Sequence, gamma: int, drafter: str | None, fwd: ForwardOutput, decision: Decision,
                       stats: StepStats, predicted: bool) -> _Advance:
        """Keep the K/V of a decode sequence's root and accepted path; count its draft (a prediction's
        apart: the policy prices its drafters from the others)."""
        row = fwd.rows[seq.seq_id]
        res = decision.result
        if predicted and row.draft is not None:
            count_prediction(stats, seq, row.draft.num_tokens, res.num_accepted)
        else:
            count_draft(stats, seq, gamma, drafter, row.draft, res)
            if self.trim is not None and row.draft is not None:
                self.trim.learn(drafter or "", not seq.params.greedy, row.draft, res.accepted)
        if seq.prediction is not None:
            seq.prediction.advance(res.token_ids)
        if seq.grammar is not None:  # the grammar moves over the emitted tokens only: the rest was never consumed
            seq.grammar.advance(res.token_ids)
        start = seq.num_cached
        kept = [0] + [j + 1 for j in res.accepted]  # offsets within this seq's rows: root + accepted path
        self._commit_kv(seq, kept, tree=row.draft is not None and row.draft.is_tree)
        return _Advance(seq, res.token_ids, [row.start + k for k in kept], start, decision.logprobs)

    def _commit_prefill(self, chunk: PrefillChunk, first: Decision | None, row: Row, stats: StepStats) -> _Advance:
        """A prompt chunk's K/V is final as computed; its last chunk brings the first output token
        (``first``, sampled before any commit)."""
        seq = chunk.seq
        self._commit_kv(seq, list(range(chunk.num_tokens)), tree=False)
        tokens = first.result.token_ids if first is not None else []
        if tokens and seq.grammar is not None:
            seq.grammar.advance(tokens)
        if tokens and seq.prediction is not None:
            seq.prediction.advance(tokens)
        stats.num_prefill_tokens += chunk.num_tokens
        return _Advance(seq, tokens, list(range(row.start, row.start + row.num)), chunk.start,
                        first.logprobs if first is not None else None)

    def _commit_kv(self, seq: Sequence, kept: list[int], tree: bool) -> None:
        """Keep the K/V at offsets ``kept`` of this step's new positions, in order; drop the rest.

        A chain's accepted path is a prefix (the cache length alone rolls the rest back); a tree's
        accepted path is compacted into place first. Example: ctx 10, tree rows [root, a, b, c],
        path root -> b -> c: kept [0, 2, 3] -> positions 12, 13 move to 11, 12; length 13."""
        ctx = seq.num_cached
        if tree:
            self.kv.compact(seq.slot, [ctx + k for k in kept], ctx)  # type: ignore[arg-type]
        seq.num_cached = ctx + len(kept)
        self.kv.set_length(seq.slot, seq.num_cached)  # type: ignore[arg-type]

    def _observe(self, advances: list[_Advance], fwd: ForwardOutput) -> None:
        """Tell the drafter (and the observers) which tokens became final, with the
        target's taps at those positions when it asked for them. A sequence that finished this step
        is released instead of observed."""
        if self.drafter is None:
            return
        observations = []
        wants_hidden = fwd.hidden is not None and (self.drafter.wants_hidden
                                                   or any(observer.wants_hidden() for observer in self.observers))
        for a in advances:
            if a.seq.finish_reason is not None:
                continue
            taps = hidden = None
            if fwd.taps is not None or wants_hidden:
                taps = rows_of(fwd.taps, a.kept_rows)
                hidden = rows_of(fwd.hidden, a.kept_rows) if wants_hidden else None
            observations.append(Observation(a.seq.seq_id, list(a.seq.token_ids), len(a.kept_rows), taps, a.start,
                                            hidden, len(a.seq.prompt_ids)))
            if self.prefix_cache is not None:  # the side rows the blocks saved later carry
                self.prefix_cache.record(a.seq.seq_id, a.start,
                                         {name: t for name, t in (("taps", taps), ("hidden", hidden)) if t is not None})
        if observations:
            self._deliver(observations)

    def _deliver(self, observations: list[Observation]) -> None:
        """Hand observations to the drafter, then to the observers."""
        assert self.drafter is not None
        self.drafter.observe(observations)
        for observer in self.observers:
            observer.on_observations(observations)

    # ----------------------------------------------------------------- prefix cache
    def _side_needed(self) -> frozenset[str]:
        """The side rows a prompt's prefill hands out now, so a reused prefix must bring them too:
        the taps for a tap-reading drafter, the final hidden states when one wants them."""
        if self.drafter is None:
            return frozenset()
        need = {"taps"} if self.drafter.tap_layers else set()
        if self.drafter.wants_hidden or any(observer.wants_hidden() for observer in self.observers):
            need.add("hidden")
        return frozenset(need)

    def _reuse_prefixes(self, admitted: list[Sequence], stats: StepStats) -> None:
        """Start each admitted prompt after its longest cached prefix (``engine/prefix_cache.py``);
        the drafter and the observers get the reused positions as one observation, as a prefill of
        them would have given. A failure here costs the request its hit, nothing else."""
        pc = self.prefix_cache
        assert pc is not None
        need = self._side_needed()
        for seq in admitted:
            if seq.wants_prompt_logprobs:  # every prompt row's logits are needed: its prefill computes them all
                continue
            stats.num_prefix_query_tokens += seq.prefill_len
            assert seq.slot is not None
            try:  # a preempted sequence's tokens: its prompt and the output before its last token
                hit, side = pc.reuse(seq.seq_id, seq.slot, seq.prefill_tokens(0, seq.prefill_len), need)
            except Exception:  # the prompt is then computed in full, as without a cache
                self.component_errors += 1
                self.kv.release(seq.slot)  # never written over: blocks it may have shared go back
                log.exception("prefix cache lookup failed for request %s; its prompt is computed in full",
                              seq.request_id)
                continue
            if not hit:
                continue
            seq.num_cached = seq.stats.num_cached_tokens = hit
            stats.num_prefix_hit_tokens += hit
            if self.drafter is not None:
                obs = Observation(seq.seq_id, list(seq.token_ids), hit, side.get("taps"), 0, side.get("hidden"),
                                  len(seq.prompt_ids))
                self._guarded("drafter observe", self._deliver, [obs])

    def _reused_blocks(self, seq: Sequence) -> list[int]:
        """The paged cache's blocks that ``seq``'s prompt will share from the prefix cache (admission)."""
        if self.prefix_cache is None or seq.wants_prompt_logprobs:
            return []
        blocks = self.prefix_cache.match(seq.prefill_tokens(0, seq.prefill_len), self._side_needed())
        return [blk.index for blk in blocks]

    def _cache_prompts(self, chunks: list[PrefillChunk]) -> None:
        """Save the full blocks of every prompt whose prefill completed this step."""
        assert self.prefix_cache is not None
        for chunk in chunks:
            seq = chunk.seq
            if chunk.is_last and seq.slot is not None:
                self.prefix_cache.insert(seq.seq_id, seq.slot, seq.prompt_ids, seq.num_cached)

    def _let_go(self, seq: Sequence) -> None:
        """Before a sequence's K/V is freed: its full blocks (its output too: a chat resends it as
        history; a preempted sequence finds them again) into the prefix cache; the drafter releases it."""
        if self.prefix_cache is not None:
            if seq.slot is not None:
                self._guarded("prefix cache", self.prefix_cache.insert, seq.seq_id, seq.slot, seq.token_ids,
                              seq.num_cached)
            self.prefix_cache.forget(seq.seq_id)
        if self.drafter is not None:
            self._guarded("drafter release", self.drafter.release, seq.seq_id)

    def _preempted(self, seq: Sequence) -> None:
        """A sequence loses its KV blocks (``Scheduler``): its recompute is then mostly a prefix hit,
        and the drafter relearns it from that prefill."""
        self._let_go(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.stats.finish_time = time.perf_counter()
        self._let_go(seq)
        self.scheduler.remove(seq)
        for observer in self.observers:
            self._guarded("finish observer", observer.on_finish, seq)

    def _record(self, stats: StepStats, decode: list[Sequence], num_prefill: int, gammas: dict[int, int],
                t0: float) -> None:
        """Close the step's record and hand it to the policy, the history and the observers."""
        stats.batch_size = len(decode) + num_prefill
        stats.num_decode_seqs = len(decode)
        stats.spec_lens = {s.seq_id: gammas[s.seq_id] for s in decode}
        if self.drafter is not None:
            stats.shadow_outcomes = self.drafter.drain_shadow()
        stats.total_time = time.perf_counter() - t0
        stats.other_time = stats.total_time - stats.draft_time - stats.verify_time  # incl. output processing
        stats.kv_usage = self.kv.usage()
        stats.num_running = self.num_running
        stats.num_waiting = self.num_waiting
        if self.policy is not None and decode:
            self.policy.observe(stats)
        self.last_stats = stats
        self.history.append(stats)
        for observer in self.observers:
            observer.on_step_end(stats)
