"""Configuration of `specserve serve`, from a TOML file (every key optional).

One tree: the top level names the model and the router's address, and each
part of the deployment has its section, a model handed as it is to what it
configures (`[router]`: router.settings.RouterSettings, `[verifiers]`:
verifier_service.settings.VerifierSettings, `[drafter_pools]`:
drafter_service.settings.DrafterPoolSettings, `[registry]`, ...), so each
default is written once, there; the sections that live with their service
are re-exported here.
Loads no torch: names are checked by speculative.drafter_kinds.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from drafter_service.settings import DrafterPoolSettings
from router.settings import RouterSettings
from verifier_service.settings import VerifierSettings


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in the file is an error, not a silent default


class RouterReplicaSettings(_Section):
    """`[routers]`: the router replicas (speculation settings are `[router]`'s)."""

    count: int = Field(1, ge=1, description="router replicas (the minimum when autoscaling)")
    max_count: int | None = Field(None, ge=1, description="most router replicas the autoscaler starts "
                                                          "(default: count, no autoscaling)")
    target_ongoing: float = Field(16, gt=0, description="autoscaling aims each router at this many requests "
                                                        "in flight (gRPC and HTTP)")


class AutoscalingSettings(_Section):
    """`[autoscaling]`: how fast Serve follows the signals (each service's `max_count` turns it on)."""

    upscale_delay_s: float = Field(10.0, ge=0, description="a need for more replicas must last this long")
    downscale_delay_s: float = Field(60.0, ge=0, description="a need for fewer replicas must last this long")
    metrics_interval_s: float = Field(2.0, gt=0, description="how often replicas report their signal")
    look_back_period_s: float = Field(10.0, gt=0, description="the window the signal is averaged over")
    graceful_shutdown_s: float = Field(60.0, ge=0, description="a replica going away first finishes requests "
                                                               "in flight for up to this long")


class HttpSettings(_Section):
    """`[http]`: the OpenAI-compatible HTTP API (Ray Serve's proxy)."""

    port: int = Field(8000, ge=0, le=65535, description="HTTP port on the router's host")
    served_model_name: str | None = Field(None, description="the model's id in the API (default: the model "
                                                            "file's or directory's name)")
    # 2 MiB: a prompt that fits the default router.max_prompt_tokens with the default model (4096
    # tokens of at most 81 bytes) takes at most 1.99 MB of JSON even with every byte a \u escape
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024, description="larger request bodies get a 413 before "
                                                                      "they are read whole")


