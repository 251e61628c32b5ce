"""What the engine, the drafters, capture and the profiler need of a target model, whatever its family.

Why this exists: the layers above ``models/`` (engine, speculative, online, bench) depended on
``DecoderModel`` itself; they now depend on ``TargetModel`` (a protocol: a forward over a
``BatchLayout`` with taps, the embedding, the LM head, the layers the EAGLE-3 head reads, its
``TargetConfig``), and a model family (``models/families/``) is one module that satisfies it.
``TargetConfig`` is the one hyper-parameter record of every family (the optional fields of a
family's differences default to off), parsed from an HF ``config.json``.

Worked example::

    cfg = TargetConfig.from_hf(json.loads(Path("Qwen3-0.6B/config.json").read_text()))
    cfg.qk_norm, cfg.attention_bias        # ("head", False): Qwen3's row of ARCHITECTURES
    model = build_target(cfg)              # models/families: the family's module builds it
    out = model(ids, BatchLayout.build([3], [0], [0]), kv)   # ModelOutput: logits [3, V], taps, last hidden
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import transformers
from torch import nn

from tidespec.errors import ConfigError, UserError
from tidespec.models.architectures import ARCHITECTURES, NORM_PLACEMENTS, QK_NORMS
from tidespec.models.layout import BatchLayout, KVStorage, ModelOutput


class ModelConfigError(UserError, ValueError):
    """A checkpoint's config cannot be served by this model (unknown architecture, bad field)."""


