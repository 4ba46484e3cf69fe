"""Drafter kinds by name, so the CLI and services build them the same way."""

from __future__ import annotations

from speculative.model import Transformer
from speculative.sampling import InvalidArgument

from speculative.suffix import SuffixIndex

from .drafters import ModelDrafter, PromptLookupDrafter, SuffixDrafter, layer_skip_layers

# Layer-skip default: the target's first layers and its last, with its head.
# Argmax agreement with the full SmolLM2-135M, teacher-forced on 8 dev prompts:
# first 6 + last 2 layers 0%, first 20 19%, first 10 + last 10 23%.
# Untrained early exit is weak on a model this small.
LAYER_SKIP_FIRST, LAYER_SKIP_LAST = 10, 10

# Prompt lookup matches 2- to 4-grams: single-token matches propose more than
# they win when a 5-token verify costs 1.5x a 1-token step (tuned on 12 dev prompts).
PLD_MAX_NGRAM, PLD_MIN_NGRAM = 4, 2

DRAFTER_NAMES = ("none", "pld", "layerskip", "suffix")

# One suffix index per target in this process: every request feeds it and drafts from it.
_suffix_indexes: dict[int, SuffixIndex] = {}


def make_drafter(name: str, target: Transformer, draft_top_k: int | None = None):
    """A fresh per-request drafter of kind `name` for `target`; None for plain decoding.

    `draft_top_k` makes a model drafter sample from its top-k renormalised
    distribution, so its q is exactly sparse (k pairs on the wire)."""
    if name == "none":
        return None
    if name == "pld":
        return PromptLookupDrafter(target.config.vocab_size, max_ngram=PLD_MAX_NGRAM, min_ngram=PLD_MIN_NGRAM)
    if name == "layerskip":
        layers = layer_skip_layers(target.config.num_layers, LAYER_SKIP_FIRST, LAYER_SKIP_LAST)
        return ModelDrafter(target, layers, name="layerskip", draft_top_k=draft_top_k)
    if name == "suffix":
        index = _suffix_indexes.setdefault(id(target), SuffixIndex())
        return SuffixDrafter(index, target.config.vocab_size)
    raise InvalidArgument("drafter", f"unknown drafter {name!r}; choose from {', '.join(DRAFTER_NAMES)}")
