"""Hand-traced tests for the draft-tree helpers (tidespec/speculative/tree.py)."""

from __future__ import annotations

import random

import pytest
import torch

from tidespec.speculative.api import SeqDraft
from tidespec.speculative.tree import build_tree_from_paths, children, path_to, tree_depths, tree_mask

# root ─┬─ 0 ─┬─ 1 ── 3
#       │     └─ 2
#       └─ 4
PARENTS = [-1, 0, 0, 1, -1]


def test_depths_hand_drawn_tree() -> None:
    assert tree_depths(PARENTS) == [0, 1, 1, 2, 0]
    assert tree_depths([-1, 0, 1, 2]) == [0, 1, 2, 3]
    assert tree_depths([]) == []


def test_mask_hand_drawn_tree() -> None:
    expected = torch.tensor(
        [
            # r  0  1  2  3  4
            [1, 0, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0, 0],  # 0
            [1, 1, 1, 0, 0, 0],  # 1
            [1, 1, 0, 1, 0, 0],  # 2
            [1, 1, 1, 0, 1, 0],  # 3
            [1, 0, 0, 0, 0, 1],  # 4
        ],
        dtype=torch.bool,
    )
    mask = tree_mask(PARENTS)
    assert mask.dtype == torch.bool and mask.shape == (6, 6)
    assert torch.equal(mask, expected)


def test_mask_of_chain_is_causal() -> None:
    assert torch.equal(tree_mask([-1, 0, 1]), torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_children_and_paths() -> None:
    assert children(PARENTS) == [[0, 4], [1, 2], [3], [], [], []]
    assert path_to(PARENTS, 3) == [0, 1, 3]
    assert path_to(PARENTS, 2) == [0, 2]
    assert path_to(PARENTS, 4) == [4]
    with pytest.raises(ValueError):
        path_to(PARENTS, 5)


def test_invalid_parents_rejected() -> None:
    for bad in ([0], [-1, 1], [-1, -2], [-1, 3, 0]):
        with pytest.raises(ValueError):
            tree_depths(bad)
        with pytest.raises(ValueError):
            tree_mask(bad)


def test_build_tree_dedups_shared_prefixes() -> None:
    tokens, parents = build_tree_from_paths([[5, 6, 7], [5, 8], [9], [5, 6], []])
    assert tokens == [5, 6, 7, 8, 9]
    assert parents == [-1, 0, 1, 0, -1]


def test_build_tree_single_path_is_chain_and_empty() -> None:
    assert build_tree_from_paths([[3, 3, 3]]) == ([3, 3, 3], [-1, 0, 1])
    assert build_tree_from_paths([]) == ([], [])
    # the same token may repeat along a path and under different parents, never among siblings
    assert build_tree_from_paths([[1, 1], [2, 1], [1, 2]]) == ([1, 1, 2, 2, 1], [-1, 0, 0, -1, 3])


def test_build_tree_random_paths_roundtrip() -> None:
    rng = random.Random(0)
    for _ in range(50):
        paths = [[rng.randrange(3) for _ in range(rng.randrange(1, 5))] for _ in range(rng.randrange(1, 6))]
        tokens, parents = build_tree_from_paths(paths)
        SeqDraft(tokens, parents)  # validates topological order
        kids = children(parents)
        for sibs in kids:
            assert len({tokens[c] for c in sibs}) == len(sibs)
        # every input path is a root path of the tree, and every node lies on some input path prefix
        node_paths = {tuple(tokens[i] for i in path_to(parents, j)) for j in range(len(tokens))}
        prefixes = {tuple(p[:k]) for p in paths for k in range(1, len(p) + 1)}
        assert node_paths == prefixes
        assert len(tokens) == len(prefixes)
        # mask row j+1 marks exactly the path to j (plus the root)
        mask = tree_mask(parents)
        for j in range(len(tokens)):
            cols = {0} | {i + 1 for i in path_to(parents, j)}
            assert set(torch.nonzero(mask[j + 1]).flatten().tolist()) == cols
