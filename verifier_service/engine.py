"""The target engine: one KV cache row per request, and one worker thread that
verifies the draft trees of many requests in each forward pass (continuous
batching).

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
from runtime.cpu_tuning import PAD_ROWS_TO, own_torch_threads
from runtime.graphs import static_passes
from runtime.model import Transformer, attention_mask, causal_ancestors
from speculative.recycling import PROMPT_SEED, top_candidates
from speculative.sampling import InvalidArgument, SamplingParams, make_generator
from speculative.tree import DraftTree

from .metrics import VerifierMetrics
from .settings import VerifierSettings

log = logging.getLogger(__name__)

_SETTINGS = VerifierSettings()  # the engine's defaults are the served verifier's


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
    """Neither a cache row nor a checkpoint holds this request: it must be prefilled again."""


class ResourceExhausted(RuntimeError):
    """Every cache row is taken."""


class CheckpointStore(Protocol):
    """The part of cluster.state's stores the engine uses."""

    def save_checkpoint(self, request_id: str, data: dict[str, Any], ttl_s: float) -> None: ...

    def load_checkpoint(self, request_id: str) -> dict[str, Any] | None: ...

    def delete_checkpoint(self, request_id: str) -> None: ...

MAX_CANDIDATES = 64  # most next tokens a verify call may ask for per scored position
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


@dataclass
class VerifyOutcome:
    accepted: list[int]  # accepted draft tokens, root to leaf
    bonus: int           # the target's own next token
    batch_size: int      # requests that shared the forward pass
    queued: int = 0      # verify items still waiting when the pass began
    active: int = 0      # requests holding a row: the load a caller adapts to (some may be between rounds)
    # with candidates asked: the target's likeliest next tokens [1+N, k] and their probabilities
    # at the root and at each tree node (Token Recycling)
    candidate_ids: torch.Tensor | None = None
    candidate_probs: torch.Tensor | None = None
    pass_shape: "PassShape | None" = None  # the forward pass it went into
    drafted: int = 0  # nodes of the tree it verified
    drafted_depth: int = 0  # ... and its levels
    forced: int = 0  # accepted tokens a grammar forced (jump-forward)
    logprobs: list[TokenLogprob] | None = None  # of the accepted tokens and the bonus, when asked


@dataclass(frozen=True)
class PassShape:
    """One verification pass as its requests see it: what routers learn pass costs from."""
    pass_id: int  # this engine's count of forward passes, this one included
    seconds: float
    tokens: int  # scored tokens of all rows: each row's last verified token and its tree
    width: int  # tokens of the widest row


@dataclass
class _Request:
    row: int
    params: SamplingParams
    generator: torch.Generator  # the verifier stream (stream 0), as in the single-process loop
    tokens: list[int]           # every verified token; the last one is not in the cache yet
    last_used: float = 0.0      # engine clock at the last prefill or verify
    prompt_length: int = 0      # tokens before the output (penalties count the output's)
    processor: Processor | None = None  # penalties, bias, grammar, in step with `tokens`


# Work items for the worker. eq=False: they are taken off the queue by identity.
@dataclass(eq=False)
class _Prefill:
    request_id: str
    tokens: list[int]
    params: SamplingParams
    candidates: int = 0
    resumed: int = 0  # earlier prefills of the request: its random stream must be fresh
    prompt_length: int | None = None  # tokens before the output (None: all of them)
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

    def keep_top(self, tokens, scores: torch.Tensor) -> None:
        self.top = top_candidates(scores, self.candidates)


@dataclass(eq=False)
class _Release:
    request_id: str
    future: Future = field(default_factory=Future)


_Work = _Prefill | _Verify | _Release


