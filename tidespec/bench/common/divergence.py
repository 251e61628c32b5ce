"""Where a speculative output first leaves plain decoding's, and how close the target's choice was there.

Why this exists: greedy speculation is lossless up to arithmetic. A verification row runs other
kernels than a decode row (bfloat16 on a GPU, where the row count picks the GEMM; the CPU's
quantized paths), so the two may pick different tokens where the target's two best logits lie
within rounding of each other, and from that token on the outputs differ. Such a flip is a
near-tie; a flip where one token clearly wins is a bug. ``bench spec`` reports, for every output
that differs from plain decoding, the first differing position, the two tokens, and the gap
between their logits in one eager forward of the target over the prompt and plain's tokens up
to there, absolute and relative to the largest logit; a gap within ``NEAR_TIE_EPS`` machine
epsilons of the model's dtype (relative) counts as a near-tie.

Worked example (a 2-token prompt; plain decoded [7, 9, 4], the speculative run [7, 3, ...])::

    d = first_divergence(model, [5, 6], plain=[7, 9, 4], spec=[7, 3, 1], prompt_id="p0")
    d.position, d.plain_token, d.spec_token   # 1, 9, 3  (the target read [5, 6, 7] there)
    d.gap, d.relative_gap, d.near_tie         # logit[9] - logit[3], / |max logit|, within tolerance?
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.models.target import TargetModel

# relative gap, in machine epsilons of the model's dtype, within which a flip counts as a near-tie
# (bfloat16: 4 x 2^-7 = 3 % of the largest logit; float32: 4.8e-7)
NEAR_TIE_EPS = 4


@dataclass
class Divergence:
    prompt_id: str
    position: int  # index into the generated tokens
    plain_token: int
    spec_token: int
    gap: float  # logit[plain_token] - logit[spec_token] in the eager forward
    relative_gap: float  # |gap| / max(1, |largest logit|)
    near_tie: bool


def first_index(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length difference counts), or None.

    Example: ``first_index([1, 2, 3], [1, 4, 3]) == 1``; ``first_index([1], [1, 2]) == 1``."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def first_divergence(model: TargetModel, prompt: list[int], plain: list[int], spec: list[int],
                     prompt_id: str = "") -> Divergence | None:
    """The first position where ``spec`` leaves ``plain`` and the target's logits there (None when
    they agree, or when one output merely stops earlier)."""
    i = first_index(plain, spec)
    if i is None or i >= len(plain) or i >= len(spec):
        return None
    seq = prompt + plain[:i]
    kv = KVCache.for_model(model.cfg, 1, len(seq), model.dtype, model.device)
    ids = torch.tensor(seq, dtype=torch.int64, device=model.device)
    rows = torch.tensor([len(seq) - 1], device=model.device)
    out = model(ids, BatchLayout.build([len(seq)], [0], [0], device=model.device), kv, logits_rows=rows)
    assert out.logits is not None
    logits = out.logits[0].double()  # [V]
    gap = float(logits[plain[i]] - logits[spec[i]])
    relative = abs(gap) / max(1.0, float(logits.abs().max()))
    tol = NEAR_TIE_EPS * torch.finfo(model.dtype).eps if model.dtype.is_floating_point else 0.0
    return Divergence(prompt_id, i, plain[i], spec[i], gap, relative, relative <= tol)


def divergence_report(model: TargetModel, prompts: list[list[int]], plain: list[list[int]], spec: list[list[int]],
                      prompt_ids: list[str]) -> dict[str, Any]:
    """Every differing output's first divergence, and a summary: how many, how many at near-ties,
    the largest relative gap."""
    found = [d for d in (first_divergence(model, p, a, b, pid)
                         for p, a, b, pid in zip(prompts, plain, spec, prompt_ids)) if d is not None]
    return {"count": len(found), "near_ties": sum(d.near_tie for d in found),
            "max_relative_gap": max((d.relative_gap for d in found), default=0.0),
            "divergences": [asdict(d) for d in found]}
