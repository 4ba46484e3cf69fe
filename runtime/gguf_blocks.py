"""A GGUF's Q4_0/Q4_1 blocks as they are stored, for `runtime.quantize`'s int4 layers, and
its Q8_0 head's, for the int8 head beside them.

A block holds 32 consecutive weights of a row: a float16 scale d (and, Q4_1, a float16
minimum m), then 16 bytes of 4-bit q, the low nibbles weights 0-15 and the high nibbles
16-31; w = d*q + m (Q4_0: w = d*(q - 8), that is m = -8d). A Q8_0 block is a float16 d and
32 int8 q, w = d*q. Nothing goes through float32
weights: q stays an integer, d and m only widen from float16 (exact). Reading a GGUF's
metadata is slow (its whole vocabulary), so the blocks are kept beside the model's
converted checkpoint after the first read (`cached_int4_blocks`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from .gguf_convert import gguf_config, unpermute

# our fused layer -> the GGUF tensors whose rows it stacks
_PARTS = {
    "attn.qkv": ("attn_q", "attn_k", "attn_v"),
    "attn.o": ("attn_output",),
    "mlp.gate_up": ("ffn_gate", "ffn_up"),
    "mlp.down": ("ffn_down",),
}


def _blocks(tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [rows, cols] int32 0..15, d, m [rows, cols/32] float32) of a Q4_0/Q4_1 tensor."""
    import gguf

    rows = tensor.data.shape[0]
    kind = tensor.tensor_type
    per_block = 20 if kind == gguf.GGMLQuantizationType.Q4_1 else 18
    raw = np.ascontiguousarray(tensor.data).reshape(rows, -1, per_block)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == gguf.GGMLQuantizationType.Q4_1:
        m, packed = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), raw[..., 4:]
    else:
        m, packed = -8 * d, raw[..., 2:]
    q = np.concatenate((packed & 0x0F, packed >> 4), axis=-1).reshape(rows, -1)  # low nibbles first
    return torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(m)


def _q8_blocks(tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [rows, cols] int8, d [rows, cols/32] float32) of a Q8_0 tensor."""
    rows = tensor.data.shape[0]
    raw = np.ascontiguousarray(tensor.data).reshape(rows, -1, 34)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = raw[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return torch.from_numpy(q), torch.from_numpy(d)


BLOCKS_FILE = "gguf_blocks.safetensors"
HEAD = "lm_head"  # the key of the Q8_0 head's (q, d), where the GGUF's head is Q8_0


def cached_int4_blocks(gguf_path: str | Path, converted_dir: Path
                       ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`int4_blocks(gguf_path)`, kept in `converted_dir` (the GGUF's converted checkpoint,
    `runtime.gguf_convert.converted_gguf_dir`) once read: q two to a byte, d and m float16."""
    from safetensors.torch import load_file, save_file

    path = Path(converted_dir) / BLOCKS_FILE
    if path.exists():
        stored = load_file(str(path))
        names = {key.rsplit(".", 1)[0] for key in stored} - {HEAD}
        blocks = {name: (torch.stack((stored[f"{name}.q"] & 0x0F, stored[f"{name}.q"] >> 4), dim=-1)
                         .flatten(-2).to(torch.int32),
                         stored[f"{name}.d"].float(), stored[f"{name}.m"].float()) for name in names}
        if f"{HEAD}.q" in stored:
            blocks[HEAD] = (stored[f"{HEAD}.q"], stored[f"{HEAD}.d"].float())
        return blocks
    blocks = int4_blocks(gguf_path)
    stored = {}
    for name, parts in blocks.items():
        if name == HEAD:
            stored[f"{name}.q"], stored[f"{name}.d"] = parts[0], parts[1].half()
            continue
        q, d, m = parts
        stored[f"{name}.q"] = (q[:, 0::2] | q[:, 1::2] << 4).to(torch.uint8)
        stored[f"{name}.d"], stored[f"{name}.m"] = d.half(), m.half()  # both came from float16
    tmp = path.with_name(f".{BLOCKS_FILE}.{os.getpid()}")
    save_file(stored, str(tmp))
    os.replace(tmp, path)  # whole or absent, however many processes race here
    return blocks


def int4_blocks(gguf_path: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Our layer name ("layers.3.attn.qkv") -> (q, d, m) for every fused linear layer of
    `gguf_path` whose parts are all Q4_0/Q4_1; rows in our order (q/k unpermuted, the
    parts stacked as `runtime.loading` stacks them). Layers stored otherwise are absent.
    HEAD -> (q, d) of the head (the token embedding, if tied) where it is Q8_0."""
    import gguf

    four_bit = {gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1}
    reader = gguf.GGUFReader(str(gguf_path))
    cfg, _ = gguf_config(reader)
    tensors = {t.name: t for t in reader.tensors}
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    out = {}
    for i in range(cfg.num_layers):
        for ours, theirs in _PARTS.items():
            parts = [tensors[f"blk.{i}.{name}.weight"] for name in theirs]
            if any(t.tensor_type not in four_bit for t in parts):
                continue
            stacked = []
            for name, t in zip(theirs, parts):
                q, d, m = _blocks(t)
                if name in heads and cfg.model_type == "llama":  # a row reorder: blocks move with their rows
                    q, d, m = (unpermute(x, heads[name]) for x in (q, d, m))
                stacked.append((q, d, m))
            out[f"layers.{i}.{ours}"] = tuple(torch.cat(xs) for xs in zip(*stacked))
    head = tensors["token_embd.weight" if cfg.tie_word_embeddings else "output.weight"]
    if head.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        out[HEAD] = _q8_blocks(head)
    return out
