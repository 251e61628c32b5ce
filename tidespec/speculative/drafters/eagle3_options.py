"""The EAGLE-3 drafter's options: its flags (``--eagle3-*``) and the rules that read other sections.

Why this exists: the EAGLE-3 head is the drafter that online training, the fleet and the benchmarks
configure from outside the drafter (its publish root, its draft vocabulary), so its options are read
in more places than the drafter module; they live here, light to import, and ``eagle3.py``'s
``DrafterKind`` declares them (``speculative.registry`` makes them flags).

Worked example::

    spec = SpecConfig(drafter="eagle3").with_options("eagle3", Eagle3Options(dir="runs/heads"))
    eagle3_options(spec).dir             # "runs/heads"
    eagle3_options(SpecConfig()).dir     # None: the defaults
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from tidespec.config import EngineConfig, SpecConfig, opt
from tidespec.errors import ConfigError, check_at_least
from tidespec.models.quant.a8 import a8_error

NAME = "eagle3"


@dataclass
class Eagle3Options:
    dir: str | None = opt(None, "EAGLE-3: publish root (v1/, v2/, LATEST: the newest valid version is served) "
                                "or one exported checkpoint dir; none = the shipped head on the embedded model "
                                "(no --model), a fresh random head on any other (still lossless)")
    draft_vocab: int = opt(0, "EAGLE-3: draft vocabulary of a fresh head (0 = the target's vocabulary)")
    tree_depth: int = opt(5, "EAGLE-3 trees (--tree): expansion depth")
    tree_top_k: int = opt(4, "EAGLE-3 trees (--tree): children per expanded node and frontier width")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = opt(
        "auto", "EAGLE-3 head's weights and activations (auto = the target's --dtype); the drafter's precision "
                "never changes the output, only how often its drafts are accepted and what they cost")
    min_draft_prob: float = opt(
        0.4, "EAGLE-3 chains: stop drafting once the product of the chain's draft probabilities under the head "
             "falls below this (its confidence tracks acceptance, EAGLE-2); the first draft is always proposed. "
             "0 = draft as many as the policy asks. 0.4: every gamma 3-6 within a few percent of the best on "
             "code and above plain on chat")
    quantization: Literal["auto", "none", "int8", "int4", "w8a8"] = opt(
        "auto", "EAGLE-3 head's weights while drafting: int8 (per output channel), int4 (groups of 32, LM head "
                "int8) or w8a8 (Q8_0 weights x int8 activations, AVX512-VNNI) copies of its linear layers, CPU "
                "kernels; the float head still trains, swaps and rolls back. auto = w8a8 on --device cpu with "
                "AVX512-VNNI, int8 on another CPU, none elsewhere. Lossless whatever it is")

    def __post_init__(self) -> None:
        check_at_least(0, eagle3_draft_vocab=self.draft_vocab)
        check_at_least(1, eagle3_tree_depth=self.tree_depth, eagle3_tree_top_k=self.tree_top_k)
        if not 0.0 <= self.min_draft_prob < 1.0:
            raise ConfigError(f"--eagle3-min-draft-prob must be in [0, 1), got {self.min_draft_prob}")


def eagle3_options(spec: SpecConfig) -> Eagle3Options:
    """The EAGLE-3 options in ``spec`` (the defaults when it has none)."""
    return spec.options_for(NAME, Eagle3Options)


def with_eagle3(spec: SpecConfig, **changes: object) -> SpecConfig:
    """``spec`` with some EAGLE-3 options changed: ``with_eagle3(spec, dir="runs/h")``."""
    current = eagle3_options(spec)
    return spec.with_options(NAME, Eagle3Options(**{**current.__dict__, **changes}))


def check_eagle3(config: EngineConfig, options: Eagle3Options) -> None:
    """The rules of EAGLE-3's options that read other sections: online training publishes to
    ``--eagle3-dir``; an int8/int4 head drafts with PyTorch's CPU kernels."""
    if config.online.enabled and not options.dir:
        raise ConfigError("--online-training needs --eagle3-dir (the directory drafters are published to)")
    head_device = config.spec.drafter_device or config.model.device  # where the EAGLE-3 head drafts
    if options.quantization in ("int8", "int4", "w8a8") and not head_device.startswith("cpu"):
        raise ConfigError(f"--eagle3-quantization {options.quantization} needs the drafter on the CPU "
                          f"(PyTorch's CPU kernels; --device or --drafter-device cpu), got {head_device!r}")


def head_quantization(option: str, device: torch.device) -> str:
    """``--eagle3-quantization`` resolved for a head on ``device``: "auto" on a CPU is w8a8 where the CPU has
    AVX512-VNNI (``a8_error``: Q8_0 weights x int8 activations, 15 % less drafting time than int8's weight-only
    kernels for the shipped head, docs/benchmarks/drafters.md), else int8 (drafting is bound by reading the
    head's weights); none elsewhere.

    Example: ``head_quantization("auto", torch.device("cpu"))`` -> "w8a8" on a CPU with AVX512-VNNI, "int8"
    on one without; on cuda:0 -> "none".
    """
    if option != "auto":
        return option
    if device.type != "cpu":
        return "none"
    return "w8a8" if a8_error() is None else "int8"
