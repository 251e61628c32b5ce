"""Training Medusa heads from the target's own outputs and hidden states (``tidespec train-medusa``).

Why this exists: Medusa-1's recipe, self-distilled. The target writes the training text itself (its greedy
continuations of a workload's prompts, as serving would), one prefill per sequence gives its final hidden
state at every position (what the engine hands a Medusa drafter while serving), and head k learns the
token k positions after the one each state produced, by cross-entropy over the draft vocabulary (the most
frequent tokens of those outputs; the target's own LM-head rows, frozen, are the heads' output layer).
A tenth of the sequences is held out: the report is each head's top-1 accuracy there, the quantity
acceptance follows.

Worked example: a sequence [p0 p1 | o0 o1 o2 o3] (prompt | output), 2 heads: the row that produced o0 is
position 1 (p1's); head 1 learns o1 from it, head 2 o2; position 2 (o0's) teaches head 1 o2 and head 2
o3; position 3 teaches head 1 o3 only.
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tidespec.config import Section, opt
from tidespec.errors import ConfigError
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.models.medusa.heads import MedusaConfig, MedusaHeads
from tidespec.models.target import TargetModel, output_matrix

log = logging.getLogger(__name__)
IGNORE = -100


@dataclass
class MedusaTrainConfig(Section):
    """``tidespec train-medusa``: the data (the target's greedy continuations of workload prompts), the
    heads, training."""

    out: str = opt("runs/medusa", "directory the heads are written to (serve them with --medusa-dir)",
                   flag="--out")
    workloads: str = opt("drafter_boot,code_extra,chat", "workloads (names or .jsonl paths, comma-separated) whose "
                                                         "prompts the target continues")
    limit: int = opt(0, "prompts per workload (0 = all)", min=0)
    exclude: str = opt("code_unseen", "workloads whose prompts are left out (those a benchmark measures on)")
    max_tokens: int = opt(128, "tokens of each continuation", min=1)
    heads: int = opt(4, "heads (head k drafts the k-th token after the last)", min=1, max=16)
    vocab: int = opt(8192, "draft vocabulary: the most frequent tokens of the continuations", min=1)
    epochs: int = opt(4, "passes over the rows", min=1)
    lr: float = opt(1e-3, "AdamW learning rate")
    batch_rows: int = opt(512, "rows per optimizer step", min=1)
    held_out: float = opt(0.1, "share of the sequences held out for the accuracy report")
    seed: int = opt(0, "shuffling and initialisation seed")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.held_out < 1.0 or not self.lr > 0:
            raise ConfigError(f"need 0 <= held_out < 1 and lr > 0, got {self.held_out}, {self.lr}")


@torch.no_grad()
def final_hidden(model: TargetModel, token_ids: list[int]) -> torch.Tensor:
    """[len, H] the target's final (normed) hidden state at every position of one sequence, by one prefill."""
    kv = KVCache.for_model(model.cfg, 1, len(token_ids), model.dtype, model.device)
    ids = torch.tensor(token_ids, device=model.device)
    out = model(ids, BatchLayout.build([len(token_ids)], [0], [0], device=model.device), kv,
                logits_rows=torch.empty(0, dtype=torch.int64, device=model.device))
    return out.last_hidden.float()


def draft_vocabulary(sequences: list[tuple[list[int], int]], size: int) -> list[int]:
    """The ``size`` most frequent tokens of the outputs (ties by id). Example: outputs [5, 5, 7] -> [5, 7]."""
    counts = Counter(t for ids, start in sequences for t in ids[start:])
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]


def rows_of(model: TargetModel, sequences: list[tuple[list[int], int]], heads: int, index: torch.Tensor,
            progress: Callable[[str], None]) -> tuple[torch.Tensor, torch.Tensor]:
    """(X [R, H] hidden states, Y [R, K] each head's target as a draft-vocabulary index, IGNORE where the
    token is past the sequence or outside the vocabulary) over every output position (module docstring)."""
    xs, ys = [], []
    for n, (ids, start) in enumerate(sequences):
        hidden = final_hidden(model, ids)  # [L, H]
        tokens = torch.tensor(ids + [-1] * (heads + 1))
        positions = torch.arange(max(start - 1, 0), len(ids) - 1)  # rows that produced an output token
        targets = torch.stack([tokens[positions + 1 + k] for k in range(1, heads + 1)], dim=1)  # [r, K] token ids
        ys.append(torch.where(targets >= 0, index[targets.clamp(min=0)], IGNORE))
        xs.append(hidden[positions])
        if (n + 1) % 50 == 0:
            progress(f"hidden states of {n + 1}/{len(sequences)} sequences")
    return torch.cat(xs), torch.cat(ys)


