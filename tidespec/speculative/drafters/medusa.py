"""The Medusa drafter: K heads on the target's last hidden state draft K tokens at once, no forward per token.

Why this exists: the field guide's Medusa (Cai et al. 2024), the learned drafter a CPU can afford. The
engine hands every drafter that ``wants_hidden`` the target's final hidden state of each newly final
position (``Observation.hidden``, computed by every forward anyway); the row that produced a sequence's
last token is all Medusa needs. Head k drafts the k-th token after it from that one state
(``models/medusa/heads.py``): a chain is the K heads' top tokens; a tree (``--tree``) takes each
head's ``--medusa-top-k`` candidates and keeps the likeliest ``gamma`` paths by the product of the
heads' probabilities (Medusa's sparse candidate tree), verified with the tree masks every drafter uses.
Sampled requests draw each head's token from its tempered distribution, which verification's
rejection sampling takes as the draft distribution (the heads do not see the earlier draft tokens, a
proposal rejection sampling allows): lossless like every drafter.

Worked example (greedy, gamma 3, 4 heads): the last token ``t`` came from hidden ``h``; the heads' top
tokens over the draft vocabulary are [a, b, c, d] -> draft [a, b, c]. With ``--tree`` and top-k 2, head 1
gives a (0.6) / a' (0.35), head 2 b (0.5) / b' (0.4): the paths by probability are a (.6), a' (.35),
a->b (.3), a->b' (.24), a'->b (.175): gamma 3 keeps tokens [a, a', b] with parents [-1, -1, 0].
"""

from __future__ import annotations

import fcntl
import heapq
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tidespec.config import EngineConfig, Section, SpecConfig, opt
from tidespec.errors import ConfigError
from tidespec.files import latest_version
from tidespec.models.eagle3.checkpoint import SEED_LOCK_NAME, shipped_bootstrap
from tidespec.models.medusa.heads import (
    CONFIG,
    MedusaConfig,
    MedusaConfigError,
    MedusaHeads,
    check_fit,
    latest_published,
    publish_heads,
)
from tidespec.models.target import TargetModel, output_matrix
from tidespec.sampling import make_generator, row_argmax, sample_from, seeded_draw, target_probs
from tidespec.speculative.api import DrafterBase, DraftInput, DraftProposal, Observation, SeqDraft
from tidespec.speculative.drafters.draft_model import draft_seed
from tidespec.speculative.registry import BuildContext, DrafterKind

log = logging.getLogger(__name__)
SHIPPED = "medusa-smollm2-135m-instruct"  # the embedded model's heads, a directory beside the EAGLE-3 head


@dataclass
class MedusaOptions(Section):
    dir: str | None = opt(None, "Medusa: a heads directory (medusa_config.json + medusa_heads.safetensors, "
                                "`tidespec train-medusa`) or a publish root of versions (v1/, v2/, LATEST: "
                                "`train-drafter --drafter medusa`, --online-training); none = the shipped heads on "
                                "the embedded model, "
                                "zero-initialised heads elsewhere (each repeats the target's next token: "
                                "lossless, rarely accepted)")
    heads: int = opt(4, "Medusa: heads of a zero-initialised set (no --medusa-dir)", min=1, max=16)
    vocab: int = opt(8192, "Medusa: draft vocabulary of a zero-initialised set (the target's first N ids)", min=1)
    top_k: int = opt(2, "Medusa trees (--tree): candidates per head; the tree keeps the --num-speculative-tokens "
                        "likeliest paths", min=1, max=16)


