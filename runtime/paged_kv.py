"""A paged KV cache: fixed-size blocks of slots shared out among requests, with a prefix index.

Two halves, kept apart:

- The bookkeeping (`BlockPool`, `SequenceBlocks`): which blocks are free, which request
  holds which (its block table), reference counts, and an index of FULL blocks by the
  tokens they hold, so that a new request whose prompt starts as an earlier one's did
  (a conversation's next turn, a shared system prompt, a resumed request) takes those
  blocks as they are and computes only the rest. It is plain Python over block ids: no
  tensor, no model, testable alone.
- The storage (`PagedKVCache`) and a forward's view of some requests' blocks
  (`PagedRows`), which `runtime.model.Transformer` attends through: before each layer's
  attention the rows' cached keys and values are gathered into a contiguous scratch
  laid out as `KVCache` rows are, the attention runs exactly as it does over a `KVCache`
  (the same kernels, the same values in the same order: bit for bit its results), and
  the new tokens' keys and values go back to their blocks.

A block's key is a hash chain: digest(block i) = sha256(digest(block i-1), its tokens),
digest(block -1) = sha256(the memory namespace). The namespace is part of every key, so
two tenants' requests never share a block, even with the same prompt: a cache hit is
a timing side channel (vLLM's cache_salt). sha256, not Python's hash: a collision
would hand one request another's keys and values.

A block enters the index once every one of its slots holds a committed token (a prompt
token or a verified one); only a request's last, partial block, and the slots of a
round's tree past its committed tokens, are written again. Unreferenced indexed blocks
stay cached until a block is needed and none is free: then the least recently released
goes (a request's blocks are released last block first, so the heads of shared
prefixes go last).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Sequence

import torch

BLOCK_SIZE = 16  # tokens a block holds, by default
_ROOT = b"specserve-kv-prefix\0"


class NoFreeBlocks(RuntimeError):
    """The pool has fewer free (or evictable) blocks than asked for."""


def namespace_digest(namespace: str) -> bytes:
    """The digest a namespace's chains start from."""
    return hashlib.sha256(_ROOT + namespace.encode()).digest()


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block holding `tokens` after the block whose key is `parent`."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockPool:
    """`num_blocks` blocks of `block_size` slots: reference counts, the free blocks, and the
    prefix index of full blocks (digest -> block), with LRU eviction of the unreferenced ones.

    A block is free (never used, or released unindexed), held (referenced), or cached
    (indexed and unreferenced: reusable by a lookup until evicted). `available` counts
    free and cached blocks: what `allocate` can hand out."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs blocks and slots: {num_blocks} blocks of {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._refs = array("i", bytes(4 * num_blocks))
        self._fresh = 0  # blocks fresh..num_blocks-1 were never handed out
        self._free: list[int] = []  # released blocks outside the index
        self._index: dict[bytes, int] = {}  # digest -> block
        self._digest: dict[int, bytes] = {}  # block -> digest, for indexed blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently released first
        self.evictions = 0
        self.freed = 0  # times blocks became available (waiters look again when it moves)

    # ---- what is where -------------------------------------------------------

    def available(self) -> int:
        """Blocks `allocate` can hand out: free ones and cached (evictable) ones."""
        return self.num_blocks - self._fresh + len(self._free) + len(self._lru)

    def held(self) -> int:
        """Blocks some request references."""
        return self.num_blocks - self.available()

    def usage(self) -> float:
        """The share of blocks held (vLLM's kv_cache_usage_perc: cached blocks count as free)."""
        return self.held() / self.num_blocks

    def cached(self) -> int:
        """Indexed blocks, held or not."""
        return len(self._index)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def digest(self, block: int) -> bytes | None:
        return self._digest.get(block)

    # ---- handing out and taking back -----------------------------------------

    def allocate(self, n: int) -> list[int]:
        """`n` blocks, each referenced once: free ones first, then the least recently released
        cached ones, which leave the index. NoFreeBlocks (and nothing taken) if there are fewer."""
        if n > self.available():
            raise NoFreeBlocks(f"{n} blocks asked, {self.available()} of {self.num_blocks} available")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            elif self._fresh < self.num_blocks:
                block, self._fresh = self._fresh, self._fresh + 1
            else:
                block, _ = self._lru.popitem(last=False)
                del self._index[self._digest.pop(block)]
                self.evictions += 1
            self._refs[block] = 1
            out.append(block)
        return out

    def lookup(self, digests: Sequence[bytes]) -> list[int]:
        """The blocks of the longest prefix of `digests` in the index, each referenced once more
        (a cached one is held again)."""
        out = []
        for d in digests:
            block = self._index.get(d)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._lru[block]
            self._refs[block] += 1
            out.append(block)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block, last first: an unreferenced indexed block is cached
        (the last of a request's blocks the first to be evicted), any other one free."""
        for block in reversed(blocks):
            refs = self._refs[block]
            if refs <= 0:
                raise ValueError(f"block {block} is not held")
            self._refs[block] = refs - 1
            if refs == 1:
                if block in self._digest:
                    self._lru[block] = None
                else:
                    self._free.append(block)
        if blocks:
            self.freed += 1

    def register(self, block: int, digest: bytes) -> bool:
        """Index a held, full block under `digest`; False (nothing changes) when the block is
        indexed already or another block holds that digest."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not held")
        if block in self._digest or digest in self._index:
            return False
        self._index[digest] = block
        self._digest[block] = digest
        return True


class SequenceBlocks:
    """One request's block table: its blocks in order (slot s in blocks[s // block_size]),
    the digests of its full blocks' chain, and how many leading blocks went to the index.

    The request's first `length` slots hold its committed tokens; `reuse` takes a cached
    prefix, `reserve` adds blocks for slots about to be written, `trim` gives back the
    blocks past the committed slots (a round's rejected nodes), `commit` indexes the blocks
    that became full, `free` gives back everything."""

    def __init__(self, pool: BlockPool, namespace: str = ""):
        self.pool, self.namespace = pool, namespace
        self.blocks: list[int] = []
        self.digests: list[bytes] = []  # of blocks 0..len-1 of the tokens seen
        self.indexed = 0  # leading blocks given to the index (whether it took them or held the digest)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_size

    def _chain(self, tokens: Sequence[int], full: int) -> list[bytes]:
        """The digests of the first `full` full blocks of `tokens` (extending those known)."""
        bs = self.pool.block_size
        parent = self.digests[-1] if self.digests else namespace_digest(self.namespace)
        for i in range(len(self.digests), full):
            parent = block_digest(parent, tokens[i * bs:(i + 1) * bs])
            self.digests.append(parent)
        return self.digests[:full]

    def reuse(self, tokens: Sequence[int], limit: int) -> int:
        """Take the longest cached prefix of `tokens`, in whole blocks and at most `limit` tokens,
        into an empty table; returns how many tokens it holds."""
        if self.blocks:
            raise ValueError("a cached prefix goes into an empty table")
        full = max(0, min(limit, len(tokens))) // self.pool.block_size
        self.blocks = self.pool.lookup(self._chain(tokens, full))
        self.indexed = len(self.blocks)
        return len(self.blocks) * self.pool.block_size

    def needed(self, slots: int) -> int:
        """Blocks `reserve(slots)` would allocate."""
        return max(0, -(-slots // self.pool.block_size) - len(self.blocks))

    def reserve(self, slots: int) -> None:
        """Blocks enough for `slots` slots (NoFreeBlocks, and none taken, if the pool lacks them)."""
        n = self.needed(slots)
        if n:
            self.blocks += self.pool.allocate(n)

    def trim(self, length: int) -> None:
        """Give back the blocks past the first `length` slots (their tokens rejected, or never written)."""
        keep = -(-length // self.pool.block_size)
        if keep < self.indexed:
            raise ValueError(f"cannot trim to {length} slots: {self.indexed} blocks are indexed")
        if keep < len(self.blocks):
            self.pool.release(self.blocks[keep:])
            del self.blocks[keep:]

    def commit(self, tokens: Sequence[int], length: int) -> None:
        """The first `length` slots hold `tokens[:length]`: index the blocks that became full."""
        full = min(length, len(tokens)) // self.pool.block_size
        if full <= self.indexed:
            return
        digests = self._chain(tokens, full)
        for i in range(self.indexed, full):
            self.pool.register(self.blocks[i], digests[i])
        self.indexed = full

    def free(self) -> None:
        """Give back every block (the indexed ones stay cached); the digests stay, for a reuse."""
        blocks, self.blocks, self.indexed = self.blocks, [], 0
        self.pool.release(blocks)

    def slots(self, start: int, stop: int) -> list[int]:
        """The pool slots of the table's slots start..stop-1."""
        bs = self.pool.block_size
        return [self.blocks[s // bs] * bs + s % bs for s in range(start, stop)]


# ---- storage ----------------------------------------------------------------


def block_bytes(num_layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block's keys and values over every layer."""
    return 2 * num_layers * kv_heads * block_size * head_dim * torch.empty(0, dtype=dtype).element_size()


class PagedKVCache:
    """The keys and values of `num_blocks` blocks of `block_size` slots: `kv` [layers, 2 (keys,
    values), kv_heads, num_blocks * block_size + 2, head_dim], slot s of block b at
    b * block_size + s, then a slot that stays zero (what a gather reads past a row's
    committed slots) and the trash slot (padding past a row's blocks). Allocated empty: a
    page of it is memory only once written."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, max_len: int = 1 << 30):
        self.num_blocks, self.block_size, self.max_len = num_blocks, block_size, max_len
        self.zero_slot = num_blocks * block_size
        self.trash_slot = self.zero_slot + 1  # where padding past a row's blocks is written (and read by it alone)
        self.kv = torch.empty((num_layers, 2, num_kv_heads, self.zero_slot + 2, head_dim), device=device, dtype=dtype)
        self.kv[:, :, :, self.zero_slot:].zero_()

    @property
    def k(self) -> torch.Tensor:
        """Every layer's keys [layers, kv_heads, slots, head_dim] (a view)."""
        return self.kv[:, 0]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, 1]

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def rows(self, tables: Sequence[Sequence[int]], lengths: Sequence[int]) -> "PagedRows":
        """A forward's view of requests' blocks: row r's slots through tables[r], its first
        lengths[r] committed."""
        return PagedRows(self, tables, lengths)

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Slots dst[i] = slots src[i] (every layer, keys and values; all read before any is written)."""
        if not src:
            return
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        self.kv[:, :, :, d] = self.kv[:, :, :, s]


class PagedRows:
    """Some requests' blocks as the rows of one forward (what `Transformer.forward` takes
    where it takes a `KVCache`): `lengths` their committed slots, written past and rolled back
    as a KVCache's are; `keep` compacts accepted tree nodes by copying slots within the
    blocks. A row writes only the slots its table covers: padding past them is dropped."""

    def __init__(self, cache: PagedKVCache, tables: Sequence[Sequence[int]], lengths: Sequence[int]):
        if len(tables) != len(lengths):
            raise ValueError(f"{len(tables)} block tables for {len(lengths)} rows")
        self.cache, self.tables = cache, [list(t) for t in tables]
        self.lengths = lengths if not isinstance(lengths, tuple) else list(lengths)
        self.max_len = cache.max_len
        self._plan: _Plan | None = None

    @property
    def batch(self) -> int:
        return len(self.tables)

    @property
    def k(self) -> torch.Tensor:
        """The storage's keys (its dtype is the cache's)."""
        return self.cache.k

    def layer(self, i: int) -> tuple["PagedLayer", None]:
        """What a decoder layer takes for its k and v caches."""
        return PagedLayer(self, i), None

    def rows_view(self, first: int, stop: int) -> "PagedRows":
        if not 0 <= first < stop <= self.batch:
            raise ValueError(f"rows {first}..{stop - 1} are not rows of a view of {self.batch}")
        if (first, stop) == (0, self.batch):
            return self
        return PagedRows(self.cache, self.tables[first:stop], RowsLengths(self.lengths, first, stop))

    def row_view(self, row: int) -> "PagedRows":
        return self.rows_view(row, row + 1)

    def capacity(self, row: int) -> int:
        return len(self.tables[row]) * self.cache.block_size

    def rollback(self, length: int, row: int = 0) -> None:
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"cannot roll back row {row} from {self.lengths[row]} to {length}")
        self.lengths[row] = length

    def keep(self, start: int, offsets: Sequence[int], row: int = 0) -> None:
        """Keep slots start+offsets[i] as slots start+i (offsets ascending), drop the rest."""
        offsets = list(offsets)
        moved = [(start + o, start + i) for i, o in enumerate(offsets) if o != i]
        if moved:
            src, dst = zip(*moved)
            self.cache.copy_slots(self.slot_ids(row, src), self.slot_ids(row, dst))
        self.lengths[row] = start + len(offsets)

    def slot_ids(self, row: int, slots: Sequence[int]) -> list[int]:
        """The pool slots of row `row`'s slots."""
        bs, table = self.cache.block_size, self.tables[row]
        return [table[s // bs] * bs + s % bs for s in slots]

    def plan(self, starts: Sequence[int], t: int) -> "_Plan":
        """The gather and scatter indices of a pass of `t` new tokens a row after `starts`."""
        key = (tuple(starts), t)
        if self._plan is None or self._plan.key != key:
            self._plan = _Plan(self, list(starts), t)
        return self._plan


class _Plan:
    """Where a pass's rows read their cached slots from and write their new ones to: row r's
    slot j (j < S, the pass's span: the highest start plus t) is pool slot `slots[r, j]` where
    its table reaches, else the trash slot (padding past a row's blocks, never read by a real
    query). A handful of tensor operations, whatever the rows.

    specserve's kernels take `slot_map` (those slots, int32) and read and write the pool where
    it lies: the new tokens' keys and values go to their slots first (`write`). Otherwise a
    layer attends over a scratch [2, kv_heads, b * S, head_dim], viewed as key and value rows
    [b, kv_heads, S, head_dim] as a KVCache's: row r's slots below starts[r] gathered, the rest
    the zero slot's; the attention writes the new tokens' keys and values at starts[r].., and
    those within the row's blocks go back (`write_back`)."""

    def __init__(self, rows: PagedRows, starts: list[int], t: int):
        self.key = (tuple(starts), t)
        cache, bs = rows.cache, rows.cache.block_size
        self.b, self.span, self.t = b, span, _ = rows.batch, max(starts) + t, t
        widest = max(len(table) for table in rows.tables)
        capacity = [rows.capacity(r) for r in range(b)]
        if any(start > cap for start, cap in zip(starts, capacity)):
            raise ValueError(f"rows hold {starts} slots, more than their blocks {capacity}")
        tables = torch.tensor([table + [0] * (widest - len(table)) for table in rows.tables] if widest
                              else [[0]] * b, dtype=torch.long)
        j = torch.arange(span)
        first, cap = torch.tensor(starts)[:, None], torch.tensor(capacity)[:, None]
        slots = torch.where(j < cap, tables[:, (j // bs).clamp_(max=max(widest - 1, 0))] * bs + j % bs,
                            cache.trash_slot)  # [b, S]
        device = cache.device
        self.slot_map = slots.to(torch.int32).to(device)
        new = (j >= first) & (j < first + t)
        self.new_slots = slots[new].to(device)  # the new tokens', row after row (padding's to the trash)
        self.gather = torch.where(j < first, slots, cache.zero_slot).flatten().to(device)
        kept = new & (j < cap)
        self.src = kept.flatten().nonzero().flatten().to(device)
        self.dst = slots[kept].to(device)

    def write(self, store: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' keys and values k, v [b, kv_heads, t, head_dim] to their slots of one
        layer's store [2, kv_heads, slots, head_dim]."""
        kv, d = k.shape[1], k.shape[-1]
        new = torch.stack((k, v)).to(store.dtype).transpose(1, 2).reshape(2, kv, self.b * self.t, d)
        store.index_copy_(2, self.new_slots, new)

    def rows_of(self, store: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer's store [2, kv, slots, d] gathered: the flat scratch, its key and value rows."""
        flat = store.index_select(2, self.gather)
        _, kv, _, d = flat.shape
        rows = flat.view(2, kv, self.b, self.span, d).transpose(1, 2)
        return flat, rows[0], rows[1]

    def write_back(self, flat: torch.Tensor, store: torch.Tensor) -> None:
        if self.src.numel():
            store.index_copy_(2, self.dst, flat.index_select(2, self.src))


class PagedLayer:
    """One decoder layer's keys and values in a `PagedRows`: what Attention takes as its k cache
    (runtime/model.py attends through it)."""

    __slots__ = ("rows", "layer")

    def __init__(self, rows: PagedRows, layer: int):
        self.rows, self.layer = rows, layer

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.cache.kv.dtype

    def store(self) -> torch.Tensor:
        """This layer's keys and values [2, kv_heads, slots, head_dim]."""
        return self.rows.cache.kv[self.layer]

    def plan(self, starts, t: int) -> _Plan:
        return self.rows.plan(starts, t)


class RowsLengths:
    """The `lengths` list of a rows view, backed by the parent's list."""

    def __init__(self, parent: list[int], first: int, stop: int):
        self.parent, self.first, self.stop = parent, first, stop

    def __len__(self) -> int:
        return self.stop - self.first

    def __iter__(self):
        return iter(self.parent[self.first:self.stop])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.parent[self.first:self.stop][i]
        return self.parent[self._index(i)]

    def __setitem__(self, i, value):
        self.parent[self._index(i)] = value

    def _index(self, i: int) -> int:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.first + i
