"""Predicted Outputs: the text a client expects back (OpenAI's ``prediction``) as a request's own drafts.

Why this exists: a code editor that asks for a file with one change already has almost every token of
the answer. Verification makes drafting it lossless, so the prediction's tokens are drafts that cost
nothing to propose. After each step the request's ``PredictionDraft`` finds where the output's last
tokens occur in the request's own text and offers what follows them there: in the prediction, where
the output follows it (an edit skips or inserts text, so the place is found again from the output's
last tokens, not kept as a position), and in the prompt and the output itself, which the output also
copies (the file as the prompt shows it; a block the output repeats, as small models do).

Rule (suffix decoding's, arXiv 2411.04975, over one request's text; hand-written because it is a few
lines over a bigram index, where a suffix-tree library would have to be rebuilt as the output grows):

1. match: the longest suffix of the output (at least ``MIN_MATCH`` tokens, at most ``MAX_MATCH``)
   that occurs earlier in ``prompt | prediction | output`` with a token after it; while the whole
   output so far is the prediction's beginning, that match counts whatever its length (so an output
   that starts as the prediction is drafted from its first token);
2. ties: the prediction before the output before the prompt (the prediction is what the client
   said the output is), the latest occurrence within one;
3. length: twice the match (at least 1, at most the cap), never across the end of its text.

A prediction that matches nothing is never drafted from (no match reaches it), so it wastes nothing;
only drafts taken from the prediction count as prediction tokens (OpenAI's
``accepted_prediction_tokens`` / ``rejected_prediction_tokens``), those from the prompt and output
as the request's other drafts.

Worked example (prompt ``[7, 8]``, prediction ``[1, 2, 3, 4, 5, 6]``, cap 8)::

    pd = PredictionDraft([1, 2, 3, 4, 5, 6], cap=8, prompt=[7, 8])
    pd.advance([1])        # the output is the prediction's start, matched 1 token
    pd.draft(16)           # -> [2, 3] (twice the match), from the prediction
    pd.advance([2, 9])     # 9 is an edit: (2, 9) occurs nowhere before
    pd.draft(16)           # -> []
    pd.advance([4])        # (9, 4): nowhere either; then the model writes 5 ...
    pd.advance([5])        # (4, 5) ends at the prediction's index 4: match 2
    pd.draft(16)           # -> [6] (the prediction's end)
"""

from __future__ import annotations

from collections import defaultdict

SEP = -1  # between the prompt, the prediction and the output: no match spans two of them
MIN_MATCH = 2  # a single token matches too often to draft from (the output's start excepted)
MAX_MATCH = 64  # match lengths are compared up to this (a longer one drafts the cap anyway)
# occurrences of the output's last two tokens looked at, the latest first: a step's lookup stays under a
# millisecond however repetitive the request's text (a prompt of one repeated token would otherwise
# compare thousands of places, MAX_MATCH tokens each, on the engine's thread every step)
MAX_CANDIDATES = 256
PROMPT, PREDICTION, OUTPUT = 0, 2, 1  # tie priority of a match's text (higher first)


class PredictionDraft:
    """A request's drafts from its prediction, prompt and output (token ids).

    ``accepted`` / ``rejected``: prediction tokens drafted and kept / drafted and refused by the target
    (OpenAI's ``accepted_prediction_tokens`` / ``rejected_prediction_tokens``); ``from_prediction``:
    whether the last draft came from the prediction."""

    def __init__(self, prediction: list[int], cap: int, prompt: list[int] | None = None) -> None:
        self.cap = cap
        self.text: list[int] = [*(prompt or []), SEP]
        self.pred_start = len(self.text)
        self.text += [*prediction, SEP]
        self.out_start = len(self.text)
        self.accepted = 0
        self.rejected = 0
        self.from_prediction = False
        self._prefix = True  # whether the output so far is the prediction's beginning
        self._ends: dict[tuple[int, int], list[int]] = defaultdict(list)  # (t, u) -> indices of u in text
        for i in range(1, len(self.text)):
            self._ends[(self.text[i - 1], self.text[i])].append(i)

    def _kind(self, i: int) -> int:
        return PROMPT if i < self.pred_start else PREDICTION if i < self.out_start else OUTPUT

    def _match(self) -> tuple[int, int] | None:
        """(match length, index in ``text`` of the match's last token) of rule 1-2, or None."""
        text, n = self.text, len(self.text)
        out = n - self.out_start
        best: tuple[int, int, int] | None = None  # (length, kind priority, index)
        if out and self._prefix:
            best = (min(out, MAX_MATCH), PREDICTION, self.pred_start + out - 1)
        if out >= MIN_MATCH:
            for i in self._ends.get((text[-2], text[-1]), [])[-MAX_CANDIDATES - 1:]:
                if i == n - 1 or text[i + 1] == SEP:  # the output's own end; the prompt's or prediction's end
                    continue
                k = 2
                while k < MAX_MATCH and i - k >= 0 and text[i - k] == text[n - 1 - k] and text[i - k] != SEP:
                    k += 1
                key = (k, self._kind(i), i)
                if best is None or key > best:
                    best = key
        return (best[0], best[2]) if best is not None else None

    def draft(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that follow the output's longest match (rule 3); none without one."""
        self.from_prediction = False
        found = self._match() if limit > 0 else None
        if found is None:
            return []
        k, end = found
        draft = self.text[end + 1:end + 1 + min(limit, self.cap, max(1, 2 * k))]
        if SEP in draft:  # the end of the prompt or the prediction
            draft = draft[:draft.index(SEP)]
        self.from_prediction = bool(draft) and self._kind(end) == PREDICTION
        return draft

    def count(self, drafted: int, accepted: int) -> tuple[int, int]:
        """A step verified ``drafted`` of the last draft's tokens and kept ``accepted``: returns the
        (drafted, accepted) of them that were prediction tokens (all or none)."""
        if not self.from_prediction:
            return 0, 0
        self.accepted += accepted
        self.rejected += drafted - accepted
        return drafted, accepted

    def advance(self, tokens: list[int]) -> None:
        """The output grew by ``tokens`` (emitted this step)."""
        for t in tokens:
            i = len(self.text) - self.out_start  # the output's index of t
            at = self.pred_start + i  # where t stands in the prediction if the output still follows it
            self._prefix = self._prefix and at < self.out_start - 1 and self.text[at] == t
            self.text.append(t)
            self._ends[(self.text[-2], self.text[-1])].append(len(self.text) - 1)
