"""One target forward for a scheduled batch: flattened token ids, ``BatchLayout``, logits rows, taps.

Why this exists: the step decides *what* runs (which sequences, how many draft tokens); this
module decides *how* it is laid out for the model — every decode sequence contributes its last
token plus its draft (a chain or a tree with its mask), every prefill chunk its prompt slice — and
runs the model once over all of it through the ``ForwardExecutor`` (``models/execution/executor.py``: a CUDA
graph, the compiled step or eager). It knows nothing of requests, sampling or verification.

Worked example (two decode sequences, one drafting a 2-token chain, and a 3-token prefill chunk)::

    decode A: last token a5, draft [d1, d2]  -> rows 0..2, logits rows 0..2, ctx = A.num_cached
    decode B: last token b9, no draft        -> row 3,     logits row 3
    prefill C: prompt[4:7], last chunk       -> rows 4..6, logits row 6 (its first output token;
                                                 rows 4..6 when it asked for the prompt's logprobs)
    ids = [a5, d1, d2, b9, c4, c5, c6]; q_lens = [3, 1, 3]; logits_rows = [0, 1, 2, 3, 6]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidespec.engine.scheduler import ScheduledBatch
from tidespec.models.execution.executor import ForwardExecutor
from tidespec.sampling import row_argmax
from tidespec.speculative.api import DraftProposal, SeqDraft
from tidespec.speculative.tree import tree_depths, tree_mask


@dataclass
class Row:
    """Where one scheduled sequence's tokens sit in the flattened forward."""

    start: int  # first row of this sequence in the flattened batch
    num: int  # rows it contributes
    logits_start: int  # its first row in the logits tensor (-1 if it needs none)
    draft: SeqDraft | None = None  # the draft verified in these rows (decode sequences only)
    num_logits: int = 0  # its logits rows (a decode sequence: ``num``; a prompt chunk: 0, 1 or all its rows)

    @property
    def last_logits(self) -> int:
        """Its last logits row: where a prompt's last chunk samples the first output token."""
        return self.logits_start + self.num_logits - 1


@dataclass
class ForwardOutput:
    rows: dict[int, Row]  # seq_id -> its rows
    logits: torch.Tensor | None  # [R, V] at the rows that need them (decode rows, last prefill rows)
    argmax: list[int]  # [R] greedy token per logits row (one host transfer for the whole batch)
    taps: torch.Tensor | None  # [T, num_taps * H] target hidden taps when asked, else None
    hidden: torch.Tensor | None = None  # [T, H] the final (normed) hidden state of every row


@dataclass
class ForwardPlan:
    """One forward's inputs as host lists (flattened rows, per-sequence layout, logits rows)."""

    tokens: list[int]  # [T]
    rows: dict[int, Row]  # seq_id -> its rows
    q_lens: list[int]
    ctx_lens: list[int]
    slots: list[int]
    depths: list[list[int] | None]
    masks: list[torch.Tensor | None]
    logits_rows: list[int]  # [R]


class ModelRunner:
    """Lays out and runs the target forward over the engine's KV slots."""

    def __init__(self, executor: ForwardExecutor) -> None:
        self.executor = executor  # how the forward runs: a CUDA graph, the compiled step or eager

    def forward(self, batch: ScheduledBatch, proposal: DraftProposal, tap_layers: tuple[int, ...]) -> ForwardOutput:
        """ONE target forward for the whole batch (``ForwardExecutor`` decides how it runs); K/V of
        every row is written into its slot."""
        plan = self.plan(batch, proposal)
        out = self.executor(plan.tokens, plan.q_lens, plan.ctx_lens, plan.slots, plan.logits_rows, plan.depths,
                            plan.masks, tap_layers, prefill=bool(batch.prefill))
        argmax = row_argmax(out.logits).tolist() if out.logits is not None else []
        return ForwardOutput(plan.rows, out.logits, argmax, out.taps if tap_layers else None, out.last_hidden)

    def plan(self, batch: ScheduledBatch, proposal: DraftProposal) -> ForwardPlan:
        """The forward's layout as host lists (no tensor yet)."""
        tokens: list[int] = []
        q_lens: list[int] = []
        ctx_lens: list[int] = []
        slots: list[int] = []
        depths: list[list[int] | None] = []
        masks: list[torch.Tensor | None] = []
        logit_rows: list[int] = []
        rows: dict[int, Row] = {}
        for seq in batch.decode:
            draft = proposal.drafts.get(seq.seq_id)
            draft = draft if draft is not None and draft.num_tokens else None
            new = [seq.token_ids[-1]] + (draft.token_ids if draft is not None else [])
            rows[seq.seq_id] = Row(len(tokens), len(new), len(logit_rows), draft, len(new))
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
            new = seq.prefill_tokens(chunk.start, chunk.start + chunk.num_tokens)
            lstart, nlog = -1, 0
            if seq.wants_prompt_logprobs:  # every row: each predicts the prompt's next token
                lstart, nlog = len(logit_rows), len(new)
                logit_rows.extend(range(len(tokens), len(tokens) + len(new)))
            elif chunk.samples:
                lstart, nlog = len(logit_rows), 1
                logit_rows.append(len(tokens) + len(new) - 1)
            rows[seq.seq_id] = Row(len(tokens), len(new), lstart, num_logits=nlog)
            tokens.extend(new)
            q_lens.append(len(new))
            ctx_lens.append(chunk.start)
            slots.append(seq.slot)  # type: ignore[arg-type]
            depths.append(None)
            masks.append(None)
        return ForwardPlan(tokens, rows, q_lens, ctx_lens, slots, depths, masks, logit_rows)


def rows_of(t: torch.Tensor | None, rows: list[int]) -> torch.Tensor | None:
    """A copy of rows ``rows`` of a forward output: of a slice when they are consecutive (a
    chain's accepted path, a prompt chunk), else a gather. The slice spares the host-to-device
    copy of an index, which from pageable memory waits for the GPU's queue to drain (measured
    once per sequence a step on an H200). A copy, not a view: an observer may keep it, and a
    view would keep the whole batch's rows alive."""
    if t is None:
        return None
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return t[rows[0]:rows[0] + len(rows)].clone()
    return t.index_select(0, torch.tensor(rows, dtype=torch.int64, device=t.device))
