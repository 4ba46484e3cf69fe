"""A tiny randomly initialised Llama-shaped model for fast exact tests."""

from __future__ import annotations

from dataclasses import replace

import torch

from runtime.config import ModelConfig
from runtime.model import Transformer

TINY = ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, max_position_embeddings=64, rope_theta=10000.0)


def tiny_model(seed: int, logit_scale: float = 1.0, max_positions: int = TINY.max_position_embeddings,
               vocab_size: int = TINY.vocab_size, num_kv_heads: int = TINY.num_kv_heads,
               num_layers: int = TINY.num_layers, shape: ModelConfig = TINY) -> Transformer:
    """Random weights from `seed`; `logit_scale` sharpens or flattens its distributions;
    `shape` gives the widths (the other arguments override it)."""
    torch.manual_seed(seed)
    model = Transformer(replace(shape, max_position_embeddings=max_positions, vocab_size=vocab_size,
                                num_kv_heads=num_kv_heads, num_layers=num_layers))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
        for layer in model.layers:
            layer.attn_norm.weight.fill_(1.0)
            layer.mlp_norm.weight.fill_(1.0)
        model.norm.weight.fill_(logit_scale)
    return model.eval()


class DigitTokenizer:
    """Text of digits, one token each (mod the tiny vocabulary): enough of a tokenizer for a
    router serving a tiny target."""

    def encode(self, text: str) -> list[int]:
        return [int(c) % TINY.vocab_size for c in text if c.isdigit()]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(str, ids))


def tiny_grammars():
    """Grammars for the tiny model: a tokenizer whose tokens 0-6 are the digits "0"-"6" and
    token 7 the end of the sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from speculative.grammar import Grammars

    vocab = {str(i): i for i in range(TINY.vocab_size - 1)} | {"<eos>": TINY.vocab_size - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    return Grammars(tokenizer.to_str(), TINY.vocab_size, [TINY.vocab_size - 1])
