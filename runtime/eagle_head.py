"""The EAGLE-3 draft head: one decoder layer that drafts from the target's own features.

Entry i of the head pairs the target's hidden states at position i (the outputs
of a low, a middle and a high layer, concatenated, fused by one linear layer to
the hidden size) with the embedding of token i+1 (the target's embedding,
frozen); the layer (RMSNorms, attention over the head's own KV cache, MLP, as
the target's layers are) outputs a hidden state whose logits, over a reduced
draft vocabulary, predict token i+2. Drafting further, the head's own output at
position i stands in for the target's fused feature there (EAGLE's feature
extrapolation; training-time test teaches the head that input).

The LM head is the target's, rows of the draft vocabulary only, frozen, taken
from the target when the head is attached (`EagleHead.attach`), so a checkpoint
holds only the fusion, the layer and the norms (`runtime.eagle_head` save/load).
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .model import MLP, RMSNorm, Transformer

FORMAT = "specserve-eagle/1"


def feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The low, middle and high layers whose outputs the head reads (EAGLE-3's choice)."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    layers: tuple[int, ...]  # target layers whose outputs are the features
    target_vocab_size: int

    @classmethod
    def of_target(cls, cfg: ModelConfig, intermediate: int | None = None) -> "HeadConfig":
        return cls(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   intermediate or cfg.intermediate_size, cfg.rms_norm_eps, feature_layers(cfg.num_layers),
                   cfg.vocab_size)


class HeadCache:
    """The head's keys and values for one sequence: [kv_heads, slots, head_dim] each."""

    def __init__(self, cfg: HeadConfig, max_len: int, device, dtype):
        self.k = torch.zeros(cfg.num_kv_heads, max_len, cfg.head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    def grown(self, max_len: int) -> "HeadCache":
        new = object.__new__(HeadCache)
        new.k = self.k.new_zeros(self.k.shape[0], max_len, self.k.shape[2])
        new.v = torch.zeros_like(new.k)
        new.k[:, :self.length], new.v[:, :self.length] = self.k[:, :self.length], self.v[:, :self.length]
        new.length = self.length
        return new


class EagleHead(nn.Module):
    def __init__(self, cfg: HeadConfig, vocab_ids: torch.Tensor):
        super().__init__()
        self.config = cfg
        h, q_dim, kv_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.fuse = nn.Linear(len(cfg.layers) * h, h, bias=False)
        self.embed_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.feature_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv = nn.Linear(2 * h, q_dim + 2 * kv_dim, bias=False)  # from [embedding, feature]
        self.o = nn.Linear(q_dim, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_norm_eps)
        mlp_cfg = ModelConfig(vocab_size=1, hidden_size=h, intermediate_size=cfg.intermediate_size, num_layers=1,
                              num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                              max_position_embeddings=1, rope_theta=1.0)
        self.mlp = MLP(mlp_cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.register_buffer("vocab_ids", vocab_ids.to(torch.long), persistent=False)  # draft id -> target id
        # the target's: set by `attach` (not part of the checkpoint, not trained)
        self.embed_weight: torch.Tensor | None = None
        self.lm_head_weight: torch.Tensor | None = None  # [draft vocab, H]
        self.rope_cos = self.rope_sin = None

    @property
    def draft_vocab(self) -> int:
        return len(self.vocab_ids)

    def attach(self, target: Transformer) -> "EagleHead":
        """Take the target's embedding, RoPE tables and LM head rows (frozen, shared)."""
        if target.config.vocab_size != self.config.target_vocab_size:
            raise ValueError(f"the head was trained for a vocabulary of {self.config.target_vocab_size} tokens, "
                             f"the target has {target.config.vocab_size}")
        self.embed_weight = target.embed.weight.detach()
        ids = self.vocab_ids.to(target.device)
        if isinstance(target.lm_head, nn.Linear):
            self.lm_head_weight = target.lm_head.weight.detach()[ids].float()
        else:  # a quantised head (int8): its rows as it computes them, read off the identity
            with torch.inference_mode():
                eye = torch.eye(self.config.hidden_size, device=target.device, dtype=target.dtype)
                self.lm_head_weight = target.lm_head(eye).float().T[ids].clone()
        self.rope_cos, self.rope_sin = target.rope_cos, target.rope_sin
        return self

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """The target's concatenated layer outputs [..., 3H] fused to [..., H]."""
        return self.fuse(features.to(self.fuse.weight.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores over the draft vocabulary of the token after next."""
        return F.linear(self.norm(hidden), self.lm_head_weight.to(hidden.dtype)).float()

    def layer(self, g: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor,
              past_v: torch.Tensor, mask: torch.Tensor | None):
        """The decoder layer over T entries (batch B): fused features g [B, T, H], the next
        tokens [B, T] (target ids), positions [B, T]; attending to the past keys and
        values [B, kv, S, D] then to the new ones as `mask` [B, T, S + T] allows (None:
        causal, no past). Returns (hidden [B, T, H], new keys, new values [B, kv, T, D])."""
        cfg = self.config
        b, t, _ = g.shape
        emb = F.embedding(tokens, self.embed_weight).to(g.dtype)
        x = torch.cat((self.embed_norm(emb), self.feature_norm(g)), -1)
        heads = self.qkv(x).view(b, t, -1, cfg.head_dim).transpose(1, 2)
        roped = cfg.num_heads + cfg.num_kv_heads
        cos = self.rope_cos[positions].unsqueeze(1).to(g.dtype)
        sin = self.rope_sin[positions].unsqueeze(1).to(g.dtype)
        qk = heads[:, :roped]
        qk = qk * cos + torch.roll(qk, cfg.head_dim // 2, -1) * sin
        q, k, v = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:], heads[:, roped:]
        keys, values = torch.cat((past_k, k), 2), torch.cat((past_v, v), 2)
        gqa = cfg.num_heads != cfg.num_kv_heads
        if mask is None:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.unsqueeze(1), enable_gqa=gqa)
        h = g + self.o(out.transpose(1, 2).reshape(b, t, -1))
        return h + self.mlp(self.mlp_norm(h)), k, v

    @torch.inference_mode()
    def extend(self, cache: HeadCache, g: torch.Tensor, tokens: list[int], positions: list[int],
               ancestors: torch.Tensor | None = None, visible: int | None = None) -> torch.Tensor:
        """Append entries (fused features g [T, H], next tokens, positions) to `cache`; each
        sees the first `visible` cached entries (default: all) and, among the new ones,
        those `ancestors` [T, T] marks (default: causal). Returns their hidden states [T, H]."""
        t, start = len(tokens), cache.length
        if start + t > cache.max_len:
            raise ValueError(f"head cache of {cache.max_len} slots is full")
        visible = start if visible is None else visible
        device = g.device
        mask = None
        if start or ancestors is not None or visible != start:
            mask = torch.zeros(t, start + t, dtype=torch.bool, device=device)
            mask[:, :visible] = True
            mask[:, start:] = ancestors if ancestors is not None else torch.ones(t, t, dtype=torch.bool).tril()
            mask = mask[None]
        dtype = cache.k.dtype
        h, k, v = self.layer(g[None].to(dtype), torch.tensor([tokens], device=device),
                             torch.tensor([positions], device=device), cache.k[None, :, :start],
                             cache.v[None, :, :start], mask)
        cache.k[:, start:start + t], cache.v[:, start:start + t] = k[0], v[0]
        cache.length = start + t
        return h[0]


_shared: dict[tuple[str, int], EagleHead] = {}
_shared_lock = threading.Lock()


def shared_head(path: str | Path, target: Transformer) -> EagleHead:
    """The head at `path` attached to `target`, loaded once a process and target and shared by
    every request's drafter (FileNotFoundError without a checkpoint; ValueError if it does not
    fit the target)."""
    path = Path(path)
    key = (str(path.resolve()), id(target))
    with _shared_lock:
        if key not in _shared:
            if not (path / "head.safetensors").exists():
                raise FileNotFoundError(f"no head checkpoint at {path}")
            head, _ = load_head(path, device=str(target.device))
            _shared[key] = head.attach(target)
        return _shared[key]


def save_head(head: EagleHead, out: Path, info: dict) -> None:
    """float16 weights (safetensors) and eagle.json (shape, vocabulary map, how it was trained)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(tensors, str(out / "head.safetensors"), metadata={"format": "pt"})
    cfg = asdict(head.config)
    (out / "eagle.json").write_text(json.dumps({"format": FORMAT, "config": cfg,
                                                "vocab_ids": head.vocab_ids.tolist(), **info}, indent=1))


def is_head_dir(path: str | Path) -> bool:
    try:
        return (Path(path) / "eagle.json").is_file()
    except OSError:
        return False


def load_head(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
              ) -> tuple[EagleHead, dict]:
    from safetensors.torch import load_file

    path = Path(path)
    info = json.loads((path / "eagle.json").read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{path}/eagle.json: format {info.get('format')!r} is not {FORMAT!r}")
    raw = dict(info["config"])
    raw["layers"] = tuple(raw["layers"])
    head = EagleHead(HeadConfig(**raw), torch.tensor(info["vocab_ids"]))
    head.load_state_dict({k: v.to(dtype) for k, v in load_file(str(path / "head.safetensors")).items()})
    return head.to(device=device, dtype=dtype).eval(), info
