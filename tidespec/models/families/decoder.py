"""The decoder-only transformer of every family tidespec runs, composed from the families' parts, for ragged batches.

Why this exists: speculative decoding needs things a generic ``generate()`` does not give —
several new tokens per sequence in one forward, tree-shaped attention among the new tokens,
hidden states tapped at chosen layers, and a KV cache the engine can roll back. This module is
the model code; it knows nothing of requests, only of a ``BatchLayout``. The families (Llama 2/3,
Mistral, Qwen2/3, SmolLM2/3, OLMo 2, Granite, Phi-3/4, Gemma 3) differ in parts it composes from
``TargetConfig`` (filled by ``models/architectures.py`` and config.json): the norm
(``norms.py``), where the norms sit (``DecoderLayer``: pre, sandwich, post), the attention
(``attention.py``: q/k norms, scale, window per layer), the rope (``rope.py``), the MLP's
activation (``mlp.py``), and scalars on the embedding, the residual and the logits.

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

from collections.abc import Callable, Mapping
from dataclasses import replace

import torch
from torch import nn

from tidespec.models.families.attention import Attention, Rope
from tidespec.models.families.mlp import MLP
from tidespec.models.families.moe import SparseMoE
from tidespec.models.families.norms import family_norm
from tidespec.models.families.rope import rope_table
from tidespec.models.kernels.attention import transposed_keys
from tidespec.models.kernels.linear import Linear
from tidespec.models.layout import BatchLayout, ForwardLayout, KVStorage, ModelOutput
from tidespec.models.target import ModelConfigError, TargetConfig

# the norms of a layer per placement, in HF's names (the checkpoint's and the module's)
LAYER_NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
}


class DecoderLayer(nn.Module):
    """Attention and MLP blocks with their residuals. Norm placement: "pre" (Llama: norm each
    block's input), "sandwich" (Gemma: norm its input and its output), "post" (OLMo 2: its output)."""

    def __init__(self, cfg: TargetConfig, layer: int = 0) -> None:
        super().__init__()
        self.placement = cfg.norm_placement
        for name in LAYER_NORMS[self.placement]:
            setattr(self, name, family_norm(cfg, cfg.hidden_size))
        self.self_attn = Attention(cfg, layer)
        self.mlp: MLP | SparseMoE = SparseMoE(cfg) if cfg.layer_moe(layer) else MLP(cfg)
        self.residual_scale = cfg.residual_scale

    def forward(self, h: torch.Tensor, rope: Rope, layout: ForwardLayout,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        # h: [T, H] -> [T, H]. Direct .forward calls: nn.Module.__call__ costs ~2 us each, ~300 times per decode step
        if self.placement == "pre" and self.residual_scale == 1.0:  # Llama's, the hot path
            h = h + self.self_attn.forward(self.input_layernorm.forward(h), rope, layout, k_cache, v_cache)
            return h + self.mlp.forward(self.post_attention_layernorm.forward(h))
        if self.placement == "pre":
            a = self.self_attn.forward(self.input_layernorm.forward(h), rope, layout, k_cache, v_cache)
            h = h + a * self.residual_scale
            return h + self.mlp.forward(self.post_attention_layernorm.forward(h)) * self.residual_scale
        if self.placement == "sandwich":
            a = self.self_attn.forward(self.input_layernorm.forward(h), rope, layout, k_cache, v_cache)
            h = h + self.post_attention_layernorm.forward(a)
            m = self.mlp.forward(self.pre_feedforward_layernorm.forward(h))
            return h + self.post_feedforward_layernorm.forward(m)
        h = h + self.post_attention_layernorm.forward(self.self_attn.forward(h, rope, layout, k_cache, v_cache))
        return h + self.post_feedforward_layernorm.forward(self.mlp.forward(h))


class PlacedModule(nn.Module):
    """A module whose weights share one dtype and device: ``dtype`` and ``device`` are those of its
    first parameter (the target's token embedding, the EAGLE-3 head's ``fc``)."""

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device


class DecoderModel(PlacedModule):
    """Token ids + layout + KV storage -> logits at chosen rows, hidden taps, final hidden."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = family_norm(cfg, cfg.hidden_size)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # True once ``models.invariance.make_row_invariant`` chose row-invariant kernels for every
        # projection and the exact attention kernel is built: caches for this model then store their
        # keys transposed (``KVCache(transposed_keys=True)``), which routes attention to that kernel
        self.row_invariant = False
        # cos/sin tables per (device, dtype, rope variant), built lazily; kept out of the module's
        # buffers so .to(bfloat16) never degrades the float32 rope computation
        self._rope_tables: dict[tuple[torch.device, torch.dtype, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def rope(self, positions: torch.Tensor, dtype: torch.dtype,
             variant: str = "global") -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, rotary_dim] of a rope ``variant`` ("global", or "local": Gemma 3's sliding
        layers) looked up in a table computed in float32 exactly as HF's reference computes them
        per forward (position * inv_freq in float32, then cos/sin, then cast)."""
        key = (positions.device, dtype, variant)
        table = self._rope_tables.get(key)
        if table is None:
            table = self._rope_tables[key] = rope_table(self.cfg, variant, positions.device, dtype)
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def warm_rope(self, device: torch.device, dtype: torch.dtype) -> None:
        """Build every rope table the layers use (a compiled graph then only reads them)."""
        for variant in {layer.self_attn.rope_variant for layer in self.layers} - {None}:
            self.rope(torch.zeros(1, dtype=torch.int64, device=device), dtype, variant)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, layout: BatchLayout, kv: KVStorage,
                logits_rows: torch.Tensor | None = None, tap_layers: tuple[int, ...] = ()) -> ModelOutput:
        """input_ids: [T] int64. ``logits_rows``: [R] rows needing logits (None = all, empty = none).
        ``tap_layers``: layer indices whose *input* hidden state is returned (EAGLE-3 uses
        (2, L//2, L-3))."""
        if kv.paged and layout.block_table is None:
            layout.page(kv)
        for window in self.cfg.layer_windows:
            layout.attention_plan(window, kv, transposed_keys(kv.k[0]))
        return self.run(input_ids, layout, kv.k, kv.v, logits_rows, tap_layers)

    def run(self, input_ids: torch.Tensor, layout: ForwardLayout, k: list[torch.Tensor], v: list[torch.Tensor],
            logits_rows: torch.Tensor | None = None, tap_layers: tuple[int, ...] = (),
            layer_fn: Callable[..., torch.Tensor] | None = None,
            logits_out: torch.Tensor | None = None) -> ModelOutput:
        """The forward's body over any ``ForwardLayout`` (eager or the compiled step's) and the
        per-layer K/V tensors ``k[i]``, ``v[i]`` [S, n_kv, L, hd]. ``layer_fn(layer, h, rope,
        layout, k, v)`` replaces ``layer.forward`` (one compiled layer serves every layer).
        ``logits_out`` [>= R, V] (float32, or float64 for a float64 model): the logits are written
        into its first R rows, and those returned (the CUDA graphs' one shared output buffer)."""
        cfg = self.cfg
        h = self.embed_tokens(input_ids)  # [T, H]
        if cfg.embedding_scale != 1.0:  # a tensor in the model's dtype, as HF scales Gemma's
            h = h * torch.tensor(cfg.embedding_scale, dtype=h.dtype, device=h.device)
        ropes: dict[str | None, Rope] = {None: None}
        taps: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in tap_layers:
                taps.append(h)
            variant = layer.self_attn.rope_variant
            if variant not in ropes:
                ropes[variant] = self.rope(layout.positions, h.dtype, variant)
            if layer_fn is None:
                h = layer.forward(h, ropes[variant], layout, k[i], v[i])
            else:
                h = layer_fn(layer, h, ropes[variant], layout, k[i], v[i])
        h = self.norm(h)
        rows = h if logits_rows is None else h.index_select(0, logits_rows)
        logits = None
        if rows.shape[0] and logits_out is not None:
            logits = logits_out[:rows.shape[0]].copy_(self.lm_head(rows))  # [R, V], the cast in the copy
        elif rows.shape[0]:
            logits = self.lm_head(rows).to(torch.promote_types(h.dtype, torch.float32))  # [R, V]
        if logits is not None:
            logits = scale_logits(cfg, logits)
        tap_t = torch.cat(taps, dim=-1) if taps else None  # [T, num_taps * H]
        return ModelOutput(logits=logits, taps=tap_t, last_hidden=h)

    def load_hf_state_dict(self, sd: Mapping[str, torch.Tensor], strict: bool = True,
                           each_layer: Callable[[int, nn.Module], None] | None = None) -> None:
        """Load HF-named weights (``model.layers.0.self_attn.q_proj.weight`` ...), fusing q|k|v
        and gate|up (a checkpoint that has them fused, Phi-3's, is taken as it is). Raises
        ``ModelConfigError`` naming the first missing or mis-shaped tensor.

        Each tensor is copied into its parameter as soon as it is read, so with a lazy ``sd`` (the
        loader's reads safetensors files tensor by tensor) loading holds no second copy of the
        weights (a 3B model is 12.8 GB in float32). A layer still on the meta device (the loader builds
        them there) is allocated just before its weights are copied in, and ``each_layer(i, layer)`` runs
        as soon as layer i is full: the loader quantizes it there, so a quantized model loads holding
        one layer in float, never all of them. After an error the model is partly loaded: the loader
        discards it."""
        params = {name: p for name, p in self.named_parameters() if not name.startswith("layers.")}

        def put(name: str, t: torch.Tensor | None) -> None:
            if t is None:  # handed out unread: each_layer replaces the module without reading it
                return
            if params[name].shape != t.shape:
                raise ModelConfigError(f"weight {name} has shape {tuple(t.shape)}, config expects {tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(t)

        get = _Getter(sd)
        put("embed_tokens.weight", get("model.embed_tokens.weight"))
        put("norm.weight", get("model.norm.weight"))
        if not self.cfg.tie_word_embeddings:
            put("lm_head.weight", get("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p, ours = f"model.layers.{i}.", f"layers.{i}."
            if any(w.is_meta for w in layer.parameters()):
                layer.to_empty(device=self.embed_tokens.weight.device)
            params.update((ours + name, w) for name, w in layer.named_parameters())
            for norm in LAYER_NORMS[self.cfg.norm_placement]:
                put(f"{ours}{norm}.weight", get(f"{p}{norm}.weight"))
            a = p + "self_attn."
            put(ours + "self_attn.qkv_proj.weight", get.fused(a + "qkv_proj.weight", a, ("q_proj", "k_proj", "v_proj")))
            if self.cfg.attention_bias:
                put(ours + "self_attn.qkv_proj.bias",
                    torch.cat([get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")]))
            put(ours + "self_attn.o_proj.weight", get.weight(a + "o_proj.weight"))
            if self.cfg.o_proj_bias:
                put(ours + "self_attn.o_proj.bias", get(a + "o_proj.bias"))
            if self.cfg.qk_norm != "none":
                put(ours + "self_attn.q_norm.weight", get(a + "q_norm.weight"))
                put(ours + "self_attn.k_norm.weight", get(a + "k_norm.weight"))
            if self.cfg.attention_sinks:
                put(ours + "self_attn.sinks", get(a + "sinks"))
            if self.cfg.layer_moe(i):  # Mixtral's checkpoints name the mixture block_sparse_moe
                moe = p + ("block_sparse_moe." if p + "block_sparse_moe.gate.weight" in sd else "mlp.")
                experts = get.oss_experts if self.cfg.router_topk_first else get.experts
                for name, t in experts(moe, ours + "mlp.", self.cfg.num_experts).items():
                    put(name, t)
            else:
                m = p + "mlp."
                put(ours + "mlp.gate_up_proj.weight", get.fused(m + "gate_up_proj.weight", m, ("gate_proj", "up_proj")))
                put(ours + "mlp.down_proj.weight", get.weight(m + "down_proj.weight"))
                if self.cfg.mlp_bias:
                    put(ours + "mlp.gate_up_proj.bias",
                        get.fused(m + "gate_up_proj.bias", m, ("gate_proj", "up_proj"), "bias"))
                    put(ours + "mlp.down_proj.bias", get(m + "down_proj.bias"))
            for name in [n for n in params if n.startswith(ours)]:  # the layer's float weights: each_layer's now
                del params[name]
            if each_layer is not None:
                each_layer(i, layer)

    def truncated(self, num_layers: int) -> DecoderModel:
        """A model sharing this one's weights but running only its first ``num_layers`` layers
        (the cheapest same-tokenizer draft model)."""
        if not 0 < num_layers <= self.cfg.num_layers:
            raise ModelConfigError(f"cannot truncate a {self.cfg.num_layers}-layer model to {num_layers} layers")
        small = DecoderModel.__new__(DecoderModel)
        nn.Module.__init__(small)
        per_layer = {name: getattr(self.cfg, name)[:num_layers] for name in ("sliding_layers", "rope_layers", "moe_layers")
                     if getattr(self.cfg, name) is not None}
        small.cfg = replace(self.cfg, num_layers=num_layers, **per_layer)
        small.embed_tokens = self.embed_tokens
        small.layers = nn.ModuleList(list(self.layers)[:num_layers])
        small.norm = self.norm
        small.lm_head = self.lm_head
        small._rope_tables = self._rope_tables
        small.row_invariant = self.row_invariant
        return small


def scale_logits(cfg: TargetConfig, logits: torch.Tensor) -> torch.Tensor:
    """The family's last touch on the LM head's output, in place: Granite divides by
    ``logits_scaling``, Gemma 2 soft-caps (``cap * tanh(logits / cap)``). [R, V] -> [R, V]."""
    if cfg.logits_divisor != 1.0:
        logits = logits.div_(cfg.logits_divisor)
    if cfg.final_logit_softcap is not None:
        logits = logits.div_(cfg.final_logit_softcap).tanh_().mul_(cfg.final_logit_softcap)
    return logits


class _Getter:
    """Reads of a checkpoint mapping by HF name. A mapping may name in ``unread`` tensors whose values
    the caller will never use (the loader's ``SafetensorsState``: projections a GGUF's blocks replace);
    those come back as None, and a fused tensor all of whose parts are unread too, so nothing is copied."""

    def __init__(self, sd: Mapping[str, torch.Tensor]) -> None:
        self.sd = sd
        self.unread: set[str] = getattr(sd, "unread", set())

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.sd:
            raise ModelConfigError(f"checkpoint is missing tensor {name}")
        return self.sd[name]

    def weight(self, name: str) -> torch.Tensor | None:
        """A projection's weight, None when it is unread."""
        return None if name in self.unread else self(name)

    def fused(self, name: str, prefix: str, parts: tuple[str, ...], kind: str = "weight") -> torch.Tensor | None:
        """The fused tensor ``name`` if the checkpoint has it, else its ``parts``' ``kind`` ("weight",
        "bias") concatenated by rows; None when every one of them is unread."""
        if name in self.sd:
            return None if name in self.unread else self.sd[name]
        names = [f"{prefix}{part}.{kind}" for part in parts]
        if all(n in self.unread for n in names):
            return None
        return torch.cat([self(n) for n in names])

    def experts(self, hf: str, ours: str, num: int) -> dict[str, torch.Tensor | None]:
        """A mixture's router and experts under our names (``ours`` + ``gate.weight``,
        ``experts.{e}.gate_up_proj.weight``, ``experts.{e}.down_proj.weight``), from transformers'
        in-memory layout (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) or
        a checkpoint's per-expert tensors (``experts.{e}.gate_proj.weight``, ...; Mixtral's w1/w3/w2);
        None for an expert's matrix that is unread (a GGUF's blocks run it)."""
        out: dict[str, torch.Tensor | None] = {ours + "gate.weight": self(hf + "gate.weight")}
        fused_up, fused_down = self.sd.get(hf + "experts.gate_up_proj"), self.sd.get(hf + "experts.down_proj")
        for e in range(num):
            x = f"{hf}experts.{e}."
            if fused_up is not None and fused_down is not None:
                up, down = fused_up[e], fused_down[e]
            elif x + "w1.weight" in self.sd:  # Mixtral: w1 gate, w3 up, w2 down
                up, down = torch.cat([self(x + "w1.weight"), self(x + "w3.weight")]), self(x + "w2.weight")
            else:
                up, down = self.fused(x + "gate_up_proj.weight", x, ("gate_proj", "up_proj")), self.weight(x + "down_proj.weight")
            out[f"{ours}experts.{e}.gate_up_proj.weight"] = up
            out[f"{ours}experts.{e}.down_proj.weight"] = down
        return out

    def mxfp4(self, name: str) -> torch.Tensor:
        """gpt-oss's fused experts ``name`` [E, in, out] as floats: the tensor itself, or, in the released
        checkpoints, its MXFP4 ``name_blocks`` / ``name_scales`` dequantized by transformers' own routine
        (one layer at a time: the loader quantizes each layer as soon as it is full)."""
        if name in self.sd:
            return self(name)
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # 2 s to import: only here

        return convert_moe_packed_tensors(self(name + "_blocks"), self(name + "_scales"), dtype=torch.float32)

    def oss_experts(self, hf: str, ours: str, num: int) -> dict[str, torch.Tensor | None]:
        """gpt-oss's mixture under our names (``experts``' and the biases): its router
        (``router.weight`` [E, H], ``router.bias`` [E]) and its experts as transformers holds them,
        transposed ([E, H, 2I] gate|up, [E, I, H] down, biases [E, 2I], [E, H]; the released
        checkpoints' in MXFP4) with gate and up interleaved (gate the even columns, up the odd ones),
        or per expert (``experts.{e}.gate_proj.weight`` [I, H], ..., with ``.bias``: a GGUF's
        conversion). Our fused gate|up is the gate rows, then the up rows.

        Example: transformers' gate_up_proj[e] columns [g0, u0, g1, u1] -> our rows [g0, g1, u0, u1]."""
        out: dict[str, torch.Tensor | None] = {ours + "gate.weight": self(hf + "router.weight"),
                                               ours + "gate.bias": self(hf + "router.bias")}
        x = hf + "experts."
        fused = x + "gate_up_proj" in self.sd or x + "gate_up_proj_blocks" in self.sd
        up, up_bias = (self.mxfp4(x + "gate_up_proj"), self(x + "gate_up_proj_bias")) if fused else (None, None)
        down, down_bias = (self.mxfp4(x + "down_proj"), self(x + "down_proj_bias")) if fused else (None, None)
        for e in range(num):
            y, z = f"{ours}experts.{e}.", f"{x}{e}."
            if up is not None and up_bias is not None and down is not None and down_bias is not None:
                w = up[e].t()  # [2I, H], gate and up rows interleaved
                out[y + "gate_up_proj.weight"] = torch.cat([w[0::2], w[1::2]])
                out[y + "gate_up_proj.bias"] = torch.cat([up_bias[e][0::2], up_bias[e][1::2]])
                out[y + "down_proj.weight"], out[y + "down_proj.bias"] = down[e].t(), down_bias[e]
            else:
                out[y + "gate_up_proj.weight"] = self.fused(z + "gate_up_proj.weight", z, ("gate_proj", "up_proj"))
                out[y + "gate_up_proj.bias"] = self.fused(z + "gate_up_proj.bias", z, ("gate_proj", "up_proj"), "bias")
                out[y + "down_proj.weight"] = self.weight(z + "down_proj.weight")
                out[y + "down_proj.bias"] = self(z + "down_proj.bias")
        return out
