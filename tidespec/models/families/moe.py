"""A mixture of experts in place of a layer's MLP (Qwen3-MoE, Mixtral, gpt-oss): top-k routing, each expert run once over the rows that chose it.

Why this exists: on a CPU a mixture with few active parameters (Qwen3-30B-A3B reads ~3B of its
30B per token) is what makes a large model fit the memory bandwidth. For speculation to stay
exact, a token's output must not depend on which other tokens share the forward or chose its
experts: the router is a projection like any other (row-invariant), the softmax and top-k are per
row, each expert's projections run on the row-invariant kernels over whatever rows chose it, and a
token's expert outputs are summed in ascending expert order whatever the batch (as transformers
sums them), so a verification row has its decode row's bits.

The rows are grouped by expert with one sort and one host read of the counts per layer (a CPU
target pays microseconds; the compiled step and the CUDA graphs, which cannot take data-dependent
shapes, refuse a mixture at start-up).

Worked example (4 experts, top 2, three rows)::

    moe = SparseMoE(cfg)                 # cfg.num_experts 4, num_experts_per_tok 2
    moe(x)                               # x [3, H] -> [3, H]
    # rows chose experts [[2, 0], [2, 3], [1, 2]]: expert 0 runs on row 0, expert 1 on row 2,
    # expert 2 on rows 0, 1, 2, expert 3 on row 1; row 0's output = w00 * e0(x0) + w01 * e2(x0)
"""

from __future__ import annotations

import torch
from torch import nn

from tidespec.models.families.mlp import MLP
from tidespec.models.kernels.linear import Linear
from tidespec.models.target import TargetConfig


class SparseMoE(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.topk_first = cfg.router_topk_first
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.router_topk_first)  # the router (gpt-oss's: biased)
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        logits = self.gate.forward(x)  # [T, E]
        if self.topk_first:  # gpt-oss: the top k logits, a softmax over those k (in the logits' dtype)
            top, chosen = torch.topk(logits, self.top_k, dim=-1)  # [T, k] each
            weights = torch.softmax(top, dim=-1)
        else:  # softmax in float32 (float64 stays float64), then the top k renormalized, as transformers routes
            probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        flat = chosen.flatten()  # [T * k] expert of each (row, choice)
        order = torch.argsort(flat, stable=True)  # grouped by expert, rows ascending within one
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # the one host read
        rows = order // self.top_k  # [T * k] row of each grouped (row, choice)
        w = weights.flatten().index_select(0, order).unsqueeze(1)  # [T * k, 1]
        out = torch.zeros_like(x)
        start = 0
        for expert, n in zip(self.experts, counts):  # ascending expert order: each row's sum order
            if n:
                r = rows[start:start + n]
                out.index_add_(0, r, expert.forward(x.index_select(0, r)) * w[start:start + n])
                start += n
        return out
