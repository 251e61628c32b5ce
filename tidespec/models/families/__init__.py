"""The model families: the modules that build a target, chosen by ``models/architectures.py``'s ``family`` column.

Every architecture tidespec runs today is a decoder-only transformer built by ``decoder.py`` from
the parts beside it (norms, rope, attention, MLP); a family whose blocks are not those (a
state-space hybrid, say) would be one more module here and one more entry in ``FAMILIES``.

Worked example::

    model = build_target(TargetConfig.from_hf(config_dict))   # a DecoderModel for Llama, Qwen3, Gemma 3, ...
"""

from __future__ import annotations

from tidespec.models.architectures import ARCHITECTURES
from tidespec.models.families.decoder import DecoderModel
from tidespec.models.target import ModelConfigError, TargetConfig, TargetModel

FAMILIES: dict[str, type[DecoderModel]] = {"decoder": DecoderModel}


def build_target(cfg: TargetConfig) -> TargetModel:
    """The model of ``cfg``'s architecture, weights uninitialized (on the current default device)."""
    arch = ARCHITECTURES.get(cfg.architecture)
    if arch is None or arch.family not in FAMILIES:
        raise ModelConfigError(f"unknown architecture {cfg.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    return FAMILIES[arch.family](cfg)
