"""The cluster's shared state: service registry, drafter acceptance statistics,
routes' goodput statistics, request checkpoints, API keys and rate limits.

Two implementations with the same behaviour: `RedisStateStore` for a cluster
(every node talks to one Redis) and `EmbeddedStateStore` for a single node.
`open_state_store` picks one from `SPECSERVE_REDIS_URL`.

Redis layout (every key starts with the store's prefix, default "specserve:"):
    svc:{kind}:{id}       string, JSON {"address", "meta"}, PX = service TTL
    svcs:{kind}           set of service ids; may hold ids whose key expired
    accept:proposed       hash, field JSON [drafter, domain] (default namespace) or
                          [drafter, domain, namespace] -> count
    accept:accepted       hash, same fields
    goodput:requests      hash, field JSON [route, domain] or [route, domain, namespace] -> count
    goodput:log_sum       hash, same fields -> sum of the requests' log speedups (HINCRBYFLOAT)
    goodput:log_squares   hash, same fields -> sum of their squares
    ckpt:{request_id}     string, JSON checkpoint, PX = checkpoint TTL
    apikeys               hash, SHA-256 hex of key -> JSON record {"id", "name", "rpm", "tpm", ...}
    rate:{sha256 of name} integer, fixed-window counter, PX = window
    slots:{sha256 of name} integer, requests in flight, PX = slot TTL (renewed by each acquire)
    shared:{name}         string, a value set once (`setdefault`), e.g. shared:cluster_secret
    drafter:{kind}        string, JSON {"version", "path", ...}: the online learner's latest
                          published checkpoint of a drafter kind (drafter_service/published.py)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis

DEFAULT_PREFIX = "specserve:"
REDIS_URL_ENV = "SPECSERVE_REDIS_URL"
CLUSTER_SECRET = "cluster_secret"  # the shared value (`setdefault`) that holds a generated cluster secret


@dataclass(frozen=True)
class ServiceRecord:
    service_id: str
    address: str
    meta: dict[str, Any]
    expires_in: float  # seconds until the registration lapses without a heartbeat


class Acceptance(NamedTuple):
    proposed: int
    accepted: int


class Goodput(NamedTuple):
    """A route's requests on a domain: how many, and the sum of their log speedups and of
    those logs' squares (router.goodput)."""
    requests: int
    log_sum: float
    log_squares: float


