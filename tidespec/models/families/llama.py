"""One Llama-family transformer (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) for ragged batches.

Why this exists: speculative decoding needs things a generic ``generate()`` does not give —
several new tokens per sequence in one forward, tree-shaped attention among the new tokens,
hidden states tapped at chosen layers, and a KV cache the engine can roll back. This module is
the only model code in tidespec; it knows nothing of requests, only of a ``BatchLayout``.

Layout of a forward: the new tokens of all sequences are flattened into one row dimension ``T``
(sequence 0's tokens, then sequence 1's, ...). Projections and MLPs run once over ``[T, H]``;
attention runs once for the whole ragged batch over the sequences' KV slots, padded and masked
(``models/kernels/attention.py``; like varlen flash-attention).

Worked example: two sequences, one decoding a verified token plus 2 draft tokens on a 10-token
cache, one prefilling a 4-token chunk from scratch::

    layout = BatchLayout.build(q_lens=[3, 4], ctx_lens=[10, 0], slots=[5, 2])
    # T = 7 rows; rope positions = [10, 11, 12, 0, 1, 2, 3]
    # KV written to slot 5 at 10..12 and slot 2 at 0..3
    out = model(input_ids, layout, kv, logits_rows=torch.tensor([0, 1, 2, 6]))
    out.logits.shape == (4, vocab)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tidespec.models.kernels.attention import transposed_keys
from tidespec.models.kernels.linear import Linear
from tidespec.models.layout import BatchLayout, ForwardLayout, KVStorage, ModelOutput
from tidespec.models.target import ModelConfigError, TargetConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in at least float32 (float64 stays float64)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64):  # one fused op instead of six on the hot path
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: TargetConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32, as HF computes them (incl. llama3 scaling)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs.get("original_max_position_embeddings", 8192))
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled)
    return inv


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[..., head_dim]`` of rope ``positions`` (any shape), computed as HF's reference does:
    angles ``position * inv_freq`` in float32, duplicated over both halves, then cos/sin, then cast.

    Example: positions [0, 1], inv_freq [1.0] -> cos [[1, 1], [0.5403, 0.5403]].
    """
    freqs = positions.float().unsqueeze(-1) * inv_freq.float()  # [..., hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_h, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.n_h * self.hd, self.n_kv * self.hd
        # fused q|k|v projection: one matmul instead of three on the decode hot path
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: ForwardLayout,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; cos/sin: [T, hd]; k_cache/v_cache: [S, n_kv, L, hd]
        T = x.shape[0]
        qkv = self.qkv_proj.forward(x)  # [T, q_size + 2 kv_size]
        qk = qkv[:, :self.q_size + self.kv_size].view(T, self.n_h + self.n_kv, self.hd)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.n_kv, self.hd)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :self.n_h]), self.k_norm(qk[:, self.n_h:])], dim=1)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, hd]
        qk = qk * c + rotate_half(qk) * s  # rope on q and k heads together: half the small ops
        q, k = qk[:, :self.n_h], qk[:, self.n_h:]  # [T, n_h, hd], [T, n_kv, hd]
        layout.write_kv(k_cache, v_cache, k, v)
        out = layout.attend(self.cfg.sliding_window, q, k_cache, v_cache)  # [T, n_h, hd]
        return self.o_proj.forward(out.reshape(T, self.q_size))  # a view unless SDPA laid it out otherwise (CUDA)


class MLP(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # fused gate|up
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).split(self.inter, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: ForwardLayout,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        # direct .forward calls: nn.Module.__call__ costs ~2 us each, ~300 times per decode step
        h = h + self.self_attn.forward(self.input_layernorm.forward(h), cos, sin, layout, k_cache, v_cache)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h))


class PlacedModule(nn.Module):
    """A module whose weights share one dtype and device: ``dtype`` and ``device`` are those of its
    first parameter (the target's token embedding, the EAGLE-3 head's ``fc``)."""

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device