@dataclass(frozen=True)
class TargetConfig:
    """A target's hyper-parameters, parsed from an HF ``config.json`` dict by ``from_hf``; the
    family differences it carries (``attention_bias``, ``qk_norm``, ...) come from ``ARCHITECTURES``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    o_proj_bias: bool = False  # bias on the attention's output projection (Llama with attention_bias)
    mlp_bias: bool = False  # biases on the MLP's projections (Llama, Granite, SmolLM3 with mlp_bias)
    qk_norm: str = "none"  # architectures.QK_NORMS: Qwen3/Gemma 3 per head, OLMo 2 over the projection
    sliding_window: int | None = None
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # the family differences (models/architectures.py, config.json); the defaults are Llama's
    norm_placement: str = "pre"  # architectures.NORM_PLACEMENTS
    norm_offset: bool = False  # Gemma: RMSNorm scales by (1 + weight)
    norm_cast_after: bool = False  # OLMo 2: RMSNorm's product with its weight in float32, then the cast
    hidden_act: str = "silu"  # the gated MLP's activation: one of ACTIVATIONS
    attention_scale: float | None = None  # softmax scale; None = head_dim ** -0.5 (Gemma, Granite set it)
    embedding_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden) in float32; Granite)
    residual_scale: float = 1.0  # each block's output times this before the residual add (Granite)
    logits_divisor: float = 1.0  # logits divided by this (Granite's logits_scaling)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    attn_logit_softcap: float | None = None  # attention scores -> cap * tanh(score / cap) (Gemma 2)
    # per layer: True = sliding window, False = global; None = every layer as ``sliding_window`` says
    sliding_layers: tuple[bool, ...] | None = None
    local_rope_theta: float | None = None  # sliding layers' own rope (Gemma 3); None = the global rope
    local_rope_scaling: dict[str, Any] | None = None
    rope_layers: tuple[bool, ...] | None = None  # per layer: False = no rope (SmolLM3's NoPE); None = all
    partial_rotary_factor: float = 1.0  # rope over the first head_dim * factor dims of each head (Phi-4)
    # a mixture of experts in place of the MLP (families/moe.py); 0 experts: dense everywhere
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top k routing weights to sum to 1
    moe_layers: tuple[bool, ...] | None = None  # per layer: True = the mixture; None = every layer (if experts)
    # gpt-oss's router: a bias, the top k of its logits, then a softmax over those k (its checkpoints hold the
    # experts transposed, gate and up interleaved: ``families/decoder.py`` reads them so)
    router_topk_first: bool = False
    # gpt-oss's clamped SwiGLU: gate <= limit, |up| <= limit, gate * sigmoid(alpha * gate) * (up + 1)
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each attention softmax

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) not divisible by num_key_value_heads ({self.num_kv_heads})")
        for scaling in (self.rope_scaling, self.local_rope_scaling):
            kind = rope_kind(scaling)
            if kind not in ROPE_KINDS:
                raise ModelConfigError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_KINDS)})")
        if self.qk_norm not in QK_NORMS:
            raise ModelConfigError(f"qk_norm must be one of {', '.join(QK_NORMS)}, got {self.qk_norm!r}")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ModelConfigError(f"norm_placement must be one of {', '.join(NORM_PLACEMENTS)}, got {self.norm_placement!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelConfigError(f"unsupported hidden activation {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok must be in 1..{self.num_experts}, got {self.num_experts_per_tok}")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ModelConfigError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        for name in ("sliding_layers", "rope_layers", "moe_layers"):
            per_layer = getattr(self, name)
            if per_layer is not None and len(per_layer) != self.num_layers:
                raise ModelConfigError(f"{name} has {len(per_layer)} entries for {self.num_layers} layers")
        rotary = self.head_dim * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or int(rotary) % 2:
            raise ModelConfigError(f"partial_rotary_factor {self.partial_rotary_factor} leaves an odd or empty "
                                   f"rotary width of a {self.head_dim}-dim head")
        if rope_kind(self.rope_scaling) == "longrope":
            assert self.rope_scaling is not None
            for name in ("short_factor", "long_factor"):
                factors = self.rope_scaling.get(name)
                if not isinstance(factors, list) or len(factors) != int(rotary) // 2:
                    raise ModelConfigError(f"longrope needs {name}: a list of {int(rotary) // 2} numbers")

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that rope rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention, or None (global)."""
        if self.sliding_layers is None or self.sliding_layers[layer]:
            return self.sliding_window
        return None

    def layer_rope(self, layer: int) -> str | None:
        """Which rope ``layer`` applies: "global", "local" (a sliding layer's own rope), None (NoPE)."""
        if self.rope_layers is not None and not self.rope_layers[layer]:
            return None
        if self.local_rope_theta is not None and self.layer_window(layer) is not None:
            return "local"
        return "global"

    def layer_moe(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the mixture of experts."""
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer])

    @property
    def llama_layers(self) -> bool:
        """Whether the decoder layers are Llama's (what an EAGLE-3 head's layers are, and can copy)."""
        return (self.norm_placement == "pre" and not self.norm_offset and self.qk_norm == "none"
                and self.hidden_act == "silu" and self.residual_scale == 1.0 and self.attention_scale is None
                and self.rope_layers is None and self.partial_rotary_factor == 1.0 and self.num_experts == 0
                and self.attn_logit_softcap is None and self.final_logit_softcap is None
                and not self.attention_sinks and self.swiglu_limit is None)

    @functools.cached_property
    def layer_windows(self) -> tuple[int | None, ...]:
        """The distinct windows of the layers' attention, in layer order (one attention plan or
        compiled mask each): ``(None,)`` for Llama, ``(5, None)`` for a Gemma with window 5."""
        return tuple(dict.fromkeys(self.layer_window(i) for i in range(self.num_layers)))

    @property
    def uniform_attention(self) -> bool:
        """Every layer attends over the same window (what the CUDA graphs assume: one mask serves
        every layer)."""
        return len(self.layer_windows) == 1

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> TargetConfig:
        """Parse an HF config dict; raises ``ModelConfigError`` with a one-line reason."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in ARCHITECTURES:
            raise ModelConfigError(f"unknown architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
        family = ARCHITECTURES[arch]
        cfg = _through_transformers(cfg)
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope = _RopeFields.parse(cfg)
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=rope.theta,
                rope_scaling=rope.scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", family.attention_bias)),
                o_proj_bias=bool(cfg.get("attention_bias", family.attention_bias)) and family.o_proj_bias,
                mlp_bias=bool(cfg.get("mlp_bias", family.mlp_bias)),
                qk_norm=family.qk_norm,
                sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
                architecture=arch,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                norm_placement=family.norm_placement,
                norm_offset=family.norm_offset,
                norm_cast_after=family.norm_cast_after,
                hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
                attention_scale=_attention_scale(cfg),
                embedding_scale=_embedding_scale(cfg, family.embed_scale_sqrt, hidden),
                residual_scale=float(cfg.get("residual_multiplier") or 1.0),
                logits_divisor=float(cfg.get("logits_scaling") or 1.0),
                final_logit_softcap=_optional_float(cfg.get("final_logit_softcapping")),
                attn_logit_softcap=_optional_float(cfg.get("attn_logit_softcapping")),
                sliding_layers=_sliding_layers(cfg, layers),
                local_rope_theta=rope.local_theta,
                local_rope_scaling=rope.local_scaling,
                rope_layers=tuple(bool(x) for x in cfg["no_rope_layers"]) if cfg.get("no_rope_layers") else None,
                partial_rotary_factor=rope.partial_rotary_factor,
                swiglu_limit=_optional_float(cfg.get("swiglu_limit")),
                swiglu_alpha=float(cfg.get("swiglu_alpha") or 1.0),
                attention_sinks=family.attention_sinks,
                **_moe_fields(cfg, layers, family.router_topk_first),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ModelConfigError):
                raise
            raise ModelConfigError(f"config.json is missing or has a bad field: {exc}") from None


