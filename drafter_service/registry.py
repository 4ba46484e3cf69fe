"""Drafter kinds by name, so the CLI and services build them the same way.

The names and their checks live in `speculative.drafter_kinds`, which loads no
torch (the configuration and the router check names there); they are
re-exported here. This module builds the drafters a name stands for.
"""

from __future__ import annotations

import threading
import weakref

from speculative.calibration import Calibration
from speculative.drafter_kinds import (DRAFTER_NAMES, EAGLE, SELF_INT4, SHIPPED_DIR, SHIPPED_DRAFTERS,  # noqa: F401
                                       check_drafter, drafter_domains, drafter_path, eagle_path, is_drafter)
from runtime.eagle_head import EagleHead, shared_head
from speculative.eagle import EagleDrafter
from runtime.cpu_tuning import apply_cpu_tuning, tuning_of
from runtime.model import Transformer
from speculative.ngram import PLD_MAX_NGRAM, PLD_MIN_NGRAM
from runtime.quantize import quantized_copy
from speculative.sampling import InvalidArgument
from speculative.recycling import RecycledCandidates
from speculative.suffix import SuffixIndex
from speculative.fused_drafter import FusedDrafter
from speculative.namespaces import DEFAULT_NAMESPACE, Namespaces

from .checkpoint import load_drafter
from .drafters import (ModelDrafter, PromptLookupDrafter, RecyclingDrafter, SuffixDrafter,
                       layer_skip_layers)
from .layer_threads import make_runner

# Layer-skip default: the target's first layers and its last, with its head.
# Argmax agreement with the full SmolLM2-135M, teacher-forced on 8 dev prompts:
# first 6 + last 2 layers 0%, first 20 19%, first 10 + last 10 23%.
# Untrained early exit is weak on a model this small.
LAYER_SKIP_FIRST, LAYER_SKIP_LAST = 10, 10


