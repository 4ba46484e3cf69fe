"""Tensor parallelism of a plain model, Megatron-style (as gpt-fast's tp.py applies it).

Each of N ranks holds a shard of every decoder layer: the q/k/v and gate/up
projections split by output (column-parallel), the output and down projections
by input (row-parallel), so each rank's partial sums add up, in one all-reduce
after each row-parallel layer (two per layer), to the single-process result.
Attention heads split across ranks; a rank holds the KV heads its query heads
read, so KV heads split when N divides them and are replicated otherwise. The
KV cache therefore holds only the rank's KV heads. The embedding is replicated;
the LM head runs on rank 0 alone (the other ranks need no logits, and computing
them whole on one rank costs no communication, docs/SERVING.md).

Nothing here starts a process or opens a socket: the collectives come in as
functions (`all_reduce`, `send`, `receive`), verifier_service/tp_group.py
supplies torch.distributed ones. Rank 0 drives the model through
`TensorParallelTarget`, which has the interface decoding and the verifier
engine use (forward, new_cache, config, device, dtype, the caches' rollback,
keep, row views), and hands every call to the other ranks, which replay it on
their shards (`serve_rank`), so the same forward runs everywhere.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import deque
from typing import Callable, Sequence

import torch
from torch import nn

from .config import ModelConfig
from .errors import InvalidArgument
from .model import KVCache, Transformer
from .paged_kv import PagedKVCache, PagedRows

log = logging.getLogger(__name__)

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor across ranks, in place


def check_tp(cfg: ModelConfig, world: int) -> None:
    """Raise InvalidArgument naming `tensor_parallel` unless `world` ranks split this model
    evenly: the attention heads, each rank's heads reading whole KV heads (or one KV head
    shared), and the MLP's intermediate size."""
    if world < 1:
        raise InvalidArgument("tensor_parallel", f"must be >= 1, got {world}")
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    fits = [n for n in range(1, heads + 1) if _splits(cfg, n)]
    if not _splits(cfg, world):
        raise InvalidArgument("tensor_parallel", f"{world} ranks cannot split this model ({heads} attention "
                              f"heads, {kv} KV heads, MLP width {cfg.intermediate_size}): each rank needs an "
                              f"equal share of each; rank counts that fit: {', '.join(map(str, fits))}")


def _splits(cfg: ModelConfig, world: int) -> bool:
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    if heads % world or cfg.intermediate_size % world:
        return False
    local, group = heads // world, heads // kv
    # SDPA's grouped attention needs each rank's query heads to read whole groups, or to lie in one
    return local % group == 0 or group % local == 0


