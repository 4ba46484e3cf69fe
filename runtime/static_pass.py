"""A forward pass at static shapes: its inputs padded to a few buckets (rows x tokens a row x
cached slots attended), the KV cache read and written through index tensors, so that every
pass of one bucket is the same operations on the same buffers whatever the request holds.
That is what a CUDA graph replays (runtime/graphs.py); off CUDA the same pass runs eagerly.

It applies to the plain model from outside (gpt-fast style): `static_forward` calls the
`Transformer`'s own modules (embedding, norms, linear layers of any precision, head) in the
order `Transformer.forward` does, and only the attention's cache traffic differs: the new
keys and values go to their slots by an index write, and a row's cached slots are read by
an index gather, instead of slicing at Python ints (which a graph would freeze).

Padding never changes a real row's result: a padding token writes its keys and values to
its row's last slot (the trash slot, which no real query sees: a pass must end before it),
a padding row reads and writes a real row's trash slot, and a padding query attends to slot
0 only. Each real query sees exactly the slots its mask gives it; the keys past them in
the bucket's span are masked out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from .model import FUSED_ATTENTION_MAX_TOKENS, KVCache, Transformer, additive_mask
from .paged_kv import PagedKVCache, PagedRows

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_SPAN = 128  # cached slots a pass attends over, at least: spans are powers of two from here


def bucket_of(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest of `sizes` holding `n`; None when none does."""
    return next((s for s in sizes if s >= n), None)


@dataclass(frozen=True)
class Bucket:
    rows: int
    tokens: int
    span: int  # cache slots attended over, from slot 0


@dataclass(frozen=True)
class Buckets:
    """The shapes passes are padded to."""
    rows: tuple[int, ...] = ROW_BUCKETS
    tokens: tuple[int, ...] = TOKEN_BUCKETS
    min_span: int = MIN_SPAN

    def of(self, rows: int, tokens: int, span: int, max_len: int) -> Bucket | None:
        """The bucket of a pass of `rows` x `tokens` attending over `span` slots of a cache of
        `max_len` slots a row; None when it fits none (the pass then runs as it is)."""
        b, t = bucket_of(rows, self.rows), bucket_of(tokens, self.tokens)
        if b is None or t is None or span > max_len - 1:  # the last slot is the trash slot
            return None
        s = max(self.min_span, 1 << max(span - 1, 0).bit_length())
        return Bucket(b, t, min(s, max_len))


class StaticInputs:
    """One bucket's input buffers: what a captured pass reads, and a request's inputs are
    copied into."""

    def __init__(self, bucket: Bucket, device: torch.device | str, paged: bool = False):
        b, t, s = bucket.rows, bucket.tokens, bucket.span
        self.bucket = bucket
        self.tokens = torch.zeros(b, t, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, t, dtype=torch.long, device=device)
        self.mask = torch.zeros(b, 1, t, s, dtype=torch.bool, device=device)
        self.read_rows = torch.zeros(b, dtype=torch.long, device=device)  # the cache row each pass row reads
        self.write_rows = torch.zeros(b, t, dtype=torch.long, device=device)  # and writes each token's entry to
        self.write_slots = torch.zeros(b, t, dtype=torch.long, device=device)  # at this slot
        # a paged cache's: the pool slot each row's span slot is read from (`write_slots` then
        # name pool slots too)
        self.read_slots = torch.zeros(b, s, dtype=torch.long, device=device) if paged else None

    def fill(self, padded: "PaddedInputs") -> None:
        """Copy a request's padded inputs (host tensors of this bucket's shapes) in."""
        for name in ("tokens", "positions", "mask", "read_rows", "write_rows", "write_slots", "read_slots"):
            if getattr(self, name) is not None:
                getattr(self, name).copy_(getattr(padded, name), non_blocking=True)


@dataclass
class PaddedInputs:
    """A pass's inputs padded to a bucket, on the host."""
    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    read_rows: torch.Tensor
    write_rows: torch.Tensor
    write_slots: torch.Tensor
    read_slots: torch.Tensor | None = None


def pad(bucket: Bucket, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, rows: Sequence[int],
        starts: Sequence[int], real: Sequence[int], trash: int) -> PaddedInputs:
    """`tokens`, `positions` [b, t] and `mask` [b, t, span] (True: may attend) of a pass over
    cache rows `rows` whose first free slots are `starts`, row i's first real[i] tokens real,
    padded to `bucket`; `trash` is the slot padding writes to (the rows' last)."""
    b, t = tokens.shape
    B, T, S = bucket.rows, bucket.tokens, bucket.span
    out_tokens = torch.zeros(B, T, dtype=torch.long)
    out_positions = torch.zeros(B, T, dtype=torch.long)
    out_mask = torch.zeros(B, 1, T, S, dtype=torch.bool)
    out_mask[:, :, :, 0] = True  # padding queries: slot 0 alone (a real row's slot, never written by them)
    write_slots = torch.full((B, T), trash, dtype=torch.long)
    read_rows = torch.full((B,), rows[0], dtype=torch.long)
    read_rows[:b] = torch.tensor(list(rows), dtype=torch.long)
    for i, n in enumerate(real):
        out_tokens[i, :n] = tokens[i, :n]
        out_positions[i, :n] = positions[i, :n]
        span = min(mask.shape[-1], S)
        out_mask[i, 0, :n] = False
        out_mask[i, 0, :n, :span] = mask[i, :n, :span]
        write_slots[i, :n] = torch.arange(starts[i], starts[i] + n)
    return PaddedInputs(out_tokens, out_positions, out_mask, read_rows, read_rows[:, None].expand(B, T).clone(),
                        write_slots)


