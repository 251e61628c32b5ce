"""Draft-model drafter: a small same-tokenizer Llama-family model proposes the next tokens.

Why this exists: the classic speculative-decoding drafter (Leviathan et al., 2023) is a cheaper
autoregressive model sharing the target's tokenizer — a separate small checkpoint or the target
itself truncated to its first k layers (``TargetModel.truncated(k)``). It keeps its own KV cache,
so it must stay in step with the target's context under continuous batching: a sequence may
skip speculation for several steps, drafts may be rejected, or a sequence may be seen for the
first time mid-generation.

Catch-up by prefix matching. Per sequence the drafter remembers the token ids whose draft K/V is
valid in its slot. At ``propose`` it keeps the longest common prefix of those and the sequence's
context (always re-feeding at least the last context token, whose logits start drafting), rolls
the rest back, and feeds every missing context token in ONE ragged forward over all sequences of
the call. Chain drafts that were fed keep their K/V and stay in the token list, so accepted drafts
are reused for free next step and rejected ones are rolled back by the prefix comparison.

Worked example (chain, gamma=3)::

    propose(ctx=[5, 6, 7])       # feed [5, 6, 7] -> draft a; feed a -> b; feed b -> c
                                 # proposal [a, b, c]; draft KV holds [5, 6, 7, a, b]
    propose(ctx=[5, 6, 7, a, x]) # target accepted a, corrected b -> x
                                 # common prefix [5, 6, 7, a] (4 tokens), kept prefix 4 ->
                                 # roll back b, feed only [x]

Trees (``DraftInput.tree``): the tree is grown level by level; every node gets its top-k
children by draft probability; when a level would exceed the token budget gamma, the children
with the highest path probability are kept (the greedy main line is always kept, so the tree
always contains the draft's greedy chain as deep as the tree goes). Because the model's
attention sees the whole cached prefix, each level re-feeds the whole tree built so far on top of
the context with a tree attention mask (trees are a handful of tokens); the tree's K/V is rolled
back afterwards. Tree drafts are point masses (``draft_probs=None``).

The draft model must share the target's tokenizer; ``draft_probs`` rows have the draft model's
vocabulary size (the verifier pads when the target's vocabulary is larger).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tidespec.config import opt
from tidespec.errors import ConfigError, check_at_least
from tidespec.models.execution import placement
from tidespec.models.kernels.linear import tune_linears
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.models.loading.loader import load_model
from tidespec.models.quant.quantize import QuantizedLinear
from tidespec.models.target import TargetModel, output_matrix
from tidespec.sampling import SamplingParams, make_generator, row_argmax, sample_from, seeded_draw, target_probs
from tidespec.speculative import api
from tidespec.speculative.api import DrafterBase, DraftInput, DraftProposal, Observation, SeqDraft
from tidespec.speculative.registry import BuildContext, DrafterKind
from tidespec.speculative.tree import tree_depths, tree_mask
from tidespec.speculative.vocab.dynamic import DynamicVocab, VocabSnapshot

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: decorrelates the draft's stream from the target's


def draft_seed(seed: int | None) -> int | None:
    """Seed for the draft sampler derived from the request seed, never equal to it.

    The verifier's uniforms must be independent of the drafted token; seeding the draft's
    generator with the request seed itself would replay the target sampler's random stream.
    Example: ``draft_seed(0) == 0x1E3779B97F4A7C15`` (kept below 2**63); ``draft_seed(None) is None``.
    """
    if seed is None:
        return None
    return (seed ^ _SEED_MIX) % (1 << 63)


@dataclass
class _Feed:
    """Tokens one sequence feeds in one draft forward and the rows whose logits it needs."""

    slot: int
    tokens: list[int]  # [q] new tokens
    ctx_len: int  # K/V positions before them
    rows: list[int]  # local row indices needing logits
    depths: list[int] | None = None  # tree depths below the context, None = chain
    mask: torch.Tensor | None = None  # [q, q] tree mask, None = causal


@dataclass
class _ChainJob:
    """Autoregressive chain drafting for one sequence."""

    slot: int
    ctx_len: int
    gamma: int
    params: SamplingParams
    generator: torch.Generator
    position: int = 0  # output position of the first draft token (seeded race draws)
    tokens: list[int] = field(default_factory=list)  # drafted ids so far
    probs: list[torch.Tensor] = field(default_factory=list)  # [V] each, when sampling

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.gamma

    def consume(self, logits: torch.Tensor) -> None:
        """logits: [1, V] at the last fed position -> one more draft token."""
        if self.params.greedy:
            self.tokens.append(int(row_argmax(logits[0]).item()))
            return
        probs = target_probs(logits, self.params)[0]  # [V]
        if self.params.seed is not None:  # the target's race noise at this position: drafts agree with its draws
            self.tokens.append(seeded_draw(probs, self.params.seed, self.position + len(self.tokens)))
        else:
            self.tokens.append(sample_from(probs, self.generator))
        self.probs.append(probs)

    def next_feed(self) -> _Feed:
        return _Feed(self.slot, [self.tokens[-1]], self.ctx_len + len(self.tokens) - 1, [0])

    def result(self) -> SeqDraft:
        probs = torch.stack(self.probs) if self.probs else None  # [n, V]
        return SeqDraft(list(self.tokens), None, probs)


@dataclass
class _TreeJob:
    """Level-by-level top-k tree drafting for one sequence."""

    slot: int
    ctx_len: int
    gamma: int
    top_k: int
    tokens: list[int] = field(default_factory=list)  # [n] topological order
    parents: list[int] = field(default_factory=list)  # [n]
    logp: list[float] = field(default_factory=list)  # [n] path log-probability
    frontier: list[int] = field(default_factory=lambda: [-1])  # nodes of the last level (-1 = root)
    main: int = -1  # node on the greedy main line at the last level (-1 = root)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.gamma

    def consume(self, logits: torch.Tensor) -> None:
        """logits: [F, V] for the frontier nodes -> append the next level."""
        logprobs = torch.log_softmax(logits.double(), dim=-1)  # [F, V]
        k = min(self.top_k, logprobs.shape[-1])
        top_lp, top_ids = torch.topk(logprobs, k, dim=-1)  # [F, k] each, descending
        cands: list[tuple[float, int, int, bool]] = []  # (path logp, parent, token, on main line)
        for f, node in enumerate(self.frontier):
            base = self.logp[node] if node >= 0 else 0.0
            for r in range(k):
                cands.append((base + float(top_lp[f, r]), node, int(top_ids[f, r]), node == self.main and r == 0))
        budget = self.gamma - len(self.tokens)
        if len(cands) > budget:
            order = sorted(range(len(cands)), key=lambda c: (not cands[c][3], -cands[c][0], c))
            keep = set(order[:budget])
            cands = [c for i, c in enumerate(cands) if i in keep]
        self.frontier = []
        for lp, parent, tok, on_main in cands:
            if on_main:
                self.main = len(self.tokens)
            self.frontier.append(len(self.tokens))
            self.tokens.append(tok)
            self.parents.append(parent)
            self.logp.append(lp)

    def next_feed(self) -> _Feed:
        # the root (last context token) is already cached: keep only the drafts' block of the mask
        mask = tree_mask(self.parents)[1:, 1:]  # [n, n]
        return _Feed(self.slot, list(self.tokens), self.ctx_len, list(self.frontier), tree_depths(self.parents), mask)

    def result(self) -> SeqDraft:
        return SeqDraft(list(self.tokens), list(self.parents), None)


class DraftModelDrafter(DrafterBase):
    """``Drafter`` backed by a small Llama-family model with its own slot KV cache.

    ``max_num_seqs`` bounds live sequences (one slot each, allocated on first sight, freed by
    ``release``); ``max_model_len`` bounds context + drafts per sequence (gamma is clamped to
    fit). ``tree_top_k`` is the branching factor of tree proposals (1 = always a chain).
    """

    name = "draft-model"
    stateful = True  # a KV cache per sequence, caught up after a pause

    def __init__(self, model: TargetModel, max_num_seqs: int, max_model_len: int, tree_top_k: int = 2,
                 name: str = "draft-model", vocab: DynamicVocab | None = None) -> None:
        check_at_least(1, max_num_seqs=max_num_seqs, max_model_len=max_model_len, tree_top_k=tree_top_k)
        self.model = model
        self.name = name
        self.tree_top_k = tree_top_k
        self.max_model_len = max_model_len
        self.kv = KVCache.for_model(model.cfg, max_num_seqs, max_model_len, model.dtype, model.device)
        self._slots: dict[int, int] = {}  # seq_id -> KV slot
        self._cached: dict[int, list[int]] = {}  # seq_id -> token ids whose draft K/V is valid
        self._generators: dict[int, torch.Generator] = {}  # seq_id -> draft sampler stream
        self.vocab = vocab  # a draft vocabulary (EvoSpec): the LM head runs over V_t's rows only
        self._snapshot: VocabSnapshot | None = None  # the V_t of the propose in progress

    @property
    def wants_hidden(self) -> bool:
        """A dynamic vocabulary retrieves with the target's final hidden states."""
        return self.vocab is not None and self.vocab.cfg.dynamic

    def cost_signature(self) -> str:
        return api.network_signature(self.model)

    def vocab_output(self, lm: torch.Tensor) -> api.VocabOutput:
        """Its own LM head's rows for every token (``lm``, the target's rows, is not needed)."""
        rows = output_matrix(self.model)  # [V, H]
        return api.VocabOutput(lambda ids: rows[ids.to(rows.device)], None, False)

    @property
    def num_live(self) -> int:
        return len(self._slots)

    def propose(self, inputs: list[DraftInput]) -> DraftProposal:
        """Catch every sequence up in one forward, then draft all of them step by step, batched."""
        seen: set[int] = set()
        jobs: list[tuple[int, _ChainJob | _TreeJob]] = []
        catchup: list[_Feed] = []
        for inp in inputs:
            if inp.seq_id in seen:
                raise ValueError(f"sequence {inp.seq_id} appears twice in one propose call")
            seen.add(inp.seq_id)
            ctx = inp.token_ids
            if not ctx:
                raise ValueError(f"sequence {inp.seq_id} has an empty context")
            gamma = min(inp.num_speculative_tokens, self.max_model_len - len(ctx) + 1)
            if gamma < 1:
                continue  # context (plus one draft) does not fit the draft cache: no speculation
            slot = self._slot_for(inp)
            keep = min(_common_prefix(self._cached[inp.seq_id], ctx), len(ctx) - 1)
            self.kv.set_length(slot, keep)
            self._cached[inp.seq_id] = list(ctx)
            catchup.append(_Feed(slot, list(ctx[keep:]), keep, [len(ctx) - keep - 1]))
            job: _ChainJob | _TreeJob
            if inp.tree and self.tree_top_k > 1:
                job = _TreeJob(slot, len(ctx), gamma, self.tree_top_k)
            else:
                job = _ChainJob(slot, len(ctx), gamma, inp.params, self._generators[inp.seq_id],
                                len(ctx) - inp.num_prompt_tokens)
            jobs.append((inp.seq_id, job))
        if not jobs:
            return DraftProposal()
        self._snapshot = self.vocab.snapshot if self.vocab is not None else None  # V_t swaps between steps
        for (_, job), logits in zip(jobs, self._forward(catchup)):
            job.consume(logits)
        while True:
            active = [job for _, job in jobs if not job.done]
            if not active:
                break
            for job, logits in zip(active, self._forward([job.next_feed() for job in active])):
                job.consume(logits)
        drafts: dict[int, SeqDraft] = {}
        for seq_id, job in jobs:
            if isinstance(job, _ChainJob):
                # the fed drafts (all but the last) keep their K/V: reused when accepted
                self._cached[seq_id].extend(job.tokens[:-1])
            self.kv.set_length(job.slot, len(self._cached[seq_id]))
            drafts[seq_id] = job.result()
        return DraftProposal(drafts)

    def observe(self, observations: list[Observation]) -> None:
        """Catch-up happens at ``propose`` by comparing contexts; a draft vocabulary records the
        verified tokens (and retrieves off the step)."""
        if self.vocab is not None:
            self.vocab.observe(observations)

    def release(self, seq_id: int) -> None:
        """Free a finished sequence's slot (unknown ids are ignored)."""
        slot = self._slots.pop(seq_id, None)
        if slot is None:
            return
        self.kv.free(slot)
        del self._cached[seq_id]
        del self._generators[seq_id]

    def _slot_for(self, inp: DraftInput) -> int:
        slot = self._slots.get(inp.seq_id)
        if slot is not None:
            return slot
        slot = self.kv.allocate()
        if slot is None:
            raise RuntimeError(f"draft KV cache is full ({self.kv.num_slots} slots): "
                               "release finished sequences or raise max_num_seqs")
        self._slots[inp.seq_id] = slot
        self._cached[inp.seq_id] = []
        self._generators[inp.seq_id] = make_generator(draft_seed(inp.params.seed), self.model.device)
        return slot

    def _forward(self, feeds: list[_Feed]) -> list[torch.Tensor]:
        """One ragged forward over all feeds; returns per feed its logits rows [len(rows), V]."""
        device = self.model.device
        ids = torch.tensor([t for f in feeds for t in f.tokens], dtype=torch.int64, device=device)  # [T]
        layout = BatchLayout.build([len(f.tokens) for f in feeds], [f.ctx_len for f in feeds],
                                   [f.slot for f in feeds], depths=[f.depths for f in feeds],
                                   tree_masks=[f.mask for f in feeds], device=device)
        rows: list[int] = []
        start = 0
        for f in feeds:
            rows.extend(start + r for r in f.rows)
            start += len(f.tokens)
        logit_rows = torch.tensor(rows, dtype=torch.int64, device=device)  # [R]
        snap = self._snapshot
        out = self.model(ids, layout, self.kv, logits_rows=logit_rows if snap is None else logit_rows[:0])
        for f in feeds:
            self.kv.set_length(f.slot, f.ctx_len + len(f.tokens))
        if snap is not None:
            # the LM head over V_t's rows only; -inf elsewhere, so argmax, top-k and the softmax
            # (renormalised over V_t) of the jobs below never see a token outside V_t
            h = out.last_hidden.index_select(0, logit_rows)  # [R, H] after the final norm
            dtype = torch.promote_types(h.dtype, torch.float32)
            logits = torch.full((h.shape[0], self.model.cfg.vocab_size), float("-inf"), dtype=dtype, device=device)
            logits[:, snap.ids] = torch.nn.functional.linear(h, snap.rows).to(dtype)  # [R, V]
        elif out.logits is None:
            raise RuntimeError("draft forward returned no logits")
        else:
            logits = out.logits
        return list(logits.split([len(f.rows) for f in feeds]))  # [len(rows), V] each


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix. Example: ``_common_prefix([1, 2, 3], [1, 2, 4]) == 2``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def truncated_on(target: TargetModel, num_layers: int, device: torch.device) -> TargetModel:
    """The target's first ``num_layers`` layers as a draft model on ``device``: sharing the
    target's weights on its own device, else a copy of them moved there (``placement.module_copy``;
    embedding, those layers, final norm and LM head, once at build time)."""
    draft = target.truncated(num_layers)
    if not placement.elsewhere(device, target.device):
        return draft
    if device.type != "cpu" and any(isinstance(m, QuantizedLinear) for m in draft.modules()):
        raise ConfigError(f"the draft-model drafter cannot move the quantized target's layers to {device} "
                          f"(CPU kernels): give it its own --draft-model PATH there")
    return placement.module_copy(draft, device)


