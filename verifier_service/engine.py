"""The target engine: a paged KV cache whose blocks its requests share out, and one
worker thread that verifies the draft trees of many requests in each forward pass
(continuous batching).

The cache (runtime/paged_kv.py) is `kv_cache_memory` bytes of blocks of `kv_block_size`
slots. A request holds the blocks its tokens fill; a new request (a conversation's next
turn, a prompt sharing a system prompt, a request resumed after a failover) first takes
the longest prefix of its tokens cached in whole blocks in its memory namespace, and
computes only the rest. Requests are admitted while blocks last (`max_batch` caps them
if set); when a pass needs blocks that are not there, the newest request is preempted:
its blocks go back (its full ones stay cached), its verified tokens and random stream
stay, and its next round waits until there is room, when its cache is computed again
from its tokens (the prefix cache serving what is left of it). Nothing it answers changes.

Callers (gRPC threads) only check their arguments, queue work with a Future
and wait; the worker alone touches the model, the cache and the requests'
state, so none of those needs a lock. A request's state is that of the
single-process loop (speculative.decoding.generate): every verified token,
the last of which (the pending root) is not in the cache yet, and the
request's own verifier random stream. With a checkpoint store that state is
saved after every round, off the verification path, so a restarted verifier
resumes a request with identical output (or, should the last checkpoint not
have landed, the caller's context_length check sends it back to prefill).
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import logging
import math
import os
import queue
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from speculative.batching import Verdict, VerifyItem, first_verdict, verify_batch
from speculative.grammar import Grammars
from speculative.logprobs import TokenLogprob
from speculative.processing import MAX_FORCED, Processor
from runtime.cpu_tuning import own_torch_threads
from runtime.graphs import static_passes
from runtime.model import Transformer, attention_mask, causal_ancestors
from runtime.paged_kv import BlockPool, PagedRows, SequenceBlocks
from speculative.namespaces import DEFAULT_NAMESPACE, check_namespace
from speculative.recycling import PROMPT_SEED, top_candidates
from speculative.sampling import InvalidArgument, SamplingParams, make_generator
from speculative.tree import DraftTree

from .metrics import VerifierMetrics
from .settings import VerifierSettings, memory_bytes

log = logging.getLogger(__name__)

_SETTINGS = VerifierSettings()  # the engine's defaults are the served verifier's


def device_memory(device: torch.device) -> int:
    """Bytes of memory a share of `kv_cache_memory` is a share of: the GPU's on CUDA, else the
    machine's (or its container's, where a cgroup limits it lower)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(limit).read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


class _CheckpointWriter:
    """Writes checkpoints off the verification path, coalescing to the latest per request,
    and waiting `interval_s` after each batch of writes unless a delete comes: each write
    costs the state store and this process CPU that the passes on the same cores would use.

    A checkpoint a round behind is harmless: a resumed request then holds fewer
    tokens than the caller's context_length, answers state_lost and is prefilled
    again with every verified token, so the output is still the target's.
    """

    def __init__(self, store: "CheckpointStore", ttl_s: float, interval_s: float = 0.0):
        self.store, self.ttl_s, self.interval_s = store, ttl_s, interval_s
        self._pending: dict[str, dict | None] = {}  # request id -> checkpoint, or None to delete
        self._busy = False
        self._flushing = 0  # callers waiting in flush: the writer does not wait out its interval
        self._cond = threading.Condition()
        threading.Thread(target=self._run, name="checkpoint-writer", daemon=True).start()

    def save(self, request_id: str, data: dict) -> None:
        with self._cond:
            self._pending[request_id] = data
            self._cond.notify_all()

    def delete(self, request_id: str) -> None:
        with self._cond:
            self._pending[request_id] = None
            self._cond.notify_all()

    def flush(self) -> None:
        """Return once everything handed over so far is written."""
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                self._cond.wait_for(lambda: not self._pending and not self._busy)
            finally:
                self._flushing -= 1

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending)
                work, self._pending, self._busy = self._pending, {}, True
            for request_id, data in work.items():
                self._write(request_id, data)
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                # saves that come meanwhile coalesce to each request's latest; a delete (a request
                # released) or a flush does not wait
                self._cond.wait_for(lambda: self._flushing or None in self._pending.values(),
                                    timeout=self.interval_s)


    def _write(self, request_id: str, data: dict | None) -> None:
        try:
            if data is None:
                self.store.delete_checkpoint(request_id)
            else:
                self.store.save_checkpoint(request_id, data, self.ttl_s)
        except Exception:
            # Best effort: the request goes on here. A failed save leaves an older
            # checkpoint, which context_length checks catch; try to drop it anyway.
            log.warning("could not write the checkpoint of %s", request_id, exc_info=True)
            if data is not None:
                try:
                    self.store.delete_checkpoint(request_id)
                except Exception:
                    pass


def check_token_ids(token_ids: Sequence[int], vocab_size: int, name: str = "token_ids") -> list[int]:
    """The tokens as a list; an InvalidArgument naming the field (`name`) if there are none or
    one is outside the vocabulary."""
    tokens = list(token_ids)
    if not tokens:
        raise InvalidArgument(name, "must not be empty")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(name, f"token {bad} is outside the vocabulary of {vocab_size}")
    return tokens