class StateStore(ABC):
    """Shared state; every method is safe to call from many threads."""

    @abstractmethod
    def register_service(
        self, kind: str, service_id: str, address: str, ttl_s: float, meta: dict[str, Any] | None = None
    ) -> None:
        """Add or replace a service; it lapses after ttl_s without a heartbeat."""

    @abstractmethod
    def heartbeat(self, kind: str, service_id: str, ttl_s: float) -> bool:
        """Extend a live registration to ttl_s from now; False if it had lapsed or never existed."""

    @abstractmethod
    def deregister_service(self, kind: str, service_id: str) -> None: ...

    @abstractmethod
    def list_services(self, kind: str) -> list[ServiceRecord]:
        """Live services of a kind, sorted by service_id."""

    @abstractmethod
    def record_acceptance(self, drafter: str, domain: str, proposed: int, accepted: int,
                          namespace: str = "") -> None:
        """Atomically add to the (drafter, domain) counters of a memory namespace
        (speculative.namespaces; "" is the default)."""

    @abstractmethod
    def acceptance_stats(self, domain: str | None = None, namespace: str = ""
                         ) -> dict[tuple[str, str], Acceptance]:
        """A namespace's totals per (drafter, domain), optionally for one domain only."""

    @abstractmethod
    def record_goodput(self, route: str, domain: str, requests: int, log_sum: float, log_squares: float,
                       namespace: str = "") -> None:
        """Atomically add to the (route, domain) goodput sums of a memory namespace: `requests`
        served, the sum of their log speedups and of those logs' squares."""

    @abstractmethod
    def goodput_stats(self, domain: str | None = None, namespace: str = ""
                      ) -> dict[tuple[str, str], Goodput]:
        """A namespace's goodput sums per (route, domain), optionally for one domain only."""

    @abstractmethod
    def save_checkpoint(self, request_id: str, data: dict[str, Any], ttl_s: float) -> None:
        """Store a JSON-serialisable checkpoint that lapses after ttl_s."""

    @abstractmethod
    def load_checkpoint(self, request_id: str) -> dict[str, Any] | None: ...

    @abstractmethod
    def delete_checkpoint(self, request_id: str) -> None: ...

    @abstractmethod
    def count_checkpoints(self) -> int:
        """Checkpoints stored and not lapsed (soak runs check that released requests leave none)."""

    @abstractmethod
    def add_api_key(self, key: str, record: dict[str, Any]) -> None:
        """Accept `key` from now on, with its `record` (JSON: "id", "name", limits); only the
        key's SHA-256 is kept."""

    @abstractmethod
    def check_api_key(self, key: str) -> dict[str, Any] | None:
        """The record of a valid key, else None."""

    @abstractmethod
    def list_api_keys(self) -> list[dict[str, Any]]:
        """Every key's record, by id."""

    @abstractmethod
    def revoke_api_key(self, key_id: str) -> bool:
        """Refuse the key with this record id from now on; False if there is none."""

    @abstractmethod
    def count(self, counter: str, amount: int, window_s: float) -> tuple[int, float]:
        """Add `amount` to a fixed-window counter; (its total in the window, seconds until the
        window ends). The window starts at the first count and lasts window_s."""

    @abstractmethod
    def acquire_slot(self, counter: str, limit: int, ttl_s: float) -> bool:
        """Take one of `limit` slots (requests in flight); False when all are taken. The slots
        lapse `ttl_s` after the last acquire, so a crashed holder cannot keep them."""

    @abstractmethod
    def release_slot(self, counter: str) -> None:
        """Give back a slot `acquire_slot` took."""

    @abstractmethod
    def setdefault(self, name: str, value: str) -> str:
        """Store `value` under `name` unless a value is there already; return the value stored.
        Atomic: of concurrent callers, one sets its value and all get that one."""

    @abstractmethod
    def publish_drafter(self, kind: str, record: dict[str, Any]) -> None:
        """Record `record` ({"version", "path", ...}) as drafter `kind`'s latest published checkpoint."""

    @abstractmethod
    def published_drafter(self, kind: str) -> dict[str, Any] | None:
        """Drafter `kind`'s latest published checkpoint record, or None if none was published."""

    def get_or_create_cluster_secret(self) -> str:
        """The secret every internal call carries (protos.server.ClusterSecretCheck): generated
        by the first service to ask, the same for all after."""
        return self.setdefault(CLUSTER_SECRET, secrets.token_urlsafe(32))

    @abstractmethod
    def ping(self) -> bool: ...

    @abstractmethod
    def close(self) -> None: ...


def open_state_store(url: str | None = None, prefix: str = DEFAULT_PREFIX) -> StateStore:
    """Redis when a URL is given or SPECSERVE_REDIS_URL is set, else the embedded store."""
    url = url or os.environ.get(REDIS_URL_ENV)
    if url:
        return RedisStateStore(url, prefix)
    return EmbeddedStateStore()


# Validation and encoding shared by both implementations, so they accept and
# refuse exactly the same inputs.


def _ttl_ms(ttl_s: float) -> int:
    if not ttl_s > 0:
        raise ValueError(f"TTL must be positive, got {ttl_s}")
    return max(1, round(ttl_s * 1000))


def _check_kind(kind: str) -> None:
    # ":" would make svc:{kind}:{id} ambiguous (kind "a:b", id "c" vs kind "a", id "b:c").
    if not kind or ":" in kind:
        raise ValueError(f"service kind must be non-empty and free of ':', got {kind!r}")


def _acceptance_field(drafter: str, domain: str, namespace: str) -> list[str]:
    # the default namespace keeps the two-name field that stores written before namespaces hold
    return [drafter, domain, namespace] if namespace else [drafter, domain]


def _check_counts(proposed: int, accepted: int) -> None:
    if not 0 <= accepted <= proposed:
        raise ValueError(f"need 0 <= accepted <= proposed, got {accepted=} {proposed=}")


def _check_goodput(requests: int, log_sum: float, log_squares: float) -> None:
    if not (isinstance(requests, int) and requests >= 0 and math.isfinite(log_sum) and math.isfinite(log_squares)
            and log_squares >= 0):
        raise ValueError(f"need a count >= 0 and finite sums, the squares' >= 0, got {requests=} {log_sum=} "
                         f"{log_squares=}")


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _service_json(address: str, meta: dict[str, Any] | None) -> str:
    return json.dumps({"address": address, "meta": meta or {}})


