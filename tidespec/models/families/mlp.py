"""The decoder families' feed-forward block: a gated MLP with the family's activation.

Why this exists: Llama, Qwen, Phi, OLMo and Granite gate with SiLU, Gemma with tanh-approximated
GELU, gpt-oss's experts with a clamped SwiGLU (``clamped_swiglu``); the fused gate|up projection (one
matmul on the decode hot path) is shared.

Worked example::

    mlp = MLP(cfg)          # cfg.hidden_act "silu": down(silu(gate(x)) * up(x))
    mlp(x)                  # x [T, H] -> [T, H]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tidespec.models.kernels.linear import Linear
from tidespec.models.target import TargetConfig

ACTIVATION_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class MLP(nn.Module):
    """``inter``: the intermediate width (default the config's; a mixture's experts have their own)."""

    def __init__(self, cfg: TargetConfig, inter: int | None = None) -> None:
        super().__init__()
        self.inter = inter or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)  # fused gate|up
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACTIVATION_FNS[cfg.hidden_act]
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        gate, up = self.gate_up_proj.forward(x).split(self.inter, dim=-1)
        if self.limit is not None:
            return self.down_proj.forward(clamped_swiglu(gate, up, self.limit, self.alpha))
        return self.down_proj.forward(self.act(gate) * up)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's gated activation, as transformers computes it: the gate capped above at ``limit``, ``up``
    clamped to [-limit, limit], then ``gate * sigmoid(alpha * gate) * (up + 1)``. [T, I] x [T, I] -> [T, I].

    Example (limit 7, alpha 1.702): gate 10, up -9 -> gate 7, up -7 -> 7 * sigmoid(11.914) * -6 = -41.9997."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
