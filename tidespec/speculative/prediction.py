"""Predicted Outputs: the text a client expects back (OpenAI's ``prediction``) as a request's own drafts.

Why this exists: a code editor that asks for a file with one change already has almost every token of
the answer. Verification makes drafting it lossless, so the prediction's tokens are drafts that cost
nothing to propose: after each step the request's ``PredictionDraft`` finds where the output stands in
the prediction and offers the tokens that follow. An edit skips or inserts text, so the position is
found again from the output's last tokens whenever the next token is not the expected one; while the
output matches nothing in the prediction (an insertion), it drafts nothing.

How much to draft: twice as many tokens as the output has matched the prediction in a row (at least
one, at most the cap): a long run of agreement is drafted many tokens at once, an alignment found
again from two tokens four at a time, the start of the output (nothing matched yet) one token; a
prediction that matches nothing is lost after its first token and drafts nothing, so it wastes at
most one draft per step.

Worked example (prediction ``a b c d e f``, output so far ``a b``)::

    pd = PredictionDraft([a, b, c, d, e, f], cap=8)
    pd.advance([a, b])      # both expected: position 2, run 2
    pd.draft(16)            # -> [c, d, e, f] (twice the run, to the end)
    pd.advance([c, X])      # c expected, X not: lost; X's bigram (c, X) is nowhere -> no drafts
    pd.advance([e])         # (X, e) nowhere either; then the model writes `e f`...
    pd.advance([f])         # (e, f) ends at index 5: position 6 (the end) -> drafts nothing more
"""

from __future__ import annotations

from collections import defaultdict


class PredictionDraft:
    """Where a request's output stands in its prediction (token ids), and the drafts that follow.

    ``accepted`` / ``rejected``: prediction tokens drafted and kept / drafted and refused by the target
    (OpenAI's ``accepted_prediction_tokens`` / ``rejected_prediction_tokens``)."""

    def __init__(self, prediction: list[int], cap: int) -> None:
        self.pred = list(prediction)
        self.cap = cap
        self.pos: int | None = 0  # the prediction's index the next output token is expected at; None: lost
        self.run = 0  # output tokens that matched the prediction in a row at this alignment
        self.accepted = 0
        self.rejected = 0
        self._bigrams: dict[tuple[int, int], list[int]] = defaultdict(list)  # (t, u) -> indices of u
        for i in range(1, len(self.pred)):
            self._bigrams[(self.pred[i - 1], self.pred[i])].append(i)
        self._out: list[int] = []

    def draft(self, limit: int) -> list[int]:
        """Up to ``limit`` prediction tokens after the output: twice the ``run`` (at least one), none when lost."""
        if self.pos is None or limit <= 0:
            return []
        return self.pred[self.pos:self.pos + min(limit, self.cap, max(1, 2 * self.run))]

    def count(self, drafted: int, accepted: int) -> None:
        """A step verified ``drafted`` prediction tokens and kept ``accepted`` of them."""
        self.accepted += accepted
        self.rejected += drafted - accepted

    def advance(self, tokens: list[int]) -> None:
        """The output grew by ``tokens`` (emitted this step): follow the prediction, or find the place again."""
        for t in tokens:
            self._out.append(t)
            if self.pos is not None and self.pos < len(self.pred) and self.pred[self.pos] == t:
                self.pos += 1
                self.run += 1
            else:
                self._resync()

    def _resync(self) -> None:
        """Align on the output's last two tokens: of the places they occur in the prediction, the one the
        output agrees with longest backwards (the first such at or after the old position on a tie)."""
        out = self._out
        old = self.pos or 0
        self.pos, self.run = None, 0
        if len(out) < 2:
            return
        best: tuple[int, int, int] | None = None  # (match length, after the old position, -index)
        for i in self._bigrams.get((out[-2], out[-1]), []):
            k = 2
            while k < len(out) and i - k >= 0 and self.pred[i - k] == out[-1 - k]:
                k += 1
            key = (k, int(i >= old), -i)
            if best is None or key > best:
                best = key
        if best is not None:
            self.pos, self.run = -best[2] + 1, best[0]
