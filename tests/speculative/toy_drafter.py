"""A drafter in one file, defined outside the package: what ``--drafter-modules`` loads.

Why this exists: it is the proof that adding a drafter touches nothing else. The engine, the
policies, the profiler and the server see it only through the ``Drafter`` protocol
(``DrafterBase`` gives the defaults), and ``tidespec.speculative.registry`` finds it through the
``DRAFTER`` declaration below: ``tidespec serve --drafter-modules tests.speculative.toy_drafter
--drafter bigram`` serves it.

The rule (a bigram table of each sequence's own context): draft the token that last followed the
current token, then the one that last followed that, up to gamma tokens.

Example: context [5, 6, 7, 5, 6, 9, 5], gamma 3 -> after 5 came 6 (last), after 6 came 9, after 9
came 5: the draft is [6, 9, 5]. With ``--bigram-max-draft 2`` (its one option, declared below with
the drafter) the draft is [6, 9].
"""

from __future__ import annotations

from dataclasses import dataclass

from tidespec.config import Section, opt
from tidespec.speculative.api import DrafterBase, DraftInput, DraftProposal, Observation, SeqDraft
from tidespec.speculative.registry import BuildContext, DrafterKind


class BigramDrafter(DrafterBase):
    """Follows each sequence's last-seen successor of every token; keeps one table per sequence,
    extended by ``observe`` and dropped by ``release``."""

    name = "bigram"
    model_free = True  # no forward: a controller may score it on the side

    def __init__(self, max_draft: int = 0) -> None:
        self.max_draft = max_draft  # most draft tokens a step (0 = as many as asked)
        self.tables: dict[int, tuple[int, dict[int, int]]] = {}  # seq_id -> (tokens seen, successor table)

    def _table(self, seq_id: int, token_ids: list[int]) -> dict[int, int]:
        seen, table = self.tables.get(seq_id, (0, {}))
        for a, b in zip(token_ids[max(0, seen - 1):-1], token_ids[max(1, seen):]):
            table[a] = b
        self.tables[seq_id] = (len(token_ids), table)
        return table

    def propose(self, inputs: list[DraftInput]) -> DraftProposal:
        out = DraftProposal()
        for inp in inputs:
            table, draft, token = self._table(inp.seq_id, inp.token_ids), [], inp.token_ids[-1]
            limit = min(inp.num_speculative_tokens, self.max_draft or inp.num_speculative_tokens)
            while len(draft) < limit and token in table:
                token = table[token]
                draft.append(token)
            if draft:
                out.drafts[inp.seq_id] = SeqDraft(draft)
        return out

    def observe(self, observations: list[Observation]) -> None:
        for obs in observations:
            self._table(obs.seq_id, obs.token_ids)

    def release(self, seq_id: int) -> None:
        self.tables.pop(seq_id, None)


@dataclass
class BigramOptions(Section):
    max_draft: int = opt(0, "bigram drafter: most draft tokens a step (0 = the policy's gamma)", min=0)


def _build(ctx: BuildContext) -> BigramDrafter:
    return BigramDrafter(max_draft=ctx.options.max_draft)


DRAFTER = DrafterKind("bigram", BigramDrafter, _build, options=BigramOptions, prefix="bigram",
                      summary="each sequence's last-seen successor of a token")
