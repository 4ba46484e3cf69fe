"""The drafter pools' settings: the `[drafter_pools]` section of `specserve
serve`'s configuration (cluster/config.py) and the defaults of DrafterPool and
its server, so each is written here once. Loads no torch: names are checked
by speculative.drafter_kinds.
"""

from __future__ import annotations

from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from speculative.drafter_kinds import DRAFTER_NAMES, is_drafter


class DrafterPoolSettings(BaseModel):
    """`[drafter_pools]`: the drafter pool actors and the drafters each hosts."""

    model_config = ConfigDict(extra="forbid")  # a typo in the file is an error, not a silent default

    count: int = Field(1, ge=0, description="drafter pool replicas (the least, when autoscaling)")
    kinds: list[str] = Field(
        ["pld", "suffix", "recycle", "small-general", "small-math", "small-extraction", "small-language"],
        description="drafters the pools host; with default_drafter 'auto' the router picks among them")
    threads: int = Field(1, ge=1, description="torch threads of each pool server thread")
    resources: dict[str, float] = Field({"drafter": 1}, description="Ray resources each pool needs")
    max_count: int | None = Field(None, ge=0, description="most pool replicas the autoscaler starts "
                                                          "(default: count, no autoscaling)")
    target_busy: float = Field(0.5, gt=0, le=1, description="autoscaling aims each pool at this share of its "
                                                            "time spent drafting")

    @field_validator("kinds")
    @classmethod
    def _known_kinds(cls, kinds: list[str]) -> list[str]:
        check_kinds(kinds)
        return kinds


def check_kinds(kinds: Sequence[str]) -> None:
    """ValueError unless every one of `kinds` names a drafter a pool can host."""
    unknown = [k for k in kinds if k == "none" or not is_drafter(k)]
    if unknown:
        raise ValueError(f"unknown drafter kinds {unknown}; choose from {list(DRAFTER_NAMES[1:])}")
