"""Verify the draft trees of several requests in one target forward pass.

Each request owns one row of a shared KV cache. A round writes every row's
root token and tree after that row's committed tokens, scores them in one
pass, verifies each row on its own, and keeps only the accepted entries.
The rows from the lowest to the highest one in the batch take part (slicing
the cache costs nothing, gathering rows would copy it); rows between them
with no work get one dummy token that attends only to itself and is rolled
back. A dummy row still costs attention over the batch's span, so the
batch starts at its lowest row, not at row 0.

Rows are padded to the widest tree for attention only: the linear layers
and the head, most of a pass's work, run on the real tokens alone
(`Transformer.forward`'s `real`), so one request's wide tree costs its own
tokens, not its width times every row of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from runtime.model import KVCache, Transformer
from .sampling import SamplingParams, choice_scores, probabilities
from .tree import DraftTree
from .verification import verify_greedy, verify_sampling


@dataclass
class VerifyItem:
    row: int                    # the request's cache row
    root_token: int             # last verified token, not yet in the cache
    tree: DraftTree
    params: SamplingParams
    generator: torch.Generator  # the request's own verifier stream
    # called with the tokens of the row's scored positions (root, then the tree's nodes)
    # and their scores [1+N, V], for drafters that learn from the target (Token Recycling)
    on_scores: Callable[[Sequence[int], torch.Tensor], None] | None = None


def verify_batch(model: Transformer, cache: KVCache, items: list[VerifyItem]) -> list[tuple[list[int], int]]:
    """One forward for all `items`; returns each item's (accepted nodes, bonus token)."""
    if len({it.row for it in items}) != len(items):
        raise ValueError("two items in one batch share a cache row")
    device = model.device
    first = min(it.row for it in items)
    rows = max(it.row for it in items) + 1 - first
    cache = cache.rows_view(first, first + rows)  # the batch's row r is the cache's row first + r
    by_row = {it.row - first: it for it in items}
    width = max(1 + len(it.tree) for it in items)
    starts = cache.lengths[:rows]
    span = max(starts) + width
    tokens = torch.zeros(rows, width, dtype=torch.long)
    positions = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, span, dtype=torch.bool)
    for r in range(rows):
        start, it = starts[r], by_row.get(r)
        n = 0
        if it is not None:
            n = 1 + len(it.tree)
            tokens[r, :n] = torch.tensor([it.root_token] + it.tree.tokens)
            positions[r, :n] = torch.tensor([start] + [start + d for d in it.tree.depths])
            mask[r, :n, :start] = True
            mask[r, :n, start:start + n] = it.tree.ancestors()
        for j in range(n, width):  # padding: sees only itself
            mask[r, j, start + j] = True
    real = [1 + len(by_row[r].tree) if r in by_row else 0 for r in range(rows)]
    logits = model(tokens.to(device), positions.to(device), cache, mask.to(device), real=real)
    results, offset = [], 0
    for r in range(rows):
        it = by_row.get(r)
        if it is None:
            cache.rollback(starts[r], row=r)
            continue
        scores = logits[offset:offset + real[r]]
        offset += real[r]
        if it.on_scores is not None:
            it.on_scores([it.root_token] + it.tree.tokens, scores)
        if it.params.deterministic:  # the target's choice at each scored position: the root's next, each node's next
            choices = [starts[r] + 1] + [starts[r] + 1 + d for d in it.tree.depths]
            path, bonus = verify_greedy(it.tree, choice_scores(scores, it.params, choices))
        else:
            path, bonus = verify_sampling(it.tree, probabilities(scores, it.params), it.generator)
        # keep the root's and the accepted nodes' keys and values, in path order
        cache.keep(starts[r], [0] + [node + 1 for node in path], row=r)
        results.append((r, path, bonus))
    order = {r: i for i, (r, _, _) in enumerate(results)}
    return [results[order[it.row - first]][1:] for it in items]
