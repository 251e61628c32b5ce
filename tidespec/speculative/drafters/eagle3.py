"""The EAGLE-3 ``Drafter``: chains and EAGLE-2 dynamic trees from the head in ``models.eagle3_head``.

Why this exists: TIDE (Sec. 3.2) drafts with an EAGLE-3 head that reads the target's own hidden
states (taps), and a head the trainer process publishes can be swapped in between engine steps
(``load_state``). The head's computation (one step, the token/tap pairing, the d2t map) is
described in ``tidespec.models.eagle3.head``; this module owns the per-sequence drafting state
(trees grow in ``eagle3_tree``).

Drafter state per sequence: the taps ``observe`` handed over, the head's own K/V for every
position whose tap row and next token are final (one slot of a ``KVCache`` with a layer per head
layer; extended over the pending taps at the next ``propose``, so steps without speculation cost no
head forward), plus the last position's output (pre-norm hidden and logits), which starts the next proposal.
Speculative positions are written past the cached length and simply forgotten afterwards (the
rollback is not advancing the length).

Worked example (context ``t0..t4``, target KV holds t0..t3, taps h0..h3 observed)::

    head KV: positions 0..3 from (h0,t1) (h1,t2) (h2,t3) (h3,t4); last output g3, logits z3
    chain gamma=3: d1 = argmax z3; (g3, d1) at pos 4 -> d2; (g4', d2) at pos 5 -> d3
    after propose the head KV length is 4 again

Steps without taps. While speculation is off the engine runs exactly plain decoding: no taps, so
the sequence's taps get a hole. The head then restarts its context at the first position that has
taps again (``SeqState.base``): head position j holds the pair (h_{base+j}, t_{base+j+1}), and
since rotary attention depends only on position differences this is exactly the head attending
over the window after the hole. The first step with taps again drafts nothing for the sequence
(it is *cold*, reported in ``DraftProposal.cold``); the next one drafts. Example: taps h0..h9,
then 5 steps without, then taps from position 15 on -> base 15, head position 0 = (h15, t16).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tidespec.config import HEAD_QUANTIZATIONS
from tidespec.models.eagle3.checkpoint import fresh_head, head_from_published, load_drafter_source, shipped_bootstrap
from tidespec.models.eagle3.compiled import CompiledHeadStep, HeadSteps
from tidespec.models.eagle3.graphs import HeadGraphs
from tidespec.models.eagle3.head import Eagle3Config, Eagle3ConfigError, Eagle3Head, quantized_head
from tidespec.models.execution import placement
from tidespec.models.execution.graphs import uses_graphs
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.models.loading.loader import DTYPES
from tidespec.models.target import TargetModel
from tidespec.sampling import SamplingParams, make_generator, row_argmax, sample_from, seeded_draw, target_probs
from tidespec.speculative.api import (
    DrafterBase,
    DraftInput,
    DraftProposal,
    Observation,
    SeqDraft,
    VocabOutput,
    network_signature,
)
from tidespec.speculative.drafters.draft_model import draft_seed
from tidespec.speculative.drafters.eagle3_options import NAME, Eagle3Options, check_eagle3, head_quantization
from tidespec.speculative.drafters.eagle3_state import CatchUp, DraftVocab, SeqState, confident_prefix, drawn_prob
from tidespec.speculative.drafters.eagle3_tree import TreeJob, grow_trees
from tidespec.speculative.registry import BuildContext, DrafterKind
from tidespec.speculative.vocab.dynamic import DynamicVocab

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Drafter
# ----------------------------------------------------------------------------------------------


@dataclass
class Eagle3DrafterConfig:
    """Drafter-side knobs (the head's shape lives in ``Eagle3Config``)."""

    max_num_seqs: int = 32  # KV slots = sequences tracked at once
    max_model_len: int = 2048  # head KV positions per sequence (context + drafts)
    tree_depth: int = 5  # EAGLE-2: expansion depth
    tree_top_k: int = 4  # EAGLE-2: children per expanded node and frontier width
    tree_budget: int = 0  # tokens kept after the global rerank; 0 = the sequence's gamma
    retain_taps: bool = True  # keep every tap row so a weight swap can rebuild the head KV exactly
    quantization: str = "none"  # draft with an int8 / int4 / w8a8 copy of the head (CPU; models.eagle3.head.quantized_head)
    min_draft_prob: float = 0.0  # chains stop once the product of their drafts' head probabilities is below this
    # catch up and draft greedy chains through ``models.eagle3_graphs`` (CUDA graphs on a GPU; on
    # a CPU their static bodies run uncaptured, which only the tests want)
    graphs: bool = False
    # --compile: with graphs, inductor-compiles the head's step before capturing it; on a CPU without them,
    # the catch-ups and greedy chain steps over the head's own vocabulary run compiled (models/eagle3/compiled.py)
    compile: bool = False

    def __post_init__(self) -> None:
        if self.quantization not in HEAD_QUANTIZATIONS:
            raise Eagle3ConfigError(f"quantization must be one of {', '.join(HEAD_QUANTIZATIONS)}, "
                                    f"got {self.quantization!r}")
        if self.max_num_seqs < 1:
            raise Eagle3ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise Eagle3ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.tree_depth < 1 or self.tree_top_k < 1:
            raise Eagle3ConfigError(f"tree_depth and tree_top_k must be >= 1, got {self.tree_depth}, {self.tree_top_k}")
        if self.tree_budget < 0:
            raise Eagle3ConfigError(f"tree_budget must be >= 0, got {self.tree_budget}")
        if not 0.0 <= self.min_draft_prob < 1.0:
            raise Eagle3ConfigError(f"min_draft_prob must be in [0, 1), got {self.min_draft_prob}")


class Eagle3Drafter(DrafterBase):
    """``Drafter`` running an ``Eagle3Head`` beside the target (name ``"eagle3"``).

    The engine must run the target with ``tap_layers=self.tap_layers`` and pass the taps of
    every newly final position through ``observe`` (also while speculation is off, so the head
    KV stays aligned). ``propose`` drafts only for sequences whose head KV covers the context
    up to the last token; others get no draft.

    Weight swap (``load_state``): every sequence is marked stale; with ``retain_taps`` its head
    KV is recomputed from the retained taps on its next ``observe``/``propose`` (exactly what a
    fresh drafter with the new weights would hold). With ``retain_taps=False`` the old K/V and
    last output are kept (computed by the old weights) and new positions use the new weights —
    acceptance may be a little lower until those sequences finish. Either way losslessness does
    not depend on it: the target verifies every draft.

    Quantized drafting (``cfg.quantization`` int8/int4): ``head`` keeps the float weights and
    ``served``, an int8/int4 copy rebuilt at every ``load_state``, computes the drafts (about 2.5x
    cheaper per draft token on a 2-core CPU, docs/benchmarks/drafters.md). With "none" they are
    the same module. A dynamic V_t is then drafted over through its snapshot's int8 output layer.

    CUDA graphs (``cfg.graphs``, set on a GPU unless --enforce-eager): the catch-up and greedy
    chains over the head's own vocabulary replay ``models.eagle3_graphs.HeadGraphs`` (one host
    read per proposal); trees, sampled chains and a dynamic V_t take the eager path.
    """

    name = "eagle3"
    stateful = True  # a head KV cache per sequence, caught up after a pause
    versioned = True  # published heads, swapped in by online training

    def __init__(self, head: Eagle3Head, embed: nn.Embedding, cfg: Eagle3DrafterConfig | None = None,
                 version: int = 0, vocab: DynamicVocab | None = None) -> None:
        self.cfg = cfg if cfg is not None else Eagle3DrafterConfig()
        if embed.weight.shape != (head.cfg.target_vocab_size, head.cfg.hidden_size):
            raise Eagle3ConfigError(
                f"embedding {tuple(embed.weight.shape)} does not match the head "
                f"({head.cfg.target_vocab_size}, {head.cfg.hidden_size})")
        self.head = head.eval()  # the float weights: what swaps, rollbacks, adapters and V_t's rows read
        self.served = quantized_head(self.head, self.cfg.quantization)  # what drafts: the head or its int8/int4 copy
        self.embed = embed
        self.version = version
        self.kv = self._new_kv()
        self.vocab = vocab  # a dynamic draft vocabulary (EvoSpec), else the head's own
        self._own_ids = self._head_ids()
        self._states: dict[int, SeqState] = {}
        self._untracked: set[int] = set()  # first seen with no free slot: later taps would be misaligned
        self._graphs: HeadGraphs | None = None  # built on first use (cfg.graphs), over the served head
        self._steps = HeadSteps()  # compiled steps (cfg.compile without graphs), built on first use

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.head.cfg.tap_layers

    @property
    def num_live(self) -> int:
        return len(self._states)

    @property
    def wants_hidden(self) -> bool:
        """A dynamic vocabulary retrieves with the target's final hidden states."""
        return self.vocab is not None and self.vocab.cfg.dynamic

    def cost_signature(self) -> str:
        return network_signature(self.head, self.cfg.quantization)

    def own_ids(self) -> list[int]:
        """The target ids of the head's own draft vocabulary."""
        return self._own_ids.tolist()

    def vocab_output(self, lm: torch.Tensor) -> VocabOutput:
        """Its own rows for its own tokens, the target's LM-head rows ``lm`` [V, H] mapped into its
        space for the others; a head drafting in int8 or int4 drafts over V_t in int8."""
        own = self.own_ids()
        return VocabOutput(lambda ids: self.head.output_rows(ids, lm), own if len(own) < lm.shape[0] else None,
                           self.cfg.quantization != "none")

    def _head_ids(self) -> torch.Tensor:
        """[draft_vocab] target id of each of the head's own logits."""
        return self.head.draft_to_target(torch.arange(self.head.cfg.draft_vocab_size, device=self.head.device))

    def _vocab(self) -> DraftVocab:
        """The vocabulary to draft over now (read once per ``propose``: V_t swaps between steps)."""
        if self.vocab is None:
            return DraftVocab(-1, self._own_ids, None)
        snap = self.vocab.snapshot
        return DraftVocab(snap.version, snap.ids, snap.weights)

    def _new_kv(self) -> KVCache:
        c = self.head.cfg
        return KVCache(c.num_layers, self.cfg.max_num_seqs, self.cfg.max_model_len, c.num_kv_heads, c.head_dim,
                       self.head.dtype, self.head.device, spare_slot=self.cfg.graphs)

    def _head_graphs(self, vocab: DraftVocab) -> HeadGraphs | None:
        """The head's graphs when they can serve this proposal: ``cfg.graphs``, the head's own draft
        vocabulary (a dynamic V_t changes size between steps), float weights, the embedding on the
        head's device. Rebuilt after a swap that replaced the head or its cache."""
        if (not self.cfg.graphs or vocab.rows is not None or self.served is not self.head
                or self.embed.weight.device != self.head.device):
            return None
        if self._graphs is None or not self._graphs.serves(self.head, self.embed, self.kv):
            self._graphs = HeadGraphs(self.head, self.embed, self.kv, capture=self.head.device.type == "cuda",
                                      compile=self.cfg.compile)
        return self._graphs

    def _compiled_step(self, vocab: DraftVocab) -> CompiledHeadStep | None:
        """The compiled step (``cfg.compile`` without graphs, the head's own vocabulary) for the served
        head: a kept one for a head rolled back to (``HeadSteps``)."""
        if not self.cfg.compile or self.cfg.graphs or vocab.rows is not None:
            return None
        return self._steps.step(self.served, self.kv)

    def warm_up(self, max_gamma: int) -> float:
        """Capture the head's CUDA graphs for chains of up to ``max_gamma`` drafts now (``cfg.graphs``, the head's
        own vocabulary), or compile its CPU step (``cfg.compile`` without graphs); else nothing. Returns seconds."""
        vocab = self._vocab()
        graphs, compiled = self._head_graphs(vocab), self._compiled_step(vocab)
        if compiled is not None:
            return compiled.warm_up(self.served, max_gamma + 1)
        return graphs.warm_up(max_gamma) if graphs is not None else 0.0

    # -- weights ---------------------------------------------------------------------------------

    def prepare(self, state_dict: dict[str, torch.Tensor], config: Eagle3Config | None = None) -> Eagle3Head | None:
        """The int8/int4 drafting copy of weights about to be swapped in, built where they were loaded
        (an updater's thread; ~45 ms for SmolLM2's head) so ``load_state`` does not quantize on the
        engine thread. None when the head drafts with its float weights."""
        if self.cfg.quantization == "none":
            return None
        return quantized_head(self._built(config or self.head.cfg, state_dict), self.cfg.quantization, in_place=True)

    def _built(self, config: Eagle3Config, state_dict: dict[str, torch.Tensor]) -> Eagle3Head:
        """A new head of ``config`` holding ``state_dict``, in the served head's dtype and device."""
        head = Eagle3Head(config).to(dtype=self.head.dtype, device=self.head.device)
        head.load_state_dict(state_dict)
        return head.eval()

    def load_state(self, version: int, state_dict: dict[str, torch.Tensor], config: Eagle3Config | None = None,
                   served: Eagle3Head | None = None) -> None:
        """Swap in new head weights (between engine steps). A different ``config`` (e.g. another
        draft vocabulary) rebuilds the head; attention-shape changes also reallocate the KV.
        ``served``: the drafting copy ``prepare`` built from the same weights (else built here)."""
        with torch.no_grad():
            if config is not None and config != self.head.cfg:
                if config.tap_layers != self.head.cfg.tap_layers:
                    raise Eagle3ConfigError(f"tap layers changed {self.head.cfg.tap_layers} -> {config.tap_layers}")
                old = self.head
                self.head = self._built(config, state_dict)
                if ((config.num_kv_heads, config.head_dim, config.num_layers)
                        != (old.cfg.num_kv_heads, old.cfg.head_dim, old.cfg.num_layers)):
                    self.kv = self._new_kv()
                    for st in self._states.values():
                        st.slot = self._allocate_slot()
            else:
                self.head.load_state_dict(state_dict)
            if served is None or served.cfg != self.head.cfg:
                served = quantized_head(self.head, self.cfg.quantization)
            self.served = served
        self._own_ids = self._head_ids()
        if self.vocab is not None:
            self.vocab.refresh()  # V_t's output rows come from the new head (republished off the step)
        self.version = version
        for st in self._states.values():
            st.stale = True

    # -- protocol --------------------------------------------------------------------------------

    def release(self, seq_id: int) -> None:
        self._untracked.discard(seq_id)
        st = self._states.pop(seq_id, None)
        if st is not None:
            self.kv.free(st.slot)

    @torch.inference_mode()
    def observe(self, observations: list[Observation]) -> None:
        """Keep each sequence's taps for its newly final positions. The head's forward over them
        is deferred to the sequence's next ``propose`` (``_sync``, one batched catch-up over
        everything pending): a step whose sequences do not speculate (the policy chose gamma 0)
        then costs a tap copy, not a head forward, and a sequence that never speculates again
        never pays for one."""
        kept: tuple[torch.dtype, torch.device, int] | None = None  # read once, at the first taps: each walks modules
        for obs in observations:
            st = self._state(obs.seq_id)
            if st is None:
                continue
            if len(obs.token_ids) > len(st.tokens):
                st.tokens.extend(obs.token_ids[len(st.tokens):])  # final tokens only grow: no copy of the context
            if obs.num_new_cached <= 0 or st.lost:
                continue
            if obs.taps is None:
                st.hole = True  # a step without taps: the next taps restart the head's context
                continue
            if obs.start < 0 and st.hole:
                st.lost = True  # cannot tell where the taps resume
                continue
            kept = kept or (self.head.dtype, self.head.device, self.head.cfg.tap_size)  # a step without taps never reads
            dtype, device, tap_size = kept
            if tuple(obs.taps.shape) != (obs.num_new_cached, tap_size):
                raise ValueError(f"taps for sequence {obs.seq_id} have shape {tuple(obs.taps.shape)}, "
                                 f"expected ({obs.num_new_cached}, {tap_size})")
            if obs.start >= 0 and obs.start != st.base + st.taps.end:
                self._restart(st, obs.start)
            st.hole = False
            # copy: the engine may reuse its tap buffer, and a view would pin the whole batch's taps
            st.taps.append(obs.taps.to(dtype=dtype, device=device, copy=True))
        if self.vocab is not None:
            self.vocab.observe(observations)

    @torch.inference_mode()
    def propose(self, inputs: list[DraftInput]) -> DraftProposal:
        ready: list[tuple[DraftInput, SeqState]] = []
        seen: set[int] = set()
        for inp in inputs:
            if inp.seq_id in seen:
                raise ValueError(f"sequence {inp.seq_id} appears twice in one propose call")
            seen.add(inp.seq_id)
            st = self._state(inp.seq_id)
            if st is None:
                continue
            if len(inp.token_ids) > len(st.tokens):
                st.tokens = list(inp.token_ids)
            ready.append((inp, st))
        vocab = self._vocab()
        self._sync([st for _, st in ready], vocab)
        proposal = DraftProposal()
        chains: list[tuple[DraftInput, SeqState, int]] = []
        trees: list[TreeJob] = []
        for inp, st in ready:
            n = len(inp.token_ids)
            if st.lost:
                continue
            if st.base + st.taps.end < n - 1:
                proposal.cold.add(inp.seq_id)  # no taps up to the last position yet (after a hole)
                continue
            if st.base + st.kv_len != n - 1 or st.last_logits is None or st.tokens[:n] != list(inp.token_ids):
                continue  # head KV does not cover the context up to the last token
            if st.logits_vocab != vocab.version and st.last_hidden is not None:  # V_t changed since
                st.last_logits = self.served.logits(st.last_hidden[None], vocab.rows)[0]
                st.logits_vocab = vocab.version
            room = self.cfg.max_model_len - st.kv_len
            if inp.tree:
                budget = self.cfg.tree_budget or inp.num_speculative_tokens
                # levels 1..depth-1 each keep up to top_k rows in the cache past kv_len
                depth = min(self.cfg.tree_depth, budget, 1 + room // self.cfg.tree_top_k)
                if depth >= 1:
                    trees.append(TreeJob(inp.seq_id, st, budget, depth))
            else:
                gamma = min(inp.num_speculative_tokens, room)
                if gamma >= 1:
                    chains.append((inp, st, gamma))
        if chains:
            proposal.drafts.update(self._propose_chains(chains, vocab))
        if trees:
            for job, draft in zip(trees, self._propose_trees(trees, vocab)):
                proposal.drafts[job.seq_id] = draft
        return proposal

    # -- internals -------------------------------------------------------------------------------

    def _allocate_slot(self) -> int:
        slot = self.kv.allocate()
        if slot is None:
            raise RuntimeError("no free head KV slot")
        return slot

    def _state(self, seq_id: int) -> SeqState | None:
        st = self._states.get(seq_id)
        if st is None:
            slot = None if seq_id in self._untracked else self.kv.allocate()
            if slot is None:
                self._untracked.add(seq_id)  # more live sequences than slots: never drafted for
                return None
            # the draft sampler draws on the head's device (a CUDA tensor needs a CUDA generator)
            st = SeqState(slot=slot, generator=make_generator(None, self.head.device))
            self._states[seq_id] = st
        return st

    def _restart(self, st: SeqState, position: int) -> None:
        """Start the sequence's head context afresh at context ``position`` (after a hole)."""
        st.restart(position)
        self.kv.set_length(st.slot, 0)

    def _embed(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.embed.weight.device)
        return self.embed(ids).to(dtype=self.head.dtype, device=self.head.device)  # [T, H]

    def _sync(self, states: list[SeqState], vocab: DraftVocab | None = None) -> None:
        """Rebuild stale sequences and extend every sequence's head KV to
        ``min(taps held, tokens - 1)`` positions, in one ragged forward."""
        jobs: list[CatchUp] = []
        for st in states:
            if st.lost:
                continue
            if st.stale and self.cfg.retain_taps:
                st.kv_len, st.last_hidden, st.last_logits = 0, None, None
            st.stale = False
            end = min(st.taps.end, len(st.tokens) - 1 - st.base, self.cfg.max_model_len)
            if end > st.kv_len:
                jobs.append(CatchUp(st, st.kv_len, end))
        if not jobs:
            return
        taps = torch.cat([j.state.taps.rows(j.start, j.end) for j in jobs])  # [T, 3H]
        # head position i pairs tap i with the token after it
        tokens = [t for j in jobs for t in j.state.tokens[j.state.base + j.start + 1:j.state.base + j.end + 1]]
        q_lens, starts, slots = [j.end - j.start for j in jobs], [j.start for j in jobs], [j.state.slot for j in jobs]
        vocab = vocab if vocab is not None else self._vocab()
        graphs = self._head_graphs(vocab)
        found = graphs.catch_up(taps, tokens, q_lens, starts, slots) if graphs is not None else None
        if found is None:
            layout = BatchLayout.build(q_lens, starts, slots, device=self.head.device)
            last = torch.tensor(q_lens, device=self.head.device).cumsum(0) - 1  # [J] each job's last row
            compiled, embeds = self._compiled_step(vocab), self._embed(tokens)
            found = compiled(self.served, taps, embeds, layout, last) if compiled is not None else None
        if found is not None:
            last_hidden, last_logits = found  # [J, H], [J, Vd]: each job's last row
        else:
            out = self.served.step(self.served.fuse(taps), embeds, layout, self.kv)  # [T, H]
            last_hidden = out.index_select(0, last)  # [J, H]
            last_logits = self.served.logits(last_hidden, vocab.rows)  # [J, n]: only where drafting starts
        for i, j in enumerate(jobs):
            st = j.state
            st.kv_len = j.end
            st.last_hidden, st.last_logits = last_hidden[i], last_logits[i]
            st.logits_vocab = vocab.version
            self.kv.set_length(st.slot, st.kv_len)
            if not self.cfg.retain_taps:
                st.taps.drop_before(st.kv_len)

    def _draw(self, logits: torch.Tensor, ids: torch.Tensor, params: SamplingParams, gen: torch.Generator,
              position: int) -> tuple[int, torch.Tensor | None]:
        """logits [n] over target ids ``ids`` [n] -> (target token id, [V] draft probs over the target
        vocab, zero outside ``ids``, or None if greedy).

        ``position``: the output position the token is drafted for; a seeded request draws with the
        target's race noise there (``sampling.seeded_draw``), so draft and target agree more often."""
        if params.greedy:
            return int(ids[row_argmax(logits)].item()), None
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # a half-precision head's too
        q = target_probs(logits.unsqueeze(0), params)[0]  # [n]: the softmax renormalised over ids
        vocab = self.head.cfg.target_vocab_size
        if params.seed is not None:
            draft_id = seeded_draw(q, params.seed, position, ids, vocab)
        else:
            draft_id = sample_from(q, gen)
        full = torch.zeros(vocab, dtype=q.dtype, device=q.device)  # [V]
        full[ids] = q
        return int(ids[draft_id].item()), full

    def _propose_chains(self, chains: list[tuple[DraftInput, SeqState, int]], vocab: DraftVocab) -> dict[int, SeqDraft]:
        """Greedy / sampled chains, all sequences batched one token per forward.

        With ``min_draft_prob`` > 0 a chain also stops once the product of its drafts' probabilities
        under the head (greedy: the top probability; sampled: the drawn token's) falls below it: the
        head's confidence tracks how likely the target accepts (EAGLE-2), so the chain is not
        extended where a draft would likely be rejected yet cost a head step and a verification row.
        Example: probabilities 0.9, 0.5, 0.6 with min_draft_prob 0.3 -> products 0.9, 0.45, 0.27 ->
        the chain ends after its third draft (the first two keep it going)."""
        graphs = self._head_graphs(vocab)
        if graphs is not None and all(inp.params.greedy for inp, _, _ in chains):
            roots = [st.root_output() for _, st, _ in chains]
            found = graphs.chain(torch.stack([h for h, _ in roots]), torch.stack([z for _, z in roots]),
                                 [st.kv_len for _, st, _ in chains], [st.slot for _, st, _ in chains],
                                 max(g for _, _, g in chains))
            if found is not None:
                return {inp.seq_id: confident_prefix(ids[:g], tops, self.cfg.min_draft_prob)
                        for (inp, _, g), ids, tops in zip(chains, *found)}
        toks: dict[int, list[int]] = {}
        probs: dict[int, list[torch.Tensor]] = {}
        hidden: dict[int, torch.Tensor] = {}
        confident: dict[int, list[float]] = {}  # the chain's path probabilities: products of its drafts' so far
        floor = self.cfg.min_draft_prob
        roots = [st.root_output() for _, st, _ in chains]
        root_conf = self._confidence(torch.stack([logits for _, logits in roots])) if floor > 0 else None
        for i, ((inp, st, _), (root_hidden, root_logits)) in enumerate(zip(chains, roots)):
            gen = self._generator(inp, st)
            tok, p = self._draw(root_logits, vocab.ids, inp.params, gen, len(inp.token_ids) - inp.num_prompt_tokens)
            toks[inp.seq_id] = [tok]
            probs[inp.seq_id] = [p] if p is not None else []
            hidden[inp.seq_id] = root_hidden
            if root_conf is not None:
                confident[inp.seq_id] = [drawn_prob(root_conf[i], p, tok)]
        step, compiled = 1, self._compiled_step(vocab)
        # a compiled chain step's rows: one per live chain
        every = torch.arange(len(chains), device=self.head.device) if compiled is not None else None
        while True:
            live = [(inp, st) for inp, st, g in chains
                    if len(toks[inp.seq_id]) < g and confident.get(inp.seq_id, [1.0])[-1] >= floor]
            if not live:
                break
            fused = torch.stack([hidden[inp.seq_id] for inp, _ in live])  # [B, H]
            embeds = self._embed([toks[inp.seq_id][-1] for inp, _ in live])  # [B, H]
            layout = BatchLayout.build([1] * len(live), [st.kv_len + step - 1 for _, st in live],
                                       [st.slot for _, st in live], device=self.head.device)
            found = (compiled(self.served, None, embeds, layout, every[:len(live)], fused)
                     if compiled is not None and every is not None else None)
            out, logits = found if found is not None else self.served(fused, embeds, layout, self.kv, rows=vocab.rows)
            conf = self._confidence(logits) if floor > 0 else None
            for b, (inp, st) in enumerate(live):
                tok, p = self._draw(logits[b], vocab.ids, inp.params, st.generator,
                                    len(inp.token_ids) - inp.num_prompt_tokens + step)
                toks[inp.seq_id].append(tok)
                if p is not None:
                    probs[inp.seq_id].append(p)
                hidden[inp.seq_id] = out[b]
                if conf is not None:
                    path = confident[inp.seq_id]
                    path.append(path[-1] * drawn_prob(conf[b], p, tok))
            step += 1
        return {inp.seq_id: SeqDraft(toks[inp.seq_id], None,
                                     torch.stack(probs[inp.seq_id]) if probs[inp.seq_id] else None,
                                     token_probs=confident.get(inp.seq_id))
                for inp, _, _ in chains}

    @staticmethod
    def _confidence(logits: torch.Tensor) -> list[float]:
        """[B, n] logits -> each row's top probability (one host read for the batch)."""
        return torch.softmax(logits.float(), dim=-1).amax(dim=-1).tolist()

    def _generator(self, inp: DraftInput, st: SeqState) -> torch.Generator:
        """Per-sequence draft sampler, seeded once from the request seed (never equal to it)."""
        if not st.seeded:
            seed = draft_seed(inp.params.seed)
            if seed is not None:
                st.generator.manual_seed(seed)
            st.seeded = True
        return st.generator

    def _propose_trees(self, jobs: list[TreeJob], vocab: DraftVocab) -> list[SeqDraft]:
        """EAGLE-2 trees over ``vocab`` (``eagle3_tree.grow_trees``; one head forward per level)."""

        def step(fused: torch.Tensor, tokens: list[int], layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
            target_ids = vocab.ids[torch.tensor(tokens, device=vocab.ids.device)].tolist()
            return self.served(fused, self._embed(target_ids), layout, self.kv, rows=vocab.rows)

        drafts: list[SeqDraft] = []
        for ids, parents in grow_trees(jobs, self.cfg.tree_top_k, step, self.head.device):
            drafts.append(SeqDraft(vocab.ids[torch.tensor(ids, device=vocab.ids.device)].tolist(), parents, None))
        return drafts


def build_eagle3_drafter(target: TargetModel, source: str | Path | None, draft_vocab_size: int = 0,
                         cfg: Eagle3DrafterConfig | None = None, dtype: torch.dtype | None = None,
                         device: torch.device | None = None) -> Eagle3Drafter:
    """The EAGLE-3 drafter for ``target``, its head in ``dtype`` (None = the target's) on ``device``
    (None = the target's). On another device than the target's the drafter embeds its draft
    tokens with its own copy of the target's embedding there (in the head's dtype); only the taps
    cross devices (``Eagle3Drafter.observe`` moves them).

    ``source``: None -> a fresh random head (version 0; lossless anyway, it learns online);
    otherwise what ``load_drafter_source`` finds there (an exported checkpoint as version 0, or a
    publish root's newest valid version), or a fresh head when a publish root has none.
    ``draft_vocab_size`` (0 = full vocabulary) only shapes a fresh head.
    """
    pub = load_drafter_source(source, target.cfg) if source is not None else None
    if source is None:
        boot = shipped_bootstrap()
        log.warning("EAGLE-3 without --eagle3-dir: a fresh random head, whose drafts are rejected until a trained "
                    "head is published%s", f" (the embedded model's bootstrap head: --eagle3-dir {boot})" if boot else "")
    dtype = dtype if dtype is not None else target.dtype
    device = device if device is not None else target.device
    if pub is None:
        head, version = fresh_head(target.cfg, draft_vocab_size or None, dtype, device), 0
    else:
        head, version = head_from_published(pub, dtype, device), pub.version
    embed = target.embed_tokens
    if placement.elsewhere(device, target.device):
        embed = placement.embedding_copy(embed, device, dtype)
    return Eagle3Drafter(head, embed, cfg, version=version)

def _build(ctx: BuildContext) -> Eagle3Drafter:
    o: Eagle3Options = ctx.options
    return build_eagle3_drafter(ctx.target, o.dir, o.draft_vocab, Eagle3DrafterConfig(
        max_num_seqs=ctx.max_num_seqs, max_model_len=ctx.max_model_len, tree_depth=o.tree_depth,
        tree_top_k=o.tree_top_k, quantization=head_quantization(o.quantization, ctx.device),
        min_draft_prob=o.min_draft_prob, graphs=uses_graphs(ctx.device, ctx.enforce_eager), compile=ctx.compile),
        dtype=None if o.dtype == "auto" else DTYPES[o.dtype], device=ctx.device)


DRAFTER = DrafterKind(NAME, Eagle3Drafter, _build, options=Eagle3Options, prefix="eagle3", check=check_eagle3,
                      summary="an EAGLE-3 head over the target's hidden states (chains or EAGLE-2 trees)")