class MedusaDrafter(DrafterBase):
    """Drafts from each sequence's last final hidden state (kept by ``observe``); a sequence whose last
    token did not come from an observed row (a step that drafted forced tokens, a prefix reused without
    its hidden rows) is cold for a step."""

    name = "medusa"
    wants_hidden = True
    drafts_from_hidden = True  # the profiler hands it random hidden states to time its drafting

    def __init__(self, heads: MedusaHeads, lm: torch.Tensor, vocab_size: int, top_k: int = 2, version: int = 0,
                 versioned: bool = False) -> None:
        self.lm = lm  # [V, H] the target's LM-head rows (its own weights, not a copy)
        self.vocab_size = vocab_size
        self.top_k = top_k
        self.version = version  # the published version drafting (``versioned``: from a publish root)
        self.versioned = versioned
        self.last: dict[int, tuple[int, torch.Tensor]] = {}  # seq -> (len(token_ids) then, hidden [H])
        self.generators: dict[int, torch.Generator] = {}
        self._use(heads)

    def _use(self, heads: MedusaHeads) -> None:
        self.heads = heads
        device = heads.blocks[0].weight.device
        self.ids = torch.tensor(heads.cfg.vocab_ids, dtype=torch.int64, device=device)  # [N] target ids of the rows
        # [N, H] the LM-head rows of the draft vocabulary, in the heads' dtype (a proposal's one GEMM)
        self.rows = self.lm[self.ids.to(self.lm.device)].to(device=device, dtype=heads.dtype)

    def swap(self, version: int, heads: MedusaHeads) -> None:
        """Draft with ``heads`` (published as ``version``) from the next proposal on; called between steps
        (``online/serving/medusa_updates.py``). Each sequence's last hidden state is the target's, so
        nothing per sequence changes."""
        self._use(heads)
        self.version = version

    def cost_signature(self) -> str:
        return f"medusa K={self.heads.cfg.num_heads} N={len(self.ids)} {self.heads.dtype}"

    def observe(self, observations: list[Observation]) -> None:
        for o in observations:
            if o.hidden is not None and o.num_new_cached and o.start + o.num_new_cached + 1 == len(o.token_ids):
                self.last[o.seq_id] = (len(o.token_ids), o.hidden[-1].detach().clone())
            else:
                self.last.pop(o.seq_id, None)

    def release(self, seq_id: int) -> None:
        self.last.pop(seq_id, None)
        self.generators.pop(seq_id, None)

    @torch.no_grad()
    def propose(self, inputs: list[DraftInput]) -> DraftProposal:
        out = DraftProposal()
        ready = [inp for inp in inputs if self.last.get(inp.seq_id, (-1,))[0] == len(inp.token_ids)]
        out.cold = {inp.seq_id for inp in inputs} - {inp.seq_id for inp in ready}
        if not ready:
            return out
        hidden = torch.stack([self.last[inp.seq_id][1] for inp in ready]).to(self.heads.dtype)  # [B, H]
        # only the heads some sequence drafts with: head k's cost is an N x H product, most of a proposal's
        depth = max(min(inp.num_speculative_tokens, self.heads.cfg.num_heads) for inp in ready)
        states = self.heads(hidden, depth)  # [depth, B, H]
        flat = states.reshape(-1, states.shape[-1]) @ self.rows.T  # [depth * B, N]: one GEMM
        logits = flat.float().reshape(depth, len(ready), -1)  # [depth, B, N]
        greedy_top = self.ids[row_argmax(logits)].tolist()  # [depth][B]: one host read for the batch
        for b, inp in enumerate(ready):
            gamma = min(inp.num_speculative_tokens, self.heads.cfg.num_heads)
            if inp.params.greedy and inp.tree and self.top_k > 1:
                out.drafts[inp.seq_id] = self._tree(logits[:, b], inp.num_speculative_tokens)
            elif inp.params.greedy:
                out.drafts[inp.seq_id] = SeqDraft([greedy_top[k][b] for k in range(gamma)])
            else:
                out.drafts[inp.seq_id] = self._sampled(logits[:gamma, b], inp)
        return out

    def _sampled(self, logits: torch.Tensor, inp: DraftInput) -> SeqDraft:
        """logits [g, N] -> g tokens, each drawn from its head's tempered distribution, with [g, V] draft
        probabilities (zero outside the draft vocabulary) for rejection sampling."""
        q = target_probs(logits, inp.params)  # [g, N]
        full = torch.zeros(q.shape[0], self.vocab_size, dtype=q.dtype, device=q.device)  # [g, V]
        full[:, self.ids] = q
        position = len(inp.token_ids) - inp.num_prompt_tokens  # the output position of the first draft
        tokens = []
        for k in range(q.shape[0]):
            if inp.params.seed is not None:
                index = seeded_draw(q[k], inp.params.seed, position + k, self.ids, self.vocab_size)
            else:
                index = sample_from(q[k], self._generator(inp))
            tokens.append(int(self.ids[index]))
        return SeqDraft(tokens, draft_probs=full)

    def _generator(self, inp: DraftInput) -> torch.Generator:
        if inp.seq_id not in self.generators:
            self.generators[inp.seq_id] = make_generator(draft_seed(inp.params.seed))
        return self.generators[inp.seq_id]

    def _tree(self, logits: torch.Tensor, budget: int) -> SeqDraft:
        """logits [K, N] -> the ``budget`` likeliest paths through each head's top-k (module docstring).
        A child's probability product is below its parent's, so a parent is always taken first."""
        probs, index = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)  # [K, k]
        p, tok = probs.tolist(), self.ids[index].tolist()
        # (-score, level, candidate, parent index in the draft)
        heap: list[tuple[float, int, int, int]] = [(-p[0][i], 0, i, -1) for i in range(self.top_k)]
        tokens: list[int] = []
        parents: list[int] = []
        while heap and len(tokens) < budget:
            neg, level, i, parent = heapq.heappop(heap)
            tokens.append(tok[level][i])
            parents.append(parent)
            if level + 1 < len(p):
                me = len(tokens) - 1
                for j in range(self.top_k):
                    heapq.heappush(heap, (neg * p[level + 1][j], level + 1, j, me))
        return SeqDraft(tokens, parents)


def medusa_options(spec: SpecConfig) -> MedusaOptions:
    """The Medusa options in ``spec`` (the defaults when it has none)."""
    return spec.options_for("medusa", MedusaOptions)


