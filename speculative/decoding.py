"""The speculative decoding loop in one process: draft, verify, commit.

Each round the target scores the last verified token (the root) together
with a draft tree in one forward pass; verification keeps the longest valid
path plus one token of the target's own, the KV cache keeps exactly the
accepted entries, and the loop goes on. With no drafter it is plain
autoregressive decoding through the same code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from .model import Transformer, attention_mask, causal_ancestors
from .sampling import InvalidArgument, SamplingParams, make_generator, probabilities, sample
from .batching import VerifyItem, verify_batch
from .pipeline import likeliest_path, reuse_ahead
from .recycling import PROMPT_SEED, top_candidates
from .tree import DraftTree, nodes_for_depth


class Drafter(Protocol):
    """Proposes a draft tree that continues `context` (all verified tokens).

    A drafter keeps whatever state it likes per request (a KV cache, say) and
    must bring it in line with `context` itself: tokens it guessed that the
    verifier rejected are simply absent from the next context. When drafting
    ahead (pipelining), only the first `verified` tokens of `context` are
    verified (None: all); a drafter that learns from the text (a shared
    suffix index) must learn from those only.

    `max_tokens` bounds the tree's depth (a chain's length); `max_nodes` its
    size (None: `max_tokens`). Chain drafters ignore `max_nodes`; tree
    drafters may branch to fill it.

    A drafter may also have `observe(tokens, ids, probs)`: after each
    verification pass it gets the tokens of the positions the target scored
    (the root, then the tree's nodes) and the target's likeliest next tokens
    at each (`speculative.recycling.top_candidates`), to learn from (Token
    Recycling).
    """

    def propose(self, context: Sequence[int], max_tokens: int, params: SamplingParams,
                generator: torch.Generator, verified: int | None = None,
                max_nodes: int | None = None) -> DraftTree: ...


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-sequence token) or "length"
    prompt_tokens: int
    target_forward_passes: int
    draft_tokens: int = 0  # tokens proposed to the verifier
    accepted_draft_tokens: int = 0
    seconds: float = 0.0
    accepted_per_round: list[int] = field(default_factory=list)
    reused_drafts: int = 0  # rounds whose tree was drafted ahead (pipelined)

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens gained per target forward pass (1.0 for plain decoding)."""
        return len(self.token_ids) / max(self.target_forward_passes, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


def generate(target: Transformer, prompt_ids: Sequence[int], params: SamplingParams,
             drafter: Drafter | None = None, draft_length: int = 5, eos_token_ids: Sequence[int] = (),
             on_tokens: Callable[[list[int]], None] | None = None, pipelined: bool = False,
             tree_budget: int | None = None) -> GenerationResult:
    """Generate up to `params.max_tokens` tokens after `prompt_ids`.

    `draft_length` is the deepest a draft goes, `tree_budget` the most nodes a
    round's tree may have (None: `draft_length`, a chain's worth).
    `on_tokens` is called with each batch of newly verified tokens (streaming).
    `pipelined` drafts each next round ahead, before the verdict, and reuses
    it when the verdict allows (`speculative.pipeline`): in one process this
    overlaps nothing, it runs the same algorithm the router's pipelined
    coordinator runs across processes, so that tests can check it exactly.
    """
    if not prompt_ids:
        raise InvalidArgument("prompt", "must not be empty")
    if draft_length < 0:
        raise InvalidArgument("draft_length", f"must be >= 0, got {draft_length}")
    nodes = draft_length if tree_budget is None else tree_budget
    if nodes < 0:
        raise InvalidArgument("tree_budget", f"must be >= 0, got {tree_budget}")
    params.validate(len(prompt_ids), target.config.max_position_embeddings)
    started = time.perf_counter()
    device = target.device
    verifier_rng = make_generator(params.seed, device, stream=0)
    drafter_rng = make_generator(params.seed, device, stream=1)
    eos = set(eos_token_ids)
    cache = target.new_cache(len(prompt_ids) + params.max_tokens + max(draft_length, nodes) + 1)

    def choose(scores: torch.Tensor) -> int:
        if params.greedy:
            return int(scores.argmax())
        return sample(probabilities(scores, params), verifier_rng)

    observe = getattr(drafter, "observe", None)  # a drafter that learns from the target's scores
    prompt = torch.tensor([list(prompt_ids)], device=device)
    n = prompt.shape[1]
    # such a drafter also gets the target's predictions after the prompt's last tokens
    seed = min(n, PROMPT_SEED) if observe is not None else 1
    logits = target(prompt, torch.arange(n, device=device)[None], cache,
                    attention_mask(0, causal_ancestors(n, device)), logits_from=n - seed)
    if observe is not None:
        observe(list(prompt_ids[n - seed:]), *top_candidates(logits[0]))
    out = [choose(logits[0, -1])]
    result = GenerationResult([], "length", n, target_forward_passes=1)

    def emit(new: list[int]) -> bool:
        """Append verified tokens; True when generation is over."""
        done = False
        for i, tok in enumerate(new):
            if tok in eos:
                new, done, result.finish_reason = new[:i + 1], True, "stop"
                break
        room = params.max_tokens - len(result.token_ids)
        if len(new) >= room:
            new, done = new[:room], True
            result.finish_reason = "stop" if new and new[-1] in eos else "length"
        result.token_ids.extend(new)
        if on_tokens and new:
            on_tokens(new)
        return done

    done = emit(out)
    ready: DraftTree | None = None  # this round's tree, drafted ahead last round
    on_scores = None if observe is None else lambda tokens, scores: observe(tokens, *top_candidates(scores))
    while not done:
        context = list(prompt_ids) + result.token_ids
        budget = min(draft_length, params.max_tokens - len(result.token_ids) - 1)
        tree, ahead, guess = DraftTree(), None, []
        if drafter is not None and budget > 0:
            round_nodes = nodes_for_depth(budget, draft_length, nodes)
            tree = ready if ready else drafter.propose(context, budget, params, drafter_rng, max_nodes=round_nodes)
            tree = tree.truncated(round_nodes)
            if pipelined:
                guess = [tree.tokens[node] for node in likeliest_path(tree)]
                room = min(draft_length, params.max_tokens - len(result.token_ids) - len(guess) - 2)
                if room > 0:
                    ahead = drafter.propose(context + guess, room, params, drafter_rng, verified=len(context),
                                            max_nodes=nodes_for_depth(room, draft_length, nodes))
        [(path, bonus)] = verify_batch(target, cache, [VerifyItem(0, context[-1], tree, params, verifier_rng,
                                                                  on_scores=on_scores)])
        accepted = [tree.tokens[node] for node in path]
        ready = reuse_ahead(ahead, guess, accepted, bonus) if ahead is not None else None
        result.target_forward_passes += 1
        result.draft_tokens += len(tree)
        result.accepted_draft_tokens += len(path)
        result.accepted_per_round.append(len(path))
        result.reused_drafts += ready is not None and len(ready) > 0
        done = emit(accepted + [bonus])
    result.seconds = time.perf_counter() - started
    return result
