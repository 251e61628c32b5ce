"""Lossless verification of a draft chain or tree against the target's logits.

Why this exists: it is the single place where speculation could change what the model says.
Everything here is exact: greedy verification reproduces plain argmax decoding token for token;
sampled verification reproduces the target's sampling distribution (Leviathan et al. 2023 for
chains with draft probabilities; recursive rejection over siblings, as SpecInfer/EAGLE do, for
trees and model-free point-mass drafts).

Rows: verification runs the target on ``[root] + drafts`` where ``root`` is the last verified
token. Row 0 holds the logits after the root (the distribution of the first draft position);
row ``j + 1`` holds the logits after draft token ``j``.

Worked example (greedy chain): drafts ``[5, 7, 9]``, target argmax per row ``[5, 7, 2, 4]``
-> drafts 0 and 1 accepted, draft 2 rejected, the target's token at the mismatch (2) is the
*recovered* token: emitted ``[5, 7, 2]``. Had the argmax been ``[5, 7, 9, 4]`` all three would be
accepted and 4 is the *bonus* token: emitted ``[5, 7, 9, 4]``.

Seeded requests use ``verify_seeded``: the target's token at each position is the exponential
race draw of (seed, position), so the text does not depend on the drafts (reproducible per seed).

Worked example (sampled, point mass): p = [.5, .3, .2], draft token 1. Accept with prob p[1]=.3;
on rejection sample from the residual (p with token 1 zeroed) = [.714, 0, .286]. Overall
P(1) = .3, P(0) = .7 * .714 = .5, P(2) = .7 * .286 = .2 = p. Exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tidespec.sampling import SamplingParams, sample_from, seeded_draw, target_probs
from tidespec.speculative.api import SeqDraft
from tidespec.speculative.tree import children


@dataclass
class VerifyResult:
    accepted: list[int]  # indices (into the draft list) of accepted drafts, root to leaf
    token_ids: list[int]  # emitted tokens: accepted drafts, then one recovered or bonus token
    bonus: bool  # True when every draft on the path was accepted and the last token is the bonus

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


def children_of(draft: SeqDraft) -> list[list[int]]:
    """``result[0]`` = children of the root, ``result[j + 1]`` = children of draft j."""
    parents = draft.parent_indices if draft.parent_indices is not None else list(range(-1, draft.num_tokens - 1))
    return children(parents)


def _walk(draft: SeqDraft, choose: Callable[[int, int], int]) -> VerifyResult:
    """Walk the tree from the root, at each row following the child whose token is
    ``choose(row, depth)``, the target's own token there; it ends at the first row where no child
    has it, emitting that token (recovered, or bonus at a leaf)."""
    kids = children_of(draft)
    accepted: list[int] = []
    row = 0
    while True:
        want = choose(row, len(accepted))
        nxt = next((j for j in kids[row] if draft.token_ids[j] == want), None)
        if nxt is None:
            bonus = not kids[row]
            return VerifyResult(accepted, [draft.token_ids[j] for j in accepted] + [want], bonus)
        accepted.append(nxt)
        row = nxt + 1


def verify_greedy(draft: SeqDraft, target_argmax: list[int]) -> VerifyResult:
    """Walk the tree following the target's argmax; ``target_argmax`` has ``n + 1`` entries."""
    return _walk(draft, lambda row, _depth: target_argmax[row])


def verify_seeded(draft: SeqDraft, logits: torch.Tensor, params: SamplingParams, seed: int,
                  position: int) -> VerifyResult:
    """Sampled verification for a seeded request: the target's token at each row is its exponential
    race draw for that output position (``sampling.seeded_draw``); a draft token is kept when it
    equals that draw. ``position``: the output position row 0 predicts (tokens generated so far).

    Lossless because every emitted token is exactly the draw plain decoding makes at that position
    from the same distribution, whatever the draft (the draft decides only how many are checked at
    once), so the text is a function of the seed alone. For point-mass drafts (n-gram, suffix,
    trees) a candidate is kept with probability p(x), as in rejection sampling; a drafter that
    draws with the same noise (draft_model, eagle3) is kept whenever both races pick the same token.

    Worked example: drafts [5, 7], race draws per row [5, 3, ...] -> 5 kept, 7 rejected, 3 emitted.
    """
    def choose(row: int, depth: int) -> int:
        probs = target_probs(logits[row:row + 1], params)[0]  # [V]
        return seeded_draw(probs, seed, position + depth)

    return _walk(draft, choose)