def draft_dtype(target: TargetModel) -> torch.dtype:
    """bfloat16 on a CPU: a proposal's cost is reading the output rows (N x H, 19 MB in float32 for
    8,192 x 576), measured 1.6-5.9 ms in float32 against 0.5-1.0 ms in bfloat16 for 1-4 heads on the
    2-core EPYC; the drafter's precision changes which drafts are accepted, never the output. Else the
    target's dtype."""
    return torch.bfloat16 if target.device.type == "cpu" else target.dtype


def heads_for(options: MedusaOptions, target: TargetModel) -> tuple[MedusaHeads, int]:
    """The heads ``--medusa-dir`` names (a heads directory; a publish root: its newest valid version), else
    the shipped ones where they fit the target, else zero-initialised; with the version they were published
    as (-1: not from a publish root)."""
    path, dtype = options.dir, draft_dtype(target)
    if path is None:
        return default_heads(options, target, dtype)[0], -1
    if not (Path(path) / CONFIG).is_file() and latest_version(path) is not None:
        found = latest_published(Path(path), target.cfg.hidden_size, target.cfg.vocab_size, dtype, target.device)
        if found is None:
            raise ConfigError(f"--medusa-dir {path}: no published version of its heads fits this target")
        return found[1], found[0]
    try:
        heads = MedusaHeads.load(path, dtype, target.device)
        check_fit(heads.cfg, target.cfg.hidden_size, target.cfg.vocab_size)
    except MedusaConfigError as exc:
        raise ConfigError(f"--medusa-dir {path}: {exc}") from None
    return heads, -1


def default_heads(options: MedusaOptions, target: TargetModel, dtype: torch.dtype) -> tuple[MedusaHeads, str]:
    """The shipped heads where they fit the target (the embedded model), else zero-initialised ones; with
    which of the two ("shipped", "zero")."""
    boot = shipped_bootstrap()
    shipped = boot.parent / SHIPPED if boot is not None else None
    if shipped is not None and shipped.is_dir():
        heads = MedusaHeads.load(shipped, dtype, target.device)
        if heads.cfg.hidden_size == target.cfg.hidden_size and heads.cfg.target_vocab_size == target.cfg.vocab_size:
            return heads, "shipped"
    log.warning("Medusa: zero-initialised heads (each repeats the target's next token), the shipped ones do not fit")
    ids = list(range(min(options.vocab, target.cfg.vocab_size)))
    cfg = MedusaConfig(target.cfg.hidden_size, options.heads, ids, target.cfg.vocab_size)
    return MedusaHeads(cfg).to(dtype=dtype, device=target.device).eval(), "zero"


def seed_medusa_root(options: MedusaOptions, target: TargetModel) -> int | None:
    """With ``--online-training``: when the publish root ``--medusa-dir`` holds no heads that fit the target,
    publish the heads a server would start from (``default_heads``) there as its first version, so the
    trainer fine-tunes them and the server drafts with a version it can be judged against; returns that
    version, or None when the root already had one. A heads directory (not a root) is refused in one line."""
    if options.dir is None:
        raise ConfigError("online training of Medusa heads needs --medusa-dir (the heads' publish root)")
    root = Path(options.dir)
    if (root / CONFIG).is_file():
        raise ConfigError(f"--medusa-dir {root} holds one set of heads; online training needs a publish root "
                          "(a directory of v1/, v2/, ...): start from an empty directory")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / SEED_LOCK_NAME, "a+", encoding="utf-8") as lock:  # a fleet's replicas seed it once
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if latest_published(root, target.cfg.hidden_size, target.cfg.vocab_size) is not None:
            return None
        heads, source = default_heads(options, target, torch.float32)
        version = publish_heads(root, heads, {"bootstrap": source})
    log.info("online training: %s held no Medusa heads; published the %s heads there as v%d, which training "
             "fine-tunes", root, source, version)
    return version


def check_medusa(config: EngineConfig, options: MedusaOptions) -> None:
    """Medusa drafts where the target's hidden states are: on the target's device."""
    if config.spec.drafter_device and config.spec.drafter_device != config.model.device:
        raise ConfigError(f"the medusa drafter drafts on the target's device ({config.model.device}): its heads "
                          f"read the target's hidden states there; --drafter-device {config.spec.drafter_device} is "
                          "for drafters with copies of their own (eagle3, draft-model)")


def _build(ctx: BuildContext) -> MedusaDrafter:
    o: MedusaOptions = ctx.options
    heads, version = heads_for(o, ctx.target)
    return MedusaDrafter(heads, output_matrix(ctx.target), ctx.target.cfg.vocab_size, o.top_k, max(version, 0),
                         versioned=version >= 0)


DRAFTER = DrafterKind("medusa", MedusaDrafter, _build, options=MedusaOptions, prefix="medusa", check=check_medusa,
                      summary="Medusa heads on the target's last hidden state (K tokens from one state; trees)")
