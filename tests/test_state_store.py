"""The state store: the embedded and the Redis implementation behave the same.

Every behavioural test runs against both, the Redis one on a real
redis-server (tests/redis_server.py); a few more look inside Redis.
"""

from __future__ import annotations

import copy
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis_server import redis_server_fixture

from cluster.state import (
    REDIS_URL_ENV,
    Acceptance,
    EmbeddedStateStore,
    Goodput,
    RedisStateStore,
    StateStore,
    open_state_store,
)

redis_url = redis_server_fixture()

TTL = 0.3  # short lifetimes keep the file fast; waits add a margin for a busy machine
PAST_TTL = 0.45


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def _prefix() -> str:
    # A fresh prefix per store: tests share one redis-server but not data.
    return f"test-{secrets.token_hex(4)}:"


@pytest.fixture(params=["embedded", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[StateStore]:
    if request.param == "embedded":
        s: StateStore = EmbeddedStateStore()
    else:
        s = RedisStateStore(request.getfixturevalue("redis_url"), prefix=_prefix())
    yield s
    s.close()


# --- service registry


def test_register_and_list(store: StateStore) -> None:
    store.register_service("verifier", "v2", "10.0.0.2:50051", ttl_s=30)
    store.register_service("verifier", "v1", "10.0.0.1:50051", ttl_s=30, meta={"gpu": "h100", "tp": 2})
    store.register_service("drafter", "d1", "10.0.0.3:50052", ttl_s=30)

    verifiers = store.list_services("verifier")
    assert [(r.service_id, r.address, r.meta) for r in verifiers] == [
        ("v1", "10.0.0.1:50051", {"gpu": "h100", "tp": 2}),
        ("v2", "10.0.0.2:50051", {}),
    ]
    assert all(29 < r.expires_in <= 30 for r in verifiers)
    assert [r.service_id for r in store.list_services("drafter")] == ["d1"]
    assert store.list_services("router") == []


def test_register_again_replaces(store: StateStore) -> None:
    store.register_service("drafter", "d1", "old:1", ttl_s=30, meta={"v": 1})
    store.register_service("drafter", "d1", "new:2", ttl_s=30)
    [record] = store.list_services("drafter")
    assert (record.address, record.meta) == ("new:2", {})


def test_service_expires_without_heartbeat(store: StateStore) -> None:
    store.register_service("drafter", "short", "a:1", ttl_s=TTL)
    store.register_service("drafter", "long", "b:1", ttl_s=30)
    assert [r.service_id for r in store.list_services("drafter")] == ["long", "short"]
    time.sleep(PAST_TTL)
    assert [r.service_id for r in store.list_services("drafter")] == ["long"]
    assert store.heartbeat("drafter", "short", ttl_s=30) is False
    assert [r.service_id for r in store.list_services("drafter")] == ["long"]


def test_heartbeat_extends(store: StateStore) -> None:
    store.register_service("verifier", "v1", "a:1", ttl_s=TTL)
    time.sleep(TTL / 2)
    assert store.heartbeat("verifier", "v1", ttl_s=5) is True
    time.sleep(PAST_TTL - TTL / 2)  # past the first TTL, well inside the new one
    [record] = store.list_services("verifier")
    assert record.service_id == "v1" and record.address == "a:1"
    assert 4 < record.expires_in <= 5


def test_heartbeat_unknown_service(store: StateStore) -> None:
    assert store.heartbeat("verifier", "ghost", ttl_s=5) is False
    assert store.list_services("verifier") == []


def test_deregister(store: StateStore) -> None:
    store.register_service("drafter", "d1", "a:1", ttl_s=30)
    store.register_service("drafter", "d2", "b:1", ttl_s=30)
    store.deregister_service("drafter", "d1")
    store.deregister_service("drafter", "never-registered")  # a no-op
    assert [r.service_id for r in store.list_services("drafter")] == ["d2"]
    assert store.heartbeat("drafter", "d1", ttl_s=30) is False


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_nonpositive_ttl_refused(store: StateStore, bad: float) -> None:
    with pytest.raises(ValueError):
        store.register_service("drafter", "d1", "a:1", ttl_s=bad)
    with pytest.raises(ValueError):
        store.save_checkpoint("r1", {}, ttl_s=bad)
    assert store.list_services("drafter") == []


def test_kind_with_colon_refused(store: StateStore) -> None:
    with pytest.raises(ValueError):
        store.register_service("a:b", "c", "x:1", ttl_s=30)


def test_stale_index_members_pruned(redis_url: str, redis_client: redis.Redis) -> None:
    prefix = _prefix()
    store = RedisStateStore(redis_url, prefix=prefix)
    index = f"{prefix}svcs:drafter"
    store.register_service("drafter", "short", "a:1", ttl_s=TTL)
    store.register_service("drafter", "long", "b:1", ttl_s=30)
    redis_client.sadd(index, "ghost")  # as if its key expired long ago
    assert redis_client.smembers(index) == {"short", "long", "ghost"}
    time.sleep(PAST_TTL)

    assert [r.service_id for r in store.list_services("drafter")] == ["long"]
    assert redis_client.smembers(index) == {"long"}
    store.close()


def test_prune_keeps_a_service_that_came_back(redis_url: str, redis_client: redis.Redis) -> None:
    # The prune script re-checks each key, so an id that registered again after
    # list_services saw it missing stays in the index.
    prefix = _prefix()
    store = RedisStateStore(redis_url, prefix=prefix)
    index = f"{prefix}svcs:drafter"
    redis_client.sadd(index, "back", "gone")
    redis_client.set(f"{prefix}svc:drafter:back", '{"address": "a:1", "meta": {}}', px=30_000)
    keys = [index, f"{prefix}svc:drafter:back", f"{prefix}svc:drafter:gone"]
    assert store._prune_stale(keys=keys, args=["back", "gone"]) == 1
    assert redis_client.smembers(index) == {"back"}
    store.close()


# --- acceptance statistics


def test_acceptance_stats(store: StateStore) -> None:
    store.record_acceptance("pld", "code", proposed=10, accepted=7)
    store.record_acceptance("pld", "code", proposed=5, accepted=1)
    store.record_acceptance("pld", "chat", proposed=4, accepted=4)
    store.record_acceptance("layerskip", "code", proposed=3, accepted=0)
    store.record_acceptance("odd:name", "dom\x00ain", proposed=2, accepted=1)

    assert store.acceptance_stats() == {
        ("pld", "code"): (15, 8),
        ("pld", "chat"): (4, 4),
        ("layerskip", "code"): (3, 0),
        ("odd:name", "dom\x00ain"): (2, 1),
    }
    code = store.acceptance_stats("code")
    assert code == {("pld", "code"): (15, 8), ("layerskip", "code"): (3, 0)}
    assert code[("pld", "code")] == Acceptance(proposed=15, accepted=8)
    assert store.acceptance_stats("nothing") == {}


def test_acceptance_is_kept_per_namespace(store: StateStore) -> None:
    store.record_acceptance("suffix", "code", proposed=10, accepted=9)
    store.record_acceptance("suffix", "code", proposed=4, accepted=1, namespace="tenant-a")
    store.record_acceptance("suffix", "code", proposed=2, accepted=2, namespace="tenant-b")
    assert store.acceptance_stats() == {("suffix", "code"): (10, 9)}
    assert store.acceptance_stats(namespace="tenant-a") == {("suffix", "code"): (4, 1)}
    assert store.acceptance_stats("code", "tenant-b") == {("suffix", "code"): (2, 2)}
    assert store.acceptance_stats(namespace="nobody") == {}


@pytest.mark.parametrize("proposed, accepted", [(3, 4), (3, -1), (-1, -1)])
def test_acceptance_bad_counts_refused(store: StateStore, proposed: int, accepted: int) -> None:
    with pytest.raises(ValueError):
        store.record_acceptance("pld", "code", proposed, accepted)
    assert store.acceptance_stats() == {}


def test_goodput_stats(store: StateStore) -> None:
    """A route's goodput sums: requests, and the sums of their log speedups and squares, added
    atomically per (route, domain) and namespace."""
    store.record_goodput("pld", "code", 2, 0.5, 0.25)
    store.record_goodput("pld", "code", 1, -0.25, 0.0625)
    store.record_goodput("pld+recycle", "code", 1, 0.1, 0.01)
    store.record_goodput("none", "chat", 3, -0.3, 0.03, namespace="tenant-a")
    stats = store.goodput_stats()
    assert set(stats) == {("pld", "code"), ("pld+recycle", "code")}
    assert stats[("pld", "code")].requests == 3
    assert stats[("pld", "code")].log_sum == pytest.approx(0.25)
    assert stats[("pld", "code")].log_squares == pytest.approx(0.3125)
    assert store.goodput_stats("chat") == {}
    assert store.goodput_stats("chat", "tenant-a") == {("none", "chat"): Goodput(3, pytest.approx(-0.3),
                                                                                 pytest.approx(0.03))}
    assert store.goodput_stats(namespace="nobody") == {}


@pytest.mark.parametrize("requests, log_sum, log_squares", [(-1, 0.0, 0.0), (1, float("nan"), 0.0),
                                                             (1, 0.0, -1.0), (1, float("inf"), 1.0),
                                                             (1.5, 0.0, 0.0)])
def test_goodput_bad_sums_refused(store: StateStore, requests, log_sum, log_squares) -> None:
    with pytest.raises(ValueError):
        store.record_goodput("pld", "code", requests, log_sum, log_squares)
    assert store.goodput_stats() == {}


def test_acceptance_concurrent(store: StateStore) -> None:
    threads, rounds = 8, 50
    start = threading.Barrier(threads)

    def work(i: int) -> None:
        start.wait()  # all threads increment at once
        for _ in range(rounds):
            store.record_acceptance("pld", "code", proposed=3, accepted=2)
            store.record_acceptance(f"d{i % 2}", "chat", proposed=1, accepted=i % 2)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()

    n = threads * rounds
    assert store.acceptance_stats() == {
        ("pld", "code"): (3 * n, 2 * n),
        ("d0", "chat"): (n // 2, 0),
        ("d1", "chat"): (n // 2, n // 2),
    }


# --- checkpoints


def test_checkpoint_round_trip(store: StateStore) -> None:
    data: dict[str, Any] = {"tokens": [1, 2, 3, 50256], "params": {"temperature": 0.7, "seed": None}, "text": "héllo ✓"}
    expected = copy.deepcopy(data)
    store.save_checkpoint("req-1", data, ttl_s=30)
    data["tokens"].append(99)  # the stored copy is not the caller's object
    assert store.load_checkpoint("req-1") == expected
    store.save_checkpoint("req-1", {"tokens": [1]}, ttl_s=30)
    assert store.load_checkpoint("req-1") == {"tokens": [1]}
    assert store.load_checkpoint("req-2") is None

    store.delete_checkpoint("req-1")
    store.delete_checkpoint("req-1")  # deleting twice is fine
    assert store.load_checkpoint("req-1") is None


def test_checkpoint_not_json_refused(store: StateStore) -> None:
    with pytest.raises(TypeError):
        store.save_checkpoint("req-1", {"x": object()}, ttl_s=30)
    assert store.load_checkpoint("req-1") is None


def test_checkpoint_expires(store: StateStore) -> None:
    store.save_checkpoint("req-1", {"tokens": [1]}, ttl_s=TTL)
    store.save_checkpoint("req-2", {"tokens": [2]}, ttl_s=30)
    assert store.load_checkpoint("req-1") == {"tokens": [1]}
    time.sleep(PAST_TTL)
    assert store.load_checkpoint("req-1") is None
    assert store.load_checkpoint("req-2") == {"tokens": [2]}


# --- API keys and rate limits


def test_api_keys(store: StateStore) -> None:
    key = secrets.token_urlsafe(32)
    assert store.check_api_key(key) is None
    store.add_api_key(key, {"id": "k1", "name": "alice", "rpm": 10})
    assert store.check_api_key(key) == {"id": "k1", "name": "alice", "rpm": 10}
    assert store.check_api_key(key + "x") is None
    assert store.check_api_key("") is None
    other = secrets.token_urlsafe(32)
    store.add_api_key(other, {"id": "k0", "name": "bob"})
    assert [r["id"] for r in store.list_api_keys()] == ["k0", "k1"]
    assert store.revoke_api_key("k1") is True
    assert store.check_api_key(key) is None and store.revoke_api_key("k1") is False
    assert store.check_api_key(other) == {"id": "k0", "name": "bob"}


def _everything_in(client: redis.Redis) -> list[str]:
    """Every key and every stored string, whatever the value's type."""
    out = []
    for key in client.scan_iter(count=1000):
        out.append(key)
        kind = client.type(key)
        if kind == "string":
            out.append(client.get(key))
        elif kind == "hash":
            for field, value in client.hgetall(key).items():
                out += [field, value]
        elif kind == "set":
            out += client.smembers(key)
        else:
            pytest.fail(f"no reader for Redis type {kind} (key {key})")
    return out


def test_raw_api_key_never_stored(redis_url: str, redis_client: redis.Redis) -> None:
    store = RedisStateStore(redis_url, prefix=_prefix())
    key = secrets.token_urlsafe(32)
    store.add_api_key(key, {"id": "k1", "name": "alice"})
    assert store.check_api_key(key)["name"] == "alice"
    store.count(key, 1, window_s=30)  # counters named after keys are hashed too
    assert store.acquire_slot(key, 1, ttl_s=30)

    stored = _everything_in(redis_client)
    assert store.prefix + "apikeys" in stored  # the scan does see our data
    assert not [s for s in stored if key in s]
    store.close()


def test_count_window(store: StateStore) -> None:
    window = 0.4
    key, other = secrets.token_hex(8), secrets.token_hex(8)
    assert [store.count(key, 1, window)[0] for _ in range(4)] == [1, 2, 3, 4]
    total, left = store.count(key, 10, window)
    assert total == 14 and 0 < left <= window  # the seconds until the window ends
    assert store.count(other, 0, window)[0] == 0  # counted per counter; 0 reads without adding
    time.sleep(window + 0.15)
    assert store.count(key, 2, window)[0] == 2


def test_count_window_is_fixed(store: StateStore) -> None:
    # Counts inside a window do not push its end back (a sliding or resetting
    # window would still hold the first count after the sleep).
    window = 0.4
    store.count("k", 1, window)
    time.sleep(window / 2)
    assert store.count("k", 1, window)[0] == 2
    time.sleep(window / 2 + 0.15)
    assert store.count("k", 1, window)[0] == 1


def test_slots(store: StateStore) -> None:
    assert [store.acquire_slot("c", 2, ttl_s=30) for _ in range(3)] == [True, True, False]
    store.release_slot("c")
    assert store.acquire_slot("c", 2, ttl_s=30) and not store.acquire_slot("c", 2, ttl_s=30)
    assert store.acquire_slot("other", 1, ttl_s=30)  # per counter
    assert not store.acquire_slot("z", 0, ttl_s=30)


def test_slots_lapse_after_their_ttl(store: StateStore) -> None:
    # a holder that crashed without releasing cannot keep its slots
    assert store.acquire_slot("c", 1, ttl_s=0.3)
    assert not store.acquire_slot("c", 1, ttl_s=0.3)
    time.sleep(0.45)
    assert store.acquire_slot("c", 1, ttl_s=0.3)
    store.release_slot("c")
    store.release_slot("c")  # more releases than acquires never go below zero
    assert store.acquire_slot("c", 1, ttl_s=30) and not store.acquire_slot("c", 1, ttl_s=30)


# --- values set once (the cluster secret)


def test_setdefault_keeps_the_first_value(store: StateStore) -> None:
    assert store.setdefault("a", "first") == "first"
    assert store.setdefault("a", "second") == "first"
    assert store.setdefault("b", "other") == "other"  # per name


def test_setdefault_concurrent_callers_agree(store: StateStore) -> None:
    threads = 8
    start, got = threading.Barrier(threads), [None] * threads

    def work(i: int) -> None:
        start.wait()  # all threads try at once
        got[i] = store.setdefault("race", f"value-{i}")

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(set(got)) == 1 and got[0].startswith("value-")


def test_cluster_secret_generated_once(store: StateStore) -> None:
    secret = store.get_or_create_cluster_secret()
    assert len(secret) >= 32
    assert store.get_or_create_cluster_secret() == secret


def test_cluster_secret_shared_through_redis(redis_url: str) -> None:
    # two processes' stores on one Redis (a verifier and a router, say) get the same secret;
    # another prefix (another deployment) its own
    prefix = _prefix()
    a, b, c = (RedisStateStore(redis_url, prefix=p) for p in (prefix, prefix, _prefix()))
    assert a.get_or_create_cluster_secret() == b.get_or_create_cluster_secret()
    assert c.get_or_create_cluster_secret() != a.get_or_create_cluster_secret()
    for s in (a, b, c):
        s.close()


# --- store as a whole


def test_ping(store: StateStore) -> None:
    assert store.ping() is True


def test_ping_false_when_redis_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        store = RedisStateStore(f"redis://127.0.0.1:{s.getsockname()[1]}/0")
        assert store.ping() is False
        store.close()


def test_prefix_isolation(redis_url: str) -> None:
    a = RedisStateStore(redis_url, prefix=_prefix())
    b = RedisStateStore(redis_url, prefix=_prefix())
    a.register_service("drafter", "d1", "a:1", ttl_s=30)
    a.record_acceptance("pld", "code", 2, 1)
    a.save_checkpoint("req-1", {"t": 1}, ttl_s=30)
    a.add_api_key("secret-key", {"id": "k1", "name": "alice"})
    a.count("k", 1, window_s=30)

    assert b.list_services("drafter") == []
    assert b.acceptance_stats() == {}
    assert b.load_checkpoint("req-1") is None
    assert b.check_api_key("secret-key") is None
    assert b.count("k", 1, window_s=30)[0] == 1  # a's count does not count for b

    assert [r.service_id for r in a.list_services("drafter")] == ["d1"]  # a still sees its own
    a.close()
    b.close()


def test_open_state_store(monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    assert isinstance(open_state_store(), EmbeddedStateStore)

    explicit = open_state_store(redis_url, prefix="explicit:")
    assert isinstance(explicit, RedisStateStore) and explicit.prefix == "explicit:" and explicit.ping()
    explicit.close()

    monkeypatch.setenv(REDIS_URL_ENV, redis_url)
    from_env = open_state_store()
    assert isinstance(from_env, RedisStateStore) and from_env.ping()
    from_env.close()