def _record(service_id: str, stored: str, expires_in: float) -> ServiceRecord:
    d = json.loads(stored)
    return ServiceRecord(service_id, d["address"], d["meta"], expires_in)


# Removes index members whose service key has expired. A script, so that a
# service re-registering between our read and the removal cannot be dropped.
_PRUNE_STALE = """
local removed = 0
for i = 2, #KEYS do
    if redis.call('EXISTS', KEYS[i]) == 0 then
        removed = removed + redis.call('SREM', KEYS[1], ARGV[i - 1])
    end
end
return removed
"""


class RedisStateStore(StateStore):
    """Needs Redis >= 7.0 (PEXPIRE ... NX)."""

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX):
        self.prefix = prefix
        # Timeouts so that ping() and callers fail instead of hanging on a dead
        # server; options in the URL take precedence.
        self._client = redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=5, socket_timeout=10)
        self._prune_stale = self._client.register_script(_PRUNE_STALE)

    def _svc_key(self, kind: str, service_id: str) -> str:
        return f"{self.prefix}svc:{kind}:{service_id}"

    def _index_key(self, kind: str) -> str:
        return f"{self.prefix}svcs:{kind}"

    def register_service(
        self, kind: str, service_id: str, address: str, ttl_s: float, meta: dict[str, Any] | None = None
    ) -> None:
        _check_kind(kind)
        with self._client.pipeline() as pipe:  # MULTI: key and index change together
            pipe.set(self._svc_key(kind, service_id), _service_json(address, meta), px=_ttl_ms(ttl_s))
            pipe.sadd(self._index_key(kind), service_id)
            pipe.execute()

    def heartbeat(self, kind: str, service_id: str, ttl_s: float) -> bool:
        _check_kind(kind)
        # PEXPIRE on a missing key does nothing and returns False: a lapsed
        # service has to register again (with its address and meta).
        return bool(self._client.pexpire(self._svc_key(kind, service_id), _ttl_ms(ttl_s)))

    def deregister_service(self, kind: str, service_id: str) -> None:
        _check_kind(kind)
        with self._client.pipeline() as pipe:
            pipe.delete(self._svc_key(kind, service_id))
            pipe.srem(self._index_key(kind), service_id)
            pipe.execute()

    def list_services(self, kind: str) -> list[ServiceRecord]:
        _check_kind(kind)
        ids = sorted(self._client.smembers(self._index_key(kind)))
        with self._client.pipeline() as pipe:  # MULTI, so GET and PTTL see the same key
            for service_id in ids:
                key = self._svc_key(kind, service_id)
                pipe.get(key)
                pipe.pttl(key)
            replies = pipe.execute()
        live, stale = [], []
        for service_id, stored, pttl in zip(ids, replies[::2], replies[1::2], strict=True):
            if stored is None:
                stale.append(service_id)
            else:
                live.append(_record(service_id, stored, max(pttl, 0) / 1000))
        if stale:
            keys = [self._index_key(kind)] + [self._svc_key(kind, s) for s in stale]
            self._prune_stale(keys=keys, args=stale)
        return live

    def record_acceptance(self, drafter: str, domain: str, proposed: int, accepted: int,
                          namespace: str = "") -> None:
        _check_counts(proposed, accepted)
        # JSON: unambiguous whatever the names contain
        field = json.dumps(_acceptance_field(drafter, domain, namespace))
        with self._client.pipeline() as pipe:  # MULTI: readers never see one counter without the other
            pipe.hincrby(f"{self.prefix}accept:proposed", field, proposed)
            pipe.hincrby(f"{self.prefix}accept:accepted", field, accepted)
            pipe.execute()

    def acceptance_stats(self, domain: str | None = None, namespace: str = ""
                         ) -> dict[tuple[str, str], Acceptance]:
        with self._client.pipeline() as pipe:
            pipe.hgetall(f"{self.prefix}accept:proposed")
            pipe.hgetall(f"{self.prefix}accept:accepted")
            proposed, accepted = pipe.execute()
        stats = {}
        for field, count in proposed.items():
            drafter, dom, *space = json.loads(field)
            if (space[0] if space else "") == namespace and (domain is None or dom == domain):
                stats[(drafter, dom)] = Acceptance(int(count), int(accepted.get(field, 0)))
        return stats

    def record_goodput(self, route: str, domain: str, requests: int, log_sum: float, log_squares: float,
                       namespace: str = "") -> None:
        _check_goodput(requests, log_sum, log_squares)
        field = json.dumps(_acceptance_field(route, domain, namespace))
        with self._client.pipeline() as pipe:  # MULTI: readers see the three sums move together
            pipe.hincrby(f"{self.prefix}goodput:requests", field, requests)
            pipe.hincrbyfloat(f"{self.prefix}goodput:log_sum", field, float(log_sum))
            pipe.hincrbyfloat(f"{self.prefix}goodput:log_squares", field, float(log_squares))
            pipe.execute()

    def goodput_stats(self, domain: str | None = None, namespace: str = ""
                      ) -> dict[tuple[str, str], Goodput]:
        with self._client.pipeline() as pipe:
            for name in ("requests", "log_sum", "log_squares"):
                pipe.hgetall(f"{self.prefix}goodput:{name}")
            requests, sums, squares = pipe.execute()
        stats = {}
        for field, count in requests.items():
            route, dom, *space = json.loads(field)
            if (space[0] if space else "") == namespace and (domain is None or dom == domain):
                stats[(route, dom)] = Goodput(int(count), float(sums.get(field, 0.0)),
                                              float(squares.get(field, 0.0)))
        return stats

    def save_checkpoint(self, request_id: str, data: dict[str, Any], ttl_s: float) -> None:
        self._client.set(f"{self.prefix}ckpt:{request_id}", json.dumps(data), px=_ttl_ms(ttl_s))

    def load_checkpoint(self, request_id: str) -> dict[str, Any] | None:
        stored = self._client.get(f"{self.prefix}ckpt:{request_id}")
        return None if stored is None else json.loads(stored)

    def delete_checkpoint(self, request_id: str) -> None:
        self._client.delete(f"{self.prefix}ckpt:{request_id}")

    def count_checkpoints(self) -> int:
        return sum(1 for _ in self._client.scan_iter(match=f"{self.prefix}ckpt:*", count=1000))

    def add_api_key(self, key: str, record: dict[str, Any]) -> None:
        self._client.hset(f"{self.prefix}apikeys", _digest(key), json.dumps(record))

    def check_api_key(self, key: str) -> dict[str, Any] | None:
        stored = self._client.hget(f"{self.prefix}apikeys", _digest(key))
        return None if stored is None else json.loads(stored)

    def list_api_keys(self) -> list[dict[str, Any]]:
        records = [json.loads(v) for v in self._client.hvals(f"{self.prefix}apikeys")]
        return sorted(records, key=lambda r: r["id"])

    def revoke_api_key(self, key_id: str) -> bool:
        for digest, stored in self._client.hgetall(f"{self.prefix}apikeys").items():
            if json.loads(stored)["id"] == key_id:
                return bool(self._client.hdel(f"{self.prefix}apikeys", digest))
        return False

    def count(self, counter: str, amount: int, window_s: float) -> tuple[int, float]:
        key = f"{self.prefix}rate:{_digest(counter)}"  # hashed: a counter may be named after a key
        with self._client.pipeline() as pipe:
            pipe.incrby(key, amount)
            # NX: only the count that opens the window sets its end; in the same
            # MULTI, so a counter can never be left without an expiry.
            pipe.pexpire(key, _ttl_ms(window_s), nx=True)
            pipe.pttl(key)
            total, _, pttl = pipe.execute()
        return total, max(pttl, 0) / 1000

    def acquire_slot(self, counter: str, limit: int, ttl_s: float) -> bool:
        key = f"{self.prefix}slots:{_digest(counter)}"
        with self._client.pipeline() as pipe:
            pipe.incr(key)
            pipe.pexpire(key, _ttl_ms(ttl_s))
            taken, _ = pipe.execute()
        if taken > limit:
            self._client.decr(key)
            return False
        return True

    def release_slot(self, counter: str) -> None:
        key = f"{self.prefix}slots:{_digest(counter)}"
        if self._client.decr(key) < 0:  # the slots lapsed while the request ran
            self._client.set(key, 0, keepttl=True)

    def setdefault(self, name: str, value: str) -> str:
        # SET NX GET (Redis >= 7.0): the value there before, or None when this one was set
        old = self._client.set(f"{self.prefix}shared:{name}", value, nx=True, get=True)
        return value if old is None else old

    def publish_drafter(self, kind: str, record: dict[str, Any]) -> None:
        self._client.set(f"{self.prefix}drafter:{kind}", json.dumps(record))

    def published_drafter(self, kind: str) -> dict[str, Any] | None:
        stored = self._client.get(f"{self.prefix}drafter:{kind}")
        return None if stored is None else json.loads(stored)

    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except redis.RedisError:
            return False

    def close(self) -> None:
        self._client.close()


