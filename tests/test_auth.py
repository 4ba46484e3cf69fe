"""API keys and per-key limits (router.auth), on both stores and both APIs.

gRPC: two router replicas (real servers on loopback, a tiny target, no Ray) share
one Redis: a key revoked through the store is refused by both, and a limit spent
on one holds on the other. HTTP: the Serve application with keys required and
two router replicas, keys made and revoked with `specserve keys`, OpenAI's error
shape with 401 and 429 (with Retry-After), both APIs over TLS."""

from __future__ import annotations

import json
import os
import subprocess
import ssl
import sys
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import ray
from ray import serve

from certs import self_signed
from cluster.config import ServeConfig
from cluster.ray_start import start_local_ray
from deploy.app import start_app
from cluster.state import EmbeddedStateStore, RedisStateStore
from drafter_service.pool import DrafterPool
from loopback import loopback
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from redis_server import redis_server_fixture
from router.auth import Denied, Gatekeeper, bearer, create_key
from router.servicer import RouterConfig, RouterServicer
from router.servicer import serve as serve_router
from specserve.client import Client
from fuzzing import CharTokenizer
from serve_process import free_port
from test_http_api import MODEL
from tiny import TINY, tiny_model
from verifier_service.engine import VerifierEngine

redis_url = redis_server_fixture(scope="module")


@pytest.fixture(params=["embedded", "redis"])
def store(request, redis_url):
    if request.param == "embedded":
        yield EmbeddedStateStore()
    else:
        s = RedisStateStore(redis_url, prefix=f"auth-{time.monotonic_ns()}:")
        yield s
        s.close()


def test_keys_are_required_and_checked(store):
    gate = Gatekeeper(store, require_keys=True)
    key, record = create_key(store, "alice")
    assert key.startswith("sk-spec-") and record["name"] == "alice" and gate.admit(key).record == record
    for bad in (None, "", key + "x", "sk-spec-nope"):
        with pytest.raises(Denied) as e:
            gate.admit(bad)
        assert e.value.status == "UNAUTHENTICATED"
    assert store.revoke_api_key(record["id"])
    with pytest.raises(Denied, match="not valid"):
        gate.admit(key)
    assert Gatekeeper(store, require_keys=False).admit(None) is None  # off: no key needed


def test_requests_per_minute(store):
    gate = Gatekeeper(store, require_keys=True)
    key, _ = create_key(store, rpm=2)
    for _ in range(2):
        gate.finish(gate.admit(key), 10)
    with pytest.raises(Denied) as e:
        gate.admit(key)
    assert e.value.status == "RESOURCE_EXHAUSTED" and 0 < e.value.retry_after_s <= 60


def test_tokens_per_minute_count_prompt_and_output(store):
    gate = Gatekeeper(store, require_keys=True)
    key, _ = create_key(store, tpm=100)
    gate.finish(gate.admit(key), 60)
    gate.finish(gate.admit(key), 40)  # 100 used: the budget is spent
    with pytest.raises(Denied, match="tokens per minute"):
        gate.admit(key)


def test_concurrency_slots_are_given_back(store):
    gate = Gatekeeper(store, require_keys=True)
    key, _ = create_key(store, concurrency=1)
    first = gate.admit(key)
    with pytest.raises(Denied, match="in flight"):
        gate.admit(key)
    gate.finish(first, 5)
    gate.finish(gate.admit(key), 5)


def test_bad_limits_and_bearer_values():
    with pytest.raises(ValueError, match="rpm"):
        create_key(EmbeddedStateStore(), rpm=0)
    assert bearer("Bearer abc") == "abc" and bearer("bearer  abc ") == "abc" and bearer("abc") == "abc"
    assert bearer(None) is None and bearer("") is None


# -- gRPC: two router replicas, one Redis -------------------------------------------------
@pytest.fixture(scope="module")
def two_routers(redis_url):
    target = tiny_model(0)
    pool, engine = DrafterPool(target, kinds=["pld"]), VerifierEngine(target, max_batch=4, max_len=64)
    config = RouterConfig(context_length=TINY.max_position_embeddings - 12, eos_token_ids=[],
                          vocab_size=TINY.vocab_size, default_drafter="pld", draft_length=3, adaptive=False)
    store = RedisStateStore(redis_url, prefix="auth-grpc:")
    with loopback(pool, engine) as coordinator:
        servers = [serve_router(RouterServicer(CharTokenizer(TINY.vocab_size), coordinator, config,
                                               gatekeeper=Gatekeeper(RedisStateStore(redis_url, prefix="auth-grpc:"),
                                                                     require_keys=True)), "127.0.0.1", 0)
                   for _ in range(2)]
        channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for _, port in servers]
        yield store, [pb_grpc.SpecserveStub(c) for c in channels]
        for c in channels:
            c.close()
        for server, _ in servers:
            server.stop(None)
    store.close()


def _generate(stub, key: str | None):
    req = pb.GenerateRequest(prompt="hello there", sampling=pb.SamplingParams(max_tokens=4))
    metadata = () if key is None else (("authorization", f"Bearer {key}"),)
    return stub.Generate.with_call(req, metadata=metadata, timeout=60)


def test_grpc_key_revoked_through_the_store_is_refused_by_both_replicas(two_routers):
    store, (a, b) = two_routers
    for stub in (a, b):
        with pytest.raises(grpc.RpcError) as e:
            _generate(stub, None)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    key, record = create_key(store, "bob")
    assert len(_generate(a, key)[0].token_ids) == 4 and len(_generate(b, key)[0].token_ids) == 4
    assert store.revoke_api_key(record["id"])
    for stub in (b, a):
        with pytest.raises(grpc.RpcError) as e:
            _generate(stub, key)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "not valid" in e.value.details()


