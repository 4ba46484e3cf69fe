"""Accepting draft tokens so that the output is exactly the target's.

Both functions take the target's scores for the root (row 0, the last
verified token) and every tree node (row i+1), walk down from the root, and
return the accepted nodes plus one extra ("bonus") token drawn from the
target where the walk stopped.
"""

from __future__ import annotations

import torch

from .sampling import sample
from .tree import DraftTree


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Follow the target's argmax down the tree."""
    best = logits.argmax(dim=-1).tolist()
    path: list[int] = []
    node = -1
    while True:
        want = best[node + 1]
        child = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if child is None:
            return path, want
        path.append(child)
        node = child


def accept_draw(r: torch.Tensor, q: torch.Tensor, token: int, generator: torch.Generator) -> bool:
    """Speculative sampling's test: keep a token drawn from q with probability min(1, r/q)."""
    u = torch.rand((), generator=generator, device=r.device)
    return bool(u * q[token] < r[token])


def residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What is left of r after a rejected draw from q: normalised max(r - q, 0)."""
    rest = (r - q).clamp_min(0.0)
    total = rest.sum()
    return rest / total if total > 0 else r


def verify_sampling(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator,
                    accept=accept_draw) -> tuple[list[int], int]:
    """Multi-draft speculative sampling (SpecInfer's multi-step / recursive rejection).

    At each node the draws below it are tested in draw order against the
    target distribution r, and r becomes the residual after each rejection.
    Each draw being a fresh sample from its q makes the accepted token (or the
    bonus drawn from the final r) distributed exactly as the target.
    `accept` is a parameter only so tests can show a biased test is caught.
    """
    if tree.draw_q is None and len(tree):
        raise ValueError("sampling verification needs the draft distributions (draw_q)")
    path: list[int] = []
    node = -1
    while True:
        r = probs[node + 1]
        accepted = None
        for d, landed in enumerate(tree.draw_nodes):
            if tree.parents[landed] != node:
                continue
            q = tree.draw_q[d]
            token = tree.tokens[landed]
            if accept(r, q, token, generator):
                accepted = landed
                break
            r = residual(r, q)
        if accepted is None:
            return path, sample(r, generator)
        path.append(accepted)
        node = accepted
