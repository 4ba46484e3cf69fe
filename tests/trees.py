"""Reading draft trees in tests."""

from __future__ import annotations

from speculative.tree import DraftTree


def path_to(tree: DraftTree, node: int) -> list[int]:
    """`node` and its ancestors, top of the tree first."""
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]