def residual_probs(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """Distribution to resample from after rejecting ``token``: normalize((p - q)+).

    ``q`` None means the draft was a point mass at ``token``: the residual is p with that
    token removed. Example: p=[.5,.3,.2], q=None, token=1 -> [.714, 0, .286].
    """
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = (p - q).clamp_min(0.0)
    total = r.sum()
    if total <= 0:  # p == q exactly: rejection had probability 0; any draw from p is exact
        return p
    return r / total


def one_transfer(logits: torch.Tensor) -> bool:
    """Whether a chain is verified with ``verify_chain_sampled`` (on a GPU, where every host read
    of a device value stalls the device) rather than token by token."""
    return logits.is_cuda


def verify_sampled(draft: SeqDraft, logits: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator | None) -> VerifyResult:
    """Exact rejection sampling over a chain (with or without draft probs) or a point-mass tree.

    logits: [n + 1, V] target logits rows as described in the module docstring.
    """
    if draft.draft_probs is not None and draft.is_tree:
        raise ValueError("tree proposals must be point mass (draft_probs=None) for exact verification")
    probs = target_probs(logits, params)  # [n + 1, V]
    if not draft.is_tree and draft.num_tokens and one_transfer(logits):
        return verify_chain_sampled(draft, probs, generator)
    kids = children_of(draft)
    accepted: list[int] = []
    row = 0
    while True:
        p = probs[row]
        candidates = kids[row]
        if not candidates:  # leaf reached: bonus token from the target
            tok = sample_from(p, generator)
            return VerifyResult(accepted, [draft.token_ids[j] for j in accepted] + [tok], True)
        chosen: int | None = None
        for j in candidates:
            x = draft.token_ids[j]
            # the drafter may run on another device than the target (--drafter-device): q comes to p
            q = draft.draft_probs[j].to(dtype=p.dtype, device=p.device) if draft.draft_probs is not None else None
            qx = float(q[x]) if q is not None else 1.0
            u = float(torch.rand((), generator=generator, dtype=torch.float64,
                                 device=generator.device if generator is not None else None))
            if qx > 0 and u * qx < float(p[x]):  # accept with prob min(1, p(x)/q(x))
                chosen = j
                break
            p = residual_probs(p, q, x)
        if chosen is None:  # every candidate rejected: recovered token from the residual
            tok = sample_from(p, generator)
            return VerifyResult(accepted, [draft.token_ids[j] for j in accepted] + [tok], False)
        accepted.append(chosen)
        row = chosen + 1


def chain_residuals(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``residual_probs`` of every row at once: p, q [n, V] (q None: point masses at x), x [n] -> [n, V]."""
    if q is None:
        r = p.scatter(1, x.unsqueeze(1), 0.0)
    else:
        r = (p - q).clamp_min(0.0)
    total = r.sum(1, keepdim=True)  # [n, 1]
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)  # p == q: draw from p


def verify_chain_sampled(draft: SeqDraft, probs: torch.Tensor, generator: torch.Generator | None) -> VerifyResult:
    """Rejection sampling over a chain with one host transfer: every row's uniform and every row's
    fallback token (a draw from its residual; after the last draft, the bonus from p) are drawn
    up front on the device, and the acceptances and fallbacks are read in one go. The draws of
    rows past the first rejection are never used; being independent of the used ones, they leave
    the distribution exactly the sequential walk's.

    probs: [n + 1, V] target probabilities (``target_probs``). Example: drafts [5, 7, 9], accepted
    [True, False, True] -> drafts 0 kept, draft 1 rejected, the row-1 fallback emitted: [5, f1].
    """
    n = draft.num_tokens
    device = probs.device
    x = torch.tensor(draft.token_ids, dtype=torch.int64, device=device)  # [n]
    p = probs[:n]  # [n, V]
    px = p.gather(1, x.unsqueeze(1)).squeeze(1).double()  # [n]
    q = draft.draft_probs.to(dtype=p.dtype, device=device) if draft.draft_probs is not None else None  # [n, V]
    qx = q.gather(1, x.unsqueeze(1)).squeeze(1).double() if q is not None else torch.ones_like(px)  # [n]
    u = torch.rand(n, generator=generator, dtype=torch.float64,
                   device=generator.device if generator is not None else device).to(device)  # [n]
    accept = (qx > 0) & (u * qx < px)  # [n]: accept with prob min(1, p(x) / q(x))
    rows = torch.cat([chain_residuals(p, q, x), probs[n:n + 1]])  # [n + 1, V]
    fallback = torch.multinomial(rows, 1, generator=generator).squeeze(1)  # [n + 1]
    flags_and_tokens = torch.cat([accept.long(), fallback]).tolist()  # the one host transfer
    flags, tokens = flags_and_tokens[:n], flags_and_tokens[n:]
    k = flags.index(0) if 0 in flags else n  # the first rejected draft, or n: all accepted
    return VerifyResult(list(range(k)), draft.token_ids[:k] + [tokens[k]], k == n)
