"""Distillation data for a bootstrap drafter: diverse continuations, then one teacher pass over each.

Why this exists: EAGLE-3 (and SpecForge's offline data generation) trains the head on the
target's *distribution*, over contexts the target itself produces. The engine's serving capture
(``online.attach.SignalCollector``) records the taps and the token that followed; it has no logits
for prompt positions. For the offline bootstrap we can afford a second, teacher-forced pass:

1. ``generate_continuations``: every prompt of the workloads, ``samples`` times: sample 0 greedy,
   the others at ``temperature`` with seeds ``seed + k`` (diversity: contexts greedy decoding never
   reaches, which served sampled requests do reach);
2. ``teacher_pass``: one prefill over prompt + continuation per sequence, with the EAGLE-3 taps
   and the logits of every position; rows ``(taps_i, token_i, token_{i+1}, top-k of logits_i)``
   go to a ``SignalStore`` as ``SignalShard``s, ``topk_ids`` / ``topk_logits`` filled.

The trainer (``eagle3_train.ttt_loss``) then distils from the top-k distribution, and its
evaluation counts only rows whose continuation is the target's greedy one (``topk_ids[:, 0]``),
which is what greedy serving sees.

Worked example (one prompt of 5 tokens, ``samples=2``, 3 new tokens each)::

    seqs = generate_continuations(model, tok, prompts, samples=2, temperature=0.8, max_tokens=3)
    # -> [Continuation(prompt 0, sample 0, 8 ids, greedy), Continuation(prompt 0, sample 1, 8 ids)]
    teacher_pass(model, seqs, tap_layers, topk=16, store=store)
    # -> 7 rows of sample 0 (positions 0..6: the last one has no next token), 3 of sample 1
    #    (positions 4..6: the prompt's rows are stored once), each with 16 top-k ids and logits
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from tidespec.engine.engine import LLMEngine
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.models.target import TargetModel
from tidespec.online.store import ShardSink, SignalShard
from tidespec.speculative.api import Drafter
from tidespec.workloads.loader import Prompt

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Continuation:
    """One generated sequence: the prompt's ids followed by the generated ids."""

    prompt_index: int
    sample: int  # 0 = greedy
    token_ids: list[int]
    domain: str
    prompt_len: int = 0


def generate_continuations(model: TargetModel, tokenizer: object, prompts: Sequence[Prompt], *, samples: int = 1,
                           temperature: float = 0.8, max_tokens: int = 128, max_num_seqs: int = 16, seed: int = 0,
                           progress: bool = True) -> list[Continuation]:
    """Generate ``samples`` continuations of every prompt with the target (plain decoding, no drafter)."""
    from tidespec.engine.engine import RequestError
    from tidespec.sampling import SamplingParams

    if samples < 1 or max_tokens < 1 or temperature < 0:
        raise ValueError("samples and max_tokens must be >= 1 and temperature >= 0")
    engine = bootstrap_engine(model, tokenizer, prompts, max_tokens, max_num_seqs)
    owner: dict[str, tuple[int, int]] = {}
    for i, p in enumerate(prompts):
        for k in range(samples):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if k == 0 else temperature,
                                    seed=None if k == 0 else seed + 1000 * i + k)
            try:
                owner[engine.add_request(p.token_ids, params, label=p.record.domain)] = (i, k)
            except RequestError as exc:
                logger.warning("skipping workload record %s: %s", p.record.id, exc)
                break
    out: list[Continuation] = []
    with tqdm(total=len(owner), desc="distill generate", unit="seq", disable=not progress, leave=False) as bar:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    i, k = owner[o.request_id]
                    out.append(Continuation(i, k, list(prompts[i].token_ids) + list(o.token_ids),
                                            prompts[i].record.domain, len(prompts[i].token_ids)))
                    bar.update(1)
    out.sort(key=lambda c: (c.prompt_index, c.sample))
    return out


def bootstrap_engine(model: TargetModel, tokenizer: object, prompts: Sequence[Prompt], max_tokens: int,
                     max_num_seqs: int, drafter: Drafter | None = None) -> LLMEngine:
    """A plain-decoding engine whose context fits the longest prompt plus ``max_tokens`` (what the
    offline bootstrap generates with; ``drafter`` only to tap hidden states, it never drafts)."""
    from tidespec.config import CacheConfig, EngineConfig, SpecConfig

    longest = max(len(p.token_ids) for p in prompts) + max_tokens + 1
    max_len = max(8, min(model.cfg.max_position_embeddings, longest))
    config = EngineConfig(cache=CacheConfig(max_model_len=max_len, max_num_seqs=max_num_seqs),
                          spec=SpecConfig(num_speculative_tokens=0))
    return LLMEngine(model, tokenizer, config, drafter=drafter)  # type: ignore[arg-type]


