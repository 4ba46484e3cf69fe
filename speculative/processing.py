"""What changes the target's distribution before each token is chosen, at every node of
a draft tree, each node with its own context.

A request's `Processor` holds its context (the prompt and the output verified so far)
and, with a grammar, its matcher at the output's end. The scores of a verification pass
come as rows: the root's (the last verified token) and one for each tree node, each the
target's logits for the token after it. Row r is processed as if decoding alone had
reached it: the penalties count the output plus the tokens on the path down to that
node, `min_tokens` counts the path too, and the grammar masks with its state after the
path. Verification then chooses exactly as it would from the processed distribution, so
the output is constrained decoding of the target alone (greedy: the same tokens;
sampling: the same distribution).

In order, as OpenAI and Hugging Face apply them: the repetition penalty on every token of
the prompt and the output (a positive logit divided by it, a negative one multiplied),
then the frequency and presence penalties on the output's tokens (logit - count *
frequency - (count > 0) * presence), then the logit bias, then `min_tokens` (the stop
tokens held back), then the grammar's mask.

Before a pass, `prepare` drops the nodes the grammar forbids when the choice is
deterministic (greedy, or keyed sampling: a forbidden token is never the argmax) and adds
the tokens the grammar forces after the verified output (jump-forward) as a chain below
the root, verified like any draft. Under rejection sampling forbidden nodes stay: a draw
dropped because of the token it drew would bias the test of the draws after it
(speculative.tree's `truncated` keeps draws for the same reason); the verifier rejects
them, since the processed distribution gives their tokens nothing.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .grammar import Grammars, Matcher
from .sampling import SamplingParams
from .tree import DraftTree, one_hot

MAX_FORCED = 16  # jump-forward tokens added to one round's tree at most


class Processor:
    """One request's logits processing, kept in step with its verified output."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int], vocab_size: int,
                 grammars: Grammars | None = None, stops: Sequence[int] = ()):
        """`stops`: the tokens that end the output besides `params.stop_token_ids` (the
        model's end-of-sequence tokens), held back for `min_tokens` too."""
        if params.grammar and grammars is None:
            raise ValueError("a grammar needs the target's tokenizer (Grammars)")
        self.params, self.vocab_size = params, vocab_size
        self.output: list[int] = []
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # prompt and output tokens (repetition)
        self.counts = torch.zeros(vocab_size)  # output tokens (frequency, presence)
        self.seen[torch.tensor(list(prompt), dtype=torch.long)] = True
        self.stops = set(params.stop_token_ids) | set(stops)
        self.finished = False  # the output ended (a stop token): nothing more is consumed
        self.matcher: Matcher | None = grammars.matcher(params.grammar) if params.grammar else None
        bias = params.logit_bias
        self.bias_ids = torch.tensor([t for t, _ in bias], dtype=torch.long)
        self.bias_values = torch.tensor([b for _, b in bias], dtype=torch.float32)

    @classmethod
    def resumed(cls, params: SamplingParams, prompt: Sequence[int], output: Sequence[int], vocab_size: int,
                grammars: Grammars | None = None, stops: Sequence[int] = ()) -> "Processor":
        """A processor after `output` (a request prefilled again, or restored)."""
        processor = cls(params, prompt, vocab_size, grammars, stops)
        processor.advance(output)
        return processor

    # ---- after each round -----------------------------------------------------

    def advance(self, tokens: Sequence[int]) -> None:
        """The output grew by `tokens` (accepted drafts and the bonus token)."""
        for token in tokens:
            if self.finished:
                return
            self.output.append(token)
            self.seen[token] = True
            self.counts[token] += 1
            if token in self.stops:
                self.finished = True  # the output ends here; a grammar does not go past it
            elif self.matcher is not None:
                self.matcher.consume(token)

    # ---- before a pass ----------------------------------------------------------

    def prepare(self, tree: DraftTree, room: int) -> tuple[DraftTree, int]:
        """The tree to verify: without the nodes the grammar forbids (a deterministic choice),
        with the tokens it forces added below the root (at most `room`); and how many it
        forced (the target takes them all: they are its processed distribution's only tokens)."""
        if self.matcher is None or self.finished:
            return tree, 0
        if self.params.deterministic and len(tree):
            tree = self._allowed(tree)
        forced = self.matcher.forced()[:min(room, MAX_FORCED)]
        if not forced:
            return tree, 0
        grown = DraftTree(list(tree.tokens), list(tree.parents), list(tree.draw_nodes), tree.draw_q,
                          None if tree.confidence is None else list(tree.confidence))
        # a forced token is the processed distribution's only one: drawn from a one-hot q it is
        # accepted whatever the test draws
        q = None if self.params.deterministic else one_hot(forced, self.vocab_size).to(_device(tree))
        grown.add_chain(forced, q, confidence=None if tree.confidence is None else [1.0] * len(forced))
        return grown, len(forced)

    def _allowed(self, tree: DraftTree) -> DraftTree:
        """The nodes of `tree` on paths the grammar allows, in their order."""
        masks = self._masks(tree)
        kept = [i for i in range(len(tree)) if masks[i + 1] is not None]
        if len(kept) == len(tree):
            return tree
        index = {old: new for new, old in enumerate(kept)}
        parents = [-1 if tree.parents[i] < 0 else index[tree.parents[i]] for i in kept]
        confidence = None if tree.confidence is None else [tree.confidence[i] for i in kept]
        return DraftTree([tree.tokens[i] for i in kept], parents, confidence=confidence)

    # ---- the pass's scores ------------------------------------------------------

    def scores(self, logits: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        """The processed logits [1+N, V] of a pass's rows (the root's, then each node's)."""
        paths = _paths(tree)
        out = logits.float().clone()
        p = self.params
        if p.repetition_penalty != 1.0:
            seen = self.seen.to(out.device).expand_as(out).clone()
            for r, path in enumerate(paths):
                seen[r, path] = True
            out = torch.where(seen, torch.where(out < 0, out * p.repetition_penalty, out / p.repetition_penalty), out)
        if p.frequency_penalty or p.presence_penalty:
            counts = self.counts.to(out.device).expand_as(out).clone()
            for r, path in enumerate(paths):
                counts[r].index_add_(0, torch.tensor(path, dtype=torch.long, device=out.device),
                                     torch.ones(len(path), device=out.device))
            out = out - counts * p.frequency_penalty - (counts > 0).float() * p.presence_penalty
        if len(self.bias_ids):
            out[:, self.bias_ids.to(out.device)] += self.bias_values.to(out.device)
        if p.min_tokens and self.stops:
            short = torch.tensor([len(self.output) + len(path) < p.min_tokens for path in paths], device=out.device)
            stops = torch.tensor(sorted(self.stops), dtype=torch.long, device=out.device)
            out[short.nonzero().flatten()[:, None], stops] = float("-inf")
        if self.matcher is not None and not self.finished:
            out = self._masked(out, tree)
        return out.to(logits.dtype)

    def _masked(self, out: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        """Each reachable row masked by the grammar's state after its path; a row the grammar
        leaves no token in (it wants the end, `min_tokens` holds it back) keeps the grammar's."""
        for r, mask in enumerate(self._masks(tree)):
            if mask is None:
                continue  # a node the grammar forbids: verification never reaches its row
            mask = mask.to(out.device)
            row = out[r].masked_fill(~mask, float("-inf"))
            if not torch.isfinite(row).any():
                row = torch.where(mask, torch.zeros_like(row), torch.full_like(row, float("-inf")))
            out[r] = row
        return out

    def _masks(self, tree: DraftTree) -> list[torch.Tensor | None]:
        """The grammar's mask after the root and after each node (None: a node the grammar
        forbids, or one below it), walking the tree depth first from the verified state."""
        m = self.matcher
        masks: list[torch.Tensor | None] = [None] * (1 + len(tree))
        masks[0] = m.mask()
        children: list[list[int]] = [[] for _ in range(1 + len(tree))]
        for node, parent in enumerate(tree.parents):
            children[parent + 1].append(node)
        path: list[int] = []
        stack = list(reversed(children[0]))
        while stack:
            node = stack.pop()
            parent = tree.parents[node]
            while path and path[-1] != parent:
                m.rollback(1)
                path.pop()
            token = tree.tokens[node]
            if not masks[parent + 1][token]:
                continue  # forbidden: neither it nor anything below it is ever accepted
            if token in self.stops:  # the output ends with it: nothing after it is verified
                masks[node + 1] = masks[parent + 1]
                continue
            m.consume(token)
            path.append(node)
            masks[node + 1] = m.mask()
            stack.extend(reversed(children[node + 1]))
        m.rollback(len(path))
        return masks


def _paths(tree: DraftTree) -> list[list[int]]:
    """The tokens from below the root down to each row: none for the root, then each node's
    path (its own token last)."""
    paths: list[list[int]] = [[]]
    for node, parent in enumerate(tree.parents):
        paths.append(paths[parent + 1] + [tree.tokens[node]])
    return paths


def _device(tree: DraftTree) -> torch.device:
    return tree.draw_q.device if tree.draw_q is not None else torch.device("cpu")
