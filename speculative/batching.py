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

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from runtime.graphs import StaticPasses
from runtime.model import KVCache, Transformer
from .logprobs import TokenLogprob, token_logprobs
from .processing import Processor
from .sampling import SamplingParams, choice_scores, first_token, probabilities
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
    # the request's penalties, bias and grammar (speculative.processing), advanced past the
    # verdict's tokens; None: the target's distribution as it is
    processor: Processor | None = None
    extra_nodes: int = 0  # nodes the pass may add to the tree: the tokens a grammar forces
    # target layers whose outputs the row's drafter reads (EAGLE): the verdict then carries
    # them at the root and the accepted nodes (`Verdict.features`); None: not captured
    capture: Sequence[int] | None = None


@dataclass
class Verdict:
    path: list[int]  # the accepted nodes of `tree`
    bonus: int  # the target's own token after them
    tree: DraftTree  # the tree verified: the item's, less the nodes a grammar forbids, plus those it forces
    logprobs: list[TokenLogprob] | None = None  # of the accepted tokens and the bonus, when asked
    forced: int = 0  # tokens a grammar forced below the root (jump-forward), all accepted
    # the target's captured features [1 + len(path), F] at the root and the accepted nodes, in
    # path order: the positions this verdict verified (the bonus token's come next round)
    features: torch.Tensor | None = None

    @property
    def accepted(self) -> list[int]:
        return [self.tree.tokens[node] for node in self.path]


def verify_batch(model: Transformer, cache: KVCache, items: list[VerifyItem],
                 static: StaticPasses | None = None) -> list[Verdict]:
    """One forward for all `items`; returns each item's verdict. `static`: static-shape passes
    over `cache` (runtime/graphs.py: CUDA graphs), which run the pass when its shape fits a
    bucket and no item asks for features; else the eager pass runs."""
    if len({it.row for it in items}) != len(items):
        raise ValueError("two items in one batch share a cache row")
    items, forced = zip(*(_prepared(it) for it in items))
    forced_of = {it.row: n for it, n in zip(items, forced)}
    device = model.device
    capture = _capture(items)
    width = max(1 + len(it.tree) for it in items)
    if static is not None and capture is None and static.serves(cache):
        # only the items' rows take part, in row order: a static pass reads its rows by index
        ordered = sorted(items, key=lambda it: it.row)
        rows_of = [it.row for it in ordered]
        starts = [cache.lengths[r] for r in rows_of]
        if static.fits(len(ordered), width, max(starts) + width):
            tokens, positions, mask, starts, real = _inputs(dict(enumerate(ordered)), len(ordered), width, starts)
            logits = static(tokens, positions, mask, rows_of, real=real, view=cache if static.paged else None)
            return _verdicts(cache, items, {row: i for i, row in enumerate(rows_of)}, rows_of, starts, real, logits,
                             None, forced_of)
    first = min(it.row for it in items)
    rows = max(it.row for it in items) + 1 - first
    cache = cache.rows_view(first, first + rows)  # the batch's row r is the cache's row first + r
    by_row = {it.row - first: it for it in items}
    tokens, positions, mask, starts, real = _inputs(by_row, rows, width, cache.lengths[:rows])
    capture_rows, feature_rows = _capture_rows(by_row, real) if capture is not None else (None, None)
    logits = model(tokens.to(device), positions.to(device), cache, mask.to(device), real=real, capture=capture,
                   capture_rows=capture_rows)
    features = None
    if capture is not None:  # the same pass's hidden states at the capturing rows' tokens
        logits, features = logits
    return _verdicts(cache, items, {it.row: it.row - first for it in items}, list(range(rows)), starts, real,
                     logits, features, forced_of, feature_rows)


def _capture_rows(by_row: dict, real: Sequence[int]) -> tuple[list[int], dict[int, int]]:
    """The packed rows (root and tree) of the pass rows whose item captures features, and
    where each such pass row's first one lies among them: a batch's other rows copy none."""
    rows, first_of, offset = [], {}, 0
    for r, n in enumerate(real):
        it = by_row.get(r)
        if it is not None and it.capture is not None:
            first_of[r] = len(rows)
            rows.extend(range(offset, offset + n))
        offset += n
    return rows, first_of


