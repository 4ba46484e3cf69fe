"""Drafter names and their checks, without torch or the model stack.

Names: the model-free kinds (`pld`, `suffix`, `recycle`), the target's own layers
(`layerskip`), the target itself with int4 weights (`self-int4`), the feature-level
head shipped for the default target (`eagle`) or any head directory, the small
drafters shipped for the default target (`small-*`, docs/DRAFTERS.md), the
path of any drafter directory written by `specserve train-drafter`, or several
of these joined by `+`, fused into one tree per round. The configuration and the router validate names here;
`drafter_service.registry` builds the drafters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import InvalidArgument

# the shipped checkpoints are package data of drafter_service; only their path is needed here
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "drafter_service" / "checkpoints"
SHIPPED_DRAFTERS = ("small-general", "small-math", "small-extraction", "small-language")
SELF_INT4 = "self-int4"  # the target itself, its linear layers in int4
EAGLE = "eagle"  # the shipped feature-level head (speculative.eagle), or a directory with an eagle.json
EAGLE_DIR = SHIPPED_DIR / "eagle"
DRAFTER_NAMES = ("none", "pld", "layerskip", SELF_INT4, "suffix", "recycle", EAGLE) + SHIPPED_DRAFTERS
# what a verifier drafts with itself, round after round in a Decode call (verifier_service.drafting);
# an eagle head too, for a request prefilled with it there (`[router] eagle_placement`)
VERIFIER_DRAFTERS = ("pld", "suffix", "none")
# where an eagle drafter runs: beside the target in the verifier (the default), or in a drafter
# pool fed the target's features over the network
EAGLE_PLACEMENTS = ("verifier", "pool")


@dataclass(frozen=True)
class Abilities:
    """What a drafter kind does beyond proposing trees, declared once so that the
    decoding loop, the pool and the router ask instead of naming kinds."""

    # after each verification pass it takes the target's likeliest next tokens at every
    # position the pass scored (`observe`), so the target's verifier must report them
    learns_from_target: bool = False
    # it learns from every verified output, so a request that asked it for little or
    # nothing still gives it the whole output when it ends
    learns_from_outputs: bool = False
    # what it learns is shared by the requests of a memory namespace (speculative.namespaces)
    shares_memory: bool = False
    # it ends a draft after a token drawn with less confidence than it is told (SpecDec++)
    stops_on_confidence: bool = False
    # it drafts from the target's hidden states (EAGLE): the verify pass captures its
    # `feature_layers` and the loop hands it those of each newly verified position
    # (`DraftRequest.features`)
    drafts_from_features: bool = False

    def joined(self, other: "Abilities") -> "Abilities":
        """What a fusion of the two learns from (a fusion forwards no confidence stop)."""
        return Abilities(self.learns_from_target or other.learns_from_target,
                         self.learns_from_outputs or other.learns_from_outputs,
                         self.shares_memory or other.shares_memory,
                         drafts_from_features=self.drafts_from_features or other.drafts_from_features)


_ABILITIES = {
    "suffix": Abilities(learns_from_outputs=True, shares_memory=True),
    "recycle": Abilities(learns_from_target=True, shares_memory=True),
    EAGLE: Abilities(stops_on_confidence=True, drafts_from_features=True),
}
_MODEL = Abilities(stops_on_confidence=True)  # layerskip, self-int4, small drafters, trained directories


def abilities(name: str) -> Abilities:
    """What drafter `name` (a kind, a directory, or several joined by '+') declares."""
    if "+" in name:
        joined = Abilities()
        for part in name.split("+"):
            joined = joined.joined(abilities(part))
        return joined
    if name in ("none", "pld"):
        return Abilities()
    if is_eagle_dir(name):
        return _ABILITIES[EAGLE]
    return _ABILITIES.get(name, _MODEL)


def is_drafter_dir(path: str | Path) -> bool:
    """Whether `path` is a directory written by `specserve train-drafter`."""
    try:
        return (Path(path) / "drafter.json").is_file()
    except OSError:  # not a path this system can look up (e.g. too long for a file name): none
        return False


def is_eagle_dir(path: str | Path) -> bool:
    """Whether `path` is a feature-level head's directory (`specserve train-drafter --kind eagle`)."""
    try:
        return (Path(path) / "eagle.json").is_file()
    except OSError:
        return False


def eagle_path(name: str) -> Path | None:
    """The head directory an eagle drafter name refers to, else None."""
    if name == EAGLE:
        return EAGLE_DIR
    return Path(name) if is_eagle_dir(name) else None


def eagle_feature_layers(name: str) -> tuple[int, ...]:
    """The target layers eagle head `name` drafts from (its eagle.json), read without torch."""
    path = eagle_path(name)
    if path is None:
        raise ValueError(f"{name!r} is no eagle head")
    return tuple(json.loads((path / "eagle.json").read_text())["config"]["layers"])


def check_eagle_placement(placement: str) -> str:
    """`placement` if it is one of EAGLE_PLACEMENTS, else InvalidArgument('eagle_placement')."""
    if placement not in EAGLE_PLACEMENTS:
        raise InvalidArgument("eagle_placement", f"must be {' or '.join(map(repr, EAGLE_PLACEMENTS))}, "
                                                 f"got {placement!r}")
    return placement


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
    return name in DRAFTER_NAMES or drafter_path(name) is not None or is_eagle_dir(name)


def check_drafter(name: str) -> None:
    """Raise InvalidArgument('drafter') unless `name` names a drafter."""
    if not is_drafter(name):
        raise InvalidArgument("drafter", f"unknown drafter {name!r}; choose from {', '.join(DRAFTER_NAMES)} "
                                         "or a directory written by specserve train-drafter, "
                                         "or several joined by '+' (fused)")