class UnknownRequest(KeyError):
    """Neither this engine nor a checkpoint holds this request: it must be prefilled again."""


class ResourceExhausted(RuntimeError):
    """No room for another request: the KV cache's blocks are taken (or `max_batch` requests held)."""


class CheckpointStore(Protocol):
    """The part of cluster.state's stores the engine uses."""

    def save_checkpoint(self, request_id: str, data: dict[str, Any], ttl_s: float) -> None: ...

    def load_checkpoint(self, request_id: str) -> dict[str, Any] | None: ...

    def delete_checkpoint(self, request_id: str) -> None: ...

MAX_CANDIDATES = 64  # most next tokens a verify call may ask for per scored position
# requests held and queued a verifier without max_batch counts as full for autoscaling (`occupancy`):
# the fixed row count it had before its cache was paged
BATCH_TARGET = 8
IDLE_CHECK_S = 5.0  # longest an idle worker sleeps before looking for idle requests to drop
# how far a draw's q may sum from 1: a float32 distribution, renormalised by its drafter,
# sums to 1 only up to rounding
Q_SUM_TOLERANCE = 1e-3


@dataclass
class PrefillOutcome:
    next_token: int  # the target's first token after the prompt
    # with candidates asked: the target's likeliest next tokens [m, k] and their probabilities
    # after each of the prompt's last m tokens (Token Recycling)
    candidate_ids: torch.Tensor | None = None
    candidate_probs: torch.Tensor | None = None
    logprobs: list[TokenLogprob] | None = None  # of next_token, when the request asks
    # with capture asked: (0, the target's features [n, F] at every prompt position)
    features: tuple[int, torch.Tensor] | None = None


@dataclass
class VerifyOutcome:
    accepted: list[int]  # accepted draft tokens, root to leaf
    bonus: int           # the target's own next token
    batch_size: int      # requests that shared the forward pass
    queued: int = 0      # verify items still waiting when the pass began
    active: int = 0      # requests held: the load a caller adapts to (some may be between rounds)
    # with candidates asked: the target's likeliest next tokens [1+N, k] and their probabilities
    # at the root and at each tree node (Token Recycling)
    candidate_ids: torch.Tensor | None = None
    candidate_probs: torch.Tensor | None = None
    pass_shape: "PassShape | None" = None  # the forward pass it went into
    drafted: int = 0  # nodes of the tree it verified
    drafted_depth: int = 0  # ... and its levels
    forced: int = 0  # accepted tokens a grammar forced (jump-forward)
    logprobs: list[TokenLogprob] | None = None  # of the accepted tokens and the bonus, when asked
    # with capture asked: (the root's position, the target's features [1 + accepted, F] at the
    # root and the accepted nodes), the positions this verdict verified
    features: tuple[int, torch.Tensor] | None = None


@dataclass(frozen=True)
class PassShape:
    """One verification pass as its requests see it: what routers learn pass costs from."""
    pass_id: int  # this engine's count of forward passes, this one included
    seconds: float
    tokens: int  # scored tokens of all rows: each row's last verified token and its tree
    width: int  # tokens of the widest row


@dataclass
class _Request:
    blocks: SequenceBlocks      # its block table (empty while preempted)
    params: SamplingParams
    generator: torch.Generator  # the verifier stream (stream 0), as in the single-process loop
    tokens: list[int]           # every verified token; the last one is not in the cache yet
    last_used: float = 0.0      # engine clock at the last prefill or verify
    prompt_length: int = 0      # tokens before the output (penalties count the output's)
    processor: Processor | None = None  # penalties, bias, grammar, in step with `tokens`
    seq: int = 0                # admission order: the highest is preempted first
    resident: bool = True       # its cache holds its verified tokens (False: preempted)

    @property
    def context(self) -> int:
        """KV slots its verified tokens take (all but the pending last one)."""
        return len(self.tokens) - 1


# Work items for the worker. eq=False: they are taken off the queue by identity.
@dataclass(eq=False)
class _Prefill:
    request_id: str
    tokens: list[int]
    params: SamplingParams
    candidates: int = 0
    resumed: int = 0  # earlier prefills of the request: its random stream must be fresh
    prompt_length: int | None = None  # tokens before the output (None: all of them)
    namespace: str = DEFAULT_NAMESPACE  # whose cached prefixes it may take
    capture: tuple[int, ...] | None = None  # target layers whose outputs it answers (eagle)
    future: Future = field(default_factory=Future)


@dataclass(eq=False)
class _Verify:
    request_id: str
    tree: DraftTree
    context_length: int | None = None
    deadline: float = math.inf  # time.monotonic(); the earliest deadline is verified first
    candidates: int = 0  # report the target's top-k next tokens at each scored position
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # ... which the pass writes here
    future: Future = field(default_factory=Future)
    # one of a run of rounds (`VerifierEngine.verify_rounds`): called by the worker with this round's
    # outcome as its pass ends, the next round to queue at once (None: the rounds end)
    then: "Callable[[VerifyOutcome], _Verify | None] | None" = None
    capture: tuple[int, ...] | None = None  # target layers whose outputs the verdict carries (eagle)

    def keep_top(self, tokens, scores: torch.Tensor) -> None:
        self.top = top_candidates(scores, self.candidates)


