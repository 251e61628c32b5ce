"""Rotary position embeddings of the decoder families: the frequency schedules, partial rotary, NoPE.

Why this exists: families differ in their rope (Llama 3's banded scaling, linear scaling, Phi's
LongRoPE with its attention factor, gpt-oss's YaRN (interpolated low frequencies, an attention
factor), Phi-4's rope over part of each head, Gemma 3's own theta for its sliding layers, SmolLM3's
layers without rope). Each is a schedule of inverse frequencies and
a cos/sin scale; the model keeps one float32-computed table per variant it uses and every layer
looks up its own (``TargetConfig.layer_rope``).

Worked example::

    inv = rope_inv_freq(head_dim=4, theta=10000.0, scaling=None)   # tensor([1.0, 0.01])
    cos, sin = rope_cos_sin(torch.tensor([0, 1]), inv, torch.float32)
    cos[1]                                     # [cos 1, cos 0.01, cos 1, cos 0.01]
    q = apply_rope(q, cos, sin)                # q [T, heads, hd]; cos/sin [T, 1, rotary_dim]
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tidespec.models.target import TargetConfig, rope_kind


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None, short: bool = True) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32, as HF computes them (llama3, linear, LongRoPE's
    ``short`` or long factors). ``head_dim``: the rotary width (partial rotary: a fraction of the head)."""
    dim = head_dim
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope_kind(scaling)
    if scaling is None or kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "longrope":
        factors = torch.tensor(scaling["short_factor" if short else "long_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "yarn":
        return _yarn_inv_freq(dim, theta, scaling)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled)
    return inv


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's inverse frequencies, as transformers computes them: the original ones above the
    ``beta_fast`` band, divided by ``factor`` below ``beta_slow``, a linear ramp between.

    Example: dim 4, theta 10000, factor 4, original length 64: inv [1.0, 0.01] -> [1.0, 0.0025]
    (the high frequency turns 64 / 2 pi ~ 10 times in the original context: kept; the low one: scaled)."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits ``rotations`` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_attention_factor(scaling: dict[str, Any], max_positions: int) -> float:
    """YaRN's cos/sin scale (its ``mscale``), as transformers derives it when the config does not give it."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling.get("factor") or max_positions / float(scaling["original_max_position_embeddings"]))

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"])))
    return mscale(1.0)


def longrope_attention_factor(scaling: dict[str, Any], max_positions: int) -> float:
    """LongRoPE's cos/sin scale, as HF derives it when the config does not give it."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[..., rotary_dim]`` of rope ``positions`` (any shape), computed as HF's reference does:
    angles ``position * inv_freq`` in float32, duplicated over both halves, then cos/sin (times
    ``scale``: LongRoPE's attention factor), then cast.

    Example: positions [0, 1], inv_freq [1.0] -> cos [[1, 1], [0.5403, 0.5403]].
    """
    freqs = positions.float().unsqueeze(-1) * inv_freq.float()  # [..., hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., hd]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def rope_table(cfg: TargetConfig, variant: str, device: torch.device,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_position_embeddings, rotary_dim] of a rope ``variant`` ("global" or "local").
    LongRoPE uses its short factors below ``original_max_position_embeddings`` and its long ones
    from there on, per position (as vLLM does; HF switches the whole sequence once it is longer,
    so the two agree on every sequence up to the original length)."""
    theta, scaling = (cfg.rope_theta, cfg.rope_scaling) if variant == "global" else \
        (float(cfg.local_rope_theta or cfg.rope_theta), cfg.local_rope_scaling)
    pos = torch.arange(cfg.max_position_embeddings, device=device)
    inv = rope_inv_freq(cfg.rotary_dim, theta, scaling).to(device)  # [rd/2] float32
    if rope_kind(scaling) == "yarn":
        assert scaling is not None
        return rope_cos_sin(pos, inv, dtype, yarn_attention_factor(scaling, cfg.max_position_embeddings))
    if rope_kind(scaling) != "longrope":
        return rope_cos_sin(pos, inv, dtype)
    assert scaling is not None
    scale = longrope_attention_factor(scaling, cfg.max_position_embeddings)
    cos, sin = rope_cos_sin(pos, inv, dtype, scale)
    long = rope_inv_freq(cfg.rotary_dim, theta, scaling, short=False).to(device)
    cos_l, sin_l = rope_cos_sin(pos, long, dtype, scale)
    beyond = (pos >= int(scaling["original_max_position_embeddings"])).unsqueeze(1)  # [P, 1]
    return torch.where(beyond, cos_l, cos), torch.where(beyond, sin_l, sin)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]; cos/sin [T, 1, rd] (rd <= hd): the first rd dims rotated, the rest passed."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)
