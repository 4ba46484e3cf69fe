"""A small model drafter that learns online: one request's side of the online learner.

It wraps a `ModelDrafter` and does two things between rounds, at the start of each
proposal and never inside one:

- Swap: if a newer version of its kind was published (drafter_service/published.py),
  it drafts with that from now on. Its KV cache is dropped and refills from the verified
  context, so the draft depends only on the new weights and the context; verification
  is untouched, so the output is the target's whichever drafter proposed (lossless).
- Record: it declares `learns_from_target`, so it is given the target's likeliest next
  tokens at every position a verification pass scored (the root, then the tree's nodes;
  a prefill's last prompt tokens). Once the verdict shows in the verified context, the
  root's and the accepted path's rows are the target's scores at verified positions;
  they are labelled onto the context, and full windows go to the learner's buffer.

Which scored node holds each accepted token is found by walking the scored tokens in
order (a parent comes before its children); a same-token node of another branch that
comes first is taken instead, a little noise in the teacher data, never in the output.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from speculative.decoding import DraftRequest
from speculative.drafter_kinds import Abilities
from speculative.tree import DraftTree

from .drafters import ModelDrafter
from .online_buffer import window_item

WINDOW = 256  # longest window of a request sent to the buffer, tokens
MARGIN = 64  # context kept before a window's first labelled position


class LearningDrafter:
    abilities = Abilities(learns_from_target=True, stops_on_confidence=True)

    def __init__(self, base: ModelDrafter, kind: str, domain: str, version: int,
                 newer: Callable[[int], tuple[int, object] | None],
                 buffer: Callable[[dict], None], record_round: Callable[[int, int, int], None]):
        """`newer(version)`: (version, model) of a newer published version, or None.
        `buffer(item)`: takes a finished window (online_buffer.window_item).
        `record_round(version, proposed, accepted)`: one round's outcome, for the metrics."""
        self.base, self.kind, self.domain, self.version = base, kind, domain, version
        self._newer, self._buffer, self._record_round = newer, buffer, record_round
        self._pending: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
        self._labels: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # position -> target's (ids, probs)
        self._context: list[int] = []  # the verified context as of the last proposal
        self._proposed: int | None = None  # verified length at the last proposal (None: none yet)
        self._prompt_len = 0  # positions before this are the prompt's
        self._window_start = 0
        self._last_tree: DraftTree | None = None  # the last plain (not ahead) proposal, to score its verdict

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def stop_below(self) -> float:
        return self.base.stop_below

    @stop_below.setter
    def stop_below(self, value: float) -> None:
        self.base.stop_below = value

    def observe(self, tokens: Sequence[int], ids: torch.Tensor, probs: torch.Tensor) -> None:
        self._pending.append((list(tokens), ids, probs))

    def propose(self, request: DraftRequest) -> DraftTree:
        known = list(request.known)
        self._context = known
        self._learn(known)
        self._swap()
        tree = self.base.propose(request)
        self._proposed = len(known)
        self._last_tree = tree if request.verified in (None, len(request.context)) else None
        return tree

    def flush(self) -> None:
        """Send what is labelled but not yet sent (the request ends)."""
        self._emit(final=True)

    def _swap(self) -> None:
        newer = self._newer(self.version)
        if newer is not None:
            self.version, model = newer
            self.base.use_model(model)

    def _learn(self, known: list[int]) -> None:
        if self._proposed is not None and self._last_tree and len(known) > self._proposed:
            new = known[self._proposed:]
            self._record_round(self.version, len(self._last_tree), self._last_tree.path_prefix(new[:-1]))
            self._last_tree = None
        if self._pending:
            tokens = [t for p in self._pending for t in p[0]]
            ids = torch.cat([_width(p[1], self._pending[0][1].shape[1]) for p in self._pending])
            probs = torch.cat([_width(p[2], self._pending[0][1].shape[1]) for p in self._pending])
            self._pending = []
            if not self._labels and self._prompt_len == 0:
                self._label_prompt(known, tokens, ids, probs)
            else:
                self._label_rounds(known, tokens, ids, probs)
        self._emit(final=False)

    def _label_prompt(self, known: list[int], tokens: list[int], ids: torch.Tensor, probs: torch.Tensor) -> None:
        """A prefill's scores: the last prompt tokens, a contiguous run ending at the prompt's
        end (the newest verified token, or the one before it: the target's first token)."""
        n = len(tokens)
        for end in (len(known) - 1, len(known)):
            if end - n >= 0 and known[end - n:end] == tokens:
                for i in range(n - 1 if end == len(known) else n):  # the last needs its next token
                    self._labels[end - n + i] = (ids[i], probs[i])
                self._prompt_len = end
                self._window_start = max(0, end - n - MARGIN)
                return
        self._prompt_len = len(known)  # not a prefill's: learn from the rounds only

    def _label_rounds(self, known: list[int], tokens: list[int], ids: torch.Tensor, probs: torch.Tensor) -> None:
        """Rounds' scores: each starts at its root, the last verified token before it."""
        if self._proposed is None or self._proposed < 1 or len(known) <= self._proposed:
            return
        root = self._proposed - 1
        if known[root] != tokens[0]:
            return  # not this context's (a request restarted): drop
        if not self._labels:
            self._window_start = max(self._window_start, root - MARGIN)
        self._labels[root] = (ids[0], probs[0])
        at = 0
        for pos in range(root + 1, len(known) - 1):  # each verified token with a next one
            at = next((i for i in range(at + 1, len(tokens)) if tokens[i] == known[pos]), None)
            if at is None:
                break
            self._labels[pos] = (ids[at], probs[at])

    def _emit(self, final: bool) -> None:
        """Send a window once its labels span WINDOW tokens (or the request ends)."""
        if not self._labels:
            return
        last = max(self._labels)
        if not final and last + 2 - self._window_start < WINDOW:
            return
        end = min(last + 2, len(self._context))
        start = max(self._window_start, end - WINDOW)
        k = next(iter(self._labels.values()))[0].shape[0]
        ids = torch.zeros(end - start, k, dtype=torch.int32)
        probs = torch.zeros(end - start, k)
        for pos, (row_ids, row_probs) in self._labels.items():
            if start <= pos < end - 1:
                ids[pos - start], probs[pos - start] = row_ids, row_probs
        if probs.sum() > 0:
            self._buffer(window_item(self._context[start:end], ids, probs, max(self._prompt_len - start, 0)))
        self._labels = {p: v for p, v in self._labels.items() if p >= end - 1}
        self._window_start = max(0, end - 1 - MARGIN)


def _width(t: torch.Tensor, k: int) -> torch.Tensor:
    """Rows cut or zero-padded to k columns."""
    if t.shape[1] >= k:
        return t[:, :k]
    return torch.cat((t, t.new_zeros(t.shape[0], k - t.shape[1])), 1)


