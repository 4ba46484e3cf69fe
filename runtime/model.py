"""A Llama-family decoder with a preallocated, rollback-able KV cache.

The forward pass takes explicit positions and an explicit attention mask, so
one call can score a whole token tree (each node sees the cached prefix and
its own ancestors). Numerics follow Hugging Face's Llama implementation
(float32 RMSNorm, rotate-half RoPE, SDPA) so greedy outputs match it.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .paged_kv import PagedKVCache, PagedLayer, PagedRows, RowsLengths, block_bytes


class KVCache:
    """Keys and values of `batch` sequences, preallocated to `max_len` slots.

    `lengths[b]` is how many slots of row b hold committed tokens. Rolling
    back is just lowering a length; `keep` compacts accepted tree nodes.
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = [0] * batch

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def grown(self, max_len: int) -> "KVCache":
        """A cache of `max_len` slots holding this one's entries."""
        layers, batch, heads, _, dim = self.k.shape
        new = KVCache(layers, batch, heads, max_len, dim, self.k.device, self.k.dtype)
        n = max(self.lengths)
        new.k[:, :, :, :n] = self.k[:, :, :, :n]
        new.v[:, :, :, :n] = self.v[:, :, :, :n]
        new.lengths = list(self.lengths)
        return new

    def row_view(self, row: int) -> "KVCache":
        """Row `row` as a one-row cache sharing storage and length with this one."""
        return self.rows_view(row, row + 1)

    def rows_view(self, first: int, stop: int) -> "KVCache":
        """Rows first..stop-1 as a cache of their own, sharing storage and lengths with this one
        (slicing copies nothing)."""
        if not 0 <= first < stop <= self.batch:
            raise ValueError(f"rows {first}..{stop - 1} are not rows of a cache of {self.batch}")
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:, first:stop], self.v[:, first:stop]
        view.lengths = RowsLengths(self.lengths, first, stop)
        return view

    def rollback(self, length: int, row: int = 0) -> None:
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"cannot roll back row {row} from {self.lengths[row]} to {length}")
        self.lengths[row] = length

    def keep(self, start: int, offsets: Sequence[int], row: int = 0) -> None:
        """Keep slots start+offsets[i] as slots start+i (offsets ascending), drop the rest."""
        offsets = list(offsets)
        if offsets != list(range(len(offsets))):
            src = torch.tensor([start + o for o in offsets], device=self.k.device)
            dst = slice(start, start + len(offsets))
            self.k[:, row, :, dst] = self.k[:, row, :, src]
            self.v[:, row, :, dst] = self.v[:, row, :, src]
        self.lengths[row] = start + len(offsets)


