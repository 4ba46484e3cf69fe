"""Checkpoints of the Llama family load from a Hugging Face directory and give
Hugging Face's logits: Llama 3 (rope scaling), Qwen2 (q/k/v biases), Mistral."""

from __future__ import annotations

import pytest
import torch

from runtime.loading import load_hf_dir
from runtime.model import attention_mask, causal_ancestors

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def tiny_hf(family: str):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if family == "llama3":
        cfg = LlamaConfig(**SHAPE, rope_theta=500000.0, tie_word_embeddings=False,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        return LlamaForCausalLM(cfg)
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True))
    return MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=None))


@pytest.mark.parametrize("family", ["llama3", "qwen2", "mistral"])
def test_hf_directory_loads_and_matches_transformers(tmp_path, family):
    hf = tiny_hf(family).eval()
    with torch.no_grad():  # random init leaves biases at zero; make them count
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    ours = load_hf_dir(tmp_path)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits[0]
    got = ours(ids, torch.arange(100)[None], ours.new_cache(100), attention_mask(0, causal_ancestors(100)))[0]
    assert torch.allclose(got, want, atol=1e-4), f"{family}: max diff {(got - want).abs().max():.2e}"


def test_bfloat16_runs_close_to_float32(tmp_path):
    tiny_hf("qwen2").save_pretrained(tmp_path)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(2))
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        m = load_hf_dir(tmp_path, dtype=dtype)
        assert m.embed.weight.dtype == dtype
        outs.append(m(ids, torch.arange(20)[None], m.new_cache(20), attention_mask(0, causal_ancestors(20)))[0])
    assert (outs[0] - outs[1]).abs().max() < 0.1
