"""Placing a drafter's weights on another device than its target's (Dovetail-style placement).

Why this exists: Dovetail (``--drafter-device``) keeps the target on one device (e.g. the CPU)
and runs the drafter on another (e.g. a GPU); only token ids and the target's hidden-state taps
cross between them. Two drafters read weights of the target itself: EAGLE-3 embeds its draft
tokens with the target's ``embed_tokens``, and the draft-model drafter may run the target's first
layers (``DecoderModel.truncated``, which shares them). On another device each needs its own copy
there, made once at build time, so that no per-token lookup or layer crosses devices.

Worked example::

    device = resolve_device("cuda", target.device)      # cuda:0 ("" -> target.device)
    if elsewhere(device, target.device):
        embed = embedding_copy(target.embed_tokens, device, torch.bfloat16)   # [V, H] bf16 on cuda:0
        draft = module_copy(target.truncated(2), device)                      # 2 layers copied to cuda:0
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

import torch
from torch import nn

from tidespec.errors import ConfigError
from tidespec.models.target import TargetModel
from tidespec.models.kernels.linear import Linear

M = TypeVar("M", bound=nn.Module)


def resolve_device(name: str, default: torch.device) -> torch.device:
    """The device ``name`` ("", "cpu", "cuda", "cuda:N") stands for; "" is ``default`` (the
    target's). A bare "cuda" is the current CUDA device, so that it compares equal to the
    ``cuda:0`` a parameter reports. Raises ``ConfigError`` for a CUDA device this machine lacks.

    Example: ``resolve_device("", torch.device("cpu")) == torch.device("cpu")``; on a one-GPU
    machine ``resolve_device("cuda", ...) == torch.device("cuda", 0)``.
    """
    if not name:
        return default
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index if device.index is not None else (torch.cuda.current_device() if count else 0)
        if index >= count:
            raise ConfigError(f"--drafter-device {name}: this machine has {count} CUDA device(s)")
        device = torch.device("cuda", index)
    return device


def elsewhere(device: torch.device, target_device: torch.device) -> bool:
    """Whether a drafter on ``device`` needs its own copies of the target's weights."""
    return torch.device(device) != torch.device(target_device)


def embedding_copy(embed: nn.Embedding, device: torch.device, dtype: torch.dtype | None = None) -> nn.Embedding:
    """A frozen ``nn.Embedding`` holding a copy of ``embed``'s table on ``device``, in ``dtype``
    (None or a non-float table: its own dtype). Casting the table first gives exactly the rows a
    lookup followed by a cast gives, in less memory when ``dtype`` is narrower."""
    w = embed.weight.detach()
    dtype = dtype if dtype is not None and w.is_floating_point() else w.dtype
    table = w.to(device=device, dtype=dtype, copy=True)
    return nn.Embedding.from_pretrained(table, freeze=True, padding_idx=embed.padding_idx)


def module_copy(module: M, device: torch.device) -> M:
    """A deep copy of ``module`` whose parameters and buffers are new tensors on ``device``,
    copied there directly (the source is never duplicated on its own device first); tied
    parameters stay tied. Caches tied to the source's tensors are not carried over: a
    ``TargetModel``'s rope tables are rebuilt lazily, a ``Linear``'s split/packed weights when
    next used, and on a device other than the CPU a ``Linear`` drops its measured CPU kernel
    choice (it runs ``F.linear``).

    Example: ``module_copy(target.truncated(2), torch.device("cuda", 0))`` -> a two-layer model on
    cuda:0 sharing no tensor with ``target``.
    """
    memo: dict[int, Any] = {}
    for p in module.parameters():  # de-duplicated: a tied parameter is copied once
        memo[id(p)] = nn.Parameter(p.detach().to(device, copy=True), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = b.detach().to(device, copy=True)
    for m in module.modules():
        tables = getattr(m, "_rope_tables", None)  # a family model's lazily built rope tables
        if isinstance(tables, dict):
            memo[id(tables)] = {}
        if isinstance(m, Linear) and m._blocks is not None:
            memo[id(m._blocks)] = None
    out = copy.deepcopy(module, memo)
    for m in out.modules():
        if isinstance(m, Linear):
            m._blocks_key, m._blocks = None, None
            if torch.device(device).type != "cpu":
                m.choice, m.tuned_threads = (), 0
                m.set_packing(False)
    return out
