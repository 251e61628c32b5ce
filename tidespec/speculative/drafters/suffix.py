"""Suffix decoding (Snowflake Arctic, arXiv 2411.04975): model-free drafts from suffix-tree statistics.

Why this exists: prompt lookup copies one earlier span; suffix decoding instead counts *every*
earlier continuation of the matched suffix — in this request (prompt + output so far) and in the
outputs of past requests — and speculates the empirically likely ones, as a chain or a tree,
with a speculation length proportional to how long the match is (long matches are reliable).

Representation. A bounded-depth suffix trie node is identified with the set of corpus positions
where its pattern ends: its count is the size of that set, its children are the distinct tokens
that follow those positions, and descending to a child filters the set. ``SuffixIndex`` keeps
only the token buffer and answers trie queries with vectorised numpy filters, so memory is
O(tokens) instead of O(tokens x depth) Python nodes (a 64-deep trie of a 2000-token request
would be ~128k objects), appending is O(1) per token, and a proposal costs a few dozen small
array operations. Documents are separated by ``SEP`` so no pattern spans two of them.

Probabilities. A child's empirical probability is ``count(child) / count(parent)``, where the
parent count only includes occurrences that have a next token (the current context's own
occurrence at the end of the corpus has none and would otherwise dilute every estimate).
Path probabilities multiply along the path; nodes below ``min_prob`` are pruned.

Proposal for one sequence (hand-traceable):
  1. match: the longest suffix of the context (at most ``max_depth - gamma`` tokens, at least 1)
     that occurs earlier with a continuation, separately in the request index and the global one;
  2. budget = ``min(gamma, ceil(factor * match_length))`` (the paper's MAX_SPEC = alpha * p);
  3. grow best-first from the matched node: repeatedly add the candidate with the highest path
     probability (ties: higher count, then most recent occurrence) until the budget is spent or
     the best candidate is below ``min_prob``. A chain proposal only ever offers the most frequent
     child of the last node (greedy); a tree proposal offers every child;
  4. score = sum of path probabilities (expected accepted tokens under the counts); the request
     candidate wins unless the global one scores strictly higher (the paper's choice between trees).

Worked example: request context ``[1, 2, 3, 1, 2, 4, 1, 2]``, gamma 4, factor 1, min_prob 0.1.
The longest earlier suffix is ``[1, 2]`` (ends at indices 1 and 4), so budget = min(4, 2) = 2.
Children of ``[1, 2]``: 3 (count 1, prob 0.5) and 4 (count 1, prob 0.5, more recent -> first).
Chain: ``[4, 1]`` (``[1, 2, 4]`` is followed by 1 with prob 1, path prob 0.5; score 1.0).
Tree: ``[4, 3]`` with parents ``[-1, -1]`` (4's child 1 also has path prob 0.5, and equal
candidates are taken in the order they were offered, so the sibling 3 goes first).

Nodes are output in best-first order, which is topological and non-increasing in path
probability, so any prefix of a proposal is itself a valid, most-likely subtree.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tidespec.config import opt
from tidespec.errors import ConfigError, check_at_least
from tidespec.speculative.api import DrafterBase, DraftInput, DraftProposal, Observation, SeqDraft
from tidespec.speculative.registry import BuildContext, DrafterKind

SEP = -1  # document separator in the token buffer; never a vocabulary id
_SMALL = 256  # occurrence sets up to this size are counted with a dict instead of np.unique


class SuffixIndex:
    """Documents of token ids with implicit suffix-trie queries, oldest-first eviction.

    Positions are indices into the live buffer region; they are only valid until the next
    append or eviction. The last document may be open (still growing): ``extend`` appends to it.

    Example::

        idx = SuffixIndex()
        idx.add_document([1, 2, 3, 1, 2])
        idx.count([1, 2]) == 2
        idx.child_counts([1, 2]) == {3: 1}      # the second [1, 2] ends its document
    """

    def __init__(self, capacity: int = 256) -> None:
        self._buf = np.full(max(capacity, 16), SEP, dtype=np.int32)  # [C] token ids and separators
        self._lo = 0  # start of the live region in _buf
        self._hi = 0  # end of the live region in _buf
        self._doc_lens: deque[int] = deque()  # token count of each document, oldest first
        self._open = False  # whether the last document still accepts tokens
        self.num_tokens = 0  # tokens held, separators excluded

    @property
    def num_documents(self) -> int:
        return len(self._doc_lens)

    @property
    def tokens(self) -> np.ndarray:
        """The live buffer, ``[N]``, documents separated by ``SEP`` (a view; do not keep)."""
        return self._buf[self._lo : self._hi]

    def _reserve(self, extra: int) -> None:
        if self._hi + extra <= self._buf.shape[0]:
            return
        live = self._hi - self._lo
        cap = self._buf.shape[0]
        while live + extra > cap // 2:
            cap *= 2
        new = np.full(cap, SEP, dtype=np.int32)  # [C']
        new[:live] = self._buf[self._lo : self._hi]
        self._buf, self._lo, self._hi = new, 0, live

    def _write(self, token_ids: list[int] | np.ndarray) -> None:
        arr = np.asarray(token_ids, dtype=np.int32)  # [n]
        if arr.size and int(arr.min()) < 0:
            raise ValueError("token ids must be >= 0")
        self._reserve(arr.shape[0] + 1)
        self._buf[self._hi : self._hi + arr.shape[0]] = arr
        self._hi += arr.shape[0]
        self.num_tokens += arr.shape[0]
        self._doc_lens[-1] += arr.shape[0]

    def extend(self, token_ids: list[int] | np.ndarray) -> None:
        """Append tokens to the open document (opening one if needed)."""
        if not self._open:
            self._start_document()
        self._write(token_ids)

    def add_document(self, token_ids: list[int] | np.ndarray) -> None:
        """Append a complete document (closes any open one first)."""
        self.close_document()
        self._start_document()
        self._write(token_ids)
        self.close_document()

    def _start_document(self) -> None:
        if self._doc_lens:  # every document but the oldest is preceded by one separator
            self._reserve(1)
            self._buf[self._hi] = SEP
            self._hi += 1
        self._doc_lens.append(0)
        self._open = True

    def close_document(self) -> None:
        self._open = False

    def evict_oldest(self) -> int:
        """Drop the oldest document; returns how many tokens it held."""
        if not self._doc_lens:
            raise ValueError("no document to evict")
        n = self._doc_lens.popleft()
        self._lo = min(self._lo + n + 1, self._hi)  # its tokens and the separator after it
        self.num_tokens -= n
        if not self._doc_lens:
            self._lo = self._hi = 0
            self._open = False
        return n

    def occurrences(self, pattern: list[int]) -> np.ndarray:
        """End positions (live-buffer indices) of every occurrence of ``pattern``, ``[K]``."""
        buf = self.tokens  # [N]
        if not pattern:
            raise ValueError("pattern must be non-empty")
        ends = np.flatnonzero(buf == pattern[-1])  # [K]
        for k in range(1, len(pattern)):
            ends = ends[ends >= k]
            ends = ends[buf[ends - k] == pattern[-1 - k]]
        return ends

    def count(self, pattern: list[int]) -> int:
        """Occurrences of ``pattern`` = the count of its trie node."""
        return int(self.occurrences(pattern).shape[0])

    def child_counts(self, pattern: list[int]) -> dict[int, int]:
        """Next-token counts after ``pattern`` = the counts of its trie node's children."""
        tokens, counts, _ = self.children_of(self.occurrences(pattern))
        return dict(zip(tokens.tolist(), counts.tolist()))

    def _continuable(self, ends: np.ndarray) -> np.ndarray:
        """Positions of the next token after each end that has one, ``[K']``."""
        nxt = ends + 1
        nxt = nxt[nxt < self._hi - self._lo]
        return nxt[self.tokens[nxt] != SEP]

    def children_of(self, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Children of the node whose occurrences end at ``ends``: distinct next tokens ``[C]``
        sorted best first (count desc, then most recent occurrence), their counts ``[C]``, and the
        next-token positions ``[K']`` (ascending) for descending into them."""
        nxt = self._continuable(ends)  # [K'] ascending
        toks = self.tokens[nxt]  # [K']
        if toks.shape[0] <= _SMALL:  # a dict beats np.unique's fixed cost on small sets
            counts: dict[int, int] = {}
            for tok in reversed(toks.tolist()):  # most recent first: insertion order breaks ties
                counts[tok] = counts.get(tok, 0) + 1
            ranked = sorted(counts.items(), key=lambda kv: -kv[1])  # stable
            return (
                np.fromiter((t for t, _ in ranked), dtype=np.int64, count=len(ranked)),
                np.fromiter((c for _, c in ranked), dtype=np.int64, count=len(ranked)),
                nxt,
            )
        uniq, rev_first, cnts = np.unique(toks[::-1], return_index=True, return_counts=True)  # [C] each
        order = np.lexsort((rev_first, -cnts))  # count desc, then most recent first
        return uniq[order], cnts[order], nxt

    def copy_after(self, end: int, num: int) -> np.ndarray:
        """Up to ``num`` tokens following position ``end`` within its document, ``[<= num]``."""
        rest = self.tokens[end + 1 : end + 1 + num]
        stop = np.flatnonzero(rest == SEP)
        return rest[: stop[0]] if stop.shape[0] else rest

    def longest_match(self, context: np.ndarray, max_len: int) -> tuple[int, np.ndarray]:
        """Longest suffix of ``context`` ([L], at most ``max_len`` tokens) that occurs with a
        next token; returns (match length, its occurrence end positions ``[K]``), (0, empty) if none.
        """
        buf = self.tokens  # [N]
        if context.shape[0] == 0 or buf.shape[0] == 0:
            return 0, np.empty(0, dtype=np.int64)
        ends = self._continuable(np.flatnonzero(buf == context[-1])) - 1  # [K]
        if ends.shape[0] == 0:
            return 0, ends
        limit = min(max_len, int(context.shape[0]))
        k = 1
        while k < limit:
            if ends.shape[0] == 1:
                return k + self._extend_single(int(ends[0]), context, k, limit), ends
            cand = ends[ends >= k]
            cand = cand[buf[cand - k] == context[-1 - k]]
            if cand.shape[0] == 0:
                break
            ends = cand
            k += 1
        return k, ends

    def _extend_single(self, end: int, context: np.ndarray, k: int, limit: int) -> int:
        """How many more tokens (beyond k) match backwards for the single occurrence ending at end."""
        room = min(limit - k, end - k + 1)
        if room <= 0:
            return 0
        corpus = self.tokens[end - k - room + 1 : end - k + 1][::-1]  # [room] going backwards
        ctx = context[context.shape[0] - k - room : context.shape[0] - k][::-1]  # [room]
        diff = np.flatnonzero(corpus != ctx)
        return int(diff[0]) if diff.shape[0] else room


@dataclass(order=True)
class _Candidate:
    neg_prob: float
    neg_count: int
    rank: int  # insertion order: keeps the children's best-first order among equals
    token: int = field(compare=False)
    parent: int = field(compare=False)
    ends: np.ndarray = field(compare=False)  # [K] positions of this node's last token


def grow_chain(index: SuffixIndex, ends: np.ndarray, budget: int, min_prob: float) -> tuple[list[int], list[float]]:
    """Greedy chain from the node whose occurrences end at ``ends``: follow the most frequent child
    while the path probability stays >= ``min_prob``. Returns (token_ids, their path probabilities).

    Once a single occurrence is left the rest is deterministic (probability 1 per step), so it is
    copied in one slice.
    """
    token_ids: list[int] = []
    probs: list[float] = []
    prob = 1.0
    while len(token_ids) < budget:
        if ends.shape[0] == 1:
            rest = index.copy_after(int(ends[0]), budget - len(token_ids)).tolist()
            return token_ids + rest, probs + [prob] * len(rest)
        toks, counts, nxt = index.children_of(ends)
        if toks.shape[0] == 0:
            break
        p = prob * int(counts[0]) / int(counts.sum())
        if p < min_prob:
            break
        tok = int(toks[0])
        token_ids.append(tok)
        probs.append(p)
        prob = p
        ends = nxt[index.tokens[nxt] == tok]
    return token_ids, probs


def grow_tree(
    index: SuffixIndex, ends: np.ndarray, budget: int, min_prob: float
) -> tuple[list[int], list[int], list[float]]:
    """Best-first tree from the node whose occurrences end at ``ends``: repeatedly add the offered
    candidate with the highest path probability (ties: higher count, then offer order), offering
    all its children above ``min_prob``. Returns (token_ids, parent_indices, path probabilities)."""
    token_ids: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    heap: list[_Candidate] = []
    rank = 0

    def offer(node_ends: np.ndarray, prob: float, parent: int) -> None:
        nonlocal rank
        toks, counts, nxt = index.children_of(node_ends)
        if toks.shape[0] == 0:
            return
        total = int(counts.sum())
        nxt_toks = index.tokens[nxt]  # [K']
        for tok, cnt in zip(toks[:budget].tolist(), counts[:budget].tolist()):  # more could never be taken
            p = prob * cnt / total
            if p < min_prob:
                break  # children are sorted by count, the rest are smaller
            heapq.heappush(heap, _Candidate(-p, -cnt, rank, tok, parent, nxt[nxt_toks == tok]))
            rank += 1

    offer(ends, 1.0, -1)
    while heap and len(token_ids) < budget:
        cand = heapq.heappop(heap)
        token_ids.append(cand.token)
        parents.append(cand.parent)
        probs.append(-cand.neg_prob)
        offer(cand.ends, -cand.neg_prob, len(token_ids) - 1)
    return token_ids, parents, probs


@dataclass
class _RequestState:
    index: SuffixIndex  # one open document: exactly the context seen so far
    num_prompt_tokens: int  # context length at first sight minus the first output token


class SuffixDrafter(DrafterBase):
    """Suffix decoding over a per-request index and a bounded global index of past outputs.

    The per-request index follows the context by diffing: whenever ``propose`` or ``observe``
    shows a longer context, the new tail is appended. What counts as "output" for the global
    index is everything after the context length at first sight minus one (the engine first
    shows a sequence once its prompt is prefilled and its first token sampled).
    """

    name: str = "suffix"
    model_free = True

    def __init__(
        self, max_depth: int = 64, max_tree_tokens: int = 20000, min_prob: float = 0.1, factor: float = 1.0
    ) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        if max_tree_tokens < 0:
            raise ValueError(f"max_tree_tokens must be >= 0, got {max_tree_tokens}")
        if not 0.0 <= min_prob < 1.0:
            raise ValueError(f"min_prob must be in [0, 1), got {min_prob}")
        if factor <= 0.0:
            raise ValueError(f"factor must be > 0, got {factor}")
        self.max_depth = max_depth
        self.max_tree_tokens = max_tree_tokens
        self.min_prob = min_prob
        self.factor = factor
        self.global_index = SuffixIndex()
        self._requests: dict[int, _RequestState] = {}

    @property
    def num_active_requests(self) -> int:
        return len(self._requests)

    def request_index(self, seq_id: int) -> SuffixIndex | None:
        state = self._requests.get(seq_id)
        return None if state is None else state.index

    def _sync(self, seq_id: int, token_ids: list[int]) -> _RequestState:
        """Bring the request's index up to ``token_ids``: append the new tail, or rebuild when the
        context no longer extends what was seen (checked on the last seen token, O(1))."""
        state = self._requests.get(seq_id)
        if state is None:
            state = _RequestState(SuffixIndex(len(token_ids) + 64), max(len(token_ids) - 1, 0))
            self._requests[seq_id] = state
        n_seen = state.index.num_tokens
        if n_seen and (len(token_ids) < n_seen or token_ids[n_seen - 1] != int(state.index.tokens[-1])):
            state.index = SuffixIndex(len(token_ids) + 64)
            n_seen = 0
        if len(token_ids) > n_seen:
            state.index.extend(token_ids[n_seen:])
        return state

    def _draft_one(self, inp: DraftInput) -> SeqDraft:
        state = self._sync(inp.seq_id, inp.token_ids)
        gamma = inp.num_speculative_tokens
        if gamma <= 0 or not inp.token_ids:
            return SeqDraft([])
        context = state.index.tokens  # [L] the request index holds exactly the context
        max_match = max(1, self.max_depth - gamma)
        best_ids: list[int] = []
        best_parents: list[int] | None = None
        best_probs: list[float] = []
        best_score = 0.0
        for index in (state.index, self.global_index):
            if best_score >= gamma:
                break  # no candidate can score more than gamma
            match_len, ends = index.longest_match(context, max_match)
            if match_len == 0:
                continue
            budget = min(gamma, math.ceil(self.factor * match_len))
            if inp.tree:
                ids, parents, probs = grow_tree(index, ends, budget, self.min_prob)
            else:
                (ids, probs), parents = grow_chain(index, ends, budget, self.min_prob), None
            score = sum(probs)
            if score > best_score:
                best_ids, best_parents, best_probs, best_score = ids, parents, probs, score
        if best_parents is not None and all(p == j - 1 for j, p in enumerate(best_parents)):
            best_parents = None  # a chain
        return SeqDraft(best_ids, best_parents, score=best_score, token_probs=best_probs)

    def propose(self, inputs: list[DraftInput]) -> DraftProposal:
        return DraftProposal(drafts={inp.seq_id: self._draft_one(inp) for inp in inputs})

    def observe(self, observations: list[Observation]) -> None:
        """Keep each request's index current, also through steps it did not speculate in, so a
        finished request's whole output reaches the global index. A request is first indexed with
        its first output token (all but the last token are then its prompt); a prompt chunk before
        the prompt's end (every observed token cached, none generated) is skipped."""
        for obs in observations:
            if obs.start >= 0 and obs.start + obs.num_new_cached >= len(obs.token_ids):
                continue
            self._sync(obs.seq_id, obs.token_ids)

    def release(self, seq_id: int) -> None:
        """Drop the request's index and add its output tokens to the global index (budgeted)."""
        state = self._requests.pop(seq_id, None)
        if state is None or self.max_tree_tokens == 0:
            return
        output = state.index.tokens[state.num_prompt_tokens :][-self.max_tree_tokens :]
        if output.shape[0] == 0:
            return
        self.global_index.add_document(output)
        while self.global_index.num_tokens > self.max_tree_tokens:
            self.global_index.evict_oldest()


@dataclass
class SuffixOptions:
    max_tree_tokens: int = opt(20000, "suffix drafter: global tree budget (tokens), oldest evicted first")
    min_prob: float = opt(0.1, "suffix drafter: prune candidates below this empirical probability")
    factor: float = opt(1.0, "suffix drafter: speculation length per matched token")

    def __post_init__(self) -> None:
        check_at_least(0, suffix_max_tree_tokens=self.max_tree_tokens)
        if not 0.0 <= self.min_prob < 1.0:
            raise ConfigError(f"suffix_min_prob must be in [0, 1), got {self.min_prob}")
        if not self.factor > 0.0:
            raise ConfigError(f"suffix_factor must be > 0, got {self.factor}")


def _build(ctx: BuildContext) -> SuffixDrafter:
    o: SuffixOptions = ctx.options
    return SuffixDrafter(max_tree_tokens=o.max_tree_tokens, min_prob=o.min_prob, factor=o.factor)


DRAFTER = DrafterKind("suffix", SuffixDrafter, _build, options=SuffixOptions, prefix="suffix",
                      summary="suffix decoding over this request's context and past outputs")
