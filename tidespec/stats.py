"""Step and request statistics: the one data source for metrics, controllers and reports.

Why this exists: dashboards and the adaptive controllers must read the same numbers, or a
controller can be tuned against figures nobody sees. The engine fills one ``StepStats`` per
step; the speculation policies (``speculative.policy``) and the metrics (``server.metrics``)
read that same record, which is why it sits below both. ``RequestStats`` accumulate per request
and travel with its outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def add_per_position(acc: list[int], num_accepted: int) -> None:
    """Count one accepted token at each draft position 0..num_accepted-1 (grows ``acc``).

    Example: acc = [3, 1]; add_per_position(acc, 3) -> acc == [4, 2, 1].
    """
    if len(acc) < num_accepted:
        acc.extend([0] * (num_accepted - len(acc)))
    for i in range(num_accepted):
        acc[i] += 1


@dataclass
class StepStats:
    step: int = 0
    batch_size: int = 0  # sequences in the step (decode + prefill)
    num_decode_seqs: int = 0
    num_prefill_tokens: int = 0
    num_prefix_query_tokens: int = 0  # prompt tokens of the requests admitted this step (prefix cache on)
    num_prefix_hit_tokens: int = 0  # of those, reused from the prefix cache instead of computed
    num_preempted: int = 0  # sequences preempted this step for lack of KV blocks
    num_drafts: int = 0  # sequences that speculated this step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rejected: int = 0  # speculating sequences whose draft was cut by a rejection (accepted < depth)
    num_draft_depth: int = 0  # sum of draft depths (= draft tokens for chains)
    num_short_drafts: int = 0  # sequences asked for gamma > 0 whose draft was shallower than gamma
    num_trimmed: int = 0  # drafted tokens cut before verification: their rows cost more than they return
    num_emitted_tokens: int = 0  # tokens appended to outputs this step
    accepted_per_pos: list[int] = field(default_factory=list)  # [max depth] accepted count per draft position
    spec_lens: dict[int, int] = field(default_factory=dict)  # seq_id -> gamma chosen this step
    seq_drafters: dict[int, str] = field(default_factory=dict)  # seq_id -> drafter asked to draft (gamma > 0)
    # (gamma asked, draft depth, accepted) of every decode sequence asked for gamma > 0
    seq_outcomes: list[tuple[int, int, int]] = field(default_factory=list)
    seq_accepted: dict[int, int] = field(default_factory=dict)  # seq_id -> its accepted draft tokens (gamma > 0)
    # the same outcomes per drafter name (a drafter that could not draft yet for lack of context,
    # e.g. EAGLE-3 right after a step without taps, is left out: ``num_cold_drafts``)
    drafter_outcomes: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    # outcomes of drafts a model-free drafter proposed on the side and that were scored against the
    # tokens the target then produced (``speculative.drafters.multi``), per drafter name
    shadow_outcomes: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    num_prediction_tokens: int = 0  # draft tokens from requests' predicted outputs (counted apart from the drafters')
    num_accepted_prediction_tokens: int = 0
    num_cold_drafts: int = 0  # sequences asked to draft whose drafter had no context to draft from yet
    num_draft_errors: int = 0  # sequences asked to draft whose drafter raised: they decoded without drafts
    taps: bool = False  # whether the target's hidden-state taps were computed and handed out this step
    draft_time: float = 0.0  # seconds in drafter.propose
    verify_time: float = 0.0  # seconds in the target forward (+ verification)
    other_time: float = 0.0  # scheduling, bookkeeping, detokenization
    total_time: float = 0.0
    kv_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0

    @property
    def gamma(self) -> int:
        """The arm that ran: the largest per-sequence gamma this step (0 = nobody drafted)."""
        return max(self.spec_lens.values(), default=0)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per speculating sequence per step (accepted + 1); 0 when none speculated."""
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else 0.0


@dataclass
class RequestStats:
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_steps: int = 0  # decode steps that produced tokens for this request
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache (not computed)
    num_preemptions: int = 0  # times its KV blocks were taken back (it was prefilled again)
    num_accepted_prediction_tokens: int = 0  # of its predicted output's drafts, kept (also in num_accepted_tokens)
    num_rejected_prediction_tokens: int = 0  # ... and refused by the target
    # drafter name -> [draft tokens, accepted tokens] of the drafts it made for this request
    per_drafter: dict[str, list[int]] = field(default_factory=dict)

    def add_accepted(self, num_draft: int, num_accepted: int, drafter: str | None = None) -> None:
        """One verified draft; ``drafter``: the drafter that made it (None: a predicted output's)."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        add_per_position(self.accepted_per_pos, num_accepted)
        if drafter is not None:
            counts = self.per_drafter.setdefault(drafter, [0, 0])
            counts[0] += num_draft
            counts[1] += num_accepted

    def acceptance(self, drafter: str | None = None) -> float | None:
        """Accepted / drafted tokens of ``drafter``'s drafts for this request (None: of every draft); None
        where none were made. Example: suffix drafted 6 tokens and 4 were kept, eagle3 2 and 0 ->
        ``acceptance("eagle3") == 0.0``, ``acceptance() == 0.5``, ``acceptance("medusa") is None``."""
        if drafter is None:
            drafted, accepted = self.num_draft_tokens, self.num_accepted_tokens
        else:
            drafted, accepted = self.per_drafter.get(drafter, (0, 0))
        return accepted / drafted if drafted else None

    @property
    def mean_acceptance_length(self) -> float:
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else 0.0
