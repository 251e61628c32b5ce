"""What the engine, the drafters, capture and the profiler need of a target model, whatever its family.

Why this exists: the layers above ``models/`` (engine, speculative, online, bench) depended on
``LlamaModel`` itself; they now depend on ``TargetModel`` (a protocol: a forward over a
``BatchLayout`` with taps, the embedding, the LM head, the layers the EAGLE-3 head reads, its
``TargetConfig``), and a model family (``models/families/``) is one module that satisfies it.
``TargetConfig`` is the one hyper-parameter record of every family (the optional fields of a
family's differences default to off), parsed from an HF ``config.json``.

Worked example::

    cfg = TargetConfig.from_hf(json.loads(Path("Qwen3-0.6B/config.json").read_text()))
    cfg.qk_norm, cfg.attention_bias        # (True, False): Qwen3's row of ARCHITECTURES
    model = build_target(cfg)              # models/families: the family's module builds it
    out = model(ids, BatchLayout.build([3], [0], [0]), kv)   # ModelOutput: logits [3, V], taps, last hidden
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tidespec.errors import ConfigError, UserError
from tidespec.models.architectures import ARCHITECTURES
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
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    sliding_window: int | None = None
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) not divisible by num_key_value_heads ({self.num_kv_heads})")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ("default", "llama3", "linear"):
                raise ModelConfigError(f"unsupported rope_scaling type {kind!r} (supported: default, llama3, linear)")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> TargetConfig:
        """Parse an HF config dict; raises ``ModelConfigError`` with a one-line reason."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in ARCHITECTURES:
            raise ModelConfigError(f"unknown architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
        family = ARCHITECTURES[arch]
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope_scaling = cfg.get("rope_scaling")
            rope_theta = cfg.get("rope_theta")
            rope_params = cfg.get("rope_parameters")  # transformers >= 5 folds theta/scaling in here
            if isinstance(rope_params, dict):
                rope_theta = rope_params.get("rope_theta", rope_theta)
                if rope_params.get("rope_type", "default") != "default":
                    rope_scaling = rope_params
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", family.attention_bias)),
                qk_norm=family.qk_norm,
                sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
                architecture=arch,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ModelConfigError):
                raise
            raise ModelConfigError(f"config.json is missing or has a bad field: {exc}") from None


class TargetModel(Protocol):
    """A target model as the layers above ``models/`` use it (``families/llama.py``'s ``LlamaModel`` is
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

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor], strict: bool = True) -> None: ...

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
