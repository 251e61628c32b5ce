"""The engine step loop: continuous batching over one target, an optional drafter and policy.

Why this exists: this is where scheduling, drafting, one batched target forward, lossless
verification, KV rollback, streaming and statistics meet — one step at a time, nothing else.

One step (see docs/architecture.md)::

    batch    = scheduler.schedule()            # decode seqs + prefill chunks
    gammas   = plan(batch)                      # speculation length per decode seq (0 = plain)
    proposal = drafter.propose(...)             # chain or tree per speculating seq
    out      = model(tokens, layout, kv)        # ONE forward: prefill chunks + [last]+drafts
    verify   -> accepted drafts + recovered/bonus token per seq; KV rolled back / compacted
    drafter.observe(...), stop checks, detokenize, StepStats

Worked example (``tidespec.llm.build_engine`` wires model, drafter and policy from a config)::

    engine = LLMEngine(model, tokenizer, EngineConfig(), drafter=NgramDrafter())
    engine.add_request("def fib(n):", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        outputs = engine.step()        # RequestOutput per sequence that advanced
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from tidespec.config import EngineConfig
from tidespec.engine.detok import IncrementalDetokenizer
from tidespec.engine.scheduler import ScheduledBatch, Scheduler
from tidespec.engine.sequence import Sequence
from tidespec.engine.stats import RequestStats, StepStats, add_per_position
from tidespec.errors import UserError
from tidespec.models.kv_cache import KVCache
from tidespec.models.llama import BatchLayout, LlamaModel
from tidespec.sampling import SamplingParams, make_generator, sample_from, target_probs
from tidespec.speculative.api import (
    Drafter,
    DraftInput,
    DraftProposal,
    Observation,
    SeqDraft,
)
from tidespec.speculative.policy.policy import (
    PlanInput,
    SeqState,
    SpeculationPolicy,
    StepFeedback,
)
from tidespec.speculative.tree import tree_depths, tree_mask
from tidespec.speculative.verify import VerifyResult, verify_greedy, verify_sampled


class RequestError(UserError, ValueError):
    """A request cannot be served as given (prompt too long, empty prompt); one-line message."""


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text emitted so far (stop strings excluded)
    delta_text: str  # text new in this step
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort"
    stats: RequestStats

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class _Row:
    """Where one scheduled item's tokens sit in the flattened forward."""

    start: int
    num: int
    logits_start: int  # first row in the logits tensor (-1 if none)
    draft: SeqDraft | None = None