def _rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":  # Llama 3.1 frequency-dependent scaling
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind is not None:
        raise ValueError(f"rope scaling {kind!r} is not supported")
    return inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one operator, same values
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.attention_bias)
        self.o = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        # RoPE, the cache append and float64 attention of one sequence's short pass in one
        # call, where the int models' CPU kernels run (runtime/quantize.py installs
        # runtime.cpu_kernels.attend): eager PyTorch spends a dozen operators on it.
        self.fused_attention = None
        # The attention of short passes of any number of rows over their cached slots in one
        # call, each row over its own slots only, each query as it is alone, where specserve's
        # CPU kernels run (runtime.cpu_kernels.attend_rows; cpu_tuning and quantize install
        # it): SDPA pads every row to the batch's longest and gives a row's query other roundings
        # beside other rows.
        self.rows_attention = None
        self.attention_dtype: torch.dtype | None = None  # None: the cache's (Transformer.attention_dtype)

    def forward(self, x, cos, sin, k_cache, v_cache, starts, mask, packing=None):
        """`k_cache`, `v_cache`: a KVCache's rows of this layer [B, n_kv, max_len, d], or a
        `PagedLayer` (v_cache None): a paged cache's rows (runtime/paged_kv.py). The specserve
        kernels read and write its blocks where they lie (a slot map); SDPA attends over
        the rows gathered into contiguous ones. The same operations on the same values
        either way: the same results, bit for bit."""
        paged = k_cache if isinstance(k_cache, PagedLayer) else None
        qkv = self.qkv(x)
        if packing is not None:  # real tokens only [N, D]: attention works on the padded rows
            qkv = packing.unpack(qkv)
        b, t, _ = qkv.shape
        cache_dtype = k_cache.dtype
        dtype = self.attention_dtype or cache_dtype
        if self.fused_attention is not None and b == 1 and packing is None and mask is not None \
                and t <= FUSED_ATTENTION_MAX_TOKENS and dtype == torch.float64 and cache_dtype == torch.float32 \
                and qkv.dtype == torch.float32 and (paged or k_cache[0].is_contiguous() and v_cache[0].is_contiguous()):
            if paged:
                plan, store = paged.plan(starts, t), paged.store()
                keys, values, slot_map = store[0], store[1], plan.slot_map[0]
            else:
                keys, values, slot_map = k_cache[0], v_cache[0], None
            out = self.fused_attention(qkv.reshape(t, -1).contiguous(), cos.reshape(t, -1), sin.reshape(t, -1),
                                       keys, values, starts[0], mask.reshape(t, -1), self.n_heads,
                                       **({} if slot_map is None else {"slot_map": slot_map}))
            return self.o(out.view(b, t, -1))
        heads = qkv.view(b, t, -1, self.head_dim).transpose(1, 2)  # q, k and v heads [B, H, T, D]
        roped = self.n_heads + self.n_kv
        qk = heads[:, :roped]  # RoPE on queries and keys at once: half the small ops
        qk = qk * cos + torch.roll(qk, self.head_dim // 2, -1) * sin  # sin's first half negated
        q, k, v = qk[:, :self.n_heads], qk[:, self.n_heads:], heads[:, roped:]
        q = q.to(dtype)
        rows_kernel = self.rows_attention is not None and mask is not None and t <= FUSED_ATTENTION_MAX_TOKENS \
            and x.dtype == torch.float32
        if paged and rows_kernel:  # the new keys and values to their blocks, attended where they lie
            plan, store = paged.plan(starts, t), paged.store()
            plan.write(store, k, v)
            keys, values = (part[None].expand(b, *part.shape) for part in store)
            out = self.rows_attention(q, keys, values, mask, [start + t for start in starts], slot_map=plan.slot_map)
            return self.o(out if packing is None else packing.pack(out))
        if paged:  # the rows gathered into contiguous ones, the new keys and values written to them
            plan = paged.plan(starts, t)
            flat, k_cache, v_cache = plan.rows_of(paged.store())
        if b == 1:  # one copy each: a token's pass is made of many small operators
            start = starts[0]
            k_cache[:1, :, start:start + t] = k
            v_cache[:1, :, start:start + t] = v
        else:
            for row, start in enumerate(starts):
                k_cache[row, :, start:start + t] = k[row]
                v_cache[row, :, start:start + t] = v[row]
        if paged:
            plan.write_back(flat, paged.store())
        if rows_kernel:
            out = self.rows_attention(q, k_cache[:b], v_cache[:b], mask, [start + t for start in starts])
            return self.o(out if packing is None else packing.pack(out))
        span, gqa = t if mask is None else mask.shape[-1], self.n_kv != self.n_heads
        keys, values = k_cache[:b, :, :span], v_cache[:b, :, :span]
        if keys.dtype != dtype:  # a float32 cache under float64 attention (Transformer.cache_dtype)
            keys, values = keys.to(dtype), values.to(dtype)
        if packing is not None and packing.wide:
            out = self._few_wide_rows(q, keys, values, starts, mask, packing.wide)
        else:  # no mask: a causal pass from an empty cache (Transformer.layer_inputs)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                                 enable_gqa=gqa)
        out = out.to(x.dtype).transpose(1, 2).reshape(b, t, -1)
        return self.o(out if packing is None else packing.pack(out))

    def _few_wide_rows(self, q, k_cache, v_cache, starts, mask, wide):
        """Attention when few rows hold more than one real token: every row's first query
        in one call, then each wide row's others alone, over its own slots only, so the
        narrow rows do not attend for padding (the padded queries' outputs stay zero).
        k_cache and v_cache in q's dtype, at least the mask's span."""
        b, span, gqa = q.shape[0], mask.shape[-1], self.n_kv != self.n_heads
        out = torch.zeros_like(q)
        out[:, :, :1] = F.scaled_dot_product_attention(
            q[:, :, :1], k_cache[:b, :, :span], v_cache[:b, :, :span], attn_mask=mask[:, :, :1], enable_gqa=gqa)
        for row, n in wide:
            end = starts[row] + n
            out[row:row + 1, :, 1:n] = F.scaled_dot_product_attention(
                q[row:row + 1, :, 1:n], k_cache[row:row + 1, :, :end], v_cache[row:row + 1, :, :end],
                attn_mask=mask[row:row + 1, :, 1:n, :end], enable_gqa=gqa)
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate).mul_(up))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, k_cache, v_cache, starts, mask, packing=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, k_cache, v_cache, starts, mask, packing)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        # None: the model's dtype. The int modes (runtime/quantize.py) attend in float64:
        # float32 attention of a token in a many-query pass rounds unlike the same token
        # alone, and the bfloat16 cast before each int layer grows that into other tokens.
        self.attention_dtype = None
        # None: the attention dtype. float32 where specserve's CPU attention reads the caches
        # (cpu_tuning.native_attention): the keys and values are float32 values (float32
        # activations, RoPE in float32), which float64 attention widens exactly as it reads
        # them, so the caches hold half the bytes a token's attention reads.
        self.cache_dtype: torch.dtype | None = None
        cos, sin = self.rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @staticmethod
    def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position's rotary angles, [max_positions, head_dim] (float32, CPU).
        sin's first half is negated: rotating half the features is then one roll, not four
        operators, with the same values (x * -s is -x * s exactly)."""
        with torch.device("cpu"):
            freqs = torch.outer(torch.arange(cfg.max_position_embeddings).float(), _rope_inv_freq(cfg))
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = emb.sin()
            sin[:, :freqs.shape[1]].neg_()
            return emb.cos(), sin

    @property
    def attention_dtype(self) -> torch.dtype | None:
        return self._attention_dtype

    @attention_dtype.setter
    def attention_dtype(self, dtype: torch.dtype | None) -> None:
        self._attention_dtype = dtype
        for layer in self.layers:
            layer.attn.attention_dtype = dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_cache(self, max_len: int, batch: int = 1, num_layers: int | None = None) -> KVCache:
        cfg = self.config
        kv_heads = self.layers[0].attn.n_kv  # a tensor-parallel shard's own (runtime/tp.py)
        return KVCache(num_layers or cfg.num_layers, batch, kv_heads, max_len, cfg.head_dim, self.device,
                       self.cache_dtype or self.attention_dtype or self.dtype)

    def new_paged_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """The keys and values of a paged cache's blocks (runtime/paged_kv.py), in the dtype and
        with the KV heads `new_cache` gives."""
        cfg = self.config
        return PagedKVCache(cfg.num_layers, num_blocks, block_size, self.layers[0].attn.n_kv, cfg.head_dim,
                            self.device, self.cache_dtype or self.attention_dtype or self.dtype,
                            cfg.max_position_embeddings)

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one paged-cache block of `block_size` slots (this model's, or a shard's, KV heads)."""
        cfg = self.config
        return block_bytes(cfg.num_layers, self.layers[0].attn.n_kv, cfg.head_dim, block_size,
                           self.cache_dtype or self.attention_dtype or self.dtype)

    def layer_inputs(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor,
                     packed: bool = False):
        """What the first layer takes: the embeddings, RoPE's cos and sin at `positions`, each
        row's first free cache slot, and the mask with a head axis; the cache must have room.
        The mask is None for an unpacked causal pass from an empty cache (a prompt's prefill):
        SDPA then skips the blocks a causal mask hides, with the same results."""
        b, t = tokens.shape
        starts = cache.lengths[:b]
        if max(starts) + t > cache.max_len:
            raise ValueError(f"KV cache of {cache.max_len} slots is full")
        x = self.embed(tokens)
        cos = self.rope_cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.rope_sin[positions].unsqueeze(1).to(x.dtype)
        if not packed and t >= CAUSAL_MIN_TOKENS and max(starts) == 0 and is_causal(mask):
            return x, cos, sin, starts, None
        return x, cos, sin, starts, additive_mask(mask, self.attention_dtype or cache.k.dtype).unsqueeze(1)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor,
                layers: Sequence[int] | None = None, logits_from: int = 0,
                real: Sequence[int] | None = None, capture: Sequence[int] | None = None,
                capture_rows: torch.Tensor | Sequence[int] | None = None):
        """Score `tokens` [B, T] at `positions` [B, T], appending their keys and values.

        Row b's new keys go to cache slots lengths[b].. and its length grows by T.
        `mask` [B, T, S] (True = may attend) covers the first S cache slots.
        `layers` picks a subset of layers (layer-skip drafting; the cache then
        has one entry per picked layer). Logits are computed for tokens
        [logits_from:] only, which saves the large head on prefill.

        `real[b]`: only the first real[b] tokens of row b matter, the rest pad the
        rows to one width (each must attend to itself at least). The linear
        layers and the head then run on the real tokens alone, packed, and the
        logits come back packed too: [sum(real), V], row after row. A batch of
        one wide tree and seven single tokens costs 13 tokens' work, not 48.

        `capture` (layer indices; default None, nothing extra): also return the
        hidden states those layers output, concatenated in `capture`'s order, at
        every position of the pass (`logits_from` cuts the logits only):
        `(logits, features [B, T, len(capture) * H])`, packed as the logits are when
        `real` packs them. A feature-level drafter (EAGLE) drafts from them.
        `capture_rows` (with `capture`): only these rows of that layout (packed rows, or
        the B*T rows flattened), `features [len(capture_rows), len(capture) * H]`: a
        batch's rows of requests that draft otherwise copy no features out.
        """
        b, t = tokens.shape
        packing = None if real is None or sum(real) == b * t else _Packing(b, t, real, tokens.device)
        if packing is not None and logits_from:
            raise ValueError("packed rows give logits for every real token")
        x, cos, sin, starts, mask = self.layer_inputs(tokens, positions, cache, mask, packed=packing is not None)
        if packing is not None:
            x = packing.pack(x)
        picked = range(len(self.layers)) if layers is None else layers
        captured = {}
        if capture_rows is not None and not isinstance(capture_rows, torch.Tensor):
            capture_rows = torch.tensor(list(capture_rows), dtype=torch.long)
        if capture_rows is not None:
            capture_rows = capture_rows.to(x.device)
        paged = isinstance(cache, PagedRows)
        for i, layer_idx in enumerate(picked):
            k, v = cache.layer(i) if paged else (cache.k[i], cache.v[i])
            x = self.layers[layer_idx](x, cos, sin, k, v, starts, mask, packing)
            if capture is not None and layer_idx in capture:
                captured[layer_idx] = x if capture_rows is None else x.reshape(-1, x.shape[-1])[capture_rows]
        for row in range(b):
            cache.lengths[row] += t
        logits = self.lm_head(self.norm(self._at_logits(x, b, t, logits_from, real, packing))).float()
        if capture is None:
            return logits
        features = torch.cat([captured[i] for i in capture], -1)
        if capture_rows is not None:
            return logits, features
        return logits, self._at_logits(features, b, t, 0, real, packing)

    @staticmethod
    def _at_logits(x: torch.Tensor, b: int, t: int, logits_from: int, real, packing) -> torch.Tensor:
        """The rows of `x` from `logits_from` on, packed as the logits are."""
        if packing is None:
            x = x[:, logits_from:]
            if real is not None:  # nothing was padded: the same packed layout
                x = x.reshape(b * t, -1)
        return x


