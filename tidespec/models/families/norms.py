"""The normalizations of the decoder families: Llama's RMSNorm and Gemma's offset RMSNorm.

Why this exists: the families differ in how the norm's weight is applied (Llama: ``w * x`` in the
input's dtype after normalizing in float32; OLMo 2: ``w * x`` in float32, cast after; Gemma:
``(1 + w) * x`` in float32, cast after) and that difference decides bf16 bits, so it is one module
the decoder composes by the config's ``norm_offset`` and ``norm_cast_after``.

Worked example::

    RMSNorm(4, 1e-6)(torch.tensor([[1.0, -1.0, 1.0, -1.0]]))               # weight 1: unchanged
    RMSNorm(4, 1e-6, offset=True)(torch.tensor([[1.0, -1.0, 1.0, -1.0]]))  # weight 0 (Gemma's init): unchanged
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidespec.models.target import TargetConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in at least float32 (float64 stays float64). ``offset``: Gemma's, which
    scales by ``1 + weight`` (its weights start at 0) and casts after the product; ``cast_after``:
    OLMo 2's, the product with ``weight`` in float32, then the cast."""

    def __init__(self, dim: int, eps: float, offset: bool = False, cast_after: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self.cast_after = cast_after or offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        if self.offset or (self.cast_after and x.dtype not in (torch.float32, torch.float64)):
            xf = x.to(torch.promote_types(x.dtype, torch.float32))
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            w = self.weight.to(xf.dtype)
            return (xf * (1.0 + w if self.offset else w)).to(x.dtype)
        if x.dtype in (torch.float32, torch.float64):  # one fused op instead of six on the hot path
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def family_norm(cfg: TargetConfig, dim: int) -> RMSNorm:
    """The RMSNorm of ``cfg``'s family over ``dim`` features."""
    return RMSNorm(dim, cfg.rms_norm_eps, cfg.norm_offset, cfg.norm_cast_after)