class LLMEngine:
    """Continuous-batching engine over one target model, optional drafter and planner."""

    def __init__(self, model: LlamaModel, tokenizer: PreTrainedTokenizerBase, config: EngineConfig,
                 drafter: Drafter | None = None, policy: SpeculationPolicy | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.drafter = drafter
        self.policy = policy
        self.device = model.device
        cc = config.cache
        self.max_model_len = min(cc.max_model_len, model.cfg.max_position_embeddings)
        self.kv = KVCache.for_model(model.cfg, cc.max_num_seqs, self.max_model_len, model.dtype, self.device)
        self.scheduler = Scheduler(self.kv, config.scheduler.max_num_batched_tokens, config.scheduler.max_waiting)
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._req_ids = itertools.count()
        self.step_count = 0
        self.last_stats = StepStats()
        self.history: deque[StepStats] = deque(maxlen=4096)
        self.step_listeners: list[Callable[[StepStats], None]] = []
        # called with the step's observations (final tokens + target taps) after the drafter saw
        # them; training-signal capture hooks in here. Must return quickly (copy, never block).
        self.observation_consumers: list[Callable[[list[Observation]], None]] = []
        # called at the start of every step, between steps: the place to swap in a new drafter
        # version that a background thread already loaded. Must return quickly.
        self.between_steps: list[Callable[["LLMEngine"], None]] = []
        eos = list(model.cfg.eos_token_ids)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.gamma_max = config.spec.num_speculative_tokens if drafter is not None else 0
        self.use_tree = config.spec.tree

    # ----------------------------------------------------------------- requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, spec_tokens: int | None = None,
                    label: str | None = None) -> str:
        """Queue a request; raises ``RequestError`` or ``QueueFullError`` (nothing is queued then)."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("prompt is empty")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"length {self.max_model_len}")
        if spec_tokens is not None and spec_tokens < 0:
            raise RequestError(f"num_speculative_tokens must be >= 0, got {spec_tokens}")
        rid = request_id if request_id is not None else f"req-{next(self._req_ids)}"
        if rid in self.seqs:
            raise RequestError(f"duplicate request id {rid}")
        seq = Sequence(seq_id=next(self._ids), request_id=rid, prompt_ids=ids, params=params,
                       generator=make_generator(params.seed, self.device),
                       detok=IncrementalDetokenizer(self.tokenizer, ids), spec_override=spec_tokens, label=label)
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

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        for hook in self.between_steps:
            hook(self)
        t0 = time.perf_counter()
        stats = StepStats(step=self.step_count)
        self.step_count += 1
        batch = self.scheduler.schedule(self.gamma_max)
        if batch.empty:
            return []
        gammas = self._plan(batch.decode)
        proposal = self._propose(batch.decode, gammas, stats)
        t_verify = time.perf_counter()
        ids, rows, layout, logits_rows = self._build_inputs(batch, proposal)
        taps_wanted = self.drafter.tap_layers if self.drafter is not None else ()
        out = self.model(ids, layout, self.kv, logits_rows=logits_rows, tap_layers=taps_wanted)
        logits = out.logits
        argmax = logits.argmax(-1).tolist() if logits is not None else []
        outputs: list[RequestOutput] = []
        observations: list[Observation] = []
        outcomes: list[tuple[int, int, int]] = []  # (gamma asked, draft depth, accepted) for the policy
        for seq, gamma in zip(batch.decode, gammas):
            row = rows[seq.seq_id]
            res = self._verify(seq, row, logits, argmax)
            start = seq.num_cached
            kept_rows = self._commit_kv(seq, row, res)
            depth = row.draft.depth if row.draft is not None else 0
            stats.num_short_drafts += int(0 < gamma and depth < gamma)
            if gamma > 0:
                outcomes.append((gamma, depth, res.num_accepted if depth else 0))
            if row.draft is not None and row.draft.num_tokens:
                seq.stats.add_accepted(row.draft.num_tokens, res.num_accepted)
                stats.num_drafts += 1
                stats.num_draft_tokens += row.draft.num_tokens
                stats.num_accepted_tokens += res.num_accepted
                stats.num_draft_depth += depth
                stats.num_rejected += int(res.num_accepted < depth)
                add_per_position(stats.accepted_per_pos, res.num_accepted)
            o = self._emit(seq, res.token_ids, stats)
            outputs.append(o)
            if taps_wanted and not o.finished:
                observations.append(Observation(
                    seq.seq_id, list(seq.token_ids), len(kept_rows),
                    out.taps.index_select(0, torch.tensor(kept_rows, device=self.device)), start))
        for chunk in batch.prefill:
            seq = chunk.seq
            row = rows[seq.seq_id]
            seq.num_cached += chunk.num_tokens
            self.kv.set_length(seq.slot, seq.num_cached)
            stats.num_prefill_tokens += chunk.num_tokens
            finished = False
            if chunk.is_last:
                o = self._emit(seq, [self._sample(seq, logits[row.logits_start], argmax[row.logits_start])], stats)
                outputs.append(o)
                finished = o.finished
            if taps_wanted and not finished:
                observations.append(Observation(seq.seq_id, list(seq.token_ids), chunk.num_tokens,
                                                out.taps[row.start:row.start + row.num], chunk.start))
        # verify = target forward + verification + KV commit; output processing counts as other
        stats.verify_time = time.perf_counter() - t_verify - stats.other_time
        if observations and self.drafter is not None:
            self.drafter.observe(observations)
            for consume in self.observation_consumers:
                consume(observations)
        stats.batch_size = len(batch.decode) + len(batch.prefill)
        stats.num_decode_seqs = len(batch.decode)
        stats.spec_lens = {s.seq_id: g for s, g in zip(batch.decode, gammas)}
        stats.total_time = time.perf_counter() - t0
        stats.other_time = stats.total_time - stats.draft_time - stats.verify_time  # incl. output processing
        stats.kv_usage = self.kv.usage()
        stats.num_running = self.num_running
        stats.num_waiting = self.num_waiting
        if self.policy is not None and batch.decode:
            self.policy.observe(StepFeedback(
                batch_size=len(batch.decode), gamma=max(gammas), num_seqs_speculated=stats.num_drafts,
                num_draft_tokens=stats.num_draft_tokens, num_accepted_tokens=stats.num_accepted_tokens,
                num_emitted_tokens=stats.num_emitted_tokens, step_time=stats.total_time,
                draft_time=stats.draft_time, verify_time=stats.verify_time,
                num_prefill_tokens=stats.num_prefill_tokens, num_rejected=stats.num_rejected,
                num_draft_depth=stats.num_draft_depth, num_short_drafts=stats.num_short_drafts,
                seq_outcomes=outcomes))
        self.last_stats = stats
        self.history.append(stats)
        for listener in self.step_listeners:
            listener(stats)
        return outputs

    # ----------------------------------------------------------------- step parts
    def _plan(self, decode: list[Sequence]) -> list[int]:
        if self.drafter is None or not decode:
            return [0] * len(decode)
        if self.policy is not None:
            chosen = self.policy.plan(PlanInput(len(decode), self.kv.usage(), [
                SeqState(s.seq_id, s.params.temperature, s.remaining_tokens, s.spec_override) for s in decode]))
            gam = [chosen.get(s.seq_id, 0) for s in decode]
        else:
            gam = [self.gamma_max if s.spec_override is None else s.spec_override for s in decode]
        # never draft past max_tokens or the slot; clamp to the reserved budget
        return [max(0, min(g, self.gamma_max, s.remaining_tokens - 1, self.max_model_len - len(s.token_ids) - 1))
                for g, s in zip(gam, decode)]

    def _propose(self, decode: list[Sequence], gammas: list[int], stats: StepStats) -> DraftProposal:
        inputs = [DraftInput(s.seq_id, s.token_ids, g, s.params, self.use_tree, len(s.prompt_ids))
                  for s, g in zip(decode, gammas) if g > 0]
        if not inputs or self.drafter is None:
            return DraftProposal()
        t = time.perf_counter()
        proposal = self.drafter.propose(inputs)
        stats.draft_time = time.perf_counter() - t
        for inp in inputs:  # a drafter may not exceed the gamma it was given
            d = proposal.drafts.get(inp.seq_id)
            if d is not None and d.num_tokens > inp.num_speculative_tokens:
                raise RuntimeError(f"drafter {self.drafter.name} proposed {d.num_tokens} > {inp.num_speculative_tokens} tokens")
        return proposal

    def _build_inputs(self, batch: ScheduledBatch, proposal: DraftProposal
                      ) -> tuple[torch.Tensor, dict[int, _Row], BatchLayout, torch.Tensor]:
        tokens: list[int] = []
        q_lens: list[int] = []
        ctx_lens: list[int] = []
        slots: list[int] = []
        depths: list[list[int] | None] = []
        masks: list[torch.Tensor | None] = []
        logit_rows: list[int] = []
        rows: dict[int, _Row] = {}
        for seq in batch.decode:
            draft = proposal.drafts.get(seq.seq_id)
            draft = draft if draft is not None and draft.num_tokens else None
            new = [seq.token_ids[-1]] + (draft.token_ids if draft is not None else [])
            rows[seq.seq_id] = _Row(len(tokens), len(new), len(logit_rows), draft)
            logit_rows.extend(range(len(tokens), len(tokens) + len(new)))
            if draft is not None and draft.is_tree:
                assert draft.parent_indices is not None
                depths.append([0] + [d + 1 for d in tree_depths(draft.parent_indices)])
                masks.append(tree_mask(draft.parent_indices))
            else:
                depths.append(None)
                masks.append(None)
            tokens.extend(new)
            q_lens.append(len(new))
            ctx_lens.append(seq.num_cached)
            slots.append(seq.slot)  # type: ignore[arg-type]
        for chunk in batch.prefill:
            seq = chunk.seq
            new = seq.prompt_ids[chunk.start:chunk.start + chunk.num_tokens]
            lstart = -1
            if chunk.is_last:
                lstart = len(logit_rows)
                logit_rows.append(len(tokens) + len(new) - 1)
            rows[seq.seq_id] = _Row(len(tokens), len(new), lstart)
            tokens.extend(new)
            q_lens.append(len(new))
            ctx_lens.append(chunk.start)
            slots.append(seq.slot)  # type: ignore[arg-type]
            depths.append(None)
            masks.append(None)
        layout = BatchLayout.build(q_lens, ctx_lens, slots, depths, masks, device=self.device)
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        return ids, rows, layout, torch.tensor(logit_rows, dtype=torch.int64, device=self.device)

    def _verify(self, seq: Sequence, row: _Row, logits: torch.Tensor, argmax: list[int]) -> VerifyResult:
        lo, n = row.logits_start, row.num
        if row.draft is None:
            return VerifyResult([], [self._sample(seq, logits[lo], argmax[lo])], True)
        if seq.params.greedy:
            return verify_greedy(row.draft, argmax[lo:lo + n])
        return verify_sampled(row.draft, logits[lo:lo + n], seq.params, seq.generator)

    def _commit_kv(self, seq: Sequence, row: _Row, res: VerifyResult) -> list[int]:
        """Keep K/V of the root and the accepted path; roll back the rest. Returns the forward
        rows (into the flattened batch) whose K/V is now final, in cache order."""
        ctx = seq.num_cached
        kept = [0] + [j + 1 for j in res.accepted]  # offsets within this seq's new tokens
        if row.draft is not None and row.draft.is_tree:
            self.kv.compact(seq.slot, [ctx + k for k in kept], ctx)  # type: ignore[arg-type]
        seq.num_cached = ctx + len(kept)
        self.kv.set_length(seq.slot, seq.num_cached)  # type: ignore[arg-type]
        return [row.start + k for k in kept]

    def _sample(self, seq: Sequence, logits_row: torch.Tensor, argmax: int) -> int:
        if seq.params.greedy:
            return argmax
        return sample_from(target_probs(logits_row.unsqueeze(0), seq.params)[0], seq.generator)

    # ----------------------------------------------------------------- output side
    def _emit(self, seq: Sequence, new_tokens: list[int], stats: StepStats) -> RequestOutput:
        """Append tokens with stop checks, detokenize, build the output (timed into other_time)."""
        now = time.perf_counter()
        try:
            return self._emit_tokens(seq, new_tokens, stats, now)
        finally:
            stats.other_time += time.perf_counter() - now

    def _emit_tokens(self, seq: Sequence, new_tokens: list[int], stats: StepStats, now: float) -> RequestOutput:
        if seq.stats.first_token_time is None:
            seq.stats.first_token_time = now
        seq.stats.num_steps += 1
        appended: list[int] = []
        reason: str | None = None
        p = seq.params
        for tok in new_tokens:
            seq.append(tok)
            appended.append(tok)
            if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                reason = "stop"
                break
            if len(seq.output_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
                reason = "length"
                break
        stats.num_emitted_tokens += len(appended)
        seq.pending_text += seq.detok.add(appended)
        if reason is not None:
            seq.pending_text += seq.detok.flush()
        stop_hit = _find_stop(seq.pending_text, p.stop)
        if stop_hit is not None:
            seq.pending_text = seq.pending_text[:stop_hit]
            reason = "stop"
            delta = seq.pending_text
            seq.pending_text = ""
        elif reason is not None:
            delta, seq.pending_text = seq.pending_text, ""
        else:
            hold = _stop_prefix_len(seq.pending_text, p.stop)  # could still become a stop string
            cut = len(seq.pending_text) - hold
            delta, seq.pending_text = seq.pending_text[:cut], seq.pending_text[cut:]
        seq.emitted_text += delta
        if reason is not None:
            self.seqs.pop(seq.request_id, None)
            self._finish(seq, reason)
        return RequestOutput(seq.request_id, seq.prompt_ids, list(seq.output_ids), seq.emitted_text, delta,
                             appended, reason is not None, reason, seq.stats)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.stats.finish_time = time.perf_counter()
        self.scheduler.remove(seq)
        if self.drafter is not None:
            self.drafter.release(seq.seq_id)


def _find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string starts, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                best = max(best, k)
                break
    return best