class DrafterMemory:
    """What the drafters of one memory namespace learn across its requests, for one
    target: a suffix index of every output, a Token Recycling table, and each drafter
    kind's confidence calibration in fused trees. Each is made on first use."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._suffix: SuffixIndex | None = None
        self._recycled: RecycledCandidates | None = None
        self.calibrations: dict[str, Calibration] = {}
        self._lock = threading.Lock()

    def suffix_index(self) -> SuffixIndex:
        with self._lock:
            if self._suffix is None:
                self._suffix = SuffixIndex()
            return self._suffix

    def recycled(self) -> RecycledCandidates:
        with self._lock:
            if self._recycled is None:
                self._recycled = RecycledCandidates(self.vocab_size)
            return self._recycled

    def calibration(self, kind: str) -> Calibration:
        with self._lock:
            return self.calibrations.setdefault(kind, Calibration())


# Per target in this process: its namespaces' memories (speculative.namespaces).
_memories: dict[int, Namespaces[DrafterMemory]] = {}
# Small drafter models, loaded once per process and target, shared by requests.
_small_models: dict[tuple[str, int], tuple[Transformer, list[int] | None]] = {}
# Each target's int4 twin (self-int4), made once; it goes with its target.
_int4_twins: "weakref.WeakKeyDictionary[Transformer, Transformer]" = weakref.WeakKeyDictionary()
_load_lock = threading.Lock()


def memory(target: Transformer, namespace: str = DEFAULT_NAMESPACE) -> DrafterMemory:
    """The memory drafters of `target` learn in for requests of `namespace`."""
    with _load_lock:
        spaces = _memories.get(id(target))
        if spaces is None:
            vocab = target.config.vocab_size
            spaces = _memories[id(target)] = Namespaces(lambda _: DrafterMemory(vocab))
    return spaces.get(namespace)


def make_drafter(name: str, target: Transformer, draft_top_k: int | None = None,
                 namespace: str = DEFAULT_NAMESPACE, parallel_layers: int = 1, calibrate: bool = True,
                 cuda_graphs: bool | None = None, shared_passes=None):
    """A fresh per-request drafter of kind `name` for `target`; None for plain decoding.

    `draft_top_k` makes a model drafter sample from its top-k renormalised
    distribution, so its q is exactly sparse (k pairs on the wire). A drafter that
    learns across requests learns and drafts in `namespace`'s memory alone.
    `parallel_layers` > 1 makes model drafters draft EasySpec-style, that many
    layers' attentions at once (speculative.easyspec); other kinds ignore it. `calibrate`:
    greedy, a fused drafter ranks its members' nodes by calibrated confidences. `cuda_graphs`:
    model drafters draft at static shapes from captured CUDA graphs (None: on CUDA), over the
    caches of `shared_passes` (runtime.graphs.SharedPasses) when given: requests one at a time."""
    if parallel_layers < 1:
        raise InvalidArgument("parallel_layers", f"must be >= 1, got {parallel_layers}")
    # 1 keeps the model's own (CPU-tuned) forward: the same drafts, bit for bit
    easyspec = {} if parallel_layers == 1 else dict(parallel_layers=parallel_layers,
                                                    layer_runner=make_runner(parallel_layers))
    easyspec.update(cuda_graphs=cuda_graphs, shared_passes=shared_passes)
    check_drafter(name)
    if "+" in name:  # every member trusted alike; greedy, their confidences are calibrated
        parts = name.split("+")
        return FusedDrafter([(make_drafter(part, target, draft_top_k, namespace, parallel_layers,
                                           cuda_graphs=cuda_graphs, shared_passes=shared_passes), 1.0)
                             for part in parts],
                            calibrations=[calibration(part, target, namespace) if calibrate else None
                                          for part in parts])
    if name == "none":
        return None
    if name == "pld":
        return PromptLookupDrafter(target.config.vocab_size, max_ngram=PLD_MAX_NGRAM, min_ngram=PLD_MIN_NGRAM)
    if name == "layerskip":
        layers = layer_skip_layers(target.config.num_layers, LAYER_SKIP_FIRST, LAYER_SKIP_LAST)
        return ModelDrafter(target, layers, name="layerskip", draft_top_k=draft_top_k, **easyspec)
    if name == SELF_INT4:
        return ModelDrafter(_int4_twin(target), name=SELF_INT4, draft_top_k=draft_top_k, wide_model=target,
                            **easyspec)
    if name == "suffix":
        return SuffixDrafter(memory(target, namespace).suffix_index(), target.config.vocab_size)
    if name == "recycle":
        return RecyclingDrafter(memory(target, namespace).recycled())
    if eagle_path(name) is not None:
        return EagleDrafter(_head(name, target), draft_top_k=draft_top_k,
                            max_len=target.config.max_position_embeddings)
    model, vocab_ids = _small_model(name, target)
    return ModelDrafter(model, name=name, draft_top_k=draft_top_k, vocab_ids=vocab_ids,
                        target_vocab_size=target.config.vocab_size, **easyspec)


def calibration(name: str, target: Transformer, namespace: str = DEFAULT_NAMESPACE) -> Calibration:
    """`namespace`'s calibration of drafter kind `name`'s confidences for `target`."""
    return memory(target, namespace).calibration(name)


def _int4_twin(target: Transformer) -> Transformer:
    """`target` with int4 linear layers (runtime.quantize.quantized_copy), made once."""
    with _load_lock:
        if target not in _int4_twins:
            try:
                twin = quantized_copy(target, "int4")
            except ValueError as exc:  # a target quantised already, or layers too narrow for int4's groups
                raise InvalidArgument("drafter", f"{SELF_INT4!r} cannot quantise this target: {exc}") from exc
            apply_cpu_tuning(twin, tuning_of(target))
            _int4_twins[target] = twin
        return _int4_twins[target]


def _head(name: str, target: Transformer) -> EagleHead:
    """The feature-level head `name` names, attached to `target` (its embedding and LM head rows)."""
    try:
        return shared_head(eagle_path(name), target)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"drafter {name!r}: {exc}") from exc
    except ValueError as exc:
        raise InvalidArgument("drafter", f"drafter {name!r}: {exc}") from exc


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
            # tuned as its target was (a tree level scores several tokens at once)
            apply_cpu_tuning(model, tuning_of(target))
            _small_models[key] = (model, vocab_ids)
        return _small_models[key]
