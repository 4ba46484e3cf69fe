"""Trained drafter checkpoints: a standard Hugging Face Llama directory
(config.json + model.safetensors, float16) plus `drafter.json`.

A drafter may have a trimmed vocabulary (VocabTrim): its token i is the
target's token `vocab_ids[i]`, and one extra last row stands, on input, for
every target token it does not keep (it is never proposed). `drafter.json`
holds that map, the target it was trained for, and how it was trained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from runtime.loading import load_hf_dir
from runtime.model import Transformer

FORMAT = "specserve-drafter/1"


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Our tensor names back to Hugging Face Llama names (q/k/v and gate/up split)."""
    cfg = model.config
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.attn.qkv.weight.split((q_dim, kv_dim, kv_dim))
        gate, up = layer.mlp.gate_up.weight.chunk(2)
        out.update({
            p + "input_layernorm.weight": layer.attn_norm.weight,
            p + "post_attention_layernorm.weight": layer.mlp_norm.weight,
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": layer.attn.o.weight,
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer.mlp.down.weight,
        })
    return out


def save_drafter(model: Transformer, vocab_ids: list[int] | None, out: Path, info: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous().cpu() for k, v in hf_state_dict(model).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_hf()
    config["torch_dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "drafter.json").write_text(json.dumps({"format": FORMAT, "vocab_ids": vocab_ids, **info}, indent=1))


def load_drafter(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32
                 ) -> tuple[Transformer, list[int] | None, dict[str, Any]]:
    """(model, vocab map or None, drafter.json) of a drafter directory."""
    path = Path(path)
    info = json.loads((path / "drafter.json").read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{path}/drafter.json: format {info.get('format')!r} is not {FORMAT!r}")
    model = load_hf_dir(path, device, dtype)
    vocab_ids = info.get("vocab_ids")
    if vocab_ids is not None and len(vocab_ids) + 1 != model.config.vocab_size:
        raise ValueError(f"{path}: {len(vocab_ids)} vocab ids for a model of {model.config.vocab_size} rows "
                         "(expected one extra row for tokens outside the trimmed vocabulary)")
    return model, vocab_ids, info
