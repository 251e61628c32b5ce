"""The ``grammar`` drafter: the tokens a constrained request's grammar forces, and nothing else.

Why this exists: the engine puts a constrained sequence's forced tokens (``speculative/forced.py``)
before any drafter's own drafts; naming ``grammar`` as a drafter makes "the forced tokens alone"
one more choice a policy prices (``--drafter grammar,suffix --policy bandit``) and gives it its own
series in ``/metrics`` (``drafter="grammar"``). ``--drafter grammar`` alone serves constrained
requests with drafts that cost nothing to propose and every other request with plain decoding.

It drafts nothing of its own, so a controller does not score it on the side (``side_scored``):
on the side it would see no grammar and score nothing.

Example: a request constrained to ``{"name": ..., "age": ...}`` that has just emitted the name's
closing quote drafts ``", "age": `` (the forced key) when the policy gives it gamma 4 or more.
"""

from __future__ import annotations

from tidespec.speculative.api import DrafterBase, DraftInput, DraftProposal
from tidespec.speculative.registry import BuildContext, DrafterKind


class GrammarDrafter(DrafterBase):
    """Proposes nothing itself: the engine's forced tokens are the whole draft."""

    name = "grammar"
    model_free = True
    side_scored = False

    def propose(self, inputs: list[DraftInput]) -> DraftProposal:
        return DraftProposal()


def _build(ctx: BuildContext) -> GrammarDrafter:
    return GrammarDrafter()


DRAFTER = DrafterKind("grammar", GrammarDrafter, _build,
                      summary="the tokens a constrained request's grammar forces (JSON keys, brackets, enum tails)")