class LlamaModel(PlacedModule):
    """Token ids + layout + KV storage -> logits at chosen rows, hidden taps, final hidden."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # True once ``models.invariance.make_row_invariant`` chose row-invariant kernels for every
        # projection and the exact attention kernel is built: caches for this model then store their
        # keys transposed (``KVCache(transposed_keys=True)``), which routes attention to that kernel
        self.row_invariant = False
        # cos/sin tables per (device, dtype), built lazily; kept out of the module's buffers so
        # .to(bfloat16) never degrades the float32 rope computation
        self._rope_tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, hd] looked up in a table computed in float32 exactly as HF's reference
        computes them per forward (position * inv_freq in float32, then cos/sin, then cast)."""
        key = (positions.device, dtype)
        table = self._rope_tables.get(key)
        if table is None:
            inv = rope_inv_freq(self.cfg).to(positions.device)  # [hd/2] float32
            pos = torch.arange(self.cfg.max_position_embeddings, device=positions.device)
            table = rope_cos_sin(pos, inv, dtype)  # ([P, hd], [P, hd])
            self._rope_tables[key] = table
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, layout: BatchLayout, kv: KVStorage,
                logits_rows: torch.Tensor | None = None, tap_layers: tuple[int, ...] = ()) -> ModelOutput:
        """input_ids: [T] int64. ``logits_rows``: [R] rows needing logits (None = all, empty = none).
        ``tap_layers``: layer indices whose *input* hidden state is returned (EAGLE-3 uses
        (2, L//2, L-3))."""
        if kv.paged and layout.block_table is None:
            layout.page(kv)
        layout.attention_plan(self.cfg.sliding_window, kv, transposed_keys(kv.k[0]))
        return self.run(input_ids, layout, kv.k, kv.v, logits_rows, tap_layers)

    def run(self, input_ids: torch.Tensor, layout: ForwardLayout, k: list[torch.Tensor], v: list[torch.Tensor],
            logits_rows: torch.Tensor | None = None, tap_layers: tuple[int, ...] = (),
            layer_fn: Callable[..., torch.Tensor] | None = None,
            logits_out: torch.Tensor | None = None) -> ModelOutput:
        """The forward's body over any ``ForwardLayout`` (eager or the compiled step's) and the
        per-layer K/V tensors ``k[i]``, ``v[i]`` [S, n_kv, L, hd]. ``layer_fn(layer, h, cos, sin,
        layout, k, v)`` replaces ``layer.forward`` (one compiled layer serves every layer).
        ``logits_out`` [>= R, V] (float32, or float64 for a float64 model): the logits are written
        into its first R rows, and those returned (the CUDA graphs' one shared output buffer)."""
        h = self.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.rope(layout.positions, h.dtype)
        taps: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in tap_layers:
                taps.append(h)
            if layer_fn is None:
                h = layer.forward(h, cos, sin, layout, k[i], v[i])
            else:
                h = layer_fn(layer, h, cos, sin, layout, k[i], v[i])
        h = self.norm(h)
        rows = h if logits_rows is None else h.index_select(0, logits_rows)
        logits = None
        if rows.shape[0] and logits_out is not None:
            logits = logits_out[:rows.shape[0]].copy_(self.lm_head(rows))  # [R, V], the cast in the copy
        elif rows.shape[0]:
            logits = self.lm_head(rows).to(torch.promote_types(h.dtype, torch.float32))  # [R, V]
        tap_t = torch.cat(taps, dim=-1) if taps else None  # [T, num_taps * H]
        return ModelOutput(logits=logits, taps=tap_t, last_hidden=h)

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load HF-named weights (``model.layers.0.self_attn.q_proj.weight`` ...), fusing q|k|v
        and gate|up. Raises ``ModelConfigError`` naming the first missing or mis-shaped tensor."""
        own: dict[str, torch.Tensor] = {}
        get = _Getter(sd)
        own["embed_tokens.weight"] = get("model.embed_tokens.weight")
        own["norm.weight"] = get("model.norm.weight")
        if not self.cfg.tie_word_embeddings:
            own["lm_head.weight"] = get("lm_head.weight")
        for i in range(self.cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            own[f"layers.{i}.input_layernorm.weight"] = get(p + "input_layernorm.weight")
            own[f"layers.{i}.post_attention_layernorm.weight"] = get(p + "post_attention_layernorm.weight")
            own[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
                [get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")])
            if self.cfg.attention_bias:
                own[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat(
                    [get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")])
            own[f"layers.{i}.self_attn.o_proj.weight"] = get(a + "o_proj.weight")
            if self.cfg.qk_norm:
                own[f"layers.{i}.self_attn.q_norm.weight"] = get(a + "q_norm.weight")
                own[f"layers.{i}.self_attn.k_norm.weight"] = get(a + "k_norm.weight")
            m = p + "mlp."
            own[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")])
            own[f"layers.{i}.mlp.down_proj.weight"] = get(m + "down_proj.weight")
        params = dict(self.named_parameters())
        for name, t in own.items():
            if params[name].shape != t.shape:
                raise ModelConfigError(f"weight {name} has shape {tuple(t.shape)}, config expects {tuple(params[name].shape)}")
        with torch.no_grad():
            for name, t in own.items():
                params[name].copy_(t)

    def truncated(self, num_layers: int) -> "LlamaModel":
        """A model sharing this one's weights but running only its first ``num_layers`` layers
        (the cheapest same-tokenizer draft model)."""
        if not 0 < num_layers <= self.cfg.num_layers:
            raise ModelConfigError(f"cannot truncate a {self.cfg.num_layers}-layer model to {num_layers} layers")
        from dataclasses import replace
        small = LlamaModel.__new__(LlamaModel)
        nn.Module.__init__(small)
        small.cfg = replace(self.cfg, num_layers=num_layers)
        small.embed_tokens = self.embed_tokens
        small.layers = nn.ModuleList(list(self.layers)[:num_layers])
        small.norm = self.norm
        small.lm_head = self.lm_head
        small._rope_tables = self._rope_tables
        small.row_invariant = self.row_invariant
        return small


class _Getter:
    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        self.sd = sd

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.sd:
            raise ModelConfigError(f"checkpoint is missing tensor {name}")
        return self.sd[name]
