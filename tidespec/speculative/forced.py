"""Forced tokens first: a constrained sequence's draft starts with what its grammar forces.

Why this exists: where a grammar allows exactly one continuation (a JSON key with its quotes and
colon, a closing bracket, the tail of an enum value), those tokens are drafts that cost nothing to
propose and that verification under the grammar's mask almost always accepts. They compose with
every drafter in one verification: the forced tokens come first, and a model-free drafter (n-gram,
suffix, a plugin) continues from where they end, drafting over the context extended by them with
the rest of the sequence's gamma. A drafter that keeps model state per sequence (a draft model,
EAGLE-3) cannot draft past tokens its state has not seen, so where a grammar forces tokens the
forced tokens alone are the draft. The ``grammar`` drafter (``drafters/grammar.py``) drafts nothing
of its own: choosing it means the forced tokens alone, which a policy prices like any drafter.

Nothing here can change an output: verification checks every draft token under the mask; a model-
free drafter that saw the unverified forced tokens only drafts (the suffix drafter rebuilds its
request's index when the context stops extending what it saw).

Worked example (gamma 4, forced ``[k1, k2]``, suffix drafts ``[s1, s2]`` after them)::

    compose(drafter, [DraftInput(7, ctx, 4, params, drafter="suffix")], {7: [k1, k2]})
    # suffix is asked for DraftInput(7, ctx + [k1, k2], 2, ...) -> the draft is [k1, k2, s1, s2]
"""

from __future__ import annotations

from dataclasses import replace

from tidespec.speculative.api import Drafter, DraftInput, DraftProposal, SeqDraft


def prepend(forced: list[int], draft: SeqDraft | None) -> SeqDraft:
    """``forced`` as a chain, then ``draft`` (a chain or a point-mass tree) hanging from its last token.

    Example: forced [a, b], tree [x, y] with parents [-1, -1] -> tokens [a, b, x, y], parents [-1, 0, 1, 1].
    """
    if draft is None or not draft.num_tokens:
        return SeqDraft(list(forced))
    if draft.draft_probs is not None:
        raise ValueError("forced tokens compose only with point-mass drafts (model-free drafters)")
    k = len(forced)
    if draft.parent_indices is None:
        return SeqDraft(list(forced) + list(draft.token_ids))
    parents = list(range(-1, k - 1)) + [p + k if p >= 0 else k - 1 for p in draft.parent_indices]
    return SeqDraft(list(forced) + list(draft.token_ids), parents)


def compose(drafter: Drafter, inputs: list[DraftInput], forced: dict[int, list[int]]) -> DraftProposal:
    """The drafts of ``inputs``: each sequence's forced tokens (``forced``, seq_id -> tokens) first,
    trimmed to its gamma, then its drafter's own, which a model-free drafter drafts past them and any
    other drafter gives only where nothing is forced."""
    members = drafter.members
    first = next(iter(members))
    asked: list[DraftInput] = []
    head: dict[int, list[int]] = {}
    for inp in inputs:
        f = forced.get(inp.seq_id, [])[:inp.num_speculative_tokens]
        if not f:
            asked.append(inp)
            continue
        head[inp.seq_id] = f
        rest = inp.num_speculative_tokens - len(f)
        member = members.get(inp.drafter or first)
        if rest > 0 and member is not None and member.model_free:
            asked.append(replace(inp, token_ids=list(inp.token_ids) + f, num_speculative_tokens=rest))
    proposal = drafter.propose(asked) if asked else DraftProposal()
    for sid, f in head.items():
        proposal.drafts[sid] = prepend(f, proposal.drafts.get(sid))
        proposal.cold.discard(sid)
    return proposal
