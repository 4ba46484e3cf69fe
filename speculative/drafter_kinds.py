"""Drafter names and their checks, without torch or the model stack.

Names: the model-free kinds (`pld`, `suffix`, `recycle`), the target's own layers
(`layerskip`), the small drafters shipped for the default target
(`small-*`, docs/DRAFTERS.md), the path of any drafter directory written
by `specserve train-drafter`, or several of these joined by `+`, fused into
one tree per round. The configuration and the router validate names here;
`drafter_service.registry` builds the drafters.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import InvalidArgument

# the shipped checkpoints are package data of drafter_service; only their path is needed here
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "drafter_service" / "checkpoints"
SHIPPED_DRAFTERS = ("small-general", "small-math", "small-extraction", "small-language")
DRAFTER_NAMES = ("none", "pld", "layerskip", "suffix", "recycle") + SHIPPED_DRAFTERS


def is_drafter_dir(path: str | Path) -> bool:
    """Whether `path` is a directory written by `specserve train-drafter`."""
    return (Path(path) / "drafter.json").is_file()


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
                                         "or a directory written by specserve train-drafter, "
                                         "or several joined by '+' (fused)")