@dataclass(eq=False)
class _Release:
    request_id: str
    future: Future = field(default_factory=Future)


_Work = _Prefill | _Verify | _Release


class VerifierEngine:
    def __init__(self, model: Transformer, max_batch: int | None = _SETTINGS.max_batch,
                 max_len: int = _SETTINGS.max_len,
                 max_batch_tokens: int = _SETTINGS.max_batch_tokens, batch_wait_s: float = 0.002,
                 checkpoints: CheckpointStore | None = None, checkpoint_ttl_s: float = 600.0,
                 checkpoint_interval_s: float = _SETTINGS.checkpoint_interval_s,
                 idle_timeout_s: float = 300.0, clock: Callable[[], float] = time.monotonic,
                 threads: int | None = None, metrics: VerifierMetrics | None = None,
                 grammars: Grammars | None = None, kv_cache_memory: str | float = _SETTINGS.kv_cache_memory,
                 kv_block_size: int = _SETTINGS.kv_block_size, kv_blocks: int | None = None,
                 prefix_caching: bool = True, cuda_graphs: bool | None = _SETTINGS.cuda_graphs):
        """`threads`: torch threads of the worker thread, which runs every forward pass
        (None: torch's setting). A process that serves should run nothing multi-threaded
        on any other thread (`runtime.cpu_tuning.own_torch_threads`). `metrics`: where
        the engine records its Prometheus metrics (default: a fresh registry of its own).
        `grammars`: the target tokenizer's, for requests with a grammar (None: refused).
        `kv_cache_memory`: the paged KV cache's memory, a share of the machine's (the GPU's
        on CUDA) or bytes (`settings.memory_bytes`), in blocks of `kv_block_size` slots;
        `kv_blocks` gives the number of blocks instead. It must hold one request of
        `max_len` and a round's tree. `max_batch`: most requests held (None: as the blocks allow).
        `prefix_caching` False: every request computes all its tokens (for measurements).
        `cuda_graphs`: verification passes at static shapes over the cache's blocks, each
        bucket's pass a captured CUDA graph (runtime/graphs.py; None: on CUDA)."""
        if (max_batch is not None and max_batch < 1) or max_batch_tokens < 1:
            raise ValueError("max_batch and max_batch_tokens must be positive")
        self.model, self.threads, self.grammars = model, threads, grammars
        self.max_batch, self.max_batch_tokens, self.batch_wait_s = max_batch, max_batch_tokens, batch_wait_s
        self.max_len = min(max_len, model.config.max_position_embeddings)  # KV slots one request may use
        self.checkpoints, self.checkpoint_ttl_s = checkpoints, checkpoint_ttl_s
        # a request whose router went away would hold its row for ever: drop it when idle
        self.idle_timeout_s, self.clock = idle_timeout_s, clock
        self._writer = (None if checkpoints is None
                        else _CheckpointWriter(checkpoints, checkpoint_ttl_s, checkpoint_interval_s))
        # One request may take max_len slots and a round's tree past them (a pass pads a row to
        # the batch's width, but the padding past a row's blocks is not written).
        self.block_size = kv_block_size
        given = f"kv_blocks {kv_blocks}" if kv_blocks is not None else f"kv_cache_memory {kv_cache_memory!r}"
        if kv_blocks is None:
            kv_blocks = memory_bytes(kv_cache_memory, device_memory(model.device)) // model.kv_block_bytes(kv_block_size)
        needed = -(-(self.max_len + max_batch_tokens) // kv_block_size)
        if kv_blocks < needed:
            raise ValueError(f"{given} holds {kv_blocks} blocks of {kv_block_size} "
                             f"tokens, fewer than one request of max_len {self.max_len} and a round's "
                             f"{max_batch_tokens} tokens need ({needed})")
        self._pool = BlockPool(kv_blocks, kv_block_size)
        self.prefix_caching = prefix_caching
        self._kv = model.new_paged_cache(kv_blocks, kv_block_size)
        self._static = static_passes(model, self._kv, cuda_graphs)
        self._requests: dict[str, _Request] = {}
        self._seqs = itertools.count(1)
        self._parked: list[_Verify] = []  # rounds of preempted requests, waiting for blocks
        self._parked_at = -1  # the pool's `freed` when they were parked: they try again once it moves
        self._preemptions = self._prefix_queries = self._prefix_hits = 0
        self._queue: deque[_Work] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._stats_lock = threading.Lock()
        self._forward_passes = self._verified_requests = 0
        self._batch_sizes: Counter[int] = Counter()
        self._waiting = 0  # verify items left queued by the last batch taken
        self._busy_s, self._started = 0.0, time.monotonic()  # time in forward passes: 1 - busy/uptime is idle
        self.metrics = metrics or VerifierMetrics()
        self.metrics.watch(lambda: len(self._queue), self.active_requests, self._pool.usage)
        self._worker = threading.Thread(target=self._run, name="verifier-engine", daemon=True)
        self._worker.start()

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    # ---- called from any thread ---------------------------------------------

    def prefill(self, request_id: str, token_ids: Sequence[int], params: SamplingParams, reserve: int = 0,
                candidates: int = 0, resumed: int = 0, prompt_length: int | None = None,
                namespace: str = DEFAULT_NAMESPACE, capture: Sequence[int] | None = None) -> PrefillOutcome:
        """Take in `token_ids`, computing what the KV cache does not hold of them in `namespace`;
        returns the target's next token, and with
        `candidates` k its k likeliest next tokens after each of the last (up to
        PROMPT_SEED) tokens. `resumed`: how many times the request was prefilled before
        (anywhere); a resumed request samples from a fresh random stream. `prompt_length`:
        how many of `token_ids` are the prompt, the rest the output verified so far (None:
        all are the prompt); penalties and a grammar go on from that output. `capture`:
        target layers whose outputs at every position the outcome carries (an eagle
        drafter's); the tokens are then all computed, the prefix cache skipped, since a
        cached prefix has no features.

        `reserve` more KV slots must fit after the tokens (within max_len: they are not set
        aside). Prefilling a request this engine holds starts it over. Raises
        ResourceExhausted when the cache has no room for the tokens (or max_batch requests
        are held).
        """
        if not 0 <= candidates <= MAX_CANDIDATES:
            raise InvalidArgument("candidates", f"must be in [0, {MAX_CANDIDATES}], got {candidates}")
        if not request_id:
            raise InvalidArgument("request_id", "must not be empty")
        tokens = check_token_ids(token_ids, self.vocab_size)
        params.validate()
        params.check_vocabulary(self.vocab_size)
        if params.grammar and self.grammars is None:
            raise InvalidArgument("sampling.grammar", "this verifier has no tokenizer to run grammars with")
        if resumed < 0:
            raise InvalidArgument("resumed", f"must be >= 0, got {resumed}")
        if prompt_length is not None and not 0 < prompt_length <= len(tokens):
            raise InvalidArgument("prompt_length", f"must be in [1, {len(tokens)}], got {prompt_length}")
        if len(tokens) + reserve > self.max_len:
            raise InvalidArgument("max_len", f"{len(tokens)} tokens + {reserve} reserved slots exceed the "
                                  f"verifier's {self.max_len} KV slots per request")
        check_namespace(namespace)
        return self._submit(_Prefill(request_id, tokens, params, candidates, resumed, prompt_length, namespace,
                                     self._layers(capture)))

    def _layers(self, capture: Sequence[int] | None) -> tuple[int, ...] | None:
        """Feature layers asked for (None or empty: none), checked against the target's."""
        if not capture:
            return None
        n = self.model.config.num_layers
        bad = next((i for i in capture if not 0 <= i < n), None)
        if bad is not None or len(set(capture)) != len(capture):
            raise InvalidArgument("feature_layers", f"must be distinct layers of the target's {n}, got {list(capture)}")
        return tuple(capture)

    def verify(self, request_id: str, tree: DraftTree, context_length: int | None = None,
               deadline: float | None = None, candidates: int = 0,
               capture: Sequence[int] | None = None) -> VerifyOutcome:
        """Verify `tree` (well-formed, as protos.convert.tree_from_pb checks) below the pending token.

        Raises UnknownRequest when the request has neither a row nor a checkpoint,
        or when it holds other than `context_length` tokens (if given). Queued
        work is verified earliest `deadline` (time.monotonic()) first. With
        `candidates` k, the outcome also holds the target's k likeliest next
        tokens at every scored position (for Token Recycling drafters). With `capture`
        (target layers), the outcome carries their outputs at the positions it verified.
        """
        return self._submit(self._verify_item(request_id, tree, context_length, deadline, candidates, capture))

    def verify_rounds(self, request_id: str, tree: DraftTree, context_length: int | None,
                      next_tree: Callable[[VerifyOutcome], DraftTree | None], deadline: float | None = None,
                      candidates: int = 0, capture: Sequence[int] | None = None) -> Iterator[VerifyOutcome]:
        """A request's rounds one after another, each outcome as it comes (a Decode call):
        `tree` first, as `verify` takes it, then the trees `next_tree` gives. The worker calls
        `next_tree` with each round's outcome as its pass ends (None: the rounds end) and queues
        that round at once, so the request is in the very next pass: a caller sending each
        round itself would come back after the next pass had started, under load often.
        Raises what `verify` raises; closing the iterator ends the rounds after the one queued."""
        outcomes: queue.SimpleQueue[Future | None] = queue.SimpleQueue()
        closed = threading.Event()

        def then(outcome: VerifyOutcome) -> _Verify | None:  # in the worker
            try:
                following = None if closed.is_set() else next_tree(outcome)
                work = None if following is None else self._verify_item(request_id, following, None, deadline,
                                                                         candidates, capture)
            except Exception as exc:  # the caller's next_tree failed: its rounds end with its error
                failed = Future()
                failed.set_exception(exc)
                outcomes.put(failed)
                return None
            if work is None:
                outcomes.put(None)
                return None
            return on_done(work)

        def on_done(work: _Verify) -> _Verify:
            work.then = then
            work.future.add_done_callback(outcomes.put)
            return work

        first = on_done(self._verify_item(request_id, tree, context_length, deadline, candidates, capture))
        with self._cond:
            if self._closed:
                raise RuntimeError("the verifier engine is closed")
            self._queue.append(first)
            self._cond.notify()
        try:
            while (done := outcomes.get()) is not None:
                yield done.result()
        finally:
            closed.set()

    def _verify_item(self, request_id: str, tree: DraftTree, context_length: int | None, deadline: float | None,
                     candidates: int, capture: Sequence[int] | None = None) -> _Verify:
        """A verify call's work, its arguments checked."""
        if not 0 <= candidates <= MAX_CANDIDATES:
            raise InvalidArgument("candidates", f"must be in [0, {MAX_CANDIDATES}], got {candidates}")
        if 1 + len(tree) > self.max_batch_tokens:
            raise InvalidArgument("tree", f"{len(tree)} nodes exceed the verifier's budget of "
                                  f"{self.max_batch_tokens - 1} per request")
        if tree.draw_q is not None:
            tree = dataclasses.replace(tree, draw_q=tree.draw_q.to(self.model.device))
        return _Verify(request_id, tree, context_length, math.inf if deadline is None else deadline, candidates,
                       capture=self._layers(capture))

    def release(self, request_id: str) -> bool:
        """Free the request's blocks (its full ones stay cached) and delete its checkpoint;
        False if this engine did not hold it."""
        return self._submit(_Release(request_id))

    def sampling(self, request_id: str) -> SamplingParams | None:
        """The sampling parameters of a request held here (None: none is)."""
        state = self._requests.get(request_id)
        return None if state is None else state.params

    def active_requests(self) -> int:
        """Requests held now (preempted ones included)."""
        return len(self._requests)

    def load(self) -> int:
        """Requests held plus work queued: how full this verifier is (autoscaling reads it)."""
        with self._cond:
            queued = len(self._queue)
        return self.active_requests() + queued

    def occupancy(self) -> float:
        """How full this verifier is, for autoscaling (which aims it at `target_occupancy`): the
        share of its KV cache's blocks held, or its requests held and queued over `max_batch`
        (over BATCH_TARGET without one: what a verifier's passes batch well), the fuller."""
        return max(self._pool.usage(), self.load() / (self.max_batch or BATCH_TARGET))

    def stats(self) -> dict[str, Any]:
        """forward_passes counts prefills too; the histogram counts verification passes by batch size."""
        with self._stats_lock:
            return {"forward_passes": self._forward_passes, "verified_requests": self._verified_requests,
                    "max_batch_size": max(self._batch_sizes, default=0),
                    "batch_size_histogram": dict(self._batch_sizes), "active_requests": len(self._requests),
                    "busy_seconds": self._busy_s, "uptime_seconds": time.monotonic() - self._started}

    def kv_stats(self) -> dict[str, Any]:
        """The paged KV cache: its blocks (held by requests, cached in the prefix index), prefix
        cache queries and hits in tokens, preemptions, and the requests held, preempted."""
        pool = self._pool
        with self._stats_lock:
            return {"blocks": pool.num_blocks, "block_size": pool.block_size, "held_blocks": pool.held(),
                    "cached_blocks": pool.cached(), "usage": pool.usage(), "evictions": pool.evictions,
                    "prefix_cache_queries": self._prefix_queries, "prefix_cache_hits": self._prefix_hits,
                    "preemptions": self._preemptions, "requests": len(self._requests),
                    "preempted": sum(not r.resident for r in list(self._requests.values()))}

    def close(self) -> None:
        """Stop the worker; work still queued fails; checkpoints on their way are written."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join()
        if self._writer is not None:
            self._writer.flush()
        while self._queue:
            self._queue.popleft().future.set_exception(RuntimeError("the verifier engine is closed"))
        for work in self._parked:
            work.future.set_exception(RuntimeError("the verifier engine is closed"))
        self._parked = []

    def _submit(self, work: _Work) -> Any:
        with self._cond:
            if self._closed:
                raise RuntimeError("the verifier engine is closed")
            self._queue.append(work)
            self._cond.notify()
        return work.future.result()

    # ---- the worker thread ----------------------------------------------------

    def _run(self) -> None:
        if self.threads:
            own_torch_threads(self.threads)
        while True:
            self._unpark()  # before waiting for work: a pass or a release may have freed blocks
            batch = self._take()
            if batch is None:
                break
            self._evict_idle()
            if not batch:
                continue
            work = batch[0]
            if isinstance(work, _Verify):
                self._verify(batch)
                continue
            try:
                result = self._prefill(work) if isinstance(work, _Prefill) else self._release(work.request_id)
            except Exception as exc:
                work.future.set_exception(exc)
            else:
                work.future.set_result(result)

    def _take(self) -> list[_Work] | None:
        """The next work: one prefill or release, or a batch of verify items; None once closed."""
        with self._cond:
            if not self._queue and not self._closed:
                self._cond.wait(min(self.idle_timeout_s / 4, IDLE_CHECK_S))  # wake now and then to drop idle requests
            if self._closed:
                return None
            if not self._queue:
                return []
            first = self._queue[0]
            if not isinstance(first, _Verify):
                return [self._queue.popleft()]
            # Wait a moment for other requests' rounds, but not for more requests than there are.
            until = time.monotonic() + self.batch_wait_s
            while (len(batch := self._batchable()) < min(self.max_batch or math.inf, self._resident())
                   and (left := until - time.monotonic()) > 0):
                self._cond.wait(left)
            for work in batch:
                self._queue.remove(work)
            self._waiting = sum(isinstance(w, _Verify) for w in self._queue)
            return batch

    def _batchable(self) -> list[_Verify]:
        """The queued verify items of the next pass, up to the first other work: each
        request's first one, earliest deadline first (queue order among equals), at most
        max_batch items and max_batch_tokens tokens (roots included); a tree that does not
        fit leaves room for smaller ones behind it."""
        firsts: dict[str, _Verify] = {}
        for work in itertools.takewhile(lambda w: isinstance(w, _Verify), self._queue):
            firsts.setdefault(work.request_id, work)
        batch, tokens = [], 0
        for work in sorted(firsts.values(), key=lambda w: w.deadline):  # stable: queue order among equals
            if self.max_batch is not None and len(batch) == self.max_batch:
                break
            if not batch or tokens + 1 + len(work.tree) <= self.max_batch_tokens:
                batch.append(work)
                tokens += 1 + len(work.tree)
        return batch

    def _prefill(self, work: _Prefill) -> PrefillOutcome:
        self._drop(work.request_id)
        if self.max_batch is not None and len(self._requests) >= self.max_batch:
            raise ResourceExhausted(f"all {self.max_batch} requests this verifier holds at once are here")
        if self._parked:  # preempted requests wait for blocks: they come first
            raise ResourceExhausted(f"the KV cache is full: {len(self._parked)} preempted requests wait for room")
        params = work.params
        generator = make_generator(params.seed, self.model.device, stream=0, resumed=work.resumed)
        started = time.monotonic()
        seed = min(len(work.tokens), PROMPT_SEED) if work.candidates else 1
        blocks = SequenceBlocks(self._pool, work.namespace)
        # room for the prompt, and a block for each request held to grow by (fewer preemptions)
        # features come from computed positions only: a request that asks for them takes no cached prefix
        cached_limit = 0 if work.capture else len(work.tokens) - seed
        logits = self._compute(blocks, work.tokens, cached_limit, headroom=self._resident(), last=seed,
                               capture=work.capture)
        features = None
        if work.capture:
            logits, features = logits
        self._busy_s += time.monotonic() - started
        prompt_length = len(work.tokens) if work.prompt_length is None else work.prompt_length
        processor = self._processor(params, work.tokens, prompt_length)
        first = first_verdict(logits[-1], params, generator, len(work.tokens), processor)
        state = _Request(blocks, params, generator, work.tokens + [first.bonus], self.clock(), prompt_length,
                         processor, next(self._seqs))
        self._requests[work.request_id] = state
        self._checkpoint(work.request_id, state)
        top = top_candidates(logits, work.candidates) if work.candidates else (None, None)
        return PrefillOutcome(first.bonus, *top, logprobs=first.logprobs,
                              features=None if features is None else (0, features))

    def _processor(self, params: SamplingParams, tokens: list[int], prompt_length: int) -> Processor | None:
        """The request's processor after `tokens` (its prompt, then any output verified)."""
        if not params.processed:
            return None
        return Processor.resumed(params, tokens[:prompt_length], tokens[prompt_length:], self.vocab_size,
                                 self.grammars)

    def _verify(self, batch: list[_Verify]) -> None:
        ready: list[tuple[_Verify, _Request]] = []
        for work in batch:
            try:
                state = self._requests.get(work.request_id) or self._restore(work.request_id)
                if work.context_length is not None and work.context_length != len(state.tokens):
                    raise UnknownRequest(work.request_id)  # the caller's view differs: start over
                self._check_tree(work.tree, state)
            except Exception as exc:
                work.future.set_exception(exc)
            else:
                ready.append((work, state))
        ready = self._make_room(ready)
        if not ready:
            return
        extra = [self._room(state, work.tree) for work, state in ready]
        items = [VerifyItem(row, state.tokens[-1], work.tree, state.params, state.generator,
                            on_scores=work.keep_top if work.candidates else None, processor=state.processor,
                            extra_nodes=more, capture=work.capture)
                 for row, ((work, state), more) in enumerate(zip(ready, extra))]
        view = self._kv.rows([state.blocks.blocks for _, state in ready], [state.context for _, state in ready])
        try:
            started = time.monotonic()
            results = self._pass(view, items)
            seconds = time.monotonic() - started
            self._busy_s += seconds
        except Exception as exc:
            # The pass may have left rows half-written and random streams advanced: drop its
            # requests (they resume from their checkpoints or are prefilled again) and cut
            # every other row back to its verified tokens.
            for work, _ in ready:
                self._drop(work.request_id)
                work.future.set_exception(exc)
            self._resync_rows()
            return
        sizes = [1 + len(verdict.tree) for verdict in results]
        shape = PassShape(self._count_pass(len(ready)), seconds, sum(sizes), max(sizes))
        self.metrics.observe_pass(len(ready), seconds, sum(sizes))
        for row, ((work, state), verdict) in enumerate(zip(ready, results)):
            accepted, bonus, tree = verdict.accepted, verdict.bonus, verdict.tree
            root = state.context  # the root's position: the first this verdict verifies
            state.tokens += accepted + [bonus]
            state.last_used = self.clock()
            assert view.lengths[row] == state.context, (view.lengths[row], state.context)
            state.blocks.trim(state.context)  # the rejected nodes' blocks go back
            state.blocks.commit(state.tokens, state.context)
            self._checkpoint(work.request_id, state)
            ids, probs = work.top or (None, None)
            outcome = VerifyOutcome(accepted, bonus, len(ready), self._waiting, len(self._requests), ids, probs,
                                    shape, len(tree), max(tree.depths, default=0), verdict.forced,
                                    verdict.logprobs,
                                    None if verdict.features is None else (root, verdict.features))
            work.future.set_result(outcome)
            following = work.then(outcome) if work.then is not None else None
            if following is not None:
                with self._cond:
                    self._queue.append(following)

    def _room(self, state: _Request, tree: DraftTree) -> int:
        """Nodes a pass may add to a request's tree (the tokens a grammar forces)."""
        if state.processor is None or not state.params.grammar:
            return 0
        return max(0, min(MAX_FORCED, self.max_len - state.context - 1 - len(tree)))

    def _pass(self, view: PagedRows, items: list[VerifyItem]) -> list[Verdict]:
        """One verification pass over a batch's rows: what `PassShape.seconds` times."""
        return verify_batch(self.model, view, items, static=self._static)

    def _check_tree(self, tree: DraftTree, state: _Request) -> None:
        """What a well-formed tree still needs: room in the context, and when sampling, its draws' q."""
        used = state.context + 1  # the root goes in with the tree
        if used + len(tree) > self.max_len:
            raise InvalidArgument("tree", f"{len(tree)} nodes do not fit: the request already uses "
                                  f"{used} of {self.max_len} KV slots")
        if state.params.deterministic or not len(tree):
            return
        q = tree.draw_q
        if q is None:
            raise InvalidArgument("tree.draw_q", "sampling needs the distribution of every draw")
        drawn = q[torch.arange(len(q)), torch.tensor([tree.tokens[n] for n in tree.draw_nodes], dtype=torch.long)]
        # verification is exact only if each draw really came from its q
        sums_to_one = ((q.sum(-1) - 1).abs() <= Q_SUM_TOLERANCE).all()
        if not (q.isfinite().all() and (q >= 0).all() and sums_to_one and (drawn > 0).all()):
            raise InvalidArgument("tree.draw_q", "each draw's q must be a distribution giving its token a "
                                  "positive probability")

    def _compute(self, blocks: SequenceBlocks, tokens: list[int], cached_limit: int, headroom: int = 0,
                 last: int = 1, capture: tuple[int, ...] | None = None):
        """Put `tokens` into an empty block table: the longest prefix cached in its namespace
        (whole blocks, at most `cached_limit` tokens), then the rest computed in one pass.
        Returns the logits [last, V] after each of the `last` last tokens (None when the cache
        held them all: `cached_limit` may be all of them when no logits are wanted). Raises
        ResourceExhausted, holding nothing, unless `headroom` blocks stay available after.
        With `capture` (and no cached prefix): (logits, the features [n, F] at every position)."""
        n = len(tokens)
        cached = blocks.reuse(tokens, cached_limit if self.prefix_caching else 0)
        if blocks.needed(n) + headroom > self._pool.available():
            blocks.free()
            raise ResourceExhausted(f"the KV cache has no room for {n - cached} more tokens: "
                                    f"{self._pool.available()} of {self._pool.num_blocks} blocks available")
        with self._stats_lock:  # counted once room was found: a round waiting for it asks again and again
            self._prefix_queries += n
            self._prefix_hits += cached
        self.metrics.prefix_cache_queries.inc(n)
        self.metrics.prefix_cache_hits.inc(cached)
        blocks.reserve(n)
        if cached == n:
            blocks.commit(tokens, n)
            return None
        device, t = self.model.device, n - cached
        try:
            logits = self.model(torch.tensor([tokens[cached:]], device=device),
                                torch.arange(cached, n, device=device)[None], self._kv.rows([blocks.blocks], [cached]),
                                attention_mask(cached, causal_ancestors(t, device)), logits_from=max(0, t - last),
                                capture=capture)
        except Exception:
            blocks.free()
            raise
        blocks.commit(tokens, n)
        self._count_pass(0)
        if capture:
            logits, features = logits
            return logits[0], features[0]
        return logits[0]

    def _resident(self) -> int:
        return sum(state.resident for state in self._requests.values())

    def _make_room(self, ready: list[tuple[_Verify, _Request]]) -> list[tuple[_Verify, _Request]]:
        """The batch's requests that go into the pass, each with blocks for its round. Oldest
        first: a preempted one is computed again where there is room (else its round is
        parked), and while a request lacks blocks the newest request held is preempted (which
        may be itself: its round is parked until there is room)."""
        going = set()
        for work, state in sorted(ready, key=lambda pair: pair[1].seq):
            slots = state.context + 1 + len(work.tree) + self._room(state, work.tree)
            try:
                resumed = state.resident or self._resume(state, slots)
            except Exception as exc:  # its pass failed: it resumes from its checkpoint, or is prefilled again
                self._drop(work.request_id)
                work.future.set_exception(exc)
                continue
            if not resumed:
                self._park(work)
                continue
            # the newest is never one already given blocks: they are older than this one
            while state.resident and state.blocks.needed(slots) > self._pool.available():
                victim_id, victim = max(((rid, r) for rid, r in self._requests.items() if r.resident),
                                        key=lambda pair: pair[1].seq)
                self._preempt(victim_id, victim)
            if not state.resident:
                self._park(work)
                continue
            state.blocks.reserve(slots)
            going.add(id(work))
        return [(work, state) for work, state in ready if id(work) in going]

    def _resume(self, state: _Request, slots: int) -> bool:
        """Compute a preempted request's cache again from its verified tokens, if the blocks for
        them and `slots` in all leave a block for each request held to grow by; whether it did."""
        try:
            self._compute(state.blocks, state.tokens[:-1], state.context, headroom=self._resident())
        except ResourceExhausted:
            return False
        if state.blocks.needed(slots) > self._pool.available():
            state.blocks.free()
            return False
        state.resident = True
        log.debug("resumed a preempted request (%d tokens)", state.context)
        return True

    def _preempt(self, request_id: str, state: _Request) -> None:
        """Free a request's blocks (its full ones stay cached); it keeps its verified tokens."""
        state.blocks.free()
        state.resident = False
        with self._stats_lock:
            self._preemptions += 1
        self.metrics.num_preemptions.inc()
        log.info("preempted request %s (%d tokens): the KV cache is full", request_id, state.context)

    def _park(self, work: _Verify) -> None:
        self._parked.append(work)
        self._parked_at = self._pool.freed

    def _unpark(self) -> None:
        """Queue the parked rounds again (first) once blocks were freed since they were parked."""
        if self._parked and self._pool.freed != self._parked_at:
            with self._cond:
                self._queue.extendleft(reversed(self._parked))
            self._parked = []

    def _restore(self, request_id: str) -> _Request:
        """A request this engine does not hold, rebuilt from its checkpoint (a restarted verifier)."""
        if self._writer is not None:
            self._writer.flush()  # this engine's own latest checkpoint may still be on its way
        saved = self.checkpoints.load_checkpoint(request_id) if self.checkpoints is not None else None
        if saved is None:
            raise UnknownRequest(request_id)
        generator = torch.Generator(self.model.device)
        state_bytes = bytearray(base64.b64decode(saved["generator"]))
        generator.set_state(torch.frombuffer(state_bytes, dtype=torch.uint8))
        tokens, params = saved["tokens"], SamplingParams.from_dict(saved["params"])
        prompt_length = saved.get("prompt_length", len(tokens) - 1)
        # held as preempted: its round computes its cache when there is room (`_make_room`)
        blocks = SequenceBlocks(self._pool, saved.get("namespace", DEFAULT_NAMESPACE))
        state = _Request(blocks, params, generator, tokens, self.clock(), prompt_length,
                         self._processor(params, tokens, prompt_length), next(self._seqs), resident=False)
        self._requests[request_id] = state
        log.info("resumed request %s from its checkpoint (%d tokens)", request_id, len(tokens))
        return state

    def _checkpoint(self, request_id: str, state: _Request) -> None:
        if self._writer is None:
            return
        self._writer.save(request_id, {
            "tokens": list(state.tokens), "params": state.params.to_dict(), "prompt_length": state.prompt_length,
            "namespace": state.blocks.namespace,
            "generator": base64.b64encode(state.generator.get_state().numpy().tobytes()).decode()})

    def _release(self, request_id: str) -> bool:
        held = self._drop(request_id)
        if self._writer is not None:
            self._writer.delete(request_id)
        return held

    def _evict_idle(self) -> None:
        cutoff = self.clock() - self.idle_timeout_s
        idle = [r for r, state in self._requests.items() if state.last_used < cutoff]
        if not idle:
            return
        with self._cond:  # a request with a round queued or parked (waiting for blocks) is not idle
            waiting = {work.request_id for work in itertools.chain(self._queue, self._parked)}
        for request_id in [r for r in idle if r not in waiting]:
            log.info("dropping idle request %s (its checkpoint stays for a resume)", request_id)
            self._drop(request_id)

    def _drop(self, request_id: str) -> bool:
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        state.blocks.free()
        for work in [w for w in self._parked if w.request_id == request_id]:
            self._parked.remove(work)
            work.future.set_exception(UnknownRequest(request_id))
        return True

    def _resync_rows(self) -> None:
        """Give back every request's blocks past its verified tokens (a failed pass's)."""
        for state in self._requests.values():
            if state.resident:
                state.blocks.trim(state.context)

    def _count_pass(self, batch_size: int) -> int:
        """One target forward; batch_size > 0 for a verification pass. Returns its number."""
        with self._stats_lock:
            self._forward_passes += 1
            if batch_size:
                self._verified_requests += batch_size
                self._batch_sizes[batch_size] += 1
            return self._forward_passes
