"""Configuration of `specserve serve`, from a TOML file (every key optional).

One tree: the top level names the model and the router's address, and each
part of the deployment has its section, a model handed as it is to what it
configures (`[router]`: router.settings.RouterSettings, `[verifiers]`,
`[drafter_pools]`, `[registry]`), so each default is written once, there.
Loads no torch: names are checked by speculative.drafter_kinds.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from router.settings import RouterSettings
from speculative.drafter_kinds import DRAFTER_NAMES, is_drafter


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in the file is an error, not a silent default


class VerifierSettings(_Section):
    """`[verifiers]`: the verifier actors, each holding the target and its KV cache."""

    count: int = Field(1, ge=1, description="verifier actors")
    max_batch: int = Field(8, ge=1, description="requests one verifier holds and batches")
    max_len: int = Field(4096, ge=16, description="KV slots per request in a verifier")
    max_batch_tokens: int = Field(256, ge=1, description="most tokens in one batched verification")
    threads: int | None = Field(None, ge=1, description="torch threads of a verifier's engine (default: all cores)")
    resources: dict[str, float] = Field({"verifier": 1}, description="Ray resources each verifier needs")


class DrafterPoolSettings(_Section):
    """`[drafter_pools]`: the drafter pool actors and the drafters each hosts."""

    count: int = Field(1, ge=0, description="drafter pool actors")
    kinds: list[str] = Field(
        ["pld", "suffix", "recycle", "small-general", "small-math", "small-extraction", "small-language"],
        description="drafters the pools host; with default_drafter 'auto' the router picks among them")
    threads: int = Field(1, ge=1, description="torch threads of each pool server thread")
    resources: dict[str, float] = Field({"drafter": 1}, description="Ray resources each pool needs")

    @field_validator("kinds")
    @classmethod
    def _known_kinds(cls, kinds: list[str]) -> list[str]:
        unknown = [k for k in kinds if k == "none" or not is_drafter(k)]
        if unknown:
            raise ValueError(f"unknown drafter kinds {unknown}; choose from {list(DRAFTER_NAMES[1:])}")
        return kinds


class RegistrySettings(_Section):
    """`[registry]`: how each service keeps its address in the state store."""

    heartbeat_s: float = Field(1.0, gt=0, description="how often a service renews its registration")
    service_ttl_s: float = Field(5.0, gt=0, description="a registration not renewed for this long lapses")


class ServeConfig(_Section):
    """The whole tree: what every actor loads, the router's address, the sections."""

    model: str | None = Field(None, description="HF directory or .gguf; default SmolLM2-135M-Instruct")
    device: str = "cpu"
    dtype: str = "float32"
    host: str = Field("127.0.0.1", description="address the router listens on")
    port: int = Field(50051, ge=0, le=65535, description="router port (0 = any free port)")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve Prometheus /metrics of the router "
                                                                       "on this port")
    router: RouterSettings = Field(default_factory=RouterSettings)
    verifiers: VerifierSettings = Field(default_factory=VerifierSettings)
    drafter_pools: DrafterPoolSettings = Field(default_factory=DrafterPoolSettings)
    registry: RegistrySettings = Field(default_factory=RegistrySettings)

    @model_validator(mode="before")
    @classmethod
    def _sections_named(cls, data: Any) -> Any:
        # a section's key written at the top level: name its section rather than call it unknown
        if isinstance(data, dict):
            for key in data:
                for name, field in cls.model_fields.items():
                    section = field.annotation
                    if isinstance(section, type) and issubclass(section, BaseModel) and key in section.model_fields:
                        raise ValueError(f"{key!r} belongs in the [{name}] section")
        return data

    @field_validator("verifiers")
    @classmethod
    def _tree_fits_a_batch(cls, verifiers: VerifierSettings, info: ValidationInfo) -> VerifierSettings:
        # a tree and its root go through a verifier in one batch of at most max_batch_tokens
        # (router comes earlier, so it is validated by now; absent if it failed)
        router = info.data.get("router")
        largest = max(router.tree_budget, router.draft_length) if router else 0
        if largest >= verifiers.max_batch_tokens:
            raise ValueError(f"max_batch_tokens must be more than the router's tree_budget and draft_length "
                             f"({largest})")
        return verifiers


def load_config(path: str | Path | None) -> ServeConfig:
    if path is None:
        return ServeConfig()
    with open(path, "rb") as f:
        return ServeConfig.model_validate(tomllib.load(f))
