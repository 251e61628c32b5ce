"""The compiled static-shape anchor: a Llama decode as gpt-fast writes it, ~100 lines.

Why this exists: "is tidespec's decode step near the hardware?" needs a yardstick measured on the
same GPU in the same run. gpt-fast's recipe is the best-known one: every shape static (batch,
one token per step, a KV cache of ``max_len`` positions written with ``index_copy_`` and read
whole under a causal mask), the step compiled with ``torch.compile(mode="reduce-overhead")``
(inductor fuses the small ops and replays the step as a CUDA graph), and no host sync per token.
It runs one batch of equal-length sequences and nothing else (no requests, no speculation), so
it bounds what an engine's plain decode step can reach. It shares the weights of a tidespec
``TargetModel`` (fused q|k|v and gate|up, as ours), so its tokens can be compared too.

Worked example::

    anchor = AnchorModel(model, batch=16, max_len=256)        # model: a tidespec TargetModel on cuda
    tok_s = anchor.decode_speed(start=64, steps=128)            # tokens/s over 16 x 128 tokens
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from tidespec.errors import ConfigError
from tidespec.models.target import TargetModel
from tidespec.speculative.policy.profiler import sync_device


class _Layer(nn.Module):
    def __init__(self, src: nn.Module, batch: int, max_len: int) -> None:
        super().__init__()
        attn, mlp = src.self_attn, src.mlp
        self.attn_norm, self.mlp_norm = src.input_layernorm, src.post_attention_layernorm
        self.wqkv, self.wo = attn.qkv_proj.weight, attn.o_proj.weight
        self.w13, self.w2 = mlp.gate_up_proj.weight, mlp.down_proj.weight
        self.n_h, self.n_kv, self.hd, self.inter = attn.n_h, attn.n_kv, attn.hd, mlp.inter
        shape = (batch, self.n_kv, max_len, self.hd)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=self.wqkv.dtype, device=self.wqkv.device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=self.wqkv.dtype, device=self.wqkv.device))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        # x: [B, 1, H]; cos/sin: [1, 1, 1, hd]; pos: [1]; mask: [1, 1, 1, max_len]
        B = x.shape[0]
        qkv = F.linear(self.attn_norm(x), self.wqkv)  # [B, 1, (n_h + 2 n_kv) hd]
        q, k, v = qkv.split([self.n_h * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        q = q.view(B, 1, self.n_h, self.hd).transpose(1, 2)  # [B, n_h, 1, hd]
        k = k.view(B, 1, self.n_kv, self.hd).transpose(1, 2)  # [B, n_kv, 1, hd]
        v = v.view(B, 1, self.n_kv, self.hd).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        h = x + F.linear(out.transpose(1, 2).reshape(B, 1, -1), self.wo)
        gate, up = F.linear(self.mlp_norm(h), self.w13).split(self.inter, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.w2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class AnchorModel(nn.Module):
    """One decode step of ``batch`` sequences at a shared position over a static cache."""

    def __init__(self, model: TargetModel, batch: int, max_len: int, compile: bool = True) -> None:
        super().__init__()
        if not model.cfg.llama_layers or model.cfg.sliding_window is not None:
            raise ConfigError(f"the anchor runs Llama's decoder layers (no window); {model.cfg.architecture}'s differ")
        self.batch, self.max_len = batch, max_len
        self.embed, self.norm, self.lm_head = model.embed_tokens, model.norm, model.lm_head.weight
        self.layers = nn.ModuleList(_Layer(layer, batch, max_len) for layer in model.layers)
        positions = torch.arange(max_len, device=self.lm_head.device)
        self.cos, self.sin = model.rope(positions, self.lm_head.dtype)  # [max_len, hd] each
        self.causal = torch.ones(max_len, max_len, dtype=torch.bool, device=self.lm_head.device).tril()
        self.step = torch.compile(self.forward, mode="reduce-overhead", fullgraph=True) if compile else self.forward

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids [B, 1], pos [1] -> next greedy ids [B, 1]."""
        x = self.embed(ids)  # [B, 1, H]
        cos, sin = self.cos[pos].view(1, 1, 1, -1), self.sin[pos].view(1, 1, 1, -1)
        mask = self.causal[pos].view(1, 1, 1, -1)
        for layer in self.layers:
            x = layer(x, cos, sin, pos, mask)
        return F.linear(self.norm(x), self.lm_head).argmax(-1)  # [B, 1]

    @torch.inference_mode()
    def decode(self, ids: torch.Tensor, start: int, steps: int) -> torch.Tensor:
        """``steps`` greedy tokens after ``ids`` [B, 1] at position ``start``: [B, steps] (one sync at the end)."""
        out = []
        for i in range(steps):
            pos = torch.tensor([start + i], device=ids.device)
            ids = self.step(ids, pos).clone()  # the graph's output is overwritten by its next replay
            out.append(ids)
        return torch.cat(out, dim=1)

    def decode_speed(self, start: int, steps: int, warm_steps: int = 8) -> float:
        """Tokens/s of ``steps`` decode steps of the whole batch (after compiling and warming up)."""
        ids = torch.randint(0, self.embed.num_embeddings, (self.batch, 1), device=self.lm_head.device)
        self.decode(ids, start, min(warm_steps, steps))  # compiles, records the graph
        sync_device(ids.device)
        t0 = time.perf_counter()
        self.decode(ids, start, steps)
        sync_device(ids.device)
        return self.batch * steps / (time.perf_counter() - t0)