def pad_paged(bucket: Bucket, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
              view: PagedRows, rows: Sequence[int], real: Sequence[int]) -> PaddedInputs:
    """As `pad`, over a paged cache's rows (`view`, its rows `rows`): each token's keys and values
    go to its pool slot, and row i reads its span's slot j from pool slot
    view.slot_ids(rows[i], [j]) where it holds it (committed, or written by this pass), else
    from the zero slot; padding (and a token past its row's blocks) writes to the trash slot,
    and a padding row reads the zero slot."""
    cache = view.cache
    padded = pad(bucket, tokens, positions, mask, [0] * len(rows), [0] * len(rows), real, cache.trash_slot)
    B, S = bucket.rows, bucket.span
    read_slots = torch.full((B, S), cache.zero_slot, dtype=torch.long)
    for i, (r, n) in enumerate(zip(rows, real)):
        start, capacity = view.lengths[r], view.capacity(r)
        held = min(start + n, S, capacity)
        read_slots[i, :held] = torch.tensor(view.slot_ids(r, range(held)), dtype=torch.long)
        inside = max(0, min(start + n, capacity) - start)  # past its blocks: the trash slot, as eagerly
        padded.write_slots[i, inside:] = cache.trash_slot
        padded.write_slots[i, :inside] = torch.tensor(view.slot_ids(r, range(start, start + inside)),
                                                      dtype=torch.long)
    padded.read_slots = read_slots
    padded.read_rows.zero_()
    padded.write_rows.zero_()
    return padded


def _attention(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, inputs: StaticInputs, scores_mask: torch.Tensor) -> torch.Tensor:
    """One layer's attention (runtime.model.Attention's operations, the cache by index)."""
    qkv = attn.qkv(x)
    b, t, _ = qkv.shape
    span = inputs.bucket.span
    heads = qkv.view(b, t, -1, attn.head_dim).transpose(1, 2)
    roped = attn.n_heads + attn.n_kv
    qk = heads[:, :roped]
    qk = qk * cos + torch.roll(qk, attn.head_dim // 2, -1) * sin  # as Attention.forward: sin's first half negated
    q, k, v = qk[:, :attn.n_heads], qk[:, attn.n_heads:], heads[:, roped:]
    dtype = attn.attention_dtype or k_cache.dtype
    q = q.to(dtype)
    if inputs.read_slots is None:  # a KVCache's rows [rows, n_kv, slots, d]
        k_cache[inputs.write_rows, :, inputs.write_slots] = k.transpose(1, 2).to(k_cache.dtype)  # [b, t, n_kv, d]
        v_cache[inputs.write_rows, :, inputs.write_slots] = v.transpose(1, 2).to(v_cache.dtype)
        keys = k_cache[:, :, :span].index_select(0, inputs.read_rows)  # [b, n_kv, span, d]
        values = v_cache[:, :, :span].index_select(0, inputs.read_rows)
    else:  # a paged cache's pool [n_kv, slots, d]: every slot by its index
        n_kv, d = k_cache.shape[0], k_cache.shape[-1]
        written = inputs.write_slots.flatten()
        k_cache[:, written] = k.transpose(0, 1).reshape(n_kv, b * t, d).to(k_cache.dtype)
        v_cache[:, written] = v.transpose(0, 1).reshape(n_kv, b * t, d).to(v_cache.dtype)
        read = inputs.read_slots.flatten()
        keys = k_cache[:, read].view(n_kv, b, span, d).transpose(0, 1)
        values = v_cache[:, read].view(n_kv, b, span, d).transpose(0, 1)
    if attn.rows_attention is not None and x.dtype == torch.float32 and t <= FUSED_ATTENTION_MAX_TOKENS:
        # specserve's CPU attention (as the eager pass attends there): each query over its slots in order
        out = attn.rows_attention(q, keys, values, scores_mask, [span] * b)
        return attn.o(out)
    out = attend(q, keys.to(dtype), values.to(dtype), inputs.mask, scores_mask, attn.n_kv != attn.n_heads)
    return attn.o(out.to(x.dtype).transpose(1, 2).reshape(b, t, -1))


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, additive: torch.Tensor,
           gqa: bool) -> torch.Tensor:
    """SDPA over a pass's rows. On CUDA with a boolean mask and every query head's keys
    expanded, so that the memory-efficient kernel takes it (it takes any mask, flash none; in
    float64 only the math kernel runs). Elsewhere as the eager pass calls it (an additive
    mask, grouped heads)."""
    if q.is_cuda:
        if gqa:
            rep = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=additive, enable_gqa=gqa)


def static_forward(model: Transformer, cache: "KVCache | PagedKVCache", inputs: StaticInputs,
                   layers: Sequence[int] | None = None) -> torch.Tensor:
    """The logits [B, T, V] (float32) of a bucket's pass over `inputs`, appending each real
    token's keys and values at its slot (the cache's lengths do not move: the caller's
    bookkeeping). `layers`: the subset of layers a layer-skip drafter runs (the cache then
    has one entry per picked layer). No Python value depends on the inputs' contents."""
    x = model.embed(inputs.tokens)
    cos = model.rope_cos[inputs.positions].unsqueeze(1).to(x.dtype)
    sin = model.rope_sin[inputs.positions].unsqueeze(1).to(x.dtype)
    scores_mask = additive_mask(inputs.mask, model.attention_dtype or cache.k.dtype)
    picked = range(len(model.layers)) if layers is None else layers
    for i, layer_idx in enumerate(picked):
        block = model.layers[layer_idx]
        x = x + _attention(block.attn, block.attn_norm(x), cos, sin, cache.k[i], cache.v[i], inputs, scores_mask)
        x = x + block.mlp(block.mlp_norm(x))
    return model.lm_head(model.norm(x)).float()