ROPE_KINDS = ("default", "llama3", "linear", "longrope", "yarn")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


def rope_kind(scaling: dict[str, Any] | None) -> str:
    """The rope type of a ``rope_scaling`` dict (None: "default")."""
    if scaling is None:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


@dataclass(frozen=True)
class _RopeFields:
    """Rope as config.json spells it, in either transformers' 4.x layout (``rope_theta``,
    ``rope_scaling``, ``rope_local_base_freq``, ``partial_rotary_factor`` at the top) or its 5.x
    one (``rope_parameters``, per layer type for Gemma 3)."""

    theta: float
    scaling: dict[str, Any] | None
    local_theta: float | None
    local_scaling: dict[str, Any] | None
    partial_rotary_factor: float

    @staticmethod
    def parse(cfg: dict[str, Any]) -> _RopeFields:
        params = cfg.get("rope_parameters")
        glob, local = params, None
        if isinstance(params, dict) and "full_attention" in params:  # per layer type
            glob, local = params.get("full_attention"), params.get("sliding_attention")
        glob = glob if isinstance(glob, dict) else {}
        theta = glob.get("rope_theta", cfg.get("rope_theta"))
        scaling = glob if rope_kind(glob) != "default" else cfg.get("rope_scaling")
        local_theta = (local or {}).get("rope_theta", cfg.get("rope_local_base_freq"))
        local_scaling = local if local is not None and rope_kind(local) != "default" else None
        partial = glob.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        return _RopeFields(float(theta if theta is not None else 10000.0), scaling,
                           None if local_theta is None else float(local_theta), local_scaling,
                           float(partial if partial is not None else 1.0))