def head_shard(cfg: ModelConfig, rank: int, world: int) -> tuple[range, range]:
    """The query heads and the KV heads rank `rank` of `world` holds."""
    local, group = cfg.num_heads // world, cfg.num_heads // cfg.num_kv_heads
    q = range(rank * local, (rank + 1) * local)
    return q, range(q.start // group, (q.stop - 1) // group + 1)


def shard_plan(cfg: ModelConfig, rank: int, world: int) -> dict[str, tuple[str, torch.Tensor]]:
    """How rank `rank` of `world` slices each decoder layer's linear layers: a layer's name
    within the layer to ("rows", the output rows it keeps: column-parallel) or ("columns",
    the inputs it keeps: row-parallel). Each index is one ascending run."""
    q_heads, kv_heads = head_shard(cfg, rank, world)
    d = cfg.head_dim
    q_rows = torch.arange(q_heads.start * d, q_heads.stop * d)
    kv_rows = torch.arange(kv_heads.start * d, kv_heads.stop * d)
    q_dim, kv_dim = cfg.num_heads * d, cfg.num_kv_heads * d
    width = cfg.intermediate_size // world
    mlp_rows = torch.arange(rank * width, (rank + 1) * width)
    return {"attn.qkv": ("rows", torch.cat((q_rows, q_dim + kv_rows, q_dim + kv_dim + kv_rows))),
            "attn.o": ("columns", q_rows),
            "mlp.gate_up": ("rows", torch.cat((mlp_rows, cfg.intermediate_size + mlp_rows))),
            "mlp.down": ("columns", mlp_rows)}


def shard_model(model: Transformer, rank: int, world: int, all_reduce: AllReduce) -> Transformer:
    """Make a plain (untuned) `model` rank `rank`'s shard of `world`, in place: its weights
    sliced (`shard_plan`), its attention told its local head counts, an `all_reduce` after
    each layer's attention and MLP, and, off rank 0, no LM head. Low precision (quantize.py
    with `shard_weights`) and CPU tuning may be applied afterwards."""
    cfg = model.config
    check_tp(cfg, world)
    q_heads, kv_heads = head_shard(cfg, rank, world)
    plan = shard_plan(cfg, rank, world)
    with torch.no_grad():
        for layer in model.layers:
            for part, (how, index) in plan.items():
                (_keep_rows if how == "rows" else _keep_columns)(layer.get_submodule(part), index)
            layer.attn.n_heads, layer.attn.n_kv = len(q_heads), len(kv_heads)
            # the row-parallel outputs (o, down; neither has a bias) are partial sums
            layer.attn.register_forward_hook(_summed(all_reduce))
            layer.mlp.register_forward_hook(_summed(all_reduce))
    if rank:
        model.lm_head = NoLogits()
    return model


def shard_weights(cfg: ModelConfig, weights: dict[str, tuple], rank: int, world: int) -> dict[str, tuple]:
    """Rank `rank`'s slice of the whole model's weight-only weights (quantize.py's
    `quantized_weights`: a layer's weight [out, in] first, then scales per row [out] or per
    group of inputs [out, in/group]), sliced as `shard_plan` slices the float layers, so a
    rank holds exactly the one-process weights: a row keeps its scales; a row-parallel layer
    keeps whole groups (`check_tp_groups`) and its per-row scales whole. The LM head's weights
    go to rank 0 alone."""
    plan = shard_plan(cfg, rank, world)
    out = {}
    for name, tensors in weights.items():
        if name == "lm_head":
            if rank == 0:
                out[name] = tensors
            continue
        how, index = plan[name.split(".", 2)[2]]
        q, scales = tensors[0], tensors[1:]
        if how == "rows":
            out[name] = tuple(t[index] for t in tensors)
            continue
        inputs = q.shape[1]
        out[name] = (q[:, index], *(s if s.dim() == 1 else s[:, _groups(index, inputs // s.shape[1])]
                                    for s in scales))
    return out


def check_tp_groups(cfg: ModelConfig, world: int, group: int) -> None:
    """Raise InvalidArgument naming `tensor_parallel` unless each rank's inputs of the
    row-parallel layers (o, down) are whole groups of `group`, as groupwise weights need."""
    plan = shard_plan(cfg, 0, world)
    for part in ("attn.o", "mlp.down"):
        width = len(plan[part][1])
        if width % group:
            raise InvalidArgument("tensor_parallel", f"{world} ranks give each rank {width} inputs of {part}, not "
                                  f"whole groups of {group}: groupwise (int4) weights cannot split so")


def _groups(index: torch.Tensor, group: int) -> torch.Tensor:
    """The groups of `group` inputs that one ascending run of whole groups covers."""
    start, stop = int(index[0]), int(index[-1]) + 1
    if start % group or (stop - start) % group:
        raise InvalidArgument("tensor_parallel", f"inputs {start}..{stop - 1} are not whole groups of {group}")
    return torch.arange(start // group, stop // group)


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
    linear.out_features = len(rows)


def _keep_columns(linear: nn.Linear, columns: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight[:, columns].clone(), requires_grad=False)
    linear.in_features = len(columns)


def _summed(all_reduce: AllReduce):
    def hook(module, args, output):
        all_reduce(output)
        return output
    return hook


class NoLogits(nn.Module):
    """The LM head of ranks other than 0: they need no logits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], 0)


# ---- rank 0 drives, the other ranks replay ---------------------------------
#
# Rank 0 sends one message per forward: the cache operations since the last one
# (caches made, grown and freed, `keep` compactions, in order), then the forward
# itself with the cache's lengths (rollbacks only lower lengths, so sending them
# replays every rollback). A message is a list of tuples; ("stop",) ends a rank.

Send = Callable[[list], None]
Receive = Callable[[], list]


class TensorParallelTarget:
    """Rank 0's tensor-parallel model, usable wherever a `Transformer` is (decoding,
    VerifierEngine, a layer-skip drafter): each forward runs on every rank."""

    def __init__(self, model: Transformer, send: Send):
        self.model, self.config, self._send = model, model.config, send
        # cache operations the other ranks have not replayed yet (a deque: a cache's finalizer
        # may add one from another thread while a forward drains it)
        self._ops: deque[tuple] = deque()
        self._ids = itertools.count()
        self._stopped = False

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    # What rank 0 holds whole (the embedding is replicated, the LM head is rank 0's alone, the
    # RoPE tables every rank's): a feature-level drafter reads them (EagleHead.attach).
    @property
    def embed(self) -> torch.nn.Module:
        return self.model.embed

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.lm_head

    @property
    def rope_cos(self) -> torch.Tensor:
        return self.model.rope_cos

    @property
    def rope_sin(self) -> torch.Tensor:
        return self.model.rope_sin

    def new_cache(self, max_len: int, batch: int = 1, num_layers: int | None = None) -> "MirroredCache":
        cache = MirroredCache(self, self.model.new_cache(max_len, batch, num_layers))
        self._ops.append(("new", cache.cache_id, max_len, batch, num_layers))
        return cache

    def new_paged_cache(self, num_blocks: int, block_size: int) -> "MirroredPagedCache":
        """A paged cache's blocks (runtime/paged_kv.py) on every rank, each its own KV heads; the
        block tables live on rank 0 and go with each forward."""
        cache = MirroredPagedCache(self, self.model.new_paged_cache(num_blocks, block_size))
        self._ops.append(("new_paged", cache.cache_id, num_blocks, block_size))
        return cache

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one paged-cache block on a rank (each holds its KV heads')."""
        return self.model.kv_block_bytes(block_size)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: "MirroredCache | PagedRows",
                 mask: torch.Tensor, layers: Sequence[int] | None = None, logits_from: int = 0,
                 real: Sequence[int] | None = None, capture: Sequence[int] | None = None,
                 capture_rows=None):
        # `capture`: rank 0's residual stream is whole after each layer's all-reduce, so only
        # rank 0 keeps the features (the other ranks run the same forward without them)
        rest = (tokens.cpu(), positions.cpu(), mask.cpu(), None if layers is None else list(layers), logits_from,
                None if real is None else list(real))
        if isinstance(cache, PagedRows) and isinstance(cache.cache, MirroredPagedCache) \
                and cache.cache.target is self:
            call = ("forward_paged", cache.cache.cache_id, cache.tables, list(cache.lengths)) + rest
            self._send(self._drained() + [call])
            return self.model(tokens, positions, cache, mask, layers, logits_from, real, capture,
                              capture_rows)  # rank 0's storage
        if not isinstance(cache, MirroredCache) or cache.target is not self:
            raise ValueError("a tensor-parallel forward needs a cache of this target's new_cache")
        lengths = list(cache.whole.lengths)
        call = ("forward", cache.cache_id, cache.rows, lengths) + rest
        self._send(self._drained() + [call])
        return self.model(tokens, positions, cache.local, mask, layers, logits_from, real, capture, capture_rows)

    forward = __call__

    def stop(self) -> None:
        """Let the other ranks return from `serve_rank`."""
        if not self._stopped:
            self._stopped = True
            self._send(self._drained() + [("stop",)])

    def _drained(self) -> list[tuple]:
        ops = []
        while self._ops:
            ops.append(self._ops.popleft())
        return ops


class MirroredCache(KVCache):
    """Rank 0's KV cache shard, whose operations the other ranks replay on theirs."""

    def __init__(self, target: TensorParallelTarget, local: KVCache, cache_id: int | None = None,
                 rows: tuple[int, int] | None = None, whole: "MirroredCache | None" = None):
        self.target, self.local = target, local
        self.k, self.v, self.lengths = local.k, local.v, local.lengths
        self.rows, self._whole = rows, whole  # a rows view keeps its whole cache alive
        if cache_id is None:
            cache_id = next(target._ids)
            # the other ranks free their shard with the next message once this one is gone
            weakref.finalize(self, target._ops.append, ("free", cache_id))
        self.cache_id = cache_id

    @property
    def whole(self) -> "MirroredCache":
        """The cache this is a rows view of (itself if none)."""
        return self._whole or self

    def grown(self, max_len: int) -> "MirroredCache":
        grown = MirroredCache(self.target, self.local.grown(max_len))
        self.target._ops.append(("grow", self.cache_id, grown.cache_id, max_len))
        return grown

    def rows_view(self, first: int, stop: int) -> "MirroredCache":
        offset = self.rows[0] if self.rows else 0  # the other ranks view the whole cache's rows
        return MirroredCache(self.target, self.local.rows_view(first, stop), self.cache_id,
                             (offset + first, offset + stop), self.whole)

    def keep(self, start: int, offsets: Sequence[int], row: int = 0) -> None:
        whole_row = row if self.rows is None else self.rows[0] + row
        self.target._ops.append(("keep", self.cache_id, start, list(offsets), whole_row))
        self.local.keep(start, offsets, row)


class MirroredPagedCache:
    """Rank 0's paged cache blocks, whose slot copies (`keep` compactions) the other ranks
    replay on theirs; a forward over its `rows` sends the rows' block tables."""

    def __init__(self, target: TensorParallelTarget, local: PagedKVCache):
        self.target, self.local = target, local
        self.num_blocks, self.block_size, self.max_len = local.num_blocks, local.block_size, local.max_len
        self.zero_slot, self.trash_slot, self.kv = local.zero_slot, local.trash_slot, local.kv
        self.cache_id = next(target._ids)
        weakref.finalize(self, target._ops.append, ("free", self.cache_id))

    @property
    def k(self) -> torch.Tensor:
        return self.local.k

    @property
    def v(self) -> torch.Tensor:
        return self.local.v

    @property
    def device(self) -> torch.device:
        return self.local.device

    def rows(self, tables, lengths) -> PagedRows:
        return PagedRows(self, tables, lengths)

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        if src:
            self.target._ops.append(("copy_slots", self.cache_id, list(src), list(dst)))
        self.local.copy_slots(src, dst)


def serve_rank(model: Transformer, receive: Receive) -> dict[int, KVCache]:
    """Replay rank 0's calls on this rank's shard until it sends stop; returns the caches
    then still held, by id (each the shard of one of rank 0's caches)."""
    caches: dict[int, KVCache] = {}
    while True:
        for op in receive():
            kind = op[0]
            if kind == "stop":
                return caches
            if kind == "new":
                _, cache_id, max_len, batch, num_layers = op
                caches[cache_id] = model.new_cache(max_len, batch, num_layers)
            elif kind == "new_paged":
                _, cache_id, num_blocks, block_size = op
                caches[cache_id] = model.new_paged_cache(num_blocks, block_size)
            elif kind == "copy_slots":
                _, cache_id, src, dst = op
                caches[cache_id].copy_slots(src, dst)
            elif kind == "forward_paged":
                _, cache_id, tables, lengths, *rest = op
                _replay_paged_forward(model, caches[cache_id].rows(tables, lengths), *rest)
            elif kind == "grow":
                _, old, new, max_len = op
                caches[new] = caches[old].grown(max_len)
            elif kind == "free":
                caches.pop(op[1], None)
            elif kind == "keep":
                _, cache_id, start, offsets, row = op
                caches[cache_id].keep(start, offsets, row)
            elif kind == "forward":
                _replay_forward(model, caches, *op[1:])
            else:
                raise ValueError(f"unknown tensor-parallel operation {kind!r}")


def _replay_paged_forward(model: Transformer, rows: PagedRows, tokens, positions, mask, layers, logits_from,
                          real) -> None:
    device = model.device
    try:
        model(tokens.to(device), positions.to(device), rows, mask.to(device), layers, logits_from, real)
    except ValueError:  # as _replay_forward
        log.debug("forward refused, as on rank 0", exc_info=True)


def _replay_forward(model: Transformer, caches: dict[int, KVCache], cache_id: int, rows: tuple[int, int] | None,
                    lengths: list[int], tokens, positions, mask, layers, logits_from, real) -> None:
    cache = caches[cache_id]
    cache.lengths[:] = lengths
    if rows is not None:
        cache = cache.rows_view(*rows)
    device = model.device
    try:
        model(tokens.to(device), positions.to(device), cache, mask.to(device), layers, logits_from, real)
    except ValueError:
        # rank 0 met the same error on the same inputs, before any collective (a full
        # cache, bad shapes): it reports it; this rank waits for the next call
        log.debug("forward refused, as on rank 0", exc_info=True)