@dataclass
class DraftModelOptions:
    path: str | None = opt(None, "draft model path (same tokenizer); default: the target truncated",
                           flag="--draft-model")
    layers: int = opt(0, "draft model: use the target's first k layers (0 = use --draft-model)",
                      flag="--draft-layers")
    tree_top_k: int = opt(2, "draft model trees: children per node", flag="--tree-top-k")

    def __post_init__(self) -> None:
        check_at_least(0, draft_layers=self.layers)
        check_at_least(1, tree_top_k=self.tree_top_k)


def _build(ctx: BuildContext) -> DraftModelDrafter:
    dm: DraftModelOptions = ctx.options
    target = ctx.target
    if dm.path and not dm.layers:
        loaded = load_model(dm.path, dtype=target.dtype, device=str(ctx.device))
        if loaded.model.cfg.vocab_size != target.cfg.vocab_size:
            raise ConfigError(f"draft model vocab ({loaded.model.cfg.vocab_size}) differs from the target's "
                              f"({target.cfg.vocab_size}): drafter and target must share a tokenizer")
        draft = loaded.model
        tune_linears(draft)  # its own projections run the fastest kernel per row count (CPU; cached per machine)
    else:
        draft = truncated_on(target, dm.layers or max(1, target.cfg.num_layers // 4), ctx.device)
    return DraftModelDrafter(draft, max_num_seqs=ctx.max_num_seqs, max_model_len=ctx.max_model_len,
                             tree_top_k=dm.tree_top_k)


DRAFTER = DrafterKind("draft-model", DraftModelDrafter, _build, options=DraftModelOptions,
                      summary="a small model sharing the target's tokenizer (default: the target's first layers)")