def _through_transformers(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` as transformers' config class of its ``model_type`` completes it: the defaults a
    checkpoint leaves out and what older config.json files spell differently (Gemma 3's
    ``sliding_window_pattern`` becomes ``layer_types``, Qwen2's ``max_window_layers`` and
    ``use_sliding_window`` decide which layers slide). A dict transformers cannot read is taken as it is."""
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str):
        return cfg
    try:
        done = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"})
    except (ValueError, KeyError, TypeError, AttributeError):
        return cfg
    return {**cfg, **done.to_dict()}


def _optional_float(x: Any) -> float | None:
    return None if x is None else float(x)


def _attention_scale(cfg: dict[str, Any]) -> float | None:
    if cfg.get("query_pre_attn_scalar") is not None:  # Gemma
        return float(cfg["query_pre_attn_scalar"]) ** -0.5
    return _optional_float(cfg.get("attention_multiplier"))  # Granite


def _embedding_scale(cfg: dict[str, Any], sqrt_hidden: bool, hidden: int) -> float:
    if sqrt_hidden:  # HF keeps it in a float32 buffer, so float64 models see the float32 value too
        return float(torch.tensor(hidden ** 0.5, dtype=torch.float32))
    return float(cfg.get("embedding_multiplier") or 1.0)


def _moe_fields(cfg: dict[str, Any], layers: int, topk_first: bool = False) -> dict[str, Any]:
    """A mixture's fields: Qwen3-MoE's (``num_experts``, ``moe_intermediate_size``, sparse every
    ``decoder_sparse_step`` layers but ``mlp_only_layers``) or Mixtral's (``num_local_experts``, the
    experts as wide as ``intermediate_size``, top k always renormalized); ``topk_first``: gpt-oss's
    router (a bias, the softmax over the top k logits only)."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return {}
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    return {"num_experts": experts, "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", "num_local_experts" in cfg)),
            "moe_layers": tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
            "router_topk_first": topk_first}


def _sliding_layers(cfg: dict[str, Any], layers: int) -> tuple[bool, ...] | None:
    """Per layer whether it slides, from ``layer_types`` (None: every layer as ``sliding_window`` says)."""
    types = cfg.get("layer_types")
    if not types:
        return None
    if len(types) != layers:
        raise ModelConfigError(f"layer_types has {len(types)} entries for {layers} layers")
    return tuple(t == "sliding_attention" for t in types)


class TargetModel(Protocol):
    """A target model as the layers above ``models/`` use it (``families/decoder.py``'s ``DecoderModel`` is
    one): ``model(ids [T], layout, kv, logits_rows, tap_layers) -> ModelOutput``, its weights on one
    ``device`` and ``dtype``, the token embedding and LM head (drafters share them), its decoder
    ``layers`` (EAGLE-3 taps their inputs; a draft model keeps the first few), and ``row_invariant``
    (set once its projections and attention run on the row-invariant kernels)."""

    cfg: TargetConfig
    embed_tokens: nn.Embedding
    lm_head: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    row_invariant: bool

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def __call__(self, input_ids: torch.Tensor, layout: BatchLayout, kv: KVStorage,
                 logits_rows: torch.Tensor | None = None, tap_layers: tuple[int, ...] = ()) -> ModelOutput: ...

    def truncated(self, num_layers: int) -> TargetModel: ...

    def rope(self, positions: torch.Tensor, dtype: torch.dtype,
             variant: str = "global") -> tuple[torch.Tensor, torch.Tensor]: ...

    def warm_rope(self, device: torch.device, dtype: torch.dtype) -> None: ...

    def load_hf_state_dict(self, sd: Mapping[str, torch.Tensor], strict: bool = True,
                           each_layer: Callable[[int, nn.Module], None] | None = None) -> None: ...

    def tie_weights(self) -> None: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def to(self, *args: Any, **kwargs: Any) -> TargetModel: ...

    def eval(self) -> TargetModel: ...


def output_matrix(target: TargetModel) -> torch.Tensor:
    """[V, H] the target's LM-head rows as floats (a quantized head of a tied model: the embedding)."""
    w = getattr(target.lm_head, "weight", None)
    if isinstance(w, torch.Tensor) and w.is_floating_point():
        return w.detach()
    if target.cfg.tie_word_embeddings:
        return target.embed_tokens.weight.detach()
    raise ConfigError("a draft vocabulary needs the target's LM head in floating point (run without --quantization)")
