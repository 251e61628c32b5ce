"""Medusa heads: K residual blocks on the target's last hidden state, each drafting one position further.

Why this exists: the field guide's cheapest learned drafter. A head is one H x H layer (Medusa-1's
``ResBlock``: ``h + SiLU(W h + b)``) on the target's final normed hidden state at the position that
produced the last token; head k (1-based) drafts the k-th token after it. No attention, no KV cache,
no forward per draft token: K heads cost K small matmuls and one product with the output rows, where
an EAGLE-3 chain costs a decoder layer and an LM head per token, which is what a CPU needs.

The output layer is not stored: every head shares the target's own LM-head rows, restricted to a draft
vocabulary (``vocab_ids``, the most frequent tokens of the training data) so the product costs
``len(vocab_ids) x H`` per head rather than ``V x H``; a checkpoint holds the blocks and the ids only
(SmolLM2-135M, 4 heads: 1.3M parameters). With the blocks at zero every head repeats the target's next
token, Medusa's initialisation.

Worked example::

    heads = MedusaHeads(MedusaConfig(hidden_size=576, num_heads=4, vocab_ids=list(range(8192))))
    out = heads(h)                        # h [B, 576] -> [4, B, 576]: one state per head
    logits = out @ rows.T                 # rows = the LM head's rows of vocab_ids [8192, 576] -> [4, B, 8192]
    heads.save(path); MedusaHeads.load(path)
    publish_heads(root, heads, {"round": 1})   # root/v1, as the online trainer publishes (then v2, ...)
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from tidespec.errors import ConfigError
from tidespec.files import METRICS_NAME, latest_version, list_versions, publish_version

log = logging.getLogger(__name__)

CONFIG = "medusa_config.json"
WEIGHTS = "medusa_heads.safetensors"


class MedusaConfigError(ConfigError):
    """A Medusa checkpoint or configuration that cannot be used."""


@dataclass
class MedusaConfig:
    hidden_size: int
    num_heads: int
    vocab_ids: list[int] = field(default_factory=list)  # the draft vocabulary: target token ids, output rows
    target_vocab_size: int = 0  # the target's vocabulary the ids index (0 = unknown)

    def __post_init__(self) -> None:
        if self.hidden_size < 1 or not 1 <= self.num_heads <= 16:
            raise MedusaConfigError(f"need hidden_size >= 1 and 1 <= num_heads <= 16, got {self.hidden_size}, "
                                    f"{self.num_heads}")
        if not self.vocab_ids or len(set(self.vocab_ids)) != len(self.vocab_ids) or min(self.vocab_ids) < 0:
            raise MedusaConfigError("vocab_ids must be distinct non-negative token ids, at least one")
        if self.target_vocab_size and max(self.vocab_ids) >= self.target_vocab_size:
            raise MedusaConfigError(f"vocab_ids reach {max(self.vocab_ids)}, past the target's "
                                    f"{self.target_vocab_size} tokens")


class MedusaHeads(nn.Module):
    """``num_heads`` ResBlocks; ``forward`` [B, H] -> [K, B, H] states whose products with the draft
    vocabulary's output rows are each head's logits."""

    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(cfg.num_heads))
        for block in self.blocks:  # Medusa's start: every head the target's own next-token distribution
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0].weight.dtype

    def forward(self, hidden: torch.Tensor, count: int | None = None) -> torch.Tensor:
        # hidden: [B, H] -> [count, B, H]: the first ``count`` heads (default all K)
        return torch.stack([hidden + nn.functional.silu(block(hidden)) for block in self.blocks[:count]])

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(directory / WEIGHTS))
        (directory / CONFIG).write_text(json.dumps(asdict(self.cfg)), encoding="utf-8")

    @classmethod
    def load(cls, directory: Path | str, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> MedusaHeads:
        """The heads ``directory`` holds; a missing, unreadable, misshapen or non-finite set raises
        ``MedusaConfigError`` (a published version is read while a trainer may write the next)."""
        directory = Path(directory)
        if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
            raise MedusaConfigError(f"{directory} holds no Medusa heads ({CONFIG} and {WEIGHTS})")
        try:
            cfg = MedusaConfig(**json.loads((directory / CONFIG).read_text(encoding="utf-8")))
            heads = cls(cfg)
            state = load_file(str(directory / WEIGHTS))
            heads.load_state_dict(state)
        except MedusaConfigError:
            raise
        except (OSError, ValueError, TypeError, RuntimeError, SafetensorError) as exc:
            raise MedusaConfigError(f"{directory}: unreadable Medusa heads: {str(exc).splitlines()[0]}") from None
        if not all(bool(torch.isfinite(t).all()) for t in state.values()):
            raise MedusaConfigError(f"{directory}: Medusa heads with non-finite weights")
        return heads.to(dtype=dtype, device=device).eval()


def publish_heads(root: Path, heads: MedusaHeads, metrics: dict[str, Any]) -> int:
    """Publish ``heads`` (float32) as the next version of the publish area ``root`` (``files.publish_version``:
    ``root/v{N}``, ``LATEST``), the online trainer's output; returns N."""
    cpu = MedusaHeads(heads.cfg)
    cpu.load_state_dict({k: v.detach().float().cpu() for k, v in heads.state_dict().items()})
    return publish_version(root, cpu.save, metrics)


def load_published(root: Path, version: int, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> tuple[MedusaHeads, dict[str, Any]]:
    """Version ``version`` of the publish area ``root``: its heads and its metrics (``MedusaConfigError`` if
    unusable)."""
    d = root / f"v{version}"
    heads = MedusaHeads.load(d, dtype, device)
    try:
        metrics = json.loads((d / METRICS_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        metrics = {}
    return heads, metrics if isinstance(metrics, dict) else {}


def latest_published(root: Path, hidden_size: int, vocab_size: int, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu") -> tuple[int, MedusaHeads] | None:
    """The newest version under ``root`` (up to ``LATEST``) whose heads load and fit a target of this hidden
    size and vocabulary, as (version, heads); each refused version is logged; None when there is none."""
    newest = latest_version(root)
    for version in sorted((v for v in list_versions(root) if newest is None or v <= newest), reverse=True):
        try:
            heads, _ = load_published(root, version, dtype, device)
            check_fit(heads.cfg, hidden_size, vocab_size)
            return version, heads
        except MedusaConfigError as exc:
            log.warning("refusing Medusa heads version %d under %s: %s", version, root, exc)
    return None


def check_fit(cfg: MedusaConfig, hidden_size: int, vocab_size: int) -> None:
    """``MedusaConfigError`` unless heads of ``cfg`` read a target of this hidden size and vocabulary."""
    if cfg.hidden_size != hidden_size or (cfg.target_vocab_size and cfg.target_vocab_size != vocab_size):
        raise MedusaConfigError(f"heads for hidden size {cfg.hidden_size} and vocabulary {cfg.target_vocab_size}, "
                                f"the target has {hidden_size} and {vocab_size}")
