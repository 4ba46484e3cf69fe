"""Passes at bucketed static shapes over one KV cache, each bucket's pass captured once as a
CUDA graph and replayed with the request's inputs copied into its buffers.

A pass launched op by op on a GPU is bound by the host (about 850 kernel launches a pass
for the default model, docs/lab/gpu-h200.md): a replayed graph launches them all at once.
`StaticPasses` owns the bookkeeping (which bucket, the inputs padded and copied into the
bucket's static buffers, the outputs sliced to the real rows, the cache's lengths moved as
`Transformer.forward` moves them); with `graphs` off (the default off CUDA) the same static
pass runs eagerly on the same buffers, which is what the CPU tests check. The capture
itself (a side stream's warm-up, `torch.cuda.graph`, one memory pool for every bucket) is
CUDA only and is exercised by scripts/gpu_check.py.

A graph holds the addresses of the cache it was captured over, so a `StaticPasses` is bound
to one cache (a drafter whose cache grows makes a new one).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .model import KVCache, Transformer
from .paged_kv import PagedKVCache, PagedRows
from .static_pass import Bucket, Buckets, StaticInputs, pad, pad_paged, static_forward

WARMUP_PASSES = 2  # eager passes on a side stream before a capture (lazy inits, cuBLAS workspaces)


def static_passes(model: Transformer, cache, cuda_graphs: bool | None = None) -> "StaticPasses | None":
    """A server's static passes over its cache, as its `cuda_graphs` setting asks (None: where the
    model is on CUDA); None when off, or when the static pass cannot run over them (the passes
    then run eagerly): a cache that is neither a KVCache's rows nor a paged cache's pool, a
    tensor-parallel target."""
    on = model.device.type == "cuda" if cuda_graphs is None else cuda_graphs
    return StaticPasses(model, cache) if on and runs_static(model, cache) else None


def runs_static(model, cache) -> bool:
    """Whether static passes can run `model` over `cache`: a plain Transformer over a KVCache,
    or over a paged cache's pool (whose rows a pass names by their block tables)."""
    return isinstance(model, Transformer) and (type(cache) is KVCache or type(cache) is PagedKVCache)


