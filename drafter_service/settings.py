"""The drafter pools' settings: the `[drafter_pools]` section of `specserve
serve`'s configuration (cluster/config.py) and the defaults of DrafterPool and
its server, so each is written here once. Loads no torch: names are checked
by speculative.drafter_kinds.
"""

from __future__ import annotations

from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, field_validator

from speculative.drafter_kinds import DRAFTER_NAMES, is_drafter


class LearnerSettings(BaseModel):
    """`[drafter_pools.learner]`: online distillation of the pools' small drafters from the
    target's scores at verified positions (drafter_service/learner.py). Off by default: on a
    small machine its steps take CPU from serving."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="learn from served traffic and publish improved drafters")
    threads: int = Field(1, ge=1, description="torch threads of the learner's thread")
    steps_per_minute: float = Field(6.0, gt=0, description="most distillation steps a minute")
    tokens_per_step: int = Field(1024, ge=16, description="buffered positions one step trains on")
    buffer_tokens: int = Field(65536, ge=256, description="most tokens buffered per domain "
                                                          "(the held-aside slice included)")
    held_aside: float = Field(0.2, gt=0, lt=1, description="share of buffered windows kept aside to judge "
                                                           "a checkpoint before it is published")
    publish_every_steps: int = Field(20, ge=1, description="steps between tries to publish")
    min_improvement: float = Field(0.005, ge=0, description="a checkpoint is published only if its loss on "
                                                            "the held-aside slice is at least this share lower")
    lr: float = Field(1e-4, gt=0, description="the learning rate (AdamW)")
    refresh_s: float = Field(5.0, gt=0, description="how often a pool looks for a newer published drafter")


class DrafterPoolSettings(BaseModel):
    """`[drafter_pools]`: the drafter pool actors and the drafters each hosts."""

    model_config = ConfigDict(extra="forbid")  # a typo in the file is an error, not a silent default

    count: int = Field(1, ge=0, description="drafter pool replicas (the least, when autoscaling)")
    kinds: list[str] = Field(
        ["pld", "suffix", "recycle", "small-general", "small-math", "small-extraction", "small-language"],
        description="drafters the pools host; with default_drafter 'auto' the router picks among them")
    threads: int = Field(1, ge=1, description="torch threads of each pool server thread")
    cores: list[NonNegativeInt] | None = Field(None, min_length=1, description="CPU core ids every pool process runs on "
                                     "(default: all the node's; see verifiers.cores)")
    resources: dict[str, float] = Field({"drafter": 1}, description="Ray resources each pool needs")
    max_count: int | None = Field(None, ge=0, description="most pool replicas the autoscaler starts "
                                                          "(default: count, no autoscaling)")
    target_busy: float = Field(0.5, gt=0, le=1, description="autoscaling aims each pool at this share of its "
                                                            "time spent drafting")
    parallel_layers: int = Field(1, ge=1, description="EasySpec: model drafters run the attentions of this many "
                                                      "consecutive layers at once, on the group's input, and "
                                                      "recompute accepted tokens exactly (1: exact drafting)")
    cuda_graphs: bool | None = Field(None, description="model drafters' draft steps at static shapes, captured "
                                     "as CUDA graphs (runtime/graphs.py); default: on where the models are on "
                                     "CUDA, off on a CPU")
    learner: LearnerSettings = Field(default_factory=LearnerSettings)

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
