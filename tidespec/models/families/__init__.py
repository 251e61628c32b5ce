"""The model families: one module each, chosen by ``models/architectures.py``'s ``family`` column.

Worked example::

    model = build_target(TargetConfig.from_hf(config_dict))   # a LlamaModel for Llama, Mistral, Qwen2/3
"""

from __future__ import annotations

from tidespec.models.architectures import ARCHITECTURES
from tidespec.models.families.llama import LlamaModel
from tidespec.models.target import ModelConfigError, TargetConfig, TargetModel

FAMILIES: dict[str, type[LlamaModel]] = {"llama": LlamaModel}


def build_target(cfg: TargetConfig) -> TargetModel:
    """The model of ``cfg``'s architecture, weights uninitialized (on the current default device)."""
    arch = ARCHITECTURES.get(cfg.architecture)
    if arch is None or arch.family not in FAMILIES:
        raise ModelConfigError(f"unknown architecture {cfg.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    return FAMILIES[arch.family](cfg)