class _ExpiringDict:
    """String keys to values with deadlines on the monotonic clock; not thread-safe on its own."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[Any, float]] = {}
        self._sweep_at = 64

    def get(self, key: str, now: float) -> tuple[Any, float] | None:
        """(value, deadline) of a live entry."""
        entry = self._entries.get(key)
        if entry is not None and entry[1] <= now:
            del self._entries[key]
            return None
        return entry

    def put(self, key: str, value: Any, deadline: float, now: float) -> None:
        self._entries[key] = (value, deadline)
        # Entries nobody reads again would otherwise pile up; sweeping whenever
        # the size doubles keeps memory within 2x the live entries, amortised O(1).
        if len(self._entries) >= self._sweep_at:
            self._purge(now)
            self._sweep_at = max(64, 2 * len(self._entries))

    def pop(self, key: str) -> None:
        self._entries.pop(key, None)

    def live(self, now: float) -> list[tuple[str, Any, float]]:
        """(key, value, deadline) of every live entry."""
        self._purge(now)
        return [(k, v, deadline) for k, (v, deadline) in self._entries.items()]

    def _purge(self, now: float) -> None:
        self._entries = {k: e for k, e in self._entries.items() if e[1] > now}


class EmbeddedStateStore(StateStore):
    """In-process store for a single node; one lock guards everything.

    Values go through JSON as in Redis, so callers get copies and the same
    serialisation errors.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._services: defaultdict[str, _ExpiringDict] = defaultdict(_ExpiringDict)
        self._acceptance: dict[tuple[str, str, str], Acceptance] = {}  # (drafter, domain, namespace)
        self._goodput: dict[tuple[str, str, str], Goodput] = {}  # (route, domain, namespace)
        self._checkpoints = _ExpiringDict()
        self._api_keys: dict[str, str] = {}  # SHA-256 hex -> JSON record
        self._rate = _ExpiringDict()  # SHA-256 hex of the counter -> total in the current window
        self._slots = _ExpiringDict()  # SHA-256 hex of the counter -> slots taken
        self._shared: dict[str, str] = {}  # setdefault's values
        self._drafters: dict[str, str] = {}  # drafter kind -> JSON record of its latest published checkpoint

    def register_service(
        self, kind: str, service_id: str, address: str, ttl_s: float, meta: dict[str, Any] | None = None
    ) -> None:
        _check_kind(kind)
        stored, ttl = _service_json(address, meta), _ttl_ms(ttl_s) / 1000
        with self._lock:
            now = time.monotonic()
            self._services[kind].put(service_id, stored, now + ttl, now)

    def heartbeat(self, kind: str, service_id: str, ttl_s: float) -> bool:
        _check_kind(kind)
        ttl = _ttl_ms(ttl_s) / 1000
        with self._lock:
            now = time.monotonic()
            entry = self._services[kind].get(service_id, now)
            if entry is None:
                return False
            self._services[kind].put(service_id, entry[0], now + ttl, now)
            return True

    def deregister_service(self, kind: str, service_id: str) -> None:
        _check_kind(kind)
        with self._lock:
            self._services[kind].pop(service_id)

    def list_services(self, kind: str) -> list[ServiceRecord]:
        _check_kind(kind)
        with self._lock:
            now = time.monotonic()
            entries = self._services[kind].live(now)
        return sorted(
            (_record(service_id, stored, deadline - now) for service_id, stored, deadline in entries),
            key=lambda r: r.service_id,
        )

    def record_acceptance(self, drafter: str, domain: str, proposed: int, accepted: int,
                          namespace: str = "") -> None:
        _check_counts(proposed, accepted)
        key = (drafter, domain, namespace)
        with self._lock:
            old = self._acceptance.get(key, Acceptance(0, 0))
            self._acceptance[key] = Acceptance(old.proposed + proposed, old.accepted + accepted)

    def acceptance_stats(self, domain: str | None = None, namespace: str = ""
                         ) -> dict[tuple[str, str], Acceptance]:
        with self._lock:
            return {(drafter, dom): v for (drafter, dom, space), v in self._acceptance.items()
                    if space == namespace and (domain is None or dom == domain)}

    def record_goodput(self, route: str, domain: str, requests: int, log_sum: float, log_squares: float,
                       namespace: str = "") -> None:
        _check_goodput(requests, log_sum, log_squares)
        key = (route, domain, namespace)
        with self._lock:
            old = self._goodput.get(key, Goodput(0, 0.0, 0.0))
            self._goodput[key] = Goodput(old.requests + requests, old.log_sum + float(log_sum),
                                         old.log_squares + float(log_squares))

    def goodput_stats(self, domain: str | None = None, namespace: str = ""
                      ) -> dict[tuple[str, str], Goodput]:
        with self._lock:
            return {(route, dom): v for (route, dom, space), v in self._goodput.items()
                    if space == namespace and (domain is None or dom == domain)}

    def save_checkpoint(self, request_id: str, data: dict[str, Any], ttl_s: float) -> None:
        stored, ttl = json.dumps(data), _ttl_ms(ttl_s) / 1000
        with self._lock:
            now = time.monotonic()
            self._checkpoints.put(request_id, stored, now + ttl, now)

    def load_checkpoint(self, request_id: str) -> dict[str, Any] | None:
        with self._lock:
            entry = self._checkpoints.get(request_id, time.monotonic())
        return None if entry is None else json.loads(entry[0])

    def delete_checkpoint(self, request_id: str) -> None:
        with self._lock:
            self._checkpoints.pop(request_id)

    def count_checkpoints(self) -> int:
        with self._lock:
            return len(self._checkpoints.live(time.monotonic()))

    def add_api_key(self, key: str, record: dict[str, Any]) -> None:
        with self._lock:
            self._api_keys[_digest(key)] = json.dumps(record)

    def check_api_key(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            stored = self._api_keys.get(_digest(key))
        return None if stored is None else json.loads(stored)

    def list_api_keys(self) -> list[dict[str, Any]]:
        with self._lock:
            records = [json.loads(v) for v in self._api_keys.values()]
        return sorted(records, key=lambda r: r["id"])

    def revoke_api_key(self, key_id: str) -> bool:
        with self._lock:
            for digest, stored in list(self._api_keys.items()):
                if json.loads(stored)["id"] == key_id:
                    del self._api_keys[digest]
                    return True
        return False

    def count(self, counter: str, amount: int, window_s: float) -> tuple[int, float]:
        window, digest = _ttl_ms(window_s) / 1000, _digest(counter)
        with self._lock:
            now = time.monotonic()
            entry = self._rate.get(digest, now)
            total, deadline = (amount, now + window) if entry is None else (entry[0] + amount, entry[1])
            self._rate.put(digest, total, deadline, now)
        return total, max(deadline - now, 0.0)

    def acquire_slot(self, counter: str, limit: int, ttl_s: float) -> bool:
        digest = _digest(counter)
        with self._lock:
            now = time.monotonic()
            entry = self._slots.get(digest, now)
            taken = (entry[0] if entry else 0) + 1
            if taken > limit:
                return False
            self._slots.put(digest, taken, now + ttl_s, now)
        return True

    def release_slot(self, counter: str) -> None:
        digest = _digest(counter)
        with self._lock:
            now = time.monotonic()
            entry = self._slots.get(digest, now)
            if entry is not None and entry[0] > 0:
                self._slots.put(digest, entry[0] - 1, entry[1], now)

    def setdefault(self, name: str, value: str) -> str:
        with self._lock:
            return self._shared.setdefault(name, value)

    def publish_drafter(self, kind: str, record: dict[str, Any]) -> None:
        stored = json.dumps(record)
        with self._lock:
            self._drafters[kind] = stored

    def published_drafter(self, kind: str) -> dict[str, Any] | None:
        with self._lock:
            stored = self._drafters.get(kind)
        return None if stored is None else json.loads(stored)

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        pass