class StaticPasses:
    """Static-shape passes of `model` over `cache` (a KVCache's rows, or a paged cache's pool:
    each pass then gives its rows' `PagedRows` view, whose block tables become index inputs;
    `layers`: a layer-skip drafter's subset). `graphs`: capture each bucket as a CUDA graph
    (None: when the model is on CUDA)."""

    def __init__(self, model: Transformer, cache: "KVCache | PagedKVCache", buckets: Buckets | None = None,
                 graphs: bool | None = None, layers: Sequence[int] | None = None):
        if not runs_static(model, cache):
            raise TypeError("static passes run a plain Transformer over a KVCache's rows or a paged cache")
        self.model, self.cache, self.buckets = model, cache, buckets or Buckets()
        self.paged = isinstance(cache, PagedKVCache)
        self.layers = None if layers is None else list(layers)
        self.graphs = model.device.type == "cuda" if graphs is None else graphs
        if self.graphs and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on CUDA")
        self._inputs: dict[Bucket, StaticInputs] = {}
        self._outputs: dict[Bucket, torch.Tensor] = {}
        self._graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self._pool = None  # the captures' shared memory pool
        self.replays = 0  # passes run from a captured graph
        self.passes: dict[Bucket, int] = {}  # passes run per bucket (graph or eager)

    @classmethod
    def for_requests(cls, model: Transformer, max_len: int, **kwargs) -> "StaticPasses":
        """Passes over a one-row cache of `max_len` slots (and the trash slot), for in-process
        requests one after another (`speculative.decoding.generate(static=...)`)."""
        return cls(model, model.new_cache(max_len + 1), **kwargs)

    def bucket(self, rows: int, tokens: int, span: int) -> Bucket | None:
        """The bucket a pass of `rows` x `tokens` over `span` slots runs in; None: none fits."""
        return self.buckets.of(rows, tokens, span, self.cache.max_len)

    def fits(self, rows: int, tokens: int, span: int) -> bool:
        return self.bucket(rows, tokens, span) is not None

    def serves(self, cache) -> bool:
        """Whether a pass over `cache` (a KVCache, or a paged cache's rows) runs over this one's storage."""
        return cache is self.cache or (self.paged and isinstance(cache, PagedRows) and cache.cache is self.cache)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, rows: Sequence[int],
                 real: Sequence[int] | None = None, logits_from: int = 0, view: PagedRows | None = None
                 ) -> torch.Tensor:
        """Score `tokens` [b, t] at `positions` [b, t] with `mask` [b, t, span] over cache rows
        `rows` (pass row i is cache row rows[i]), as `Transformer.forward` does: each row's
        keys and values appended after its committed slots, whose count grows by t. `real`:
        only the first real[i] tokens of row i matter; the logits then come back packed,
        [sum(real), V], row after row, as the eager pass gives them; else [b, t - logits_from, V].
        Over a paged cache, `rows` are rows of `view` (the pass's block tables and lengths)."""
        b, t = tokens.shape
        if real is not None and logits_from:
            raise ValueError("packed rows give logits for every real token")
        if self.paged and (view is None or view.cache is not self.cache):
            raise ValueError("a static pass over a paged cache needs its rows' view of that cache")
        lengths = view.lengths if self.paged else self.cache.lengths
        starts = [lengths[r] for r in rows]
        bucket = self.bucket(b, t, mask.shape[-1])
        if bucket is None or max(starts) + t > self.cache.max_len - 1:
            raise ValueError(f"a pass of {b} x {t} tokens over {mask.shape[-1]} slots fits no bucket")
        counts = list(real) if real is not None else [t] * b
        if self.paged:
            padded = pad_paged(bucket, tokens.cpu(), positions.cpu(), mask.cpu(), view, rows, counts)
        else:
            padded = pad(bucket, tokens.cpu(), positions.cpu(), mask.cpu(), rows, starts, counts,
                         self.cache.max_len - 1)
        logits = self._run(bucket, padded)
        for r in rows:
            lengths[r] += t
        if real is None:
            return logits[:b, logits_from:t].clone()
        return torch.cat([logits[i, :n] for i, n in enumerate(counts)])

    def _run(self, bucket: Bucket, padded) -> torch.Tensor:
        """The bucket's logits [B, T, V] for `padded`: replayed, captured, or run eagerly."""
        self.passes[bucket] = self.passes.get(bucket, 0) + 1
        inputs = self._inputs.get(bucket)
        if inputs is None:
            inputs = self._inputs[bucket] = StaticInputs(bucket, self.model.device, self.paged)
        inputs.fill(padded)
        if not self.graphs:
            with torch.inference_mode():
                return static_forward(self.model, self.cache, inputs, self.layers)
        graph = self._graphs.get(bucket)
        if graph is None:
            self._capture(bucket, inputs)  # capturing computes nothing: replay it below
        self._graphs[bucket].replay()
        self.replays += 1
        return self._outputs[bucket]

    def _capture(self, bucket: Bucket, inputs: StaticInputs) -> None:
        """Warm the pass up on a side stream, then capture it into the shared pool. The warm-up
        writes the request's own keys and values to its own slots (which the replay writes
        again, the same values) and padding to the trash slots."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode():
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_PASSES):
                    static_forward(self.model, self.cache, inputs, self.layers)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a server's other threads may touch CUDA while its worker captures
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._outputs[bucket] = static_forward(self.model, self.cache, inputs, self.layers)
        self._pool = graph.pool()
        self._graphs[bucket] = graph

    def captured(self) -> list[Bucket]:
        return list(self._graphs)


class SharedPasses:
    """Static passes per (model, layers), each over a one-row cache of its own, lent to drafters
    that run one after another in one process (the in-process engine's requests), so that a
    drafter made per request replays the graphs the last one captured instead of capturing
    again. Not for drafters running at once: they would share a cache."""

    def __init__(self):
        self._passes: dict[tuple[int, tuple[int, ...] | None, int], StaticPasses] = {}

    def get(self, model: Transformer, layers: Sequence[int] | None, max_len: int) -> StaticPasses:
        """The passes of `model`'s `layers` over a cache of `max_len` slots (and the trash slot)."""
        key = (id(model), None if layers is None else tuple(layers), max_len)
        passes = self._passes.get(key)
        if passes is None or passes.model is not model:
            n_layers = None if layers is None else len(layers)
            passes = self._passes[key] = StaticPasses(model, model.new_cache(max_len + 1, num_layers=n_layers),
                                                      layers=layers)
        return passes
