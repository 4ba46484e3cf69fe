"""The drafter pool: per-request drafters behind Prefill / Propose / Release.

A drafter node hosts one pool. Each request keeps its own drafter (with its
KV cache, for model drafters), its verified context, its sampling parameters
and its own random stream, so seeded runs draft exactly what the
single-process loop drafts. Several drafters of one request (fused by the
router) are separate requests here, each under its own id and stream. State
is soft: a request idle too long is dropped, and a caller whose view of the
context differs from the pool's is told the state is lost and prefills
again. No gRPC here; see servicer.py.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from speculative.decoding import Drafter, DraftRequest
from speculative.domains import DOMAINS
from runtime.model import Transformer
from speculative.namespaces import DEFAULT_NAMESPACE, check_namespace
from speculative.sampling import InvalidArgument, SamplingParams, make_generator
from speculative.tree import DraftTree

from .learner import OnlineLearning
from .metrics import DrafterMetrics
from .registry import make_drafter
from .settings import DrafterPoolSettings, check_kinds

_SETTINGS = DrafterPoolSettings()  # the pool's defaults are the served pools'


# what the target predicted at the positions it scored: their tokens, and its likeliest
# next tokens [N, k] at each with their probabilities (Token Recycling)
Observed = tuple[Sequence[int], torch.Tensor, torch.Tensor]


@dataclass
class _Request:
    drafter: Drafter
    context: list[int]  # every verified token, the last one included
    params: SamplingParams
    generator: torch.Generator
    last_used: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    kind: str = ""  # the drafter's kind (metrics label)


class DrafterPool:
    def __init__(self, target_model: Transformer, kinds: Sequence[str] = tuple(_SETTINGS.kinds),
                 idle_timeout_s: float = 300.0, draft_top_k: int = 32,
                 clock: Callable[[], float] = time.monotonic, metrics: DrafterMetrics | None = None,
                 parallel_layers: int = _SETTINGS.parallel_layers, learning: OnlineLearning | None = None,
                 cuda_graphs: bool | None = _SETTINGS.cuda_graphs):
        """`metrics`: where the pool records its Prometheus metrics (default: a fresh registry of its own).
        `parallel_layers`: EasySpec layer-parallel drafting of the model drafters (1: exact).
        `learning`: online learning (drafter_service/learner.py): its small drafters then learn from
        the target's scores they are sent, and swap in published versions between rounds.
        `cuda_graphs`: model drafters draft from captured CUDA graphs (None: on CUDA)."""
        check_kinds(kinds)
        self.parallel_layers, self.cuda_graphs = parallel_layers, cuda_graphs
        self.target, self.kinds = target_model, tuple(kinds)
        self.idle_timeout_s, self.draft_top_k, self.clock = idle_timeout_s, draft_top_k, clock
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()  # guards the dict only; drafting holds a request's own lock
        self._busy_s = 0.0  # time spent drafting, summed over the server's threads (autoscaling reads it)
        self.metrics = metrics or DrafterMetrics()
        self.metrics.watch(self.active_requests)
        self.learning = learning

    def prefill(self, request_id: str, kind: str, token_ids: Sequence[int], params: SamplingParams,
                stream: int = 1, resumed: int = 0, namespace: str = DEFAULT_NAMESPACE, domain: str = "") -> None:
        """Start (or restart) drafting for a request whose verified tokens are `token_ids`,
        drawing from random stream `stream` of its seed (1 is the single-process loop's drafter);
        `resumed` > 0 (earlier prefills of this drafter of the request) makes that stream fresh.
        A drafter that learns across requests learns and drafts in `namespace`'s memory; an online
        learning one buffers what it learns under `domain` ("" for none given)."""
        if not request_id:
            raise InvalidArgument("request_id", "must not be empty")
        if kind not in self.kinds:
            raise InvalidArgument("drafter", f"unknown drafter {kind!r}; this pool serves {', '.join(self.kinds)}")
        if not token_ids:
            raise InvalidArgument("token_ids", "must not be empty")
        self._check_vocabulary("token_ids", token_ids)
        if stream < 1:
            raise InvalidArgument("stream", f"must be >= 1 (stream 0 is the verifier's), got {stream}")
        if resumed < 0:
            raise InvalidArgument("resumed", f"must be >= 0, got {resumed}")
        check_namespace(namespace)
        if domain and domain not in DOMAINS:  # the learner keeps a buffer per domain: only known ones
            raise InvalidArgument("domain", f"unknown domain {domain!r}; known: {', '.join(DOMAINS)}")
        params.validate()
        generator = make_generator(params.seed, self.target.device, stream=stream, resumed=resumed)
        drafter = make_drafter(kind, self.target, draft_top_k=self.draft_top_k, namespace=namespace,
                               parallel_layers=self.parallel_layers, cuda_graphs=self.cuda_graphs)
        if self.learning is not None:
            drafter = self.learning.wrap(drafter, kind, domain or "any", self.target)
        state = _Request(drafter, list(token_ids),
                         params, generator, self.clock(), kind=kind)
        with state.lock:
            with self._lock:
                self._evict_idle_locked()
                self._requests[request_id] = state
            # Drafting zero tokens brings a model drafter's KV cache up to the
            # context now, while the verifier prefills too, and draws nothing.
            self._draft(state, 0)

    def propose(self, request_id: str, context_length: int, new_tokens: Sequence[int],
                max_tokens: int, speculative: Sequence[int] = (), min_confidence: float = 0.0,
                max_nodes: int | None = None, observed: Observed | None = None,
                features: tuple[int, torch.Tensor] | None = None) -> DraftTree | None:
        """Append the newly verified tokens and draft up to `max_tokens` deep (a tree of at most
        `max_nodes` nodes, default `max_tokens`) past them, or past
        `speculative` tokens after them (drafting ahead of a verdict; they stay unverified).
        A model drafter stops after a token it drew with less than `min_confidence`.
        `observed` (tokens, ids [N, k], probs [N, k]): what the target predicted at the
        positions it scored since the last call, for a drafter that learns from it.
        `features` (start, [m, F]): the target's features at context positions start..,
        for a drafter that drafts from them (eagle; speculative.decoding.DraftRequest.features).

        None means the state is lost (unknown or evicted request, or a context
        that is not `context_length` tokens long): the caller prefills again."""
        if max_tokens < 0:
            raise InvalidArgument("max_tokens", f"must be >= 0, got {max_tokens}")
        if max_nodes is not None and max_nodes < 0:
            raise InvalidArgument("max_nodes", f"must be >= 0, got {max_nodes}")
        if not 0.0 <= min_confidence <= 1.0:
            raise InvalidArgument("min_confidence", f"must be in [0, 1], got {min_confidence}")
        self._check_vocabulary("new_tokens", new_tokens)
        self._check_vocabulary("speculative_tokens", speculative)
        if observed is not None:
            self._check_observed(*observed)
        with self._lock:
            self._evict_idle_locked()
            state = self._requests.get(request_id)
            if state is None:
                return None
            state.last_used = self.clock()
        with state.lock:
            if len(state.context) != context_length:
                return None
            state.context.extend(new_tokens)
            if observed is not None and len(observed[0]) and state.drafter.abilities.learns_from_target:
                state.drafter.observe(*observed)
            if features is not None:
                self._check_features(state, *features)
            started = time.monotonic()
            try:
                return self._draft(state, max_tokens, list(speculative), min_confidence, max_nodes, features)
            finally:
                seconds = time.monotonic() - started
                with self._lock:
                    self._busy_s += seconds
                self.metrics.observe_propose(state.kind, seconds)

    def release(self, request_id: str) -> bool:
        with self._lock:
            state = self._requests.pop(request_id, None)
        if state is None:
            return False
        flush = getattr(state.drafter, "flush", None)  # a learning drafter sends what it labelled
        if flush is not None:
            with state.lock:
                flush()
        return True

    def active_requests(self) -> int:
        with self._lock:
            return len(self._requests)

    def busy_seconds(self) -> float:
        """Seconds spent drafting so far, summed over the threads that drafted."""
        with self._lock:
            return self._busy_s

    def _evict_idle_locked(self) -> int:
        now = self.clock()
        idle = [rid for rid, s in self._requests.items() if now - s.last_used > self.idle_timeout_s]
        for rid in idle:
            del self._requests[rid]
        return len(idle)

    def _check_features(self, state: _Request, start: int, features: torch.Tensor) -> None:
        """Features fit the request's drafter: it drafts from them, they are its width, and
        they lie within the verified context."""
        drafter = state.drafter
        if not drafter.abilities.drafts_from_features:
            raise InvalidArgument("features", f"drafter {state.kind!r} does not draft from the target's features")
        head = getattr(drafter, "head", None)
        width = None if head is None else len(head.config.layers) * head.config.hidden_size
        if width is not None and features.shape[-1] != width:
            raise InvalidArgument("features", f"rows of {features.shape[-1]} values, the head reads {width}")
        if start + len(features) > len(state.context):
            raise InvalidArgument("features_start", f"positions {start}..{start + len(features) - 1} are past "
                                  f"the {len(state.context)} verified tokens")

    def _draft(self, state: _Request, max_tokens: int, speculative: list[int] = (),
               min_confidence: float = 0.0, max_nodes: int | None = None,
               features: tuple[int, torch.Tensor] | None = None) -> DraftTree:
        # Nothing past the target's context can be verified, and a model
        # drafter's KV cache holds no more.
        context = state.context + list(speculative)
        room = self.target.config.max_position_embeddings - len(context)
        if room < 0:
            return DraftTree()
        if state.drafter.abilities.stops_on_confidence:
            state.drafter.stop_below = min_confidence
        return state.drafter.propose(DraftRequest(context, min(max_tokens, room), state.params, state.generator,
                                                  verified=len(state.context), max_nodes=max_nodes,
                                                  features=features))

    def _check_observed(self, tokens: Sequence[int], ids: torch.Tensor, probs: torch.Tensor) -> None:
        self._check_vocabulary("observed_tokens", tokens)
        if ids.shape != probs.shape or ids.dim() != 2 or ids.shape[0] != len(tokens):
            raise InvalidArgument("observed_ids", f"{tuple(ids.shape)} candidates and {tuple(probs.shape)} "
                                  f"probabilities for {len(tokens)} observed tokens")
        self._check_vocabulary("observed_ids", ids.flatten().tolist())
        if not (probs.isfinite().all() and (probs >= 0).all() and (probs <= 1).all()):
            raise InvalidArgument("observed_probs", "must be probabilities")

    def _check_vocabulary(self, name: str, tokens: Sequence[int]) -> None:
        vocab = self.target.config.vocab_size
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(name, f"token {bad} is outside the vocabulary of {vocab}")
