"""Token co-occurrence graph: which tokens tend to follow a token (EvoSpec Sec. 3.3, App. A.3).

Why this exists: semantic retrieval (``index.py``) finds tokens whose LM-head rows align with the
target's hidden state, but misses rigid continuations — the pieces of a multi-token identifier,
a fixed collocation. EvoSpec expands each retrieved seed by its most likely successors in a
bigram graph built from a corpus; we build it from what we have and keep learning it from the
tokens the engine serves (``add``). Edges are pruned as in EvoSpec's Table 5: at least
``min_count`` observations, p(v|u) >= ``tau``, at most ``max_degree`` successors kept per token.

Also the unigram counts of the same streams, from which the static frequency core of a draft
vocabulary is taken (``most_frequent``).

Worked example::

    g = CooccurrenceGraph(GraphConfig(min_count=2, tau=0.3, max_degree=4))
    g.add([1, 2, 3, 1, 2, 4, 1, 2, 3])
    g.successors(1, k=8)    # [2]       (1 -> 2 seen 3 times: p = 1.0)
    g.successors(2, k=8)    # [3]       (2 -> 3 twice, p = 0.67; 2 -> 4 once: below min_count)
    g.most_frequent(2)      # [1, 2]    (1 and 2 three times each, ties by token id)
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from tidespec.errors import ConfigError, check_at_least


@dataclass(frozen=True)
class GraphConfig:
    min_count: int = 5  # observations an edge needs (EvoSpec: 5)
    tau: float = 1e-4  # smallest p(v|u) kept (EvoSpec: 1e-4)
    max_degree: int = 64  # successors kept per token (EvoSpec: 64)

    def __post_init__(self) -> None:
        check_at_least(1, graph_min_count=self.min_count, graph_max_degree=self.max_degree)
        if not 0.0 <= self.tau < 1.0:
            raise ConfigError(f"graph tau must be in [0, 1), got {self.tau}")


class CooccurrenceGraph:
    """Bigram successor counts and unigram counts over token streams."""

    def __init__(self, cfg: GraphConfig | None = None) -> None:
        self.cfg = cfg or GraphConfig()
        self.edges: defaultdict[int, Counter[int]] = defaultdict(Counter)  # u -> {v: count(u, v)}
        self.out_total: Counter[int] = Counter()  # u -> count(u, *)
        self.unigrams: Counter[int] = Counter()

    def add(self, tokens: Iterable[int], previous: int | None = None) -> None:
        """Count a stream (``previous``: the token before it, when the stream continues one)."""
        prev = previous
        for tok in tokens:
            tok = int(tok)
            self.unigrams[tok] += 1
            if prev is not None:
                self.edges[prev][tok] += 1
                self.out_total[prev] += 1
            prev = tok

    def successors(self, token: int, k: int) -> list[int]:
        """The ``k`` most likely successors of ``token`` that pass the pruning, most likely first."""
        counts = self.edges.get(token)
        if not counts:
            return []
        total = self.out_total[token]
        limit = min(k, self.cfg.max_degree)
        out: list[int] = []
        for tok, c in counts.most_common(limit):  # a heap of ``limit``: no sort of every successor
            if c < self.cfg.min_count or c / total < self.cfg.tau or len(out) >= limit:
                break
            out.append(tok)
        return out

    def most_frequent(self, n: int) -> list[int]:
        """The ``n`` most frequent tokens (ties by token id)."""
        return [t for t, _ in sorted(self.unigrams.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]

    @property
    def num_edges(self) -> int:
        return sum(len(c) for c in self.edges.values())
