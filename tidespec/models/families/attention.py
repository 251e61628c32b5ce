"""The decoder families' self-attention: fused q|k|v, optional q/k norms, rope, then the layout's attention.

Why this exists: the families' attention differs in a few places only: q/k/v biases (Qwen2),
RMSNorm on q and k per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2), the softmax
scale (Gemma's ``query_pre_attn_scalar``, Granite's ``attention_multiplier``), Gemma 2's soft cap on
the scores, which rope a layer applies (none: SmolLM3's NoPE layers; a partial one: Phi-4) and the
layer's sliding window (Gemma 2 and 3, gpt-oss alternate), and gpt-oss's attention sinks (a learned
logit per head in each softmax's denominator). One module reads them from ``TargetConfig`` and its
layer index; the attention itself is the layout's (``models/kernels/attention.py``), which takes the
scale, the cap, the sinks and the window.

Worked example (a layer of a 4-head, 2-KV-head model of head_dim 16 over 3 new tokens)::

    attn = Attention(cfg, layer=0)
    out = attn(x, (cos, sin), layout, k_cache, v_cache)   # x [3, H] -> [3, H]
"""

from __future__ import annotations

import torch
from torch import nn

from tidespec.models.families.norms import family_norm
from tidespec.models.families.rope import apply_rope
from tidespec.models.kernels.linear import Linear
from tidespec.models.layout import ForwardLayout
from tidespec.models.target import TargetConfig

Rope = tuple[torch.Tensor, torch.Tensor] | None  # cos/sin [T, rotary_dim], or None for a NoPE layer


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig, layer: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_h, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.n_h * self.hd, self.n_kv * self.hd
        # fused q|k|v projection: one matmul instead of three on the decode hot path
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.qk_norm = cfg.qk_norm
        norm_dims = {"head": (self.hd, self.hd), "proj": (self.q_size, self.kv_size)}.get(cfg.qk_norm)
        self.q_norm = family_norm(cfg, norm_dims[0]) if norm_dims else None
        self.k_norm = family_norm(cfg, norm_dims[1]) if norm_dims else None
        self.window = cfg.layer_window(layer)
        self.rope_variant = cfg.layer_rope(layer)  # "global", "local" or None (no rope)
        self.scale = cfg.attention_scale if cfg.attention_scale is not None else self.hd ** -0.5
        self.softcap = cfg.attn_logit_softcap  # Gemma 2: scores -> cap * tanh(score / cap)
        self.sinks = nn.Parameter(torch.zeros(self.n_h)) if cfg.attention_sinks else None  # [n_h] gpt-oss

    def forward(self, x: torch.Tensor, rope: Rope, layout: ForwardLayout,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; rope: cos/sin [T, rd]; k_cache/v_cache: [S, n_kv, L, hd]
        T = x.shape[0]
        qkv = self.qkv_proj.forward(x)  # [T, q_size + 2 kv_size]
        if self.qk_norm == "proj" and self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat([self.q_norm(qkv[:, :self.q_size]), self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size])],
                           dim=-1).view(T, self.n_h + self.n_kv, self.hd)
        else:
            qk = qkv[:, :self.q_size + self.kv_size].view(T, self.n_h + self.n_kv, self.hd)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.n_kv, self.hd)
        if self.qk_norm == "head" and self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :self.n_h]), self.k_norm(qk[:, self.n_h:])], dim=1)
        if rope is not None:  # rope on q and k heads together: half the small ops
            qk = apply_rope(qk, rope[0].unsqueeze(1), rope[1].unsqueeze(1))
        q, k = qk[:, :self.n_h], qk[:, self.n_h:]  # [T, n_h, hd], [T, n_kv, hd]
        layout.write_kv(k_cache, v_cache, k, v)
        out = layout.attend(self.window, q, k_cache, v_cache, self.scale, self.softcap, self.sinks)  # [T, n_h, hd]
        return self.o_proj.forward(out.reshape(T, self.q_size))  # a view unless SDPA laid it out otherwise (CUDA)
