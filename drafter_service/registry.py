"""Drafter kinds by name, so the CLI and services build them the same way.

Names: the model-free kinds (`pld`, `suffix`, `recycle`), the target's own layers
(`layerskip`), the small drafters shipped for the default target
(`small-*`, docs/DRAFTERS.md), the path of any drafter directory written
by `specserve train-drafter`, or several of these joined by `+`, fused into
one tree per round.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from speculative.calibration import Calibration, enabled as calibration_enabled
from speculative.model import Transformer, pack_for_cpu
from speculative.sampling import InvalidArgument
from speculative.recycling import RecycledCandidates
from speculative.suffix import SuffixIndex

from .checkpoint import is_drafter_dir, load_drafter
from .drafters import (FusedDrafter, ModelDrafter, PromptLookupDrafter, RecyclingDrafter, SuffixDrafter,
                       layer_skip_layers)

# Layer-skip default: the target's first layers and its last, with its head.
# Argmax agreement with the full SmolLM2-135M, teacher-forced on 8 dev prompts:
# first 6 + last 2 layers 0%, first 20 19%, first 10 + last 10 23%.
# Untrained early exit is weak on a model this small.
LAYER_SKIP_FIRST, LAYER_SKIP_LAST = 10, 10

# Prompt lookup matches 2- to 4-grams: single-token matches propose more than
# they win when a 5-token verify costs 1.5x a 1-token step (tuned on 12 dev prompts).
PLD_MAX_NGRAM, PLD_MIN_NGRAM = 4, 2

SHIPPED_DIR = Path(__file__).parent / "checkpoints"
SHIPPED_DRAFTERS = ("small-general", "small-math", "small-extraction", "small-language")
DRAFTER_NAMES = ("none", "pld", "layerskip", "suffix", "recycle") + SHIPPED_DRAFTERS

# One suffix index per target in this process: every request feeds it and drafts from it.
_suffix_indexes: dict[int, SuffixIndex] = {}
# One Token Recycling table per target in this process, likewise shared.
_recycled: dict[int, RecycledCandidates] = {}
# Confidence calibration of each drafter kind in fused trees, per target, likewise shared.
_calibrations: dict[tuple[str, int], Calibration] = {}
# Small drafter models, loaded once per process and target, shared by requests.
_small_models: dict[tuple[str, int], tuple[Transformer, list[int] | None]] = {}
_load_lock = threading.Lock()


def drafter_path(name: str) -> Path | None:
    """The checkpoint directory a small-model drafter name refers to, else None."""
    if name in SHIPPED_DRAFTERS:
        return SHIPPED_DIR / name.removeprefix("small-")
    return Path(name) if is_drafter_dir(name) else None


def drafter_domains(name: str) -> tuple[str, ...]:
    """The domains a trained drafter specialises in (its drafter.json `domains`): none for
    the other kinds, for a general drafter, and for several fused."""
    path = None if "+" in name else drafter_path(name)
    if path is None:
        return ()
    return tuple(json.loads((path / "drafter.json").read_text()).get("domains", ()))


def is_drafter(name: str) -> bool:
    if "+" in name:  # fused: every member a drafter
        return all(part not in ("", "none") and is_drafter(part) for part in name.split("+"))
    return name in DRAFTER_NAMES or drafter_path(name) is not None


def check_drafter(name: str) -> None:
    """Raise InvalidArgument('drafter') unless `name` names a drafter."""
    if not is_drafter(name):
        raise InvalidArgument("drafter", f"unknown drafter {name!r}; choose from {', '.join(DRAFTER_NAMES)} "
                                         "or a directory written by specserve train-drafter, or several joined by '+' (fused)")


def make_drafter(name: str, target: Transformer, draft_top_k: int | None = None):
    """A fresh per-request drafter of kind `name` for `target`; None for plain decoding.

    `draft_top_k` makes a model drafter sample from its top-k renormalised
    distribution, so its q is exactly sparse (k pairs on the wire)."""
    check_drafter(name)
    if "+" in name:  # every member trusted alike; greedy, their confidences are calibrated
        parts = name.split("+")
        return FusedDrafter([(make_drafter(part, target, draft_top_k), 1.0) for part in parts],
                            calibrations=[calibration(part, target) for part in parts])
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
    if name == "recycle":
        return RecyclingDrafter(_recycled.setdefault(id(target), RecycledCandidates(target.config.vocab_size)))
    model, vocab_ids = _small_model(name, target)
    return ModelDrafter(model, name=name, draft_top_k=draft_top_k, vocab_ids=vocab_ids,
                        target_vocab_size=target.config.vocab_size)


def calibration(name: str, target: Transformer) -> Calibration | None:
    """The process's calibration of drafter kind `name`'s confidences for `target`
    (None: SPECSERVE_CALIBRATE=0)."""
    if not calibration_enabled():
        return None
    with _load_lock:
        return _calibrations.setdefault((name, id(target)), Calibration())


def _small_model(name: str, target: Transformer) -> tuple[Transformer, list[int] | None]:
    path = drafter_path(name)
    key = (str(path.resolve()), id(target))
    with _load_lock:
        if key not in _small_models:
            if not (path / "model.safetensors").exists():
                raise FileNotFoundError(f"drafter {name!r}: no checkpoint at {path}")
            model, vocab_ids, info = load_drafter(path, str(target.device), target.dtype)
            trained_for = info.get("target", {}).get("vocab_size")
            if trained_for != target.config.vocab_size:
                raise InvalidArgument("drafter", f"drafter {name!r} was trained for a target with a vocabulary of "
                                                 f"{trained_for} tokens, this target has {target.config.vocab_size}")
            pack_for_cpu(model)  # a tree level scores several tokens at once
            _small_models[key] = (model, vocab_ids)
        return _small_models[key]
