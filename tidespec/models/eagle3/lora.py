"""LoRA adapters of the EAGLE-3 head: attached with peft for training, published as small files,
validated and merged into the fused projection for serving.

Why this exists: EvoSpec (Sec. 3.4, Algorithm 1 path B) aligns the draft head with the target
between full training rounds by training rank-r adapters on the query and value projections of
its attention, the backbone frozen. The head fuses q, k and v into one ``qkv_proj``; peft adapts
whole ``nn.Linear`` modules, so a *training copy* of the head gets each fused projection split
into ``q_proj`` / ``k_proj`` / ``v_proj`` (``SplitQKV``, the same function) and peft injects the
adapters into the targets: q and v by default (EvoSpec), optionally also k, ``o_proj`` and the
MLP's ``gate_up_proj`` / ``down_proj`` of every draft layer (``ALL_TARGETS``; a head that never
saw a domain recovers about twice as much with them, docs/benchmarks/learning.md). Serving never runs an
adapter: it merges ``W += B A * alpha / r`` into the rows of the serving weight each adapter stands
for (``adapted_linears``), so a draft step costs exactly what it did.

Files of one published adapter, next to the drafter versions of a publish root (renamed into
place whole, like a version)::

    root/lora/v3/a2/
      adapter_model.safetensors   peft's adapter state: <attn>.qkv_proj.q_proj.lora_A.weight [r, in],
                                  <attn>.qkv_proj.q_proj.lora_B.weight [q_size, r], likewise v_proj
                                  (and likewise for every other target)
      adapter_config.json         peft's LoraConfig (r, lora_alpha, target_modules)
      meta.json                   {"adapter": 2, "base_version": 3, "metrics": {...}}

An adapter is relative to its base version: the engine applies ``a2`` to version 3's weights,
never on top of another adapter, and ignores adapters of other versions.

Worked example (a 1-layer head, rank 2)::

    train = with_lora(copy.deepcopy(head), rank=2, alpha=2.0)  # only lora_A / lora_B require grad
    ... optimise train ...
    n = save_adapter(root, train, base_version=3, metrics={"adapted_accept_len": 2.7})   # -> 1
    ad = load_adapter(adapter_dir(root, 3, n), head.cfg)        # names, shapes, finiteness checked
    head.load_state_dict(merged_state(head.state_dict(), ad, head.cfg))
    # head now computes what train computed, with no adapter modules
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from tidespec.errors import UserError
from tidespec.files import TMP_PREFIX, fsync_path
from tidespec.models.eagle3.head import Eagle3Config, Eagle3Head

LORA_DIR = "lora"
QKV_TARGETS = ("q_proj", "k_proj", "v_proj")  # row blocks of each fused qkv_proj
LAYER_TARGETS = ("o_proj", "gate_up_proj", "down_proj")  # whole linears of each draft layer
ALL_TARGETS = QKV_TARGETS + LAYER_TARGETS
TARGETS = ("q_proj", "v_proj")  # the default, EvoSpec Table 5: the draft layer's query and value projections
WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
META_NAME = "meta.json"
_ADAPTER_DIR = re.compile(r"^a(\d+)$")


class AdapterError(UserError, ValueError):
    """A published LoRA adapter is missing, corrupt or does not fit the head (one line)."""


class SplitQKV(nn.Module):
    """A fused ``qkv_proj`` as three ``nn.Linear`` modules (peft adapts whole modules); same function.

    x [.., in] -> cat(q_proj(x), k_proj(x), v_proj(x)) [.., q_size + 2 kv_size]."""

    def __init__(self, fused: nn.Module, q_size: int, kv_size: int) -> None:
        super().__init__()
        w = fused.weight.detach()  # [q_size + 2 kv_size, in]
        if w.shape[0] != q_size + 2 * kv_size:
            raise AdapterError(f"qkv_proj has {w.shape[0]} rows, expected {q_size} + 2 x {kv_size}")
        if getattr(fused, "bias", None) is not None:
            raise AdapterError("LoRA alignment supports bias-free attention projections only")
        self.q_proj, self.k_proj, self.v_proj = (self._linear(part) for part in w.split([q_size, kv_size, kv_size]))

    @staticmethod
    def _linear(weight: torch.Tensor) -> nn.Linear:
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            lin.weight.copy_(weight)
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)


def layer_prefixes(cfg: Eagle3Config) -> list[str]:
    """State-dict prefixes of the head's draft layers (the draft layer, then deeper blocks)."""
    return ["midlayer"] + [f"blocks.{i}" for i in range(cfg.num_layers - 1)]


@dataclass(frozen=True)
class AdaptedLinear:
    """Where one adapter lands. ``module``: its path in a ``with_lora`` training copy (peft names its
    tensors ``{module}.lora_A.weight`` [r, fan_in] and ``{module}.lora_B.weight`` [hi - lo, r]);
    serving merges it into rows ``lo:hi`` of the state-dict weight ``weight``."""

    module: str
    weight: str
    lo: int
    hi: int
    fan_in: int


