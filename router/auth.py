"""API keys and per-key limits, checked once for both APIs (the router's shared path).

A key is shown once, when it is made; the state store keeps only its SHA-256 and
its record (id, name, limits). Limits are counted in the state store, so every
router replica enforces the same budget: requests and tokens per fixed
one-minute window, and requests in flight (so one key cannot take every
verifier row).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

KEY_PREFIX = "sk-spec-"
WINDOW_S = 60.0  # requests and tokens are limited per minute
# a request's in-flight slot lapses this long after the key's last admission, should the router
# holding it die without giving it back: longer than any request runs
SLOT_TTL_S = 900.0
BUSY_RETRY_S = 1.0  # what a request refused for the key's concurrency is told to wait


class Denied(Exception):
    """A request the key's owner may not make now: `status` is the gRPC status name
    (UNAUTHENTICATED or RESOURCE_EXHAUSTED); `retry_after_s` says when to try again."""

    def __init__(self, status: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s


def create_key(store, name: str = "", rpm: int | None = None, tpm: int | None = None,
               concurrency: int | None = None) -> tuple[str, dict[str, Any]]:
    """Make a key and store its hash; (the key, its record). The key is not kept anywhere."""
    for limit, value in (("rpm", rpm), ("tpm", tpm), ("concurrency", concurrency)):
        if value is not None and value < 1:
            raise ValueError(f"{limit} must be at least 1, got {value}")
    key_id = secrets.token_hex(4)
    key = f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(24)}"
    record = {"id": key_id, "name": name, "rpm": rpm, "tpm": tpm, "concurrency": concurrency,
              "created": int(time.time())}
    store.add_api_key(key, record)
    return key, record


def bearer(value: str | None) -> str | None:
    """The key in an `authorization` value ("Bearer KEY", or the bare key)."""
    if not value:
        return None
    scheme, _, rest = value.strip().partition(" ")
    return rest.strip() if scheme.lower() == "bearer" and rest.strip() else value.strip()


@dataclass
class Admission:
    """An admitted request: what to count when it ends."""

    record: dict[str, Any]
    slot: str | None  # the in-flight counter holding one of its slots


class Gatekeeper:
    """Admits requests by key (when keys are required) and counts what they use."""

    def __init__(self, store, require_keys: bool):
        self.store, self.require_keys = store, require_keys

    def authenticate(self, key: str | None) -> dict[str, Any] | None:
        """The key's record (None: keys are not required); raises Denied for a missing or bad key."""
        if not self.require_keys:
            return None
        if not key:
            raise Denied("UNAUTHENTICATED", "an API key is required (HTTP: Authorization: Bearer KEY; "
                                            "gRPC: authorization metadata)")
        record = self.store.check_api_key(key)
        if record is None:
            raise Denied("UNAUTHENTICATED", "the API key is not valid (unknown or revoked)")
        return record

    def admit(self, key: str | None) -> Admission | None:
        """The request's admission (None: keys are not required); raises Denied."""
        record = self.authenticate(key)
        if record is None:
            return None
        key_id = record["id"]
        if record.get("rpm"):
            made, left = self.store.count(f"rpm:{key_id}", 1, WINDOW_S)
            if made > record["rpm"]:
                raise Denied("RESOURCE_EXHAUSTED", f"the key's limit of {record['rpm']} requests per minute "
                                                   "is spent", left)
        if record.get("tpm"):
            used, left = self.store.count(f"tpm:{key_id}", 0, WINDOW_S)
            if used >= record["tpm"]:
                raise Denied("RESOURCE_EXHAUSTED", f"the key's limit of {record['tpm']} tokens per minute "
                                                   "is spent", left)
        slot = None
        if record.get("concurrency"):
            slot = f"inflight:{key_id}"
            if not self.store.acquire_slot(slot, record["concurrency"], SLOT_TTL_S):
                raise Denied("RESOURCE_EXHAUSTED", f"the key already has {record['concurrency']} requests "
                                                   "in flight", BUSY_RETRY_S)
        return Admission(record, slot)

    def finish(self, admission: Admission | None, tokens: int) -> None:
        """Count the request's tokens (prompt and output) and give back its slot."""
        if admission is None:
            return
        if admission.record.get("tpm") and tokens:
            self.store.count(f"tpm:{admission.record['id']}", tokens, WINDOW_S)
        if admission.slot is not None:
            self.store.release_slot(admission.slot)
