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
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tidespec.errors import ConfigError

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
        directory = Path(directory)
        if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
            raise MedusaConfigError(f"{directory} holds no Medusa heads ({CONFIG} and {WEIGHTS})")
        cfg = MedusaConfig(**json.loads((directory / CONFIG).read_text(encoding="utf-8")))
        heads = cls(cfg)
        heads.load_state_dict(load_file(str(directory / WEIGHTS)))
        return heads.to(dtype=dtype, device=device).eval()