@torch.inference_mode()
def teacher_rows(model: TargetModel, token_ids: list[int], tap_layers: tuple[int, ...], topk: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One prefill over a whole sequence -> (taps [N-1, 3H], topk_ids [N-1, K], topk_logits [N-1, K])
    for positions 0..N-2 (those with a next token)."""
    n = len(token_ids)
    kv = KVCache.for_model(model.cfg, 1, n, model.dtype, model.device)
    ids = torch.tensor(token_ids, device=model.device)
    rows = torch.arange(n - 1, device=model.device)
    out = model(ids, BatchLayout.build([n], [0], [0], device=model.device), kv, logits_rows=rows,
                tap_layers=tap_layers)
    assert out.taps is not None and out.logits is not None
    top = torch.topk(out.logits, topk, dim=-1)  # values, indices [N-1, K] each, descending
    return out.taps[: n - 1], top.indices, top.values.float()


def teacher_pass(model: TargetModel, sequences: Sequence[Continuation], tap_layers: tuple[int, ...], topk: int,
                 store: ShardSink, *, shard_rows: int = 4096, first_seq_id: int = 0, progress: bool = True) -> int:
    """Teacher-force every sequence and append its rows to ``store`` (shards of about ``shard_rows``).
    Returns the number of rows written.

    Store seq ids are sample-major, ``first_seq_id + sample * num_prompts + prompt_index``, so the
    trainer's held-out rule (every k-th sequence id) holds out the same prompts in every sample,
    greedy ones included. A prompt's own rows are stored once, with sample 0: sampled continuations
    start at the prompt's last position (the one that predicts the first generated token).
    """
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    domains = sorted({c.domain for c in sequences}) or [""]
    num_prompts = max((c.prompt_index for c in sequences), default=0) + 1
    pending: list[SignalShard] = []
    written = 0

    def flush() -> None:
        if pending:
            store.append(_concat(pending, domains))
            pending.clear()

    for c in tqdm(sequences, desc="distill teacher", unit="seq", disable=not progress, leave=False):
        if len(c.token_ids) < 2:
            continue
        taps, top_ids, top_logits = teacher_rows(model, c.token_ids, tap_layers, topk)
        n = taps.shape[0]
        a = min(n - 1, max(0, c.prompt_len - 1)) if c.sample else 0
        ids = torch.tensor(c.token_ids, dtype=torch.int64)
        m = n - a
        pending.append(SignalShard(
            taps=taps[a:].cpu(), token_ids=ids[a:n], next_token_ids=ids[a + 1:n + 1],
            seq_ids=torch.full((m,), first_seq_id + c.sample * num_prompts + c.prompt_index, dtype=torch.int64),
            positions=torch.arange(a, n), domain_ids=torch.full((m,), domains.index(c.domain), dtype=torch.int64),
            topk_ids=top_ids[a:].cpu(), topk_logits=top_logits[a:].cpu(), domains=domains))
        written += m
        if sum(s.num_signals for s in pending) >= shard_rows:
            flush()
    flush()
    return written


def _concat(shards: list[SignalShard], domains: list[str]) -> SignalShard:
    """Rows of several same-domain-vocabulary shards as one shard."""
    cat = lambda name: torch.cat([getattr(s, name) for s in shards])  # noqa: E731
    return SignalShard(taps=cat("taps"), token_ids=cat("token_ids"), next_token_ids=cat("next_token_ids"),
                       seq_ids=cat("seq_ids"), positions=cat("positions"), domain_ids=cat("domain_ids"),
                       topk_ids=cat("topk_ids"), topk_logits=cat("topk_logits"), domains=domains)


def training_prompts(workloads: str, tokenizer: object, *, exclude: str = "", limit: int = 0) -> list[Prompt]:
    """Prompts of comma-separated ``workloads`` (names or JSONL paths), minus any whose prompt text
    appears in the comma-separated ``exclude`` workloads (the prompts a benchmark measures on), the
    first ``limit`` of each workload when ``limit`` > 0.

    Example: ``training_prompts("chat.jsonl,math.jsonl", tok, exclude="chat")`` drops the shipped
    chat benchmark's 48 prompts from the shared 120-prompt chat set.
    """
    from tidespec.workloads.loader import load_workload, tokenize_workload, workload_texts

    held = set(workload_texts(exclude))
    records = []
    for name in (w.strip() for w in workloads.split(",")):
        if name:
            records += [r for r in load_workload(name, limit or None) if r.prompt not in held]
    if not records:
        raise ValueError(f"no training prompts left in {workloads!r} after excluding {exclude!r}")
    return tokenize_workload(records, tokenizer)  # type: ignore[arg-type]