# passes of more new tokens attend through SDPA even where a fused attention is installed
# (a long prompt appended to a conversation: SDPA's blocked kernel is faster there)
FUSED_ATTENTION_MAX_TOKENS = 64
# a causal pass of at least this many tokens from an empty cache attends without a mask,
# skipping the hidden blocks (shorter ones gain nothing worth the check)
CAUSAL_MIN_TOKENS = 64
WIDE_ROWS_SHARE = 4  # attend for wide rows alone while at most 1 row in 4 is wide
WIDE_ROWS_MIN_WIDTH = 4  # and the widest holds at least 4 tokens


class _Packing:
    """Where the real tokens of padded rows [B, T] lie, to drop the padding and put it back."""

    def __init__(self, b: int, t: int, real: Sequence[int], device: torch.device):
        if len(real) != b or any(not 0 <= n <= t for n in real):
            raise ValueError(f"real token counts {list(real)} do not fit {b} rows of {t}")
        self.b, self.t = b, t
        self.index = torch.cat([torch.arange(n) + row * t for row, n in enumerate(real)]).to(device)
        # rows of more than one real token, when few and wide enough that attending for them
        # alone costs less than padding every row's queries to their width (docs/DESIGN-NOTES.md)
        wide = [(row, n) for row, n in enumerate(real) if n > 1]
        self.wide = wide if len(wide) <= b // WIDE_ROWS_SHARE and t >= WIDE_ROWS_MIN_WIDTH else []

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, C] -> [N, C], the real tokens row after row."""
        return x.reshape(self.b * self.t, -1).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] -> [B, T, C], zeros where the padding was."""
        out = x.new_zeros(self.b * self.t, x.shape[-1])
        out.index_copy_(0, self.index, x)
        return out.view(self.b, self.t, -1)


def is_causal(mask: torch.Tensor) -> bool:
    """Whether every row of `mask` [B, T, T] is the plain causal mask."""
    t = mask.shape[-1]
    return mask.shape[-2] == t and bool((mask == causal_ancestors(t, mask.device)).all())


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = may attend) as the 0 / -inf scores SDPA adds, in `dtype`: what
    SDPA makes of a boolean mask itself, made once a pass instead of once a layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attention_mask(prefix_len: int, ancestors: torch.Tensor) -> torch.Tensor:
    """Mask [1, T, prefix_len + T]: every new token sees the whole prefix and,
    among the new tokens, exactly those `ancestors[i, j]` marks (itself included)."""
    t = ancestors.shape[0]
    prefix = torch.ones(t, prefix_len, dtype=torch.bool, device=ancestors.device)
    return torch.cat((prefix, ancestors), dim=1).unsqueeze(0)


def causal_ancestors(t: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()