def accuracy(heads: MedusaHeads, rows: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Each head's top-1 accuracy over the rows it has a target for."""
    with torch.no_grad():
        pred = (heads(x) @ rows.T).argmax(-1).T  # [R, K]
    valid = y != IGNORE
    return [float(((pred[:, k] == y[:, k]) & valid[:, k]).sum() / valid[:, k].sum().clamp(min=1))
            for k in range(y.shape[1])]


def train_medusa(model: TargetModel, sequences: list[tuple[list[int], int]], cfg: MedusaTrainConfig,
                 progress: Callable[[str], None] = log.info) -> tuple[MedusaHeads, dict[str, list[float]]]:
    """Heads trained on ``sequences`` ((token ids, where the output starts) each); returns them (float32)
    and the held-out top-1 accuracy per head before (zero blocks: the target's next token) and after."""
    torch.manual_seed(cfg.seed)
    order = list(range(len(sequences)))
    random.Random(cfg.seed).shuffle(order)
    n_held = max(1, int(len(order) * cfg.held_out)) if len(order) > 1 else 0
    held, train = [sequences[i] for i in order[:n_held]], [sequences[i] for i in order[n_held:]]
    vocab_ids = draft_vocabulary(train, cfg.vocab)
    index = torch.full((model.cfg.vocab_size,), IGNORE, dtype=torch.int64)
    index[torch.tensor(vocab_ids)] = torch.arange(len(vocab_ids))
    rows = output_matrix(model).float()[torch.tensor(vocab_ids, device=model.device)].cpu()  # [N, H]
    heads = MedusaHeads(MedusaConfig(model.cfg.hidden_size, cfg.heads, vocab_ids, model.cfg.vocab_size))
    x, y = rows_of(model, train, cfg.heads, index, progress)
    hx, hy = rows_of(model, held, cfg.heads, index, progress) if held else (x[:0], y[:0])
    report = {"before": accuracy(heads, rows, hx, hy)} if held else {}
    fit_heads(heads, rows, x, y, cfg.epochs, cfg.lr, cfg.batch_rows, progress)
    if held:
        report["after"] = accuracy(heads, rows, hx, hy)
    return heads.eval(), report


def fit_heads(heads: MedusaHeads, rows: torch.Tensor, x: torch.Tensor, y: torch.Tensor, epochs: float, lr: float,
              batch_rows: int, progress: Callable[[str], None] = log.info) -> float:
    """Train ``heads`` in place: AdamW, cross-entropy of each head over the draft vocabulary's output rows
    ``rows`` [N, H], on hidden states ``x`` [R, H] and targets ``y`` [R, K] (draft-vocabulary indices,
    IGNORE where none), ``epochs`` passes (a fraction: that share of one) in shuffled batches of
    ``batch_rows``. Returns the mean loss per head of the last pass. Shared by ``tidespec train-medusa``
    and the online rounds (``medusa_rounds``)."""
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    loss_fn = nn.CrossEntropyLoss(ignore_index=IGNORE)
    num_heads = y.shape[1]
    heads.train()
    mean = float("nan")
    for epoch in range(max(1, math.ceil(epochs))):
        share = min(1.0, epochs - epoch)  # the last pass of a fractional count covers that share of the rows
        perm = torch.randperm(x.shape[0])[:max(1, round(share * x.shape[0]))]
        total, seen = 0.0, 0
        for lo in range(0, perm.shape[0], batch_rows):
            b = perm[lo:lo + batch_rows]
            logits = heads(x[b]) @ rows.T  # [K, b, N]
            loss = sum(loss_fn(logits[k], y[b, k]) for k in range(num_heads) if (y[b, k] != IGNORE).any())
            if not isinstance(loss, torch.Tensor):  # no head has a target in these rows
                continue
            opt.zero_grad()
            loss.backward()  # type: ignore[union-attr]
            opt.step()
            total += loss.item() * len(b)
            seen += len(b)
        mean = total / max(1, seen) / num_heads
        progress(f"epoch {epoch + 1}/{math.ceil(epochs)}: loss {mean:.3f} per head, {seen} rows")
    heads.eval()
    return mean