class SecuritySettings(_Section):
    """`[security]`: who may call the client-facing APIs and the internal services, and where
    the internal services listen."""

    require_api_keys: bool = Field(False, description="refuse requests without a valid API key "
                                                      "(`specserve keys create`); /health and /metrics stay open")
    allow_open_access: bool = Field(False, description="serve on a non-loopback host without API keys "
                                                       "(a warning is printed)")
    cluster_secret: str | None = Field(None, min_length=16, repr=False,
                                       description="the secret every call to a verifier or drafter pool must "
                                                   "carry (default: SPECSERVE_CLUSTER_SECRET, else one generated "
                                                   "once and kept in the state store)")
    internal_host: str = Field("auto", pattern="^(auto|loopback|node)$",
                               description="where verifiers, drafter pools and their metrics listen: loopback, "
                                           "the node's address as Ray reports it, or auto (loopback while the "
                                           "Ray cluster is one node, else the node's address); never all "
                                           "interfaces")
    tls_cert_file: str | None = Field(None, description="PEM certificate chain: the HTTP and gRPC APIs speak "
                                                        "only TLS (with tls_key_file)")
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file")
    internal_tls_cert_file: str | None = Field(None, description="PEM certificate chain every verifier, drafter "
                                                                 "pool and router presents on internal calls: "
                                                                 "with internal_tls_key_file and "
                                                                 "internal_tls_ca_file, those speak only mutual "
                                                                 "TLS (the cluster secret still checked)")
    internal_tls_key_file: str | None = Field(None, description="PEM private key of internal_tls_cert_file")
    internal_tls_ca_file: str | None = Field(None, description="PEM certificate(s) of the CA that signed every "
                                                               "service's and router's certificate: no other "
                                                               "peer is accepted")
    internal_tls_server_name: str | None = Field(None, description="the name callers check each service's "
                                                                   "certificate for (default: the address it "
                                                                   "registered, its node's IP, which its "
                                                                   "certificate must then name)")

    @model_validator(mode="after")
    def _tls_pair(self) -> "SecuritySettings":
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        for name in ("tls_cert_file", "tls_key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no file at {path}")
        return self

    @model_validator(mode="after")
    def _internal_tls(self) -> "SecuritySettings":
        names = ("internal_tls_cert_file", "internal_tls_key_file", "internal_tls_ca_file")
        given = [name for name in names if getattr(self, name) is not None]
        if given and len(given) < len(names):
            missing = [name for name in names if name not in given]
            raise ValueError(f"internal TLS needs {', '.join(names)} together ({', '.join(missing)} missing)")
        if not given and self.internal_tls_server_name is not None:
            raise ValueError("internal_tls_server_name needs internal_tls_cert_file, _key_file and _ca_file")
        for name in given:
            path = getattr(self, name)
            if not Path(path).is_file():
                raise ValueError(f"{name}: no file at {path}")
        if given:
            self.internal_tls(check=True)
        return self

    def tls(self) -> tuple[bytes, bytes] | None:
        """(certificate chain, key) as PEM bytes, or None without TLS."""
        if self.tls_cert_file is None:
            return None
        return Path(self.tls_cert_file).read_bytes(), Path(self.tls_key_file).read_bytes()

    def internal_tls(self, check: bool = False, address: str | None = None):
        """The internal calls' protos.server.MutualTls (the files read now), or None without.
        `check`: ValueError naming the files unless the pair loads, the CA signed it, it is in
        date, and it names `internal_tls_server_name` or, given, `address` (a service's own:
        callers check it for the address it registers when no server name is set)."""
        if self.internal_tls_cert_file is None:
            return None
        from protos.server import MutualTls, check_mutual_tls

        tls = MutualTls(Path(self.internal_tls_cert_file).read_bytes(), Path(self.internal_tls_key_file).read_bytes(),
                        Path(self.internal_tls_ca_file).read_bytes(), self.internal_tls_server_name)
        if check:
            name = self.internal_tls_server_name or address
            try:
                check_mutual_tls(tls.cert, tls.key, tls.ca, name)
            except ValueError as e:
                files = f"internal_tls_cert_file {self.internal_tls_cert_file}, internal_tls_key_file " \
                        f"{self.internal_tls_key_file}, internal_tls_ca_file {self.internal_tls_ca_file}"
                named = f" for {name}" if name else ""
                raise ValueError(f"internal TLS{named}: {e} ({files})") from None
        return tls


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
    routers: RouterReplicaSettings = Field(default_factory=RouterReplicaSettings)
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    security: SecuritySettings = Field(default_factory=SecuritySettings)

    @model_validator(mode="before")
    @classmethod
    def _sections_named(cls, data: Any) -> Any:
        # a section's key written at the top level: name its section rather than call it unknown
        if isinstance(data, dict):
            for key in data:
                if key in cls.model_fields:
                    continue
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


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def open_access_warning(cfg: ServeConfig) -> str | None:
    """Why serving `cfg` would let anyone on the network in (None: it would not); raises
    ValueError when that was not asked for explicitly."""
    if cfg.host in LOOPBACK_HOSTS:
        return None
    if not cfg.security.require_api_keys:
        if not cfg.security.allow_open_access:
            raise ValueError(f"host {cfg.host} is reachable from the network and API keys are off: set "
                             "[security] require_api_keys = true, or allow_open_access = true "
                             "(--allow-open-access) to serve without keys")
        return f"serving on {cfg.host} without API keys: anyone who reaches it can use it"
    if cfg.security.tls() is None:
        return f"serving on {cfg.host} without TLS: API keys and text cross the network in the clear"
    return None


def load_config(path: str | Path | None) -> ServeConfig:
    if path is None:
        return ServeConfig()
    with open(path, "rb") as f:
        return ServeConfig.model_validate(tomllib.load(f))
