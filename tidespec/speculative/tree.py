"""Pure helpers for draft trees stored as flattened parent lists.

Why this exists: the engine (tree attention mask, position ids), the verifier (walking accepted
paths) and every drafter that proposes trees must agree on one encoding. A tree of ``n`` draft
tokens is a list ``parents`` of length ``n`` in topological order: ``parents[j]`` is the index of
draft j's parent, or -1 when draft j is a child of the root (the last verified token). The
verification input is ``[root] + drafts``, so draft j sits at input index ``j + 1``.

Worked example used throughout this module (tokens in brackets)::

    root ─┬─ 0[a] ─┬─ 1[b] ── 3[d]
          │        └─ 2[c]
          └─ 4[e]

    parents = [-1, 0, 0, 1, -1]
    tree_depths(parents)   == [0, 1, 1, 2, 0]
    children(parents)      == [[0, 4], [1, 2], [3], [], [], []]   # index 0 = root, j + 1 = draft j
    path_to(parents, 3)    == [0, 1, 3]
"""

from __future__ import annotations

import numpy as np
import torch


def check_parents(parents: list[int]) -> None:
    """Raise ``ValueError`` unless every parent is -1 or an earlier index (a topological tree)."""
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"parent of draft {j} is {p}: must be -1 or an earlier index")


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each draft; 0 = child of the root (so position id = root position + depth + 1).

    Example: ``tree_depths([-1, 0, 0, 1, -1]) == [0, 1, 1, 2, 0]``.
    """
    check_parents(parents)
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def tree_mask(parents: list[int]) -> torch.Tensor:
    """Ancestor-or-self attention mask over the verification input ``[root] + drafts``.

    Returns a bool tensor ``[n + 1, n + 1]``: ``mask[i, j]`` is True iff input j is input i or an
    ancestor of it. The root is input 0 (ancestor of everything); draft j is input ``j + 1``.

    Example: ``parents = [-1, 0, -1]`` (root -> a -> b, root -> c) gives::

        [[1, 0, 0, 0],    # root
         [1, 1, 0, 0],    # a
         [1, 1, 1, 0],    # b sees root, a, itself
         [1, 0, 0, 1]]    # c sees root, itself
    """
    check_parents(parents)
    n = len(parents)
    mask = np.zeros((n + 1, n + 1), dtype=np.bool_)  # [n + 1, n + 1]
    mask[0, 0] = True
    for j, p in enumerate(parents):
        mask[j + 1] = mask[p + 1]  # inherit the parent's ancestors (p = -1 -> the root row)
        mask[j + 1, j + 1] = True
    return torch.from_numpy(mask)


def children(parents: list[int]) -> list[list[int]]:
    """Child lists indexed like the verification input: ``out[0]`` = children of the root,
    ``out[j + 1]`` = children of draft j, each in increasing draft index.

    Example: ``children([-1, 0, -1]) == [[0, 2], [1], [], []]``.
    """
    check_parents(parents)
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for j, p in enumerate(parents):
        out[p + 1].append(j)
    return out


def path_to(parents: list[int], node: int) -> list[int]:
    """Draft indices from the root's child down to ``node`` (inclusive); the root is not listed.

    Example: ``path_to([-1, 0, 0, 1, -1], 3) == [0, 1, 3]``.
    """
    check_parents(parents)
    if not 0 <= node < len(parents):
        raise ValueError(f"node {node} out of range for a tree of {len(parents)} drafts")
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    path.reverse()
    return path


def row_paths(tokens: list[int], parents: list[int] | None) -> list[list[int]]:
    """The draft tokens before each verification row of a draft (``tokens`` with ``parents``, None for
    a chain): row 0 follows the root alone, row ``j + 1`` follows the path down to draft ``j``.

    Example: tokens [5, 7, 9], parents [-1, 0, 0] -> ``[[], [5], [5, 7], [5, 9]]``; a chain [5, 7] ->
    ``[[], [5], [5, 7]]``.
    """
    if parents is None:
        return [list(tokens[:j]) for j in range(len(tokens) + 1)]
    out: list[list[int]] = [[]]
    for j, p in enumerate(parents):
        out.append(out[p + 1] + [tokens[j]])
    return out


def build_tree_from_paths(paths: list[list[int]]) -> tuple[list[int], list[int]]:
    """Merge candidate token paths (each starting below the root) into a prefix tree.

    Shared prefixes are stored once, so siblings always carry distinct tokens (tree verification
    needs that). Nodes are emitted in DFS preorder with children in first-insertion order, which
    is topological and keeps the first path as the chain ``[-1, 0, 1, ...]`` at the front.
    Empty paths are ignored.

    Example: ``paths = [[5, 6, 7], [5, 8], [9], [5, 6]]`` ->
    ``token_ids = [5, 6, 7, 8, 9]``, ``parent_indices = [-1, 0, 1, 0, -1]``.
    """
    # trie node = (token -> child index into `kids`); index 0 is the root
    kids: list[dict[int, int]] = [{}]
    toks: list[int] = [-1]
    for path in paths:
        node = 0
        for tok in path:
            nxt = kids[node].get(tok)
            if nxt is None:
                nxt = len(kids)
                kids.append({})
                toks.append(tok)
                kids[node][tok] = nxt
            node = nxt
    token_ids: list[int] = []
    parent_indices: list[int] = []
    stack: list[tuple[int, int]] = [(c, -1) for c in reversed(kids[0].values())]  # (trie node, parent draft index)
    while stack:
        node, parent = stack.pop()
        idx = len(token_ids)
        token_ids.append(toks[node])
        parent_indices.append(parent)
        stack.extend((c, idx) for c in reversed(kids[node].values()))
    return token_ids, parent_indices


def rerank_tree(scores: list[float], parents: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Keep the ``budget`` candidates with the highest cumulative log-probability, as a tree.

    ``parents[j]`` indexes an earlier candidate or is -1 (root child); ``scores`` are cumulative
    path log-probabilities (a child never scores above its parent). A candidate is kept only
    when its parent is kept, so the result is always a tree; ties go to the shallower, earlier
    candidate. Returns (kept candidate indices in topological order, their parents re-indexed).

    Example: scores [-0.1, -1.0, -0.3, -2.0], parents [-1, -1, 0, 2], budget 3
    -> order by score: 0, 2, 1 -> kept [0, 1, 2] -> parents [-1, -1, 0].
    """
    depths = tree_depths(parents)
    order = sorted(range(len(scores)), key=lambda j: (-scores[j], depths[j], j))
    kept: set[int] = set()
    for j in order:
        if len(kept) >= budget:
            break
        if parents[j] < 0 or parents[j] in kept:
            kept.add(j)
    topo = sorted(kept, key=lambda j: (depths[j], j))
    new_index = {j: i for i, j in enumerate(topo)}
    return topo, [new_index[parents[j]] if parents[j] >= 0 else -1 for j in topo]