def test_grpc_limit_spent_on_one_replica_holds_on_the_other(two_routers):
    store, (a, b) = two_routers
    key, _ = create_key(store, rpm=3)
    for stub in (a, b, a):
        _generate(stub, key)
    with pytest.raises(grpc.RpcError) as e:
        _generate(b, key)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry_after = dict(e.value.trailing_metadata())["retry-after"]
    assert 1 <= int(retry_after) <= 60
    # and the servers keep serving other keys
    other, _ = create_key(store)
    assert len(_generate(b, other)[0].token_ids) == 4


# -- HTTP: the Serve application, keys from `specserve keys` ------------------------------
def _keys_cli(redis_url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECSERVE_REDIS_URL": redis_url}
    return subprocess.run([sys.executable, "-m", "commands.cli", "keys", *args], capture_output=True, text=True,
                          env=env, timeout=60)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def http_app(redis_url, tls_files):
    cert, key = tls_files
    cfg = ServeConfig.model_validate({
        "port": 0, "http": {"port": free_port()},
        "security": {"require_api_keys": True, "tls_cert_file": str(cert), "tls_key_file": str(key)},
        "routers": {"count": 2}, "verifiers": {"max_len": 512, "threads": 1},
        "drafter_pools": {"kinds": ["pld"]}, "registry": {"heartbeat_s": 0.5, "service_ttl_s": 3.0}})
    start_local_ray(num_cpus=2, resources={"verifier": 1, "drafter": 1}, include_dashboard=False,
                    log_to_driver=False, namespace="specserve")
    try:
        start_app(cfg, redis_url, progress=lambda _: None)
        yield f"https://127.0.0.1:{cfg.http.port}"
    finally:
        serve.shutdown()
        ray.shutdown()


CA: dict[str, str] = {}  # the test certificate, which the clients trust (set by the HTTP test)


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120,
                         http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=CA["file"])))


def _urlopen(request, timeout: float = 30):
    return urllib.request.urlopen(request, timeout=timeout, context=ssl.create_default_context(cafile=CA["file"]))


def _chat(client: openai.OpenAI):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=4, temperature=0)


def test_http_keys_from_the_cli_limits_and_revocation(http_app, redis_url, tls_files):
    CA["file"] = str(tls_files[0])
    made = _keys_cli(redis_url, "create", "--name", "carol", "--rpm", "3")
    assert made.returncode == 0, made.stderr
    created = json.loads(made.stdout)
    key = created["key"]
    listed = [json.loads(line) for line in _keys_cli(redis_url, "list").stdout.splitlines()]
    assert {"id": created["id"], "name": "carol", "rpm": 3} .items() <= next(
        r for r in listed if r["id"] == created["id"]).items()
    assert all(key not in json.dumps(r) for r in listed)  # the key itself is never shown again

    with pytest.raises(openai.AuthenticationError) as e:
        _chat(_client(http_app, "sk-spec-00000000-wrong"))
    assert e.value.status_code == 401 and e.value.body["code"] == "unauthenticated"
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    no_key = urllib.request.Request(f"{http_app}/v1/chat/completions", data=body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        _urlopen(no_key)
    assert e.value.code == 401 and "API key is required" in json.loads(e.value.read())["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        _client(http_app, "wrong").models.list()

    good = _client(http_app, key)
    assert [m.id for m in good.models.list().data] == [MODEL]
    for _ in range(3):  # spread over both router replicas by Serve; the budget is one
        assert _chat(good).usage.completion_tokens == 4
    with pytest.raises(openai.RateLimitError) as e:
        _chat(good)
    assert e.value.status_code == 429 and 1 <= int(e.value.response.headers["retry-after"]) <= 60

    assert _keys_cli(redis_url, "revoke", created["id"]).returncode == 0
    with pytest.raises(openai.AuthenticationError):
        _chat(good)
    gone = _keys_cli(redis_url, "revoke", created["id"])
    assert gone.returncode == 2 and "no key has the id" in gone.stderr
    bad_limit = _keys_cli(redis_url, "create", "--rpm", "0")
    assert bad_limit.returncode == 2 and "--rpm" in bad_limit.stderr

    # /health and /metrics stay open
    for path in ("/health", "/metrics"):
        with _urlopen(f"{http_app}{path}") as r:
            assert r.status == 200


def test_tls_on_both_apis(http_app, redis_url, tls_files):
    cert = tls_files[0]
    key, _ = create_key(RedisStateStore(redis_url))
    # HTTPS only: plain HTTP on the port gets no answer
    with pytest.raises(Exception):
        urllib.request.urlopen(http_app.replace("https://", "http://") + "/health", timeout=10)
    # the routers' gRPC ports speak TLS: a client that trusts the certificate is answered
    routers = [s.address for s in RedisStateStore(redis_url).list_services("router")]
    assert len(routers) == 2
    for address in routers:
        with Client(address, tls=True, root_certificates=cert.read_bytes(), timeout=120,
                    metadata=[("authorization", f"Bearer {key}")]) as client:
            out = client.generate(messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
        assert len(out.token_ids) == 4
        with grpc.insecure_channel(address) as plain:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.SpecserveStub(plain).Generate(pb.GenerateRequest(prompt="hi"), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
