"""A GGUF file read as a Llama-family checkpoint: its model shape, its tensors
dequantised under our names, and the Hugging Face directory converted from it once
(under the cache) so that later loads read plain safetensors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from .cache import cache_root
from .config import ModelConfig

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def unpermute(w, n_head: int):
    """Undo llama.cpp's reordering of q/k rows (it interleaves the RoPE halves)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def gguf_config(reader) -> tuple[ModelConfig, str]:
    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"GGUF architecture {arch!r} is not a supported Llama-family decoder")
    heads = field(f"{arch}.attention.head_count")
    hidden = field(f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    eos = field("tokenizer.ggml.eos_token_id")
    vocab = field(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = ModelConfig(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=field(f"{arch}.feed_forward_length"),
        num_layers=field(f"{arch}.block_count"), num_heads=heads,
        num_kv_heads=field(f"{arch}.attention.head_count_kv", heads),
        head_dim=field(f"{arch}.attention.key_length", hidden // heads),
        rms_norm_eps=field(f"{arch}.attention.layer_norm_rms_epsilon", ModelConfig.rms_norm_eps),
        rope_theta=field(f"{arch}.rope.freq_base", ModelConfig.rope_theta),
        max_position_embeddings=field(f"{arch}.context_length", ModelConfig.max_position_embeddings),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [eos],
        model_type=arch,
    )
    return cfg, arch


def _gguf_tensors(reader, cfg: ModelConfig):
    from gguf.quants import dequantize

    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        name = _GGUF_NAMES.get(t.name)
        if name is None:
            _, layer, kind, suffix = t.name.split(".")
            if kind == "attn_q":
                w = unpermute(w, cfg.num_heads) if cfg.model_type == "llama" else w
            elif kind == "attn_k":
                w = unpermute(w, cfg.num_kv_heads) if cfg.model_type == "llama" else w
            name = f"model.layers.{layer}.{_GGUF_BLOCK_NAMES[kind]}.{suffix}"
        yield name, torch.from_numpy(w.astype("float32", copy=False).copy())


def converted_gguf_dir(gguf_path: Path, cache_dir: str | os.PathLike | None = None, *,
                       show_progress: bool = False) -> Path:
    """The Hugging Face directory converted from `gguf_path` under `cache_dir` (`cache_root`),
    made on first use (`show_progress`: its steps on stderr)."""
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root(cache_dir) / "models" / f"{gguf_path.stem}-{key}"
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp, show_progress=show_progress)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is as good
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, show_progress: bool = False) -> None:
    """Write `gguf_path` as a Hugging Face checkpoint: dequantised float32 safetensors,
    config.json, and the tokenizer with its chat template."""
    import gguf
    from safetensors.torch import save_file
    from tqdm import tqdm

    say = (lambda line: tqdm.write(line, file=sys.stderr)) if show_progress else (lambda _: None)
    say(f"specserve: converting {gguf_path.name} once into a float32 checkpoint under {out_dir.parent}")
    reader = gguf.GGUFReader(str(gguf_path))
    cfg, _ = gguf_config(reader)
    tensors = dict(tqdm(_gguf_tensors(reader, cfg), total=len(reader.tensors), desc="specserve: dequantising",
                        unit="tensor", disable=not show_progress, leave=False))
    out_dir.mkdir(parents=True, exist_ok=True)
    say("specserve: writing the weights and rebuilding the tokenizer")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None}))
    _save_gguf_tokenizer(gguf_path, out_dir)


def _save_gguf_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    # transformers knows how to rebuild a fast tokenizer from GGUF metadata;
    # we only need it this once, at conversion time.
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))
