"""Post-verify (PEARL): draft the next round while this one is verified.

While the target verifies a tree, the drafter drafts *ahead*: past the
tree's likeliest path, as if the verifier will accept all of it. When the
verdict comes, the ahead draft still applies only if the verifier did accept
exactly that path and its bonus token is one of the ahead tree's first
tokens; then the subtree below that token is the next round's draft, ready
at once. Otherwise it is dropped and the next round drafts as usual.

    guess = likeliest_path(tree)
    ahead = drafter.propose(context + guess, ...)   # while the target verifies `tree`
    accepted, bonus = verify(tree)
    next_tree = reuse_ahead(ahead, guess, accepted, bonus)  # or None: draft afresh

Pre-verify falls out of the same loop: with a draft length of 1 (what the
adaptive length gives when acceptance is poor) the first draft token goes to
the verifier while the drafter drafts the rest ahead of it.

Why sampling stays exact. The next round's tree must hold draws that are
fresh samples from their q given the verified context, independent of the
verifier's coins for that round. A reused subtree's draws were made by the
drafter from exactly that context (verified tokens, then the accepted guess,
then the bonus token), from the drafter's own random stream. Whether it is
reused depends only on the verdict and on the ahead tree's *first* draws,
all made before the draws below them; each draw below still is a fresh
sample given its ancestors, as in a tree drafted after the verdict.
"""

from __future__ import annotations

from typing import Sequence

from .tree import DraftTree


def likeliest_path(tree: DraftTree) -> list[int]:
    """Node ids of the path the drafter bets on: from the root, each node's first child.

    A chain is its own path; a fused tree lists nodes best-first, so its
    first child is the best-scoring one (`speculative.fusion`)."""
    path, node = [], -1
    while True:
        child = next((i for i, p in enumerate(tree.parents) if p == node), None)
        if child is None:
            return path
        path.append(child)
        node = child


def reuse_ahead(ahead: DraftTree, guess: Sequence[int], accepted: Sequence[int], bonus: int) -> DraftTree | None:
    """The next round's tree cut from `ahead` (drafted after the tokens `guess`), or
    None when the verdict (`accepted` tokens, then `bonus`) left it behind."""
    if list(accepted) != list(guess):
        return None
    first = next((i for i, (tok, p) in enumerate(zip(ahead.tokens, ahead.parents)) if p < 0 and tok == bonus), None)
    if first is None:
        return None
    return subtree(ahead, first)


def subtree(tree: DraftTree, top: int) -> DraftTree:
    """The nodes below `top` as a tree of their own (`top` becomes its root), with
    their draws in the order they were made and their confidence."""
    inside = {top: -1}  # old node -> new node (top: the root)
    for node, parent in enumerate(tree.parents):  # parents come before their children
        if parent in inside and node != top:
            inside[node] = len(inside) - 1
    out = DraftTree()
    for node, new in sorted(inside.items(), key=lambda kv: kv[1]):
        if node == top:
            continue
        out.tokens.append(tree.tokens[node])
        out.parents.append(inside[tree.parents[node]])
    if tree.confidence is not None and len(out):
        out.confidence = [tree.confidence[node] for node in sorted(inside, key=inside.get) if node != top]
    draws = [d for d, node in enumerate(tree.draw_nodes) if node != top and node in inside]
    out.draw_nodes = [inside[tree.draw_nodes[d]] for d in draws]
    if tree.draw_q is not None and draws:
        out.draw_q = tree.draw_q[draws]
    return out
