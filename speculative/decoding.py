"""The speculative decoding loop in one process: draft, verify, commit.

Each round the target scores the last verified token (the root) together
with a draft tree in one forward pass; verification keeps the longest valid
path plus one token of the target's own, the KV cache keeps exactly the
accepted entries, and the loop goes on. With no drafter it is plain
autoregressive decoding through the same code.

`speculative_round` is one round and `generate` the loop around it: prefill,
then rounds until `speculative.stopping.clip` ends the output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from runtime.graphs import StaticPasses
from runtime.model import KVCache, Transformer, attention_mask, causal_ancestors
from .sampling import InvalidArgument, SamplingParams, make_generator
from .batching import Verdict, VerifyItem, first_verdict, verify_batch
from .drafter_kinds import Abilities
from .grammar import Grammars
from .logprobs import TokenLogprob
from .processing import MAX_FORCED, Processor
from .pipeline import likeliest_path, reuse_ahead
from .recycling import PROMPT_SEED, top_candidates
from .stopping import clip
from .tree import DraftTree, nodes_for_depth


@dataclass(frozen=True)
class DraftRequest:
    """What one `Drafter.propose` call asks for."""

    context: Sequence[int]  # every verified token; drafting ahead, the guessed ones after them
    depth: int  # the most tokens deep the tree may go (a chain's length)
    params: SamplingParams
    generator: torch.Generator | None = None  # the request's drafter stream (None: greedy callers)
    verified: int | None = None  # how many of `context` are verified (None: all)
    max_nodes: int | None = None  # the most nodes of the tree (None: `depth`, a chain's worth)
    # (start, [m, F]): the target's captured features (its `feature_layers`' outputs) at context
    # positions start..start+m-1, those verified since the drafter was last given any; for a
    # drafter that `drafts_from_features` (EAGLE), None for the others
    features: tuple[int, torch.Tensor] | None = None

    @property
    def nodes(self) -> int:
        """The node budget."""
        return self.depth if self.max_nodes is None else self.max_nodes

    @property
    def known(self) -> Sequence[int]:
        """The verified part of the context: all a drafter may learn from."""
        return self.context if self.verified is None else self.context[:self.verified]


class Drafter(Protocol):
    """Proposes a draft tree that continues a request's context (`DraftRequest`).

    A drafter keeps whatever state it likes per request (a KV cache, say) and
    must bring it in line with the context itself: tokens it guessed that the
    verifier rejected are simply absent from the next context. When drafting
    ahead (pipelining), only `request.known` is verified; a drafter that learns
    from the text (a shared suffix index) must learn from that only. Chain
    drafters ignore the node budget; tree drafters may branch to fill it.

    `abilities` declares what else it does (`speculative.drafter_kinds.Abilities`).
    One that `learns_from_target` has `observe(tokens, ids, probs)`: after each
    verification pass it gets the tokens of the positions the target scored
    (the root, then the tree's nodes) and the target's likeliest next tokens
    at each (`speculative.recycling.top_candidates`), to learn from (Token
    Recycling). One that `stops_on_confidence` has `stop_below`.
    """

    abilities: Abilities

    def propose(self, request: DraftRequest) -> DraftTree: ...


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
    forced_tokens: int = 0  # tokens a grammar forced (jump-forward), drafted for free
    logprobs: list[TokenLogprob] | None = None  # one a token, when the request asks (SamplingParams.logprobs)

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens gained per target forward pass (1.0 for plain decoding)."""
        return len(self.token_ids) / max(self.target_forward_passes, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def record(self, done: Round) -> None:
        """Count a round in (its tokens are appended apart, once clipped)."""
        self.target_forward_passes += 1
        self.draft_tokens += done.drafted
        self.accepted_draft_tokens += done.accepted
        self.accepted_per_round.append(done.accepted)
        self.reused_drafts += done.ready is not None and len(done.ready) > 0
        self.forced_tokens += done.forced


@dataclass
class Speculation:
    """What every round of one request uses: the target and the request's cache, the
    drafter (None: plain decoding), the verifier's and the drafter's random streams, and
    how far a round may draft."""
    target: Transformer
    cache: KVCache
    params: SamplingParams
    verifier_rng: torch.Generator  # stream 0
    drafter: Drafter | None = None
    drafter_rng: torch.Generator | None = None  # stream 1
    draft_length: int = 0  # the deepest a draft goes
    tree_budget: int = 0  # the most nodes of a round's tree at full draft length
    pipelined: bool = False  # draft each next round before this one's verdict
    # the target's scores at the positions it scored, for a drafter that learns from them
    on_scores: Callable[[Sequence[int], torch.Tensor], None] | None = None
    processor: Processor | None = None  # penalties, bias, grammar (None: the target as it is)
    # the layers a drafter drafts from (EAGLE; None: nothing captured), and the target's features
    # at verified positions not yet handed to the drafter (`DraftRequest.features`)
    capture: tuple[int, ...] | None = None
    static: StaticPasses | None = None  # static-shape passes over `cache` (runtime/graphs.py)
    features: tuple[int, torch.Tensor] | None = None

    def add_features(self, start: int, features: torch.Tensor) -> None:
        """Features at positions start.. join those the drafter has not had yet."""
        if self.features is None:
            self.features = (start, features)
        else:
            first, held = self.features
            self.features = (first, torch.cat((held[:start - first], features)))

    def take_features(self) -> tuple[int, torch.Tensor] | None:
        held, self.features = self.features, None
        return held


@dataclass
class Round:
    """What one round did."""
    tokens: list[int]  # the accepted draft tokens, then the target's bonus token
    drafted: int  # nodes of the tree verified
    accepted: int  # draft tokens accepted
    ready: DraftTree | None = None  # the next round's tree: drafted ahead and kept by the verdict
    forced: int = 0  # tokens a grammar forced
    logprobs: list[TokenLogprob] | None = None  # of `tokens`, when asked


def _captured_layers(drafter: Drafter | None) -> tuple[int, ...] | None:
    """The target layers a drafter that drafts from features reads."""
    if drafter is None or not drafter.abilities.drafts_from_features:
        return None
    return tuple(drafter.feature_layers)


def _observer(drafter: Drafter | None):
    """The drafter's `observe`, if it learns from the target's scores."""
    return drafter.observe if drafter is not None and drafter.abilities.learns_from_target else None


def prefill(spec: Speculation, prompt_ids: Sequence[int]) -> Verdict:
    """Put the prompt in the cache; returns the target's first token (as a verdict on an empty
    tree). A drafter that learns from the target's scores also gets its predictions after
    the prompt's last tokens."""
    observe = _observer(spec.drafter)
    device, n = spec.target.device, len(prompt_ids)
    seed = min(n, PROMPT_SEED) if observe is not None else 1
    logits = spec.target(torch.tensor([list(prompt_ids)], device=device), torch.arange(n, device=device)[None],
                         spec.cache, attention_mask(0, causal_ancestors(n, device)), logits_from=n - seed,
                         capture=spec.capture)
    if spec.capture is not None:  # the prompt's features, for a drafter that drafts from them
        logits, features = logits
        spec.add_features(0, features[0])
    if observe is not None:
        observe(list(prompt_ids[n - seed:]), *top_candidates(logits[0]))
    return first_verdict(logits[0, -1], spec.params, spec.verifier_rng, n, spec.processor)


def speculative_round(spec: Speculation, context: list[int], left: int, ready: DraftTree | None = None) -> Round:
    """One round after `context` (every verified token; the last one is not in the cache
    yet) with `left` tokens still to generate: draft, or take `ready` (the tree drafted
    ahead last round); when pipelined, draft the next round ahead of the verdict; verify;
    keep the ahead draft if the verdict allows (`speculative.pipeline`)."""
    budget = min(spec.draft_length, left - 1)  # the bonus token always comes
    tree, ahead, guess = DraftTree(), None, []
    if spec.drafter is not None and budget > 0:
        nodes = nodes_for_depth(budget, spec.draft_length, spec.tree_budget)
        tree = ready if ready else spec.drafter.propose(DraftRequest(context, budget, spec.params, spec.drafter_rng,
                                                                     max_nodes=nodes, features=spec.take_features()))
        tree = tree.truncated(nodes)
        if spec.pipelined:
            guess = [tree.tokens[node] for node in likeliest_path(tree)]
            ahead = _draft_ahead(spec, context, guess, left)
    room = min(left - 1, spec.cache.max_len - spec.cache.lengths[0] - 1 - len(tree))  # for forced tokens
    [verdict] = verify_batch(spec.target, spec.cache, [VerifyItem(0, context[-1], tree, spec.params, spec.verifier_rng,
                                                                  on_scores=spec.on_scores, processor=spec.processor,
                                                                  extra_nodes=max(room, 0), capture=spec.capture)],
                             static=spec.static)
    if verdict.features is not None:  # the root's and the accepted nodes' positions
        spec.add_features(len(context) - 1, verdict.features)
    accepted, bonus = verdict.accepted, verdict.bonus
    kept = reuse_ahead(ahead, guess, accepted, bonus) if ahead is not None else None
    return Round(accepted + [bonus], len(verdict.tree), len(verdict.path), kept, verdict.forced, verdict.logprobs)


def _draft_ahead(spec: Speculation, context: list[int], guess: list[int], left: int) -> DraftTree | None:
    """The next round's draft past the unverified `guess`, made before the verdict; None
    when no room is left past a whole accepted guess and its bonus token."""
    room = min(spec.draft_length, left - len(guess) - 2)
    if room <= 0:
        return None
    return spec.drafter.propose(DraftRequest(context + guess, room, spec.params, spec.drafter_rng,
                                             verified=len(context), features=spec.take_features(),
                                             max_nodes=nodes_for_depth(room, spec.draft_length, spec.tree_budget)))


def generate(target: Transformer, prompt_ids: Sequence[int], params: SamplingParams,
             drafter: Drafter | None = None, draft_length: int = 5, eos_token_ids: Sequence[int] = (),
             on_tokens: Callable[[list[int]], None] | None = None, pipelined: bool = False,
             tree_budget: int | None = None, grammars: Grammars | None = None,
             static: StaticPasses | None = None) -> GenerationResult:
    """Generate up to `params.max_tokens` tokens after `prompt_ids`.

    `draft_length` is the deepest a draft goes, `tree_budget` the most nodes a
    round's tree may have (None: `draft_length`, a chain's worth).
    `on_tokens` is called with each batch of newly verified tokens (streaming).
    `pipelined` drafts each next round ahead, before the verdict, and reuses
    it when the verdict allows (`speculative.pipeline`): in one process this
    overlaps nothing, it runs the same algorithm the router's pipelined
    coordinator runs across processes, so that tests can check it exactly.
    `grammars`: the target tokenizer's, for a request with a grammar (`params.grammar`).
    `static`: static-shape passes of `target` over a one-row cache (`StaticPasses.for_requests`),
    kept across requests since its captured graphs are bound to that cache: the rounds'
    passes run there (the prompt's prefill runs eagerly into the same cache).
    """
    if not prompt_ids:
        raise InvalidArgument("prompt", "must not be empty")
    if draft_length < 0:
        raise InvalidArgument("draft_length", f"must be >= 0, got {draft_length}")
    nodes = draft_length if tree_budget is None else tree_budget
    if nodes < 0:
        raise InvalidArgument("tree_budget", f"must be >= 0, got {tree_budget}")
    params.validate(len(prompt_ids), target.config.max_position_embeddings)
    params.check_vocabulary(target.config.vocab_size)
    started = time.perf_counter()
    observe = _observer(drafter)
    eos = set(eos_token_ids) | set(params.stop_token_ids)
    processor = Processor(params, prompt_ids, target.config.vocab_size, grammars, eos) if params.processed else None
    slots = len(prompt_ids) + params.max_tokens + max(draft_length, nodes) + 1 + (MAX_FORCED if params.grammar else 0)
    if static is not None:
        if static.cache.batch != 1 or static.cache.max_len <= slots:
            raise ValueError(f"static passes over {static.cache.batch} rows of {static.cache.max_len} slots "
                             f"cannot hold a request of {slots}")
        static.cache.rollback(0)
    spec = Speculation(
        target, target.new_cache(slots) if static is None else static.cache, params,
        verifier_rng=make_generator(params.seed, target.device, stream=0),
        drafter=drafter, drafter_rng=make_generator(params.seed, target.device, stream=1),
        draft_length=draft_length, tree_budget=nodes, pipelined=pipelined,
        on_scores=None if observe is None else lambda tokens, scores: observe(tokens, *top_candidates(scores)),
        processor=processor, capture=_captured_layers(drafter), static=static)
    result = GenerationResult([], "length", len(prompt_ids), target_forward_passes=1,
                              logprobs=[] if params.logprobs is not None else None)

    def emit(new: list[int], logprobs: list[TokenLogprob] | None = None) -> str | None:
        """Append verified tokens (and their logprobs); the finish reason once generation is over."""
        new, finish = clip(new, len(result.token_ids), params.max_tokens, eos)
        result.token_ids.extend(new)
        if result.logprobs is not None:
            result.logprobs.extend(logprobs[:len(new)])
        if on_tokens and new:
            on_tokens(new)
        return finish

    first = prefill(spec, prompt_ids)
    finish = emit([first.bonus], first.logprobs)
    ready: DraftTree | None = None  # this round's tree, drafted ahead last round
    while finish is None:
        left = params.max_tokens - len(result.token_ids)
        done = speculative_round(spec, list(prompt_ids) + result.token_ids, left, ready)
        result.record(done)
        ready = done.ready
        finish = emit(done.tokens, done.logprobs)
    result.finish_reason = finish
    result.seconds = time.perf_counter() - started
    return result