def _inputs(by_row: dict, rows: int, width: int, starts: Sequence[int]):
    """A pass's tokens, positions [rows, width] and mask [rows, width, span] (host tensors):
    pass row r holds by_row[r]'s root and tree after slot starts[r] (none: padding alone),
    each padding token seeing only itself; and each row's real token count."""
    starts = list(starts)
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
    return tokens, positions, mask, starts, real


def _verdicts(cache, items, pass_row: dict, rows: list[int], starts, real, logits, features, forced_of,
              feature_rows: dict[int, int] | None = None):
    """Each item's verdict from the pass's packed logits; the rows' caches keep the root's and
    the accepted nodes' entries (a row without an item rolls back). `pass_row[cache row]`
    is the item's pass row; `rows[r]` pass row r's row of `cache`; `feature_rows[r]` where
    pass row r's captured features start in `features`."""
    by_pass_row = {pass_row[it.row]: it for it in items}
    results, offset = {}, 0
    for r in range(len(rows)):
        it = by_pass_row.get(r)
        if it is None:
            cache.rollback(starts[r], row=rows[r])
            continue
        scores = logits[offset:offset + real[r]]
        offset += real[r]
        if it.on_scores is not None:
            it.on_scores([it.root_token] + it.tree.tokens, scores)
        verdict = _choose(it, scores, starts[r], forced_of[it.row])
        if it.capture is not None:
            at = feature_rows[r]
            verdict.features = features[at:at + real[r]][[0] + [node + 1 for node in verdict.path]]
        # keep the root's and the accepted nodes' keys and values, in path order
        cache.keep(starts[r], [0] + [node + 1 for node in verdict.path], row=rows[r])
        results[it.row] = verdict
    return [results[it.row] for it in items]


def _capture(items) -> tuple[int, ...] | None:
    """The layers the pass captures: those the items ask for (one target: the same for all)."""
    asked = {tuple(it.capture) for it in items if it.capture is not None}
    if len(asked) > 1:
        raise ValueError(f"items of one pass ask for different feature layers: {sorted(asked)}")
    return next(iter(asked), None)


def _prepared(it: VerifyItem) -> tuple[VerifyItem, int]:
    """The item with the tree its processor verifies (forbidden nodes out, forced ones in),
    and how many tokens were forced."""
    if it.processor is None:
        return it, 0
    tree, forced = it.processor.prepare(it.tree, it.extra_nodes)
    return (it if tree is it.tree else dataclasses.replace(it, tree=tree)), forced


def _choose(it: VerifyItem, scores: torch.Tensor, start: int, forced: int) -> Verdict:
    """The row's verdict from its scores [1+N, V], processed as the request asks; the
    processor then advances past the tokens chosen."""
    processed = scores if it.processor is None else it.processor.scores(scores, it.tree)
    if it.params.deterministic:  # the target's choice at each scored position: the root's next, each node's next
        choices = [start + 1] + [start + 1 + d for d in it.tree.depths]
        path, bonus = verify_greedy(it.tree, choice_scores(processed, it.params, choices))
    else:
        path, bonus = verify_sampling(it.tree, probabilities(processed, it.params), it.generator)
    verdict = Verdict(path, bonus, it.tree, forced=forced)
    if it.params.logprobs is not None:  # each emitted token from the row it was chosen after
        rows = [0] + [node + 1 for node in path]
        chosen = (processed if it.params.processed_logprobs else scores)[rows]
        verdict.logprobs = token_logprobs(chosen, verdict.accepted + [bonus], it.params.logprobs)
    if it.processor is not None:
        it.processor.advance(verdict.accepted + [bonus])
    return verdict


def first_verdict(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, position: int,
                  processor: Processor | None = None) -> Verdict:
    """The target's first token after a prefill, from its last position's `logits` [V], as a
    verdict on an empty tree (`sampling.first_token` chooses it, from the processed
    distribution when there is a processor, which then advances past it)."""
    processed = logits if processor is None else processor.scores(logits[None], DraftTree())[0]
    verdict = Verdict([], first_token(processed, params, generator, position), DraftTree())
    if params.logprobs is not None:
        chosen = processed if params.processed_logprobs else logits
        verdict.logprobs = token_logprobs(chosen[None], [verdict.bonus], params.logprobs)
    if processor is not None:
        processor.advance([verdict.bonus])
    return verdict