class VerifierEngine:
    def __init__(self, model: Transformer, max_batch: int = _SETTINGS.max_batch, max_len: int = _SETTINGS.max_len,
                 max_batch_tokens: int = _SETTINGS.max_batch_tokens, batch_wait_s: float = 0.002,
                 checkpoints: CheckpointStore | None = None, checkpoint_ttl_s: float = 600.0,
                 checkpoint_interval_s: float = _SETTINGS.checkpoint_interval_s,
                 idle_timeout_s: float = 300.0, clock: Callable[[], float] = time.monotonic,
                 threads: int | None = None, metrics: VerifierMetrics | None = None,
                 grammars: Grammars | None = None, cuda_graphs: bool | None = _SETTINGS.cuda_graphs):
        """`threads`: torch threads of the worker thread, which runs every forward pass
        (None: torch's setting). A process that serves should run nothing multi-threaded
        on any other thread (`runtime.cpu_tuning.own_torch_threads`). `metrics`: where
        the engine records its Prometheus metrics (default: a fresh registry of its own).
        `grammars`: the target tokenizer's, for requests with a grammar (None: refused).
        `cuda_graphs`: passes at static shapes from captured CUDA graphs (None: on CUDA)."""
        if max_batch < 1 or max_batch_tokens < 1:
            raise ValueError("max_batch and max_batch_tokens must be positive")
        self.model, self.threads, self.grammars = model, threads, grammars
        self.max_batch, self.max_batch_tokens, self.batch_wait_s = max_batch, max_batch_tokens, batch_wait_s
        self.max_len = min(max_len, model.config.max_position_embeddings)  # KV slots one request may use
        self.checkpoints, self.checkpoint_ttl_s = checkpoints, checkpoint_ttl_s
        # a request whose router went away would hold its row for ever: drop it when idle
        self.idle_timeout_s, self.clock = idle_timeout_s, clock
        self._writer = (None if checkpoints is None
                        else _CheckpointWriter(checkpoints, checkpoint_ttl_s, checkpoint_interval_s))
        # A pass pads every row up to the highest one in the batch to the batch's width (at most
        # max_batch_tokens; a tuned CPU model may pad one row's 2-3 tokens to PAD_ROWS_TO), so rows
        # get spare slots for it.
        self._cache = model.new_cache(self.max_len + max(max_batch_tokens, PAD_ROWS_TO), batch=max_batch)
        self._static = static_passes(model, self._cache, cuda_graphs)
        self._requests: dict[str, _Request] = {}
        self._queue: deque[_Work] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._stats_lock = threading.Lock()
        self._forward_passes = self._verified_requests = 0
        self._batch_sizes: Counter[int] = Counter()
        self._waiting = 0  # verify items left queued by the last batch taken
        self._busy_s, self._started = 0.0, time.monotonic()  # time in forward passes: 1 - busy/uptime is idle
        self.metrics = metrics or VerifierMetrics()
        self.metrics.watch(lambda: len(self._queue), self.active_requests)
        self._worker = threading.Thread(target=self._run, name="verifier-engine", daemon=True)
        self._worker.start()

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    # ---- called from any thread ---------------------------------------------

    def prefill(self, request_id: str, token_ids: Sequence[int], params: SamplingParams, reserve: int = 0,
                candidates: int = 0, resumed: int = 0, prompt_length: int | None = None) -> PrefillOutcome:
        """Fill the lowest free row with `token_ids`; returns the target's next token, and with
        `candidates` k its k likeliest next tokens after each of the last (up to
        PROMPT_SEED) tokens. `resumed`: how many times the request was prefilled before
        (anywhere); a resumed request samples from a fresh random stream. `prompt_length`:
        how many of `token_ids` are the prompt, the rest the output verified so far (None:
        all are the prompt); penalties and a grammar go on from that output.

        `reserve` more KV slots must fit after the tokens. Prefilling a request
        this engine holds starts it over. Raises ResourceExhausted when no row is free.
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
        return self._submit(_Prefill(request_id, tokens, params, candidates, resumed, prompt_length))

    def verify(self, request_id: str, tree: DraftTree, context_length: int | None = None,
               deadline: float | None = None, candidates: int = 0) -> VerifyOutcome:
        """Verify `tree` (well-formed, as protos.convert.tree_from_pb checks) below the pending token.

        Raises UnknownRequest when the request has neither a row nor a checkpoint,
        or when it holds other than `context_length` tokens (if given). Queued
        work is verified earliest `deadline` (time.monotonic()) first. With
        `candidates` k, the outcome also holds the target's k likeliest next
        tokens at every scored position (for Token Recycling drafters).
        """
        return self._submit(self._verify_item(request_id, tree, context_length, deadline, candidates))

    def verify_rounds(self, request_id: str, tree: DraftTree, context_length: int | None,
                      next_tree: Callable[[VerifyOutcome], DraftTree | None], deadline: float | None = None,
                      candidates: int = 0) -> Iterator[VerifyOutcome]:
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
                                                                         candidates)
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

        first = on_done(self._verify_item(request_id, tree, context_length, deadline, candidates))
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
                     candidates: int) -> _Verify:
        """A verify call's work, its arguments checked."""
        if not 0 <= candidates <= MAX_CANDIDATES:
            raise InvalidArgument("candidates", f"must be in [0, {MAX_CANDIDATES}], got {candidates}")
        if 1 + len(tree) > self.max_batch_tokens:
            raise InvalidArgument("tree", f"{len(tree)} nodes exceed the verifier's budget of "
                                  f"{self.max_batch_tokens - 1} per request")
        if tree.draw_q is not None:
            tree = dataclasses.replace(tree, draw_q=tree.draw_q.to(self.model.device))
        return _Verify(request_id, tree, context_length, math.inf if deadline is None else deadline, candidates)

    def release(self, request_id: str) -> bool:
        """Free the request's row and delete its checkpoint; False if no row held it."""
        return self._submit(_Release(request_id))

    def sampling(self, request_id: str) -> SamplingParams | None:
        """The sampling parameters of a request holding a row here (None: none holds one)."""
        state = self._requests.get(request_id)
        return None if state is None else state.params

    def active_requests(self) -> int:
        """Requests holding a row now."""
        return len(self._requests)

    def load(self) -> int:
        """Rows held plus work queued: how full this verifier is (autoscaling reads it)."""
        with self._cond:
            queued = len(self._queue)
        return self.active_requests() + queued

    def stats(self) -> dict[str, Any]:
        """forward_passes counts prefills too; the histogram counts verification passes by batch size."""
        with self._stats_lock:
            return {"forward_passes": self._forward_passes, "verified_requests": self._verified_requests,
                    "max_batch_size": max(self._batch_sizes, default=0),
                    "batch_size_histogram": dict(self._batch_sizes), "active_requests": len(self._requests),
                    "busy_seconds": self._busy_s, "uptime_seconds": time.monotonic() - self._started}

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
        while (batch := self._take()) is not None:
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
            while (len(batch := self._batchable()) < min(self.max_batch, len(self._requests))
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
            if len(batch) == self.max_batch:
                break
            if not batch or tokens + 1 + len(work.tree) <= self.max_batch_tokens:
                batch.append(work)
                tokens += 1 + len(work.tree)
        return batch

    def _prefill(self, work: _Prefill) -> PrefillOutcome:
        self._drop(work.request_id)
        params = work.params
        generator = make_generator(params.seed, self.model.device, stream=0, resumed=work.resumed)
        started = time.monotonic()
        seed = min(len(work.tokens), PROMPT_SEED) if work.candidates else 1
        row, logits = self._fill_free_row(work.tokens, seed)
        self._busy_s += time.monotonic() - started
        prompt_length = len(work.tokens) if work.prompt_length is None else work.prompt_length
        processor = self._processor(params, work.tokens, prompt_length)
        first = first_verdict(logits[-1], params, generator, len(work.tokens), processor)
        state = _Request(row, params, generator, work.tokens + [first.bonus], self.clock(), prompt_length, processor)
        self._requests[work.request_id] = state
        self._checkpoint(work.request_id, state)
        top = top_candidates(logits, work.candidates) if work.candidates else (None, None)
        return PrefillOutcome(first.bonus, *top, logprobs=first.logprobs)

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
        if not ready:
            return
        items = [VerifyItem(state.row, state.tokens[-1], work.tree, state.params, state.generator,
                            on_scores=work.keep_top if work.candidates else None, processor=state.processor,
                            extra_nodes=self._room(state, work.tree))
                 for work, state in ready]
        try:
            started = time.monotonic()
            results = self._pass(items)
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
        self.metrics.observe_pass(len(ready), seconds)
        for (work, state), verdict in zip(ready, results):
            accepted, bonus, tree = verdict.accepted, verdict.bonus, verdict.tree
            state.tokens += accepted + [bonus]
            state.last_used = self.clock()
            self._checkpoint(work.request_id, state)
            ids, probs = work.top or (None, None)
            outcome = VerifyOutcome(accepted, bonus, len(ready), self._waiting, len(self._requests), ids, probs,
                                    shape, len(tree), max(tree.depths, default=0), verdict.forced,
                                    verdict.logprobs)
            work.future.set_result(outcome)
            following = work.then(outcome) if work.then is not None else None
            if following is not None:
                with self._cond:
                    self._queue.append(following)

    def _room(self, state: _Request, tree: DraftTree) -> int:
        """Nodes a pass may add to a request's tree (the tokens a grammar forces)."""
        if state.processor is None or not state.params.grammar:
            return 0
        return max(0, min(MAX_FORCED, self.max_len - self._cache.lengths[state.row] - 1 - len(tree)))

    def _pass(self, items: list[VerifyItem]) -> list[Verdict]:
        """One verification pass over a batch's rows: what `PassShape.seconds` times."""
        return verify_batch(self.model, self._cache, items, static=self._static)

    def _check_tree(self, tree: DraftTree, state: _Request) -> None:
        """What a well-formed tree still needs: room in the row, and when sampling, its draws' q."""
        used = self._cache.lengths[state.row] + 1  # the root goes in with the tree
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

    def _fill_free_row(self, tokens: list[int], last: int = 1) -> tuple[int, torch.Tensor]:
        """Prefill `tokens` into the lowest free row (keeping batches narrow); returns it and the
        logits [last, V] after each of the `last` last tokens."""
        taken = {state.row for state in self._requests.values()}
        row = next((r for r in range(self.max_batch) if r not in taken), None)
        if row is None:
            raise ResourceExhausted(f"all {self.max_batch} KV cache rows are in use")
        device, n = self.model.device, len(tokens)
        try:
            logits = self.model(torch.tensor([tokens], device=device), torch.arange(n, device=device)[None],
                                self._cache.row_view(row), attention_mask(0, causal_ancestors(n, device)),
                                logits_from=n - last)
        except Exception:
            self._cache.rollback(0, row=row)  # free rows hold nothing
            raise
        self._count_pass(0)
        return row, logits[0]

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
        row, _ = self._fill_free_row(tokens[:-1])
        state = _Request(row, params, generator, tokens, self.clock(), prompt_length,
                         self._processor(params, tokens, prompt_length))
        self._requests[request_id] = state
        log.info("resumed request %s from its checkpoint (%d tokens)", request_id, len(tokens))
        return state

    def _checkpoint(self, request_id: str, state: _Request) -> None:
        if self._writer is None:
            return
        self._writer.save(request_id, {
            "tokens": list(state.tokens), "params": state.params.to_dict(), "prompt_length": state.prompt_length,
            "generator": base64.b64encode(state.generator.get_state().numpy().tobytes()).decode()})

    def _release(self, request_id: str) -> bool:
        held = self._drop(request_id)
        if self._writer is not None:
            self._writer.delete(request_id)
        return held

    def _evict_idle(self) -> None:
        cutoff = self.clock() - self.idle_timeout_s
        for request_id in [r for r, state in self._requests.items() if state.last_used < cutoff]:
            log.info("dropping idle request %s (its checkpoint stays for a resume)", request_id)
            self._drop(request_id)

    def _drop(self, request_id: str) -> bool:
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        self._cache.rollback(0, row=state.row)
        return True

    def _resync_rows(self) -> None:
        """Cut every row back to its request's verified tokens, and free rows to nothing."""
        committed = {state.row: len(state.tokens) - 1 for state in self._requests.values()}
        for row in range(self.max_batch):
            self._cache.rollback(committed.get(row, 0), row=row)

    def _count_pass(self, batch_size: int) -> int:
        """One target forward; batch_size > 0 for a verification pass. Returns its number."""
        with self._stats_lock:
            self._forward_passes += 1
            if batch_size:
                self._verified_requests += batch_size
                self._batch_sizes[batch_size] += 1
            return self._forward_passes
