"""What a request does to the target's logits before a token is chosen (bias, ``min_tokens``,
penalties), and the log-probabilities it asked for.

Why this exists: speculation is lossless only if verification chooses from exactly the numbers plain
decoding chooses from. A penalty depends on the tokens generated before the position, and in a
verification row those include the draft tokens on the path to that row: row ``j + 1`` of a chain
counts the output so far plus drafts ``0..j``, as plain decoding would count them had it emitted
them. Every change is elementwise on a row (an addition, a product, a mask), so a verification row
(the same bits as a decode row on every CPU path) gives the same processed bits, the same argmax and
the same log-probabilities. The counts advance only over emitted tokens: nothing here keeps state
across steps but the prompt's token set.

Worked example (frequency_penalty 0.5, output so far [7], a chain draft [7, 3])::

    row 0 counts token 7 once -> logit[7] -= 0.5
    row 1 (after draft 7) counts 7 twice -> logit[7] -= 1.0
    row 2 (after drafts 7, 3) counts 7 twice and 3 once -> logit[7] -= 1.0, logit[3] -= 0.5
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidespec.sampling import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probability: the chosen token's and the ``top`` most likely tokens'
    (id, log-probability), most likely first, as float32 log-softmax values."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class LogitsProcessing:
    """A request's bias, ``min_tokens`` and penalties over rows of the target's logits (vLLM's order:
    bias and ``min_tokens``, then repetition, frequency and presence penalties).

    ``stop_ids``: the tokens ``min_tokens`` masks (end of sequence unless ``ignore_eos``, and the
    request's ``stop_token_ids``). Built once per request; holds the prompt's token set (repetition
    penalty) and the bias as tensors.
    """

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab: int, stop_ids: frozenset[int],
                 device: torch.device | str) -> None:
        self.params = params
        self.vocab = vocab
        self.device = device
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.int64, device=device)  # [S]
        self.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=device)  # [B]
        self.bias = torch.tensor(list(params.logit_bias.values()), dtype=torch.float64, device=device)  # [B]
        self.prompt_mask: torch.Tensor | None = None  # [V] bool: tokens of the prompt (repetition penalty)
        if params.repetition_penalty != 1.0:
            self.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.prompt_mask[torch.tensor(prompt_ids, dtype=torch.int64, device=device)] = True

    def apply(self, logits: torch.Tensor, output_ids: list[int], paths: list[list[int]]) -> torch.Tensor:
        """[n, V] logits -> [n, V] processed (float64 for float64 logits, else float32); ``paths[r]``:
        the draft tokens between the output so far and row ``r`` (row 0 of a step: none)."""
        p = self.params
        dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
        x = logits.to(dt, copy=True)  # [n, V]
        if len(self.bias_ids):
            x[:, self.bias_ids] += self.bias.to(dt)
        if p.min_tokens and len(self.stop_ids):
            early = [r for r, path in enumerate(paths) if len(output_ids) + len(path) < p.min_tokens]
            if early:
                rows = torch.tensor(early, dtype=torch.int64, device=x.device)
                x[rows.unsqueeze(1), self.stop_ids.unsqueeze(0)] = float("-inf")
        if not (p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty):
            return x
        counts = self._counts(output_ids, paths, dt)  # [n, V]
        if self.prompt_mask is not None:
            seen = (counts > 0) | self.prompt_mask  # [n, V]
            x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        if p.frequency_penalty:
            x = x - counts * p.frequency_penalty
        if p.presence_penalty:
            x = x - (counts > 0).to(dt) * p.presence_penalty
        return x

    def _counts(self, output_ids: list[int], paths: list[list[int]], dt: torch.dtype) -> torch.Tensor:
        """[n, V] how often each token occurs in the output before each row (output + the row's path)."""
        out = torch.tensor(output_ids, dtype=torch.int64, device=self.device)
        base = torch.bincount(out, minlength=self.vocab).to(dt)  # [V]
        counts = base.repeat(len(paths), 1)  # [n, V]
        for r, path in enumerate(paths):
            if path:
                ids = torch.tensor(path, dtype=torch.int64, device=self.device)
                counts[r].index_add_(0, ids, torch.ones(len(path), dtype=dt, device=self.device))
        return counts


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], top: int) -> list[TokenLogprob]:
    """The log-probability of ``tokens[i]`` at logits row ``rows[i]`` and the row's ``top`` most likely
    tokens; ``logits`` [n, V] as the token was chosen from (processed, constrained). One row at a time
    (a row's log-softmax is then the same bits whatever rows sit beside it), one host transfer.

    Example: logits [[0, ln 3]] (probabilities .25, .75), rows [0], tokens [0], top 1 ->
    ``[TokenLogprob(0, ln .25, ((1, ln .75),))]``.
    """
    if not rows:
        return []
    lp = torch.cat([torch.log_softmax(logits[r:r + 1].float(), dim=-1) for r in rows])  # [k, V] float32
    ids = torch.tensor(tokens, dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1)  # [k]
    if top:
        values, indices = lp.topk(min(top, lp.shape[-1]), dim=-1)  # [k, top]
        values_l, indices_l, chosen_l = values.tolist(), indices.tolist(), chosen.tolist()
        return [TokenLogprob(t, c, tuple(zip(i, v))) for t, c, i, v in zip(tokens, chosen_l, indices_l, values_l)]
    return [TokenLogprob(t, c) for t, c in zip(tokens, chosen.tolist())]


def emitted_rows(accepted: list[int]) -> list[int]:
    """The verification rows the emitted tokens were chosen at: row 0, then the row after each accepted
    draft. Example: accepted drafts [0, 2] of a tree -> tokens chosen at rows [0, 1, 3]."""
    return [0] + [j + 1 for j in accepted]
