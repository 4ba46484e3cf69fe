"""Configuration of `specserve serve`, from a TOML file (every key optional)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from drafter_service.registry import DRAFTER_NAMES, is_drafter


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in the file is an error, not a silent default

    model: str | None = Field(None, description="HF directory or .gguf; default SmolLM2-135M-Instruct")
    device: str = "cpu"
    dtype: str = "float32"
    host: str = Field("127.0.0.1", description="address the router listens on")
    port: int = Field(50051, ge=0, le=65535, description="router port (0 = any free port)")
    verifiers: int = Field(1, ge=1)
    drafter_pools: int = Field(1, ge=0)
    drafter_kinds: list[str] = Field(
        ["pld", "suffix", "recycle", "small-general", "small-math", "small-extraction", "small-language"],
        description="drafters the pools host; with default_drafter 'auto' the router picks among them")
    default_drafter: str = Field("auto", description="drafter of requests that name none; 'auto' = expertise routing")
    routing_refresh_s: float = Field(5.0, ge=0, description="how often a router syncs drafter statistics")
    fused_drafters: int = Field(1, ge=1, le=8, description="drafters per routed request, their trees fused into "
                                                           "one (1 = a single drafter, no fusion)")
    draft_length: int = Field(5, ge=0, le=64, description="most tokens each drafter drafts per round")
    tree_budget: int = Field(8, ge=1, le=128, description="most nodes of a round's draft tree, fused or one "
                                                          "drafter's (greedy model drafters branch to fill it)")
    pipelined: bool = Field(False, description="draft each next round while the verifier checks this one "
                                               "(PEARL post-verify); a request may override it")
    adaptive: bool = Field(True, description="draft length per request (its acceptance) and per verifier "
                                             "load (goodput); off: always draft_length")
    stop_confidence: float = Field(0.3, ge=0, le=1, description="a model drafter ends its draft after a token "
                                                                "it drafted with less confidence (SpecDec++)")
    verify_row_cost: float = Field(0.06, gt=0, description="one more request's row (one token) in a verification "
                                                           "pass as a share of a one-row, one-token pass: the "
                                                           "goodput model's cost of batching")
    verify_token_cost: float = Field(0.06, gt=0, description="one more verified token in a row as a share of a "
                                                             "one-token target pass: the goodput model's cost "
                                                             "of a draft")
    verify_pad_cost: float = Field(0.01, ge=0, description="attention over one more padded slot of one row of a "
                                                           "verification pass, as a share of a one-token pass")
    learn_verify_costs: bool = Field(True, description="learn the three verify costs from the verifiers' pass "
                                                      "timings, starting from the settings above; off: the "
                                                      "settings as they are")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve Prometheus /metrics of the router "
                                                                       "on this port")
    max_batch: int = Field(8, ge=1, description="requests one verifier holds and batches")
    max_len: int = Field(4096, ge=16, description="KV slots per request in a verifier")
    max_batch_tokens: int = Field(256, ge=1)
    max_prompt_tokens: int = Field(4096, ge=1)
    heartbeat_s: float = Field(1.0, gt=0)
    service_ttl_s: float = Field(5.0, gt=0)
    verifier_threads: int | None = Field(None, ge=1, description="torch threads per verifier (default: all cores)")
    drafter_threads: int | None = Field(1, ge=1)
    verifier_resources: dict[str, float] = {"verifier": 1}
    drafter_resources: dict[str, float] = {"drafter": 1}

    @field_validator("drafter_kinds")
    @classmethod
    def _known_kinds(cls, kinds: list[str]) -> list[str]:
        unknown = [k for k in kinds if k == "none" or not is_drafter(k)]
        if unknown:
            raise ValueError(f"unknown drafter kinds {unknown}; choose from {list(DRAFTER_NAMES[1:])}")
        return kinds

    @field_validator("default_drafter")
    @classmethod
    def _known_default(cls, name: str) -> str:
        if name != "auto" and not is_drafter(name):
            raise ValueError(f"unknown drafter {name!r}")
        return name

    @field_validator("max_batch_tokens")
    @classmethod
    def _fused_tree_fits(cls, tokens: int, info: ValidationInfo) -> int:
        # a tree and its root go through the verifier in one batch of at most max_batch_tokens
        # (draft_length and tree_budget come earlier, so they are validated by now)
        largest = max(info.data.get("tree_budget", 0), info.data.get("draft_length", 0))
        if largest >= tokens:
            raise ValueError(f"must be more than tree_budget and draft_length ({largest})")
        return tokens


def load_config(path: str | Path | None) -> ServeConfig:
    if path is None:
        return ServeConfig()
    with open(path, "rb") as f:
        return ServeConfig.model_validate(tomllib.load(f))
