"""The EAGLE-3 draft head: one decoder layer over the target's fused hidden states, a draft-vocabulary LM head.

Why this exists: TIDE (Sec. 3.2) trains an EAGLE-3 head online from hidden states the target
already computes while serving. The head is one decoder layer plus a draft-vocabulary LM head
that reads the target's hidden states entering three tap layers (low, middle, high). It is a
model like the target (``llama.py``), so it lives here; the drafter that proposes with it is
``tidespec.speculative.drafters.eagle3``, its training-time-test forward is in
``tidespec.online.training.eagle3_train``, and its checkpoint format in ``eagle3_checkpoint``. The module
layout follows vLLM's / SGLang's ``LlamaForCausalLMEagle3`` so exported checkpoints load there.

One head step at rope position ``i`` (``fused`` is ``fc(taps_i)`` for a real position, or the
head's own previous pre-norm output while drafting)::

    residual = fused                                              # [T, H]
    x = cat(input_layernorm(embed(token_{i+1})), hidden_norm(fused))   # [T, 2H]
    h = residual + o_proj(attn(q/k/v_proj(x)))                     # q/k/v take 2H inputs
    h = h + mlp(post_attention_layernorm(h))                       # [T, H]
    h = blocks[j](h) for j = 0 .. num_layers-2                     # optional deeper head (plain blocks)
    logits = lm_head(norm(h))                                      # [T, draft_vocab]; h is fed back

Dovetail (Sec. 3.2-3.3) options: ``num_layers`` > 1 adds plain decoder blocks after the first,
and ``fusion="gated"`` replaces the concatenation by Dynamic Gated Fusion::

    h2 = silu(embed_proj(embed_norm(embed(token_{i+1}))))          # [T, H]
    z = sigmoid(gate([fused; h2]))                                  # [T, H]
    residual = z * fused + (1 - z) * h2;  x = hidden_norm(residual)  # q/k/v take H inputs

Pairing (as in EAGLE): the head at position i sees the target hidden of position i and the
token at position i+1, and predicts the token at i+2. Target token ids are recovered from draft
ids by ``target_id = draft_id + d2t[draft_id]``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tidespec.errors import ConfigError
from tidespec.models.families.attention import Attention
from tidespec.models.families.decoder import DecoderLayer, PlacedModule
from tidespec.models.families.mlp import MLP
from tidespec.models.families.norms import RMSNorm
from tidespec.models.families.rope import rope_cos_sin, rope_inv_freq
from tidespec.models.layout import BatchLayout, ForwardLayout, KVStorage
from tidespec.models.quant.quantize import quantize_linears
from tidespec.models.target import ModelConfigError, TargetConfig


class Eagle3ConfigError(ConfigError):
    """An EAGLE-3 head configuration is invalid; the message is one line."""


def default_tap_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's tap layers ``(2, L//2, L-3)`` (inputs of those target layers, as vLLM taps them).

    Tiny targets where those collide fall back to ``(0, L//2, L-1)``: the target model returns
    taps deduplicated and in layer order, so the three layers must be distinct.
    Examples: ``default_tap_layers(32) == (2, 16, 29)``; ``default_tap_layers(4) == (0, 2, 3)``.
    """
    if num_layers < 3:
        raise Eagle3ConfigError(f"EAGLE-3 needs a target with >= 3 layers, got {num_layers}")
    taps = (2, num_layers // 2, num_layers - 3)
    if taps[0] < taps[1] < taps[2]:
        return taps
    return (0, num_layers // 2, num_layers - 1)


@dataclass(frozen=True)
class Eagle3Config:
    """Shape of an EAGLE-3 head; ``for_target`` derives it from the target's config."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_vocab_size: int
    draft_vocab_size: int
    tap_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    num_layers: int = 1  # decoder blocks (Dovetail Sec. 3.3: deeper drafters)
    fusion: str = "concat"  # "concat" (EAGLE-3) or "gated" (Dovetail's Dynamic Gated Fusion)

    def __post_init__(self) -> None:
        try:  # the layer's config checks width, heads, head_dim, MLP size, draft vocab and divisibility
            self.layer_config()
        except ModelConfigError as exc:
            raise Eagle3ConfigError(str(exc)) from None
        if self.num_layers < 1:
            raise Eagle3ConfigError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.fusion not in FUSIONS:
            raise Eagle3ConfigError(f"fusion must be one of {', '.join(FUSIONS)}, got {self.fusion!r}")
        if self.draft_vocab_size > self.target_vocab_size:
            raise Eagle3ConfigError(
                f"draft_vocab_size ({self.draft_vocab_size}) exceeds target_vocab_size ({self.target_vocab_size})")
        taps = tuple(int(t) for t in self.tap_layers)
        if len(taps) != 3 or taps[0] < 0 or not taps[0] < taps[1] < taps[2]:
            raise Eagle3ConfigError(f"tap_layers must be 3 strictly increasing layer indices, got {self.tap_layers}")
        object.__setattr__(self, "tap_layers", taps)
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise Eagle3ConfigError("rms_norm_eps and rope_theta must be positive")

    @classmethod
    def for_target(cls, target_cfg: TargetConfig, draft_vocab_size: int | None = None, num_layers: int = 1,
                   fusion: str = "concat") -> Eagle3Config:
        """Head matching the target's width, heads and rope; ``draft_vocab_size=None`` = full vocab."""
        return cls(
            num_layers=num_layers, fusion=fusion,
            hidden_size=target_cfg.hidden_size,
            num_heads=target_cfg.num_heads,
            num_kv_heads=target_cfg.num_kv_heads,
            head_dim=target_cfg.head_dim,
            intermediate_size=target_cfg.intermediate_size,
            target_vocab_size=target_cfg.vocab_size,
            draft_vocab_size=draft_vocab_size if draft_vocab_size is not None else target_cfg.vocab_size,
            tap_layers=default_tap_layers(target_cfg.num_layers),
            rms_norm_eps=target_cfg.rms_norm_eps,
            rope_theta=target_cfg.rope_theta,
            rope_scaling=target_cfg.rope_scaling,
            max_position_embeddings=target_cfg.max_position_embeddings,
        )

    @property
    def tap_size(self) -> int:
        return len(self.tap_layers) * self.hidden_size

    def layer_config(self) -> TargetConfig:
        """The Llama config each of the head's layers (attention, MLP, rope) is built from."""
        return TargetConfig(
            vocab_size=self.draft_vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
        )


FUSIONS = ("concat", "gated")


class GatedFusion(nn.Module):
    """Dovetail's Dynamic Gated Fusion of the fused hidden and the token embedding (Sec. 3.2).

    Example: a zero ``gate`` gives z = 0.5 everywhere: the mean of ``fused`` and ``h2``.
    """

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.embed_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.embed_proj = nn.Linear(h, h, bias=False)
        self.gate = nn.Linear(2 * h, h, bias=False)

    def forward(self, fused: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[..., H], [..., H] -> [..., H]."""
        h2 = torch.nn.functional.silu(self.embed_proj(self.embed_norm(embeds)))
        z = torch.sigmoid(self.gate(torch.cat([fused, h2], dim=-1)))
        return z * fused + (1 - z) * h2


class Eagle3Layer(nn.Module):
    """The head's first decoder layer. With concat fusion its q/k/v projection reads ``2H``
    (embedding | fused hidden); with gated fusion ``H`` (the gated mix, also the residual)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        lcfg = cfg.layer_config()
        self.gated = GatedFusion(cfg) if cfg.fusion == "gated" else None
        if self.gated is None:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the fused hidden
        self.self_attn = Attention(lcfg)
        attn = self.self_attn
        width = cfg.hidden_size if self.gated is not None else 2 * cfg.hidden_size
        attn.qkv_proj = nn.Linear(width, attn.q_size + 2 * attn.kv_size, bias=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(lcfg)

    def attn_input(self, fused: torch.Tensor, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., H], [..., H] -> (attention input [..., 2H] or [..., H], residual [..., H]).

        Concat: normalized embedding first, then normalized hidden (vLLM order); the residual is
        the un-normed fused hidden. Gated: the normalized gated mix; the residual is the mix.
        """
        if self.gated is not None:
            mix = self.gated(fused, embeds)
            return self.hidden_norm(mix), mix
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(fused)], dim=-1), fused

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + attention, then the MLP block -> [..., H]."""
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(PlacedModule):
    """EAGLE-3 draft head: ``fc`` (3H -> H), ``num_layers`` decoder layers (``midlayer``, then
    plain ``blocks``), final norm, draft-vocab LM head.

    The token embedding is the target's (frozen, not owned): callers pass embeddings in.
    ``d2t`` [draft_vocab] int64 and ``t2d`` [target_vocab] bool are persistent buffers.
    """

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.tap_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.blocks = nn.ModuleList(DecoderLayer(cfg.layer_config()) for _ in range(cfg.num_layers - 1))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)  # identity prefix map by default
        t2d = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        lcfg = cfg.layer_config()
        self.register_buffer("inv_freq", rope_inv_freq(lcfg.head_dim, lcfg.rope_theta, lcfg.rope_scaling),
                             persistent=False)
        # (key of the weights it was fitted to, [H, H] map): ``output_rows``' calibration, refitted
        # whenever the LM head or the fallback rows change (a new version, a merged adapter)
        self._row_map: tuple[tuple[int, ...], torch.Tensor] | None = None

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a draft vocabulary (see ``tidespec.online.training.eagle3_train.select_draft_vocab``)."""
        if tuple(d2t.shape) != tuple(self.d2t.shape) or tuple(t2d.shape) != tuple(self.t2d.shape):
            raise Eagle3ConfigError(f"vocab map shapes {tuple(d2t.shape)}/{tuple(t2d.shape)} do not match the head")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target ids (same shape)."""
        return draft_ids + self.d2t[draft_ids]

    def target_to_draft(self) -> torch.Tensor:
        """[target_vocab] int64: draft id of each target id, -1 where it is not in the draft vocab."""
        inv = torch.full((self.cfg.target_vocab_size,), -1, dtype=torch.int64, device=self.d2t.device)
        ids = torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device)
        inv[self.draft_to_target(ids)] = ids
        return inv

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, hd] like the target's (float32 angles, then cast)."""
        return rope_cos_sin(positions, self.inv_freq, dtype)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """[T, 3H] target taps -> [T, H] fused hidden."""
        return self.fc(taps)

    def logits(self, prenorm: torch.Tensor, rows: torch.Tensor | nn.Module | None = None) -> torch.Tensor:
        """[T, H] pre-norm output -> [T, draft_vocab] logits, or [T, n] over the output ``rows``
        [n, H] of another vocabulary (a dynamic draft vocabulary's V_t), or through a layer built
        from such rows (V_t's int8 output layer, for a head that drafts in int8)."""
        if rows is None:
            return self.lm_head(self.norm(prenorm))
        if isinstance(rows, nn.Module):
            return rows(self.norm(prenorm))
        return torch.nn.functional.linear(self.norm(prenorm), rows)

    def output_rows(self, ids: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
        """Output rows [n, H] for target ids [n]: this head's LM-head row where the id is in its
        draft vocabulary, else the row of ``fallback`` [V, H] (the target's LM head) carried into
        the head's output space by ``row_map``, a linear map fitted on the tokens that have both
        rows. Raw target rows would not do: training moves the head's rows and final norm away
        from the target's (and the target's rows of rare tokens are longer), so raw rows out-score
        the trained ones and take the argmax (docs/benchmarks/learning.md)."""
        ids = ids.to(self.d2t.device)
        draft = self.target_to_draft()[ids]  # [n] draft index or -1
        inside = draft >= 0
        w = self.lm_head.weight
        rows = torch.empty(ids.shape[0], self.cfg.hidden_size, dtype=w.dtype, device=w.device)  # [n, H]
        rows[inside] = w[draft[inside]].detach()
        if not bool(inside.all()):
            m = self.row_map(fallback)  # [H, H]
            outside = fallback[ids[~inside].to(fallback.device)].to(device=m.device, dtype=m.dtype)  # [n_out, H]
            rows[~inside] = (outside @ m).to(rows.dtype)
        return rows

    @torch.no_grad()
    def row_map(self, fallback: torch.Tensor) -> torch.Tensor:
        """[H, H] map from ``fallback`` rows [V, H] to this head's LM-head rows (``fit_row_map``
        over the head's own draft vocabulary), cached until either weight changes."""
        w = self.lm_head.weight
        key = (id(w), w._version, w.data_ptr(), id(fallback), fallback._version, fallback.data_ptr())
        cached = self._row_map
        if cached is not None and cached[0] == key:
            return cached[1]
        own = self.draft_to_target(torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device))  # [Vd]
        m = fit_row_map(fallback[own.to(fallback.device)].to(w.device), w.detach())
        self._row_map = (key, m)
        return m

    def forward(self, fused: torch.Tensor, embeds: torch.Tensor, layout: BatchLayout,
                kv: KVStorage, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Inference step over a ragged batch with the head's KV cache (``num_layers`` layers of
        ``[S, n_kv, L, hd]``).

        fused, embeds: [T, H] -> (pre-norm output [T, H], logits [T, draft_vocab] or [T, n] over
        the output ``rows`` [n, H] when given).
        """
        out = self.step(fused, embeds, layout, kv)
        return out, self.logits(out, rows)

    def step(self, fused: torch.Tensor, embeds: torch.Tensor, layout: BatchLayout, kv: KVStorage) -> torch.Tensor:
        """``forward`` without the output layer: fused, embeds [T, H] -> pre-norm output [T, H]."""
        layout.attention_plan(self.midlayer.self_attn.cfg.sliding_window, kv)
        return self.run(fused, embeds, layout, kv.k, kv.v)

    def run(self, fused: torch.Tensor, embeds: torch.Tensor, layout: ForwardLayout, k: list[torch.Tensor],
            v: list[torch.Tensor]) -> torch.Tensor:
        """``step``'s body over any ``ForwardLayout`` (eager or a CUDA graph's static block,
        ``models/eagle3/graphs.py``) and the per-layer K/V ``k[i]``, ``v[i]`` [S, n_kv, L, hd]:
        fused, embeds [T, H] -> pre-norm output [T, H]."""
        layer = self.midlayer
        rope = self.rope(layout.positions, fused.dtype)
        x, residual = layer.attn_input(fused, embeds)
        out = layer.finish(residual, layer.self_attn(x, rope, layout, k[0], v[0]))
        for i, block in enumerate(self.blocks, start=1):
            out = block.forward(out, rope, layout, k[i], v[i])
        return out


HEAD_INT4_GROUP_SIZE = 32  # the int4 kernel's finest group (GGUF Q4_1's block): divides any width that is a multiple of 32


def quantized_head(head: Eagle3Head, mode: str, in_place: bool = False) -> Eagle3Head:
    """A copy of ``head`` whose linear layers hold int8, int4 or w8a8 (Q8_0 blocks, int8 activations) weights
    (``models.quant``), for drafting on a CPU; ``head`` itself is left as it is (training, LoRA merges, rollbacks and the
    dynamic vocabulary's output rows read its float weights). ``mode`` "none" returns ``head``.

    Why: at one row per step the head is bound by reading its weights, and its float32 weights
    (about 35 MB for SmolLM2-135M's head with an 8,192-token vocabulary) are read again for every
    draft token: int8 reads a quarter of that. The LM head stays int8 under int4 (it writes the
    logits; as the target's, ``quantize_model``). Lossless either way: the target verifies every
    draft, and sampled drafts carry the probabilities this copy computed. ``in_place``: quantize
    ``head`` itself (a head built only to be drafted with).

    Example: ``quantized_head(head, "int8").lm_head`` is an ``Int8Linear`` with ``head``'s d2t/t2d.
    """
    if mode == "none":
        return head
    served = head if in_place else copy.deepcopy(head)
    quantize_linears(served, mode, HEAD_INT4_GROUP_SIZE, int8_names=("lm_head",))
    return served.eval()


def fit_row_map(source: torch.Tensor, target: torch.Tensor, ridge: float = 1e-2) -> torch.Tensor:
    """Ridge least squares ``argmin_M |source M - target|^2 + lam |M|^2`` -> M [H, H], with
    ``lam = ridge * mean(diag(source^T source))``; solved in float32 or wider.

    source, target: [n, H] paired rows (the target's LM-head rows and the head's trained rows of
    the same tokens). Example: target = 0.5 * source (a head whose rows shrank by half) -> M is
    about 0.5 * I (a little less: the ridge), so an untrained token's target row r drafts as 0.5 * r.
    """
    dtype = torch.promote_types(source.dtype, torch.float32)
    x, y = source.to(dtype), target.to(dtype)
    gram = x.T @ x  # [H, H]
    lam = ridge * float(gram.diagonal().mean())
    return torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=dtype, device=gram.device), x.T @ y)


INIT_FROM_TARGET = ("none", "lm_head", "layer")


@torch.no_grad()
def init_from_target(head: Eagle3Head, target: nn.Module, what: str = "layer") -> Eagle3Head:
    """Start a head from the target's own weights instead of random ones (in place; returns it).

    ``"lm_head"``: the draft LM head's row ``d`` is the target's LM-head row of target token
    ``d + d2t[d]``, the final norm is the target's. ``"layer"``: also the head's decoder layers
    from the target's last ``num_layers`` layers (the first one's q/k/v read the fused-hidden half
    of the ``2H`` concat input, the embedding half starting at zero) and ``fc`` passing the highest
    tap through (the fused hidden starts as the target's hidden state entering layer
    ``tap_layers[-1]``). ``"none"`` changes nothing.
    ``target`` is a ``DecoderModel`` with the head's width and vocabulary.

    Example: draft vocab {5, 9} (d2t [5, 8]) -> lm_head rows = target lm_head rows 5 and 9.
    """
    if what not in INIT_FROM_TARGET:
        raise Eagle3ConfigError(f"init-from-target must be one of {', '.join(INIT_FROM_TARGET)}, got {what!r}")
    if what == "none":
        return head
    cfg = head.cfg
    rows = head.draft_to_target(torch.arange(cfg.draft_vocab_size, device=head.d2t.device))  # [Vd]
    w = target.lm_head.weight  # [V, H]
    head.lm_head.weight.copy_(w[rows.to(w.device)].to(head.lm_head.weight))
    head.norm.weight.copy_(target.norm.weight.to(head.norm.weight))
    if what == "lm_head":
        return head
    if target.cfg.norm_placement != "pre" or (cfg.num_layers > 1 and not target.cfg.llama_layers):
        # the first layer's projections and pre-norms are copied into the head's; further layers whole
        raise Eagle3ConfigError(f"init-from-target 'layer' copies Llama-style decoder layers; {target.cfg.architecture}'s "
                                "differ (use 'lm_head')")
    blocks = list(target.layers)[-cfg.num_layers:]  # the target's last num_layers layers, in order
    src = blocks[0]
    layer = head.midlayer
    h = cfg.hidden_size
    qkv = layer.self_attn.qkv_proj.weight  # [q + 2kv, 2H] (embedding half, hidden half) or [q + 2kv, H]
    qkv.zero_()
    qkv[:, qkv.shape[1] - h:].copy_(src.self_attn.qkv_proj.weight.to(qkv))
    layer.hidden_norm.weight.copy_(src.input_layernorm.weight.to(qkv))
    if layer.gated is None:
        layer.input_layernorm.weight.fill_(1.0)
    layer.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight.to(qkv))
    layer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight.to(qkv))
    layer.mlp.load_state_dict({k: v.to(qkv) for k, v in src.mlp.state_dict().items()})
    for mine, theirs in zip(head.blocks, blocks[1:]):
        mine.load_state_dict({k: v.to(qkv) for k, v in theirs.state_dict().items()})
    head.fc.weight.zero_()
    head.fc.weight[:, 2 * h:3 * h].copy_(torch.eye(h, dtype=qkv.dtype, device=qkv.device))
    return head