def check_targets(targets: Sequence[str]) -> tuple[str, ...]:
    """``targets`` in ``ALL_TARGETS`` order, or ``AdapterError``. Example: (v_proj, q_proj) -> (q_proj, v_proj)."""
    unknown = sorted(set(targets) - set(ALL_TARGETS))
    if unknown or not targets:
        raise AdapterError(f"LoRA targets must be a non-empty subset of {', '.join(ALL_TARGETS)}, got "
                           f"{', '.join(targets) or 'none'}")
    return tuple(t for t in ALL_TARGETS if t in targets)


def adapted_linears(cfg: Eagle3Config, targets: Sequence[str]) -> list[AdaptedLinear]:
    """Every linear of the draft layers of a head of ``cfg`` that ``targets`` adapts, read off a
    meta-device head (no memory). Example (1 layer, q_size 576, kv_size 192, targets q/v): rows
    0:576 and 768:960 of ``midlayer.self_attn.qkv_proj.weight``."""
    targets = check_targets(targets)
    with torch.device("meta"):
        head = Eagle3Head(cfg)
    out = []
    for prefix in layer_prefixes(cfg):
        attn = head.get_submodule(f"{prefix}.self_attn")
        qkv = f"{prefix}.self_attn.qkv_proj"
        q, kv, fan_in = attn.q_size, attn.kv_size, attn.qkv_proj.in_features
        for part, lo, hi in (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)):
            if part in targets:
                out.append(AdaptedLinear(f"{qkv}.{part}", f"{qkv}.weight", lo, hi, fan_in))
        for name in (f"{prefix}.self_attn.o_proj", f"{prefix}.mlp.gate_up_proj", f"{prefix}.mlp.down_proj"):
            if name.rsplit(".", 1)[1] in targets:
                lin = head.get_submodule(name)
                out.append(AdaptedLinear(name, f"{name}.weight", 0, lin.out_features, lin.in_features))
    return out


def with_lora(head: Eagle3Head, rank: int, alpha: float, targets: Sequence[str] = TARGETS) -> Eagle3Head:
    """Split every attention's ``qkv_proj`` of ``head`` (in place) and inject peft LoRA adapters
    (rank ``rank``, scaling ``alpha / rank``, B initialised to zero so the function is unchanged)
    into ``targets`` of every draft layer; everything else is frozen. Returns ``head``."""
    from peft import LoraConfig, inject_adapter_in_model  # training side only: peft pulls in transformers

    targets = check_targets(targets)
    for prefix in layer_prefixes(head.cfg):
        attn = head.get_submodule(f"{prefix}.self_attn")
        if not isinstance(attn.qkv_proj, SplitQKV):
            attn.qkv_proj = SplitQKV(attn.qkv_proj, attn.q_size, attn.kv_size)
    for p in head.parameters():
        p.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets), bias="none")
    return inject_adapter_in_model(config, head)


def lora_parameters(head: Eagle3Head) -> list[nn.Parameter]:
    """The adapter parameters of a ``with_lora`` head (what the optimizer updates)."""
    return [p for n, p in head.named_parameters() if "lora_" in n]


def adapter_state(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """peft's adapter state dict of a ``with_lora`` head (``...q_proj.lora_A.weight`` etc.)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(head).items()}


def lora_scaling(head: Eagle3Head) -> tuple[int, float, tuple[str, ...]]:
    """(rank, alpha, targets) of a ``with_lora`` head's adapters."""
    adapted = {name.rsplit(".", 1)[1]: m for name, m in head.named_modules() if hasattr(m, "lora_A")}
    first = next(iter(adapted.values()))
    return int(first.r["default"]), float(first.lora_alpha["default"]), check_targets(list(adapted))


def adapter_dir(root: Path | str, base_version: int, number: int) -> Path:
    return Path(root) / LORA_DIR / f"v{base_version}" / f"a{number}"


def list_adapters(root: Path | str, base_version: int) -> list[int]:
    """Complete adapters published for ``base_version`` (``a{N}`` dirs; temp dirs ignored), ascending."""
    d = Path(root) / LORA_DIR / f"v{base_version}"
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _ADAPTER_DIR.match(p.name)) and p.is_dir())


