"""EAGLE-2's dynamic draft trees grown by the EAGLE-3 head, level by level in the head's own cache.

Why this exists: a tree proposes several candidates per position (EAGLE-2, the field guide's
"tree attention"), so one verification of gamma + 1 rows can accept where a chain's single guess
missed; on chat, where the target itself is unsure, the shipped head accepts 1.85 with trees of 4
tokens against 1.68 with chains (docs/benchmarks/drafters.md). ``Eagle3Drafter`` owns the
per-sequence state and the head; this module owns the growth: which candidates are expanded, how a
level is laid out against the cached ones, and the global rerank into a tree of ``budget`` tokens.

Growth: every level expands the ``top_k`` candidates of highest cumulative log-probability, each
with its ``top_k`` children. A level feeds only its frontier (``top_k`` rows a sequence): the nodes
of earlier levels keep their K/V in the head's cache past the sequence's committed length, in
expansion order, and the frontier attends to the context and, among those, to its ancestors (a
[q, p + q] ancestor-or-self mask, ``AttentionPlan.build``). That speculative K/V is never
committed: the next proposal or catch-up overwrites it. After ``depth`` levels the best ``budget``
candidates are kept (``speculative.tree.rerank_tree``).

Worked example, top_k 2, depth 3, committed length L: the root's children [a, b] come from the
last position's logits; level 1 feeds [a, b] at L, L + 1 and gets their children; level 2 feeds the
best two grandchildren [c, d] at L + 2, L + 3 with mask rows c: [a 1, b 0, c 1, d 0] and
d: [a 1, b 0, c 0, d 1] when both hang under a; the rerank keeps the best ``budget`` of a, b, c, d
and their children.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tidespec.models.layout import BatchLayout
from tidespec.speculative.drafters.eagle3_state import SeqState
from tidespec.speculative.tree import rerank_tree, tree_depths, tree_mask

# one head forward over a level: (fused rows [n, H], draft-vocabulary ids [n], layout) ->
# (pre-norm outputs [n, H], logits over the draft vocabulary [n, Vd])
HeadStep = Callable[[torch.Tensor, list[int], BatchLayout], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TreeJob:
    """EAGLE-2 expansion state for one sequence."""

    seq_id: int
    state: SeqState
    budget: int
    depth: int
    tokens: list[int] = field(default_factory=list)  # [n] draft ids of all candidates
    parents: list[int] = field(default_factory=list)  # [n] candidate parent (-1 = root)
    scores: list[float] = field(default_factory=list)  # [n] cumulative log-prob
    expanded: list[int] = field(default_factory=list)  # candidates forwarded so far (cache order)
    frontier: list[int] = field(default_factory=list)  # candidates to forward this level
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # candidate -> its pre-norm output [H]

    def add_children(self, parent: int, logits: torch.Tensor, top_k: int) -> list[int]:
        """logits [Vd] at ``parent`` (-1 = root) -> top-k children appended; returns their indices."""
        logp = torch.log_softmax(logits.double(), dim=-1)
        k = min(top_k, logp.shape[-1])
        top_lp, top_ids = torch.topk(logp, k)
        base = self.scores[parent] if parent >= 0 else 0.0
        new: list[int] = []
        for lp, tok in zip(top_lp.tolist(), top_ids.tolist()):
            new.append(len(self.tokens))
            self.tokens.append(int(tok))
            self.parents.append(parent)
            self.scores.append(base + float(lp))
        return new


def grow_trees(jobs: list[TreeJob], top_k: int, step: HeadStep,
               device: torch.device) -> list[tuple[list[int], list[int]]]:
    """Grow every job's tree (one head forward per level for all of them) and rerank it:
    per job (kept draft-vocabulary ids, their parent indices) in topological order."""
    for job in jobs:
        job.frontier = job.add_children(-1, job.state.root_output()[1], top_k)
    for level in range(1, max(j.depth for j in jobs)):
        live = [j for j in jobs if level < j.depth and j.frontier]
        if not live:
            break
        fused_rows: list[torch.Tensor] = []
        tokens: list[int] = []
        q_lens: list[int] = []
        ctx_lens: list[int] = []
        depths: list[list[int]] = []
        masks: list[torch.Tensor] = []
        for job in live:
            prev = len(job.expanded)  # nodes already in the cache past the committed length
            job.expanded = job.expanded + job.frontier
            local = {c: i for i, c in enumerate(job.expanded)}
            parents = [local[job.parents[c]] if job.parents[c] >= 0 else -1 for c in job.expanded]
            for c in job.frontier:
                p = job.parents[c]
                fused_rows.append(job.hidden[p] if p >= 0 else job.state.root_output()[0])
                tokens.append(job.tokens[c])
            q_lens.append(len(job.frontier))
            ctx_lens.append(job.state.kv_len + prev)
            depths.append([d - prev for d in tree_depths(parents)[prev:]])  # offsets from kv_len + prev
            masks.append(tree_mask(parents)[prev + 1:, 1:])  # [q, prev + q]: the (cached) root dropped
        layout = BatchLayout.build(q_lens, ctx_lens, [j.state.slot for j in live], depths=depths,
                                   tree_masks=masks, device=device)
        out, logits = step(torch.stack(fused_rows), tokens, layout)
        row = 0
        for job in live:
            children: list[int] = []
            for c in job.frontier:
                job.hidden[c] = out[row]
                children.extend(job.add_children(c, logits[row], top_k))
                row += 1
            children.sort(key=lambda c: (-job.scores[c], c))
            job.frontier = children[:top_k]
    result: list[tuple[list[int], list[int]]] = []
    for job in jobs:
        kept, parents = rerank_tree(job.scores, job.parents, job.budget)
        result.append(([job.tokens[c] for c in kept], parents))
    return result