def save_adapter(root: Path | str, head: Eagle3Head, base_version: int, metrics: dict[str, Any]) -> int:
    """Publish the adapters of a ``with_lora`` head for ``base_version``: write a temp dir, fsync,
    rename it to ``lora/v{base}/a{N}``; returns N (a lost rename race retries with N+1)."""
    rank, alpha, targets = lora_scaling(head)
    base = Path(root) / LORA_DIR / f"v{base_version}"
    base.mkdir(parents=True, exist_ok=True)
    tensors = adapter_state(head)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
              "lora_dropout": 0.0, "bias": "none"}
    while True:
        existing = list_adapters(root, base_version)
        n = (existing[-1] if existing else 0) + 1
        tmp = base / f"{TMP_PREFIX}a{n}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            save_file(tensors, str(tmp / WEIGHTS_NAME))
            (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=1), encoding="utf-8")
            meta = {"adapter": n, "base_version": base_version, "metrics": metrics}
            (tmp / META_NAME).write_text(json.dumps(meta, indent=1), encoding="utf-8")
            fsync_path(tmp)
            try:
                os.rename(tmp, base / f"a{n}")
            except OSError:
                if (base / f"a{n}").exists():
                    continue
                raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        fsync_path(base)
        return n


@dataclass
class LoraAdapter:
    """A validated adapter: ``tensors`` are peft's state dict; ``scaling`` = alpha / rank."""

    number: int
    base_version: int
    rank: int
    scaling: float
    tensors: dict[str, torch.Tensor]
    metrics: dict[str, Any]
    targets: tuple[str, ...] = TARGETS


def expected_adapter_shapes(cfg: Eagle3Config, rank: int, targets: Sequence[str] = TARGETS
                            ) -> dict[str, tuple[int, int]]:
    """Every tensor name of a rank-``rank`` adapter of ``targets`` of a head of ``cfg`` -> its shape."""
    out: dict[str, tuple[int, int]] = {}
    for lin in adapted_linears(cfg, targets):
        out[f"{lin.module}.lora_A.weight"] = (rank, lin.fan_in)
        out[f"{lin.module}.lora_B.weight"] = (lin.hi - lin.lo, rank)
    return out


def load_adapter(directory: Path | str, cfg: Eagle3Config) -> LoraAdapter:
    """Read and validate one adapter directory against the head config ``cfg``; raises ``AdapterError``."""
    d = Path(directory)
    try:
        meta = json.loads((d / META_NAME).read_text(encoding="utf-8"))
        config = json.loads((d / CONFIG_NAME).read_text(encoding="utf-8"))
        tensors = load_file(str(d / WEIGHTS_NAME))
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        number, base_version = int(meta["adapter"]), int(meta["base_version"])
        named = [str(t) for t in config.get("target_modules") or []]
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise AdapterError(f"adapter {d} is unreadable: {exc}") from exc
    if rank < 1 or not alpha > 0:
        raise AdapterError(f"adapter {d}: rank {rank} / alpha {alpha} invalid")
    try:
        targets = check_targets(named)
    except AdapterError as exc:
        raise AdapterError(f"adapter {d}: {exc}") from None
    want = expected_adapter_shapes(cfg, rank, targets)
    if set(tensors) != set(want):
        missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
        raise AdapterError(f"adapter {d} does not fit the head: missing {missing[:2]}, unexpected {extra[:2]}")
    for name, t in tensors.items():
        if tuple(t.shape) != want[name]:
            raise AdapterError(f"adapter {d}: {name} has shape {tuple(t.shape)}, expected {want[name]}")
        if not bool(torch.isfinite(t).all()):
            raise AdapterError(f"adapter {d}: {name} has non-finite values")
    return LoraAdapter(number, base_version, rank, alpha / rank, tensors, dict(meta.get("metrics", {})), targets)


def merged_state(state: dict[str, torch.Tensor], adapter: LoraAdapter, cfg: Eagle3Config) -> dict[str, torch.Tensor]:
    """A copy of the head state ``state`` with the adapter merged into the rows each of its linears
    stands for (``adapted_linears``: a block of a fused ``qkv_proj``, or a whole linear).

    The formula is peft's ``get_delta_weight`` for a Linear (B @ A * alpha / r), written out so
    serving merges without building the training-time module tree (or importing peft).

    Example (q_size 2, kv_size 1, rank 1, scaling 1): A_q [[1, 0]], B_q [[1], [2]] -> rows 0..1
    of W_qkv gain [[1, 0], [2, 0]]; the k row is unchanged; A_v, B_v move row 3 likewise.
    """
    out = dict(state)
    for lin in adapted_linears(cfg, adapter.targets):
        if out[lin.weight] is state[lin.weight]:
            out[lin.weight] = state[lin.weight].clone()  # [out, in], once per weight (q and v share qkv_proj)
        a = adapter.tensors[f"{lin.module}.lora_A.weight"]  # [r, in]
        b = adapter.tensors[f"{lin.module}.lora_B.weight"]  # [hi - lo, r]
        w = out[lin.weight]
        w[lin.lo:lin.hi] += (b.to(torch.float64) @ a.to(torch.float64) * adapter.scaling).to(w.dtype)
    return out
