"""Internal services are no open doors (issue 21).

A verifier and a drafter pool served with the cluster secret refuse
(UNAUTHENTICATED) every call that does not carry it, and serve those that do;
health checks and reflection stay open for readiness probes. A coordinator
holding the secret drives a request end to end. And `specserve serve`'s
services, started as it starts them with default settings on this one-node
Ray cluster, listen on loopback only and share the secret generated in the
state store.
"""

from __future__ import annotations

import ipaddress

import grpc
import psutil
import pytest
import ray
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from cluster.ray_start import start_local_ray
from drafter_service.pool import DrafterPool
from drafter_service.servicer import SERVICE_NAME as DRAFTER_SERVICE
from drafter_service.servicer import serve as serve_drafters
from loopback import loopback
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from protos.convert import params_to_pb, tree_to_pb
from protos.server import CLUSTER_SECRET_METADATA
from router.coordinator import Channels, Coordinator, Job
from router.stats import RoundStats
from speculative.decoding import generate
from speculative.sampling import SamplingParams
from speculative.tree import DraftTree
from tiny import TINY, tiny_model
from verifier_service.engine import VerifierEngine
from verifier_service.servicer import SERVICE_NAME as VERIFIER_SERVICE
from verifier_service.servicer import serve as serve_verifier

SECRET = "s3cret-of-this-test-cluster-0123456789"
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
GREEDY = SamplingParams(max_tokens=12)
# what a caller may send that is not the secret: nothing, a wrong one, the secret with more
# after it or less of it, an empty one
NOT_THE_SECRET = [None, "wrong-secret-wrong-secret-wrong", SECRET + "x", SECRET[:-1], ""]


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_model(0)


@pytest.fixture(scope="module")
def services(target):
    """(verifier address, drafter pool address, engine, pool), both served with SECRET."""
    engine = VerifierEngine(target, max_batch=4, max_len=64)
    pool = DrafterPool(target, kinds=["pld"])
    verifier_server, verifier_port = serve_verifier(engine, secret=SECRET)
    pool_server, pool_port = serve_drafters(pool, secret=SECRET)
    yield f"127.0.0.1:{verifier_port}", f"127.0.0.1:{pool_port}", engine, pool
    pool_server.stop(None)
    verifier_server.stop(None)
    engine.close()


def metadata(secret: str | None) -> list[tuple[str, str]]:
    return [] if secret is None else [(CLUSTER_SECRET_METADATA, secret)]


def verifier_calls(request_id: str):
    """(name, call(stub, metadata)) of every RPC of the Verifier service."""
    return [
        ("Prefill", lambda stub, md: stub.Prefill(pb.VerifierPrefillRequest(
            request_id=request_id, token_ids=PROMPT, sampling=params_to_pb(GREEDY), max_len=32),
            metadata=md, timeout=10)),
        ("Verify", lambda stub, md: stub.Verify(pb.VerifyRequest(request_id=request_id, tree=tree_to_pb(DraftTree())),
                                                metadata=md, timeout=10)),
        ("Decode", lambda stub, md: list(stub.Decode(pb.DecodeRequest(
            request_id=request_id, token_ids=PROMPT, drafter="pld", draft_length=2, max_tokens=1),
            metadata=md, timeout=10))),
        ("Stats", lambda stub, md: stub.Stats(pb.VerifierStatsRequest(), metadata=md, timeout=10)),
        ("Release", lambda stub, md: stub.Release(pb.ReleaseRequest(request_id=request_id), metadata=md, timeout=10)),
    ]


def drafter_calls(request_id: str):
    """(name, call(stub, metadata)) of every RPC of the Drafter service."""
    return [
        ("Prefill", lambda stub, md: stub.Prefill(pb.DrafterPrefillRequest(
            request_id=request_id, drafter="pld", token_ids=PROMPT, sampling=params_to_pb(GREEDY)),
            metadata=md, timeout=10)),
        ("Propose", lambda stub, md: stub.Propose(pb.ProposeRequest(
            request_id=request_id, context_length=len(PROMPT), max_tokens=3), metadata=md, timeout=10)),
        ("Release", lambda stub, md: stub.Release(pb.ReleaseRequest(request_id=request_id), metadata=md, timeout=10)),
    ]


@pytest.mark.parametrize("secret", NOT_THE_SECRET, ids=["none", "wrong", "longer", "shorter", "empty"])
def test_a_caller_without_the_secret_is_refused_by_every_rpc(services, secret):
    verifier, drafters, engine, pool = services
    with grpc.insecure_channel(verifier) as v, grpc.insecure_channel(drafters) as d:
        for stub, calls in ((pb_grpc.VerifierStub(v), verifier_calls("intruder")),
                            (pb_grpc.DrafterStub(d), drafter_calls("intruder"))):
            for name, call in calls:
                with pytest.raises(grpc.RpcError) as refused:
                    call(stub, metadata(secret))
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
    # refused before doing anything: no row taken, no drafter state kept
    assert engine.stats()["active_requests"] == 0 and pool.active_requests() == 0


def test_the_secret_under_another_key_is_refused(services):
    verifier, _, _, _ = services
    with grpc.insecure_channel(verifier) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.VerifierStub(channel).Stats(pb.VerifierStatsRequest(), timeout=10,
                                                metadata=[("authorization", SECRET)])
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_caller_with_the_secret_is_served(services):
    verifier, drafters, engine, pool = services
    with grpc.insecure_channel(verifier) as v, grpc.insecure_channel(drafters) as d:
        vstub, dstub, md = pb_grpc.VerifierStub(v), pb_grpc.DrafterStub(d), metadata(SECRET)
        (_, prefill), (_, verify), (_, decode), (_, stats), (_, release) = verifier_calls("member")
        assert prefill(vstub, md).next_token in range(TINY.vocab_size)
        assert not verify(vstub, md).state_lost
        assert [r.state_lost for r in decode(vstub, md)] == [True]  # it holds a token more than PROMPT now
        assert stats(vstub, md).active_requests == 1
        assert release(vstub, md).released
        (_, dprefill), (_, propose), (_, drelease) = drafter_calls("member")
        dprefill(dstub, md)
        assert not propose(dstub, md).state_lost
        assert drelease(dstub, md).released
    assert engine.stats()["active_requests"] == 0 and pool.active_requests() == 0


def test_health_checks_and_reflection_need_no_secret(services):
    verifier, drafters, _, _ = services
    for address, service in ((verifier, VERIFIER_SERVICE), (drafters, DRAFTER_SERVICE)):
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == \
                    health_pb2.HealthCheckResponse.SERVING
            assert service in ProtoReflectionDescriptorDatabase(channel).get_services()


def job(request_id: str) -> Job:
    return Job(request_id=request_id, prompt_ids=PROMPT, params=GREEDY, drafters=(("pld", 1.0),),
               draft_length=4, tree_budget=6, vocab_size=TINY.vocab_size, eos_token_ids=())


def test_a_coordinator_with_the_secret_drives_a_request(target):
    pool, engine = DrafterPool(target, kinds=["pld"]), VerifierEngine(target, max_batch=2, max_len=64)
    with loopback(pool, engine, secret=SECRET) as coordinator:
        stats = RoundStats()
        tokens = [t for new in coordinator.run(job("ok"), stats) for t in new]
        assert tokens == generate(target, PROMPT, GREEDY).token_ids
        assert stats.draft_tokens > 0  # the drafter pool was called, and with the secret
        assert engine.stats()["active_requests"] == 0 and pool.active_requests() == 0

        # the same services, a coordinator holding another secret: refused, not retried as if down
        outsider = Coordinator(verifiers=coordinator.services.verifiers, drafters=coordinator.services.drafters,
                               channels=Channels(secret="not-the-cluster-secret"))
        with pytest.raises(grpc.RpcError) as refused:
            list(outsider.run(job("outsider"), RoundStats()))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        outsider.services.channels.close()
        assert engine.stats()["active_requests"] == 0


# --- `specserve serve`'s services on a one-node Ray cluster, default settings


@pytest.fixture(scope="module")
def served_cluster():
    from cluster.actors import connect_store
    from cluster.config import ServeConfig
    from raw_actors import deploy, shutdown

    with pytest.MonkeyPatch.context() as mp:
        # the defaults: no secret configured anywhere (the actors inherit this environment)
        mp.delenv("SPECSERVE_CLUSTER_SECRET", raising=False)
        mp.delenv("SPECSERVE_REDIS_URL", raising=False)
        start_local_ray(num_cpus=2, resources={"verifier": 1, "drafter": 1}, include_dashboard=False,
                        log_to_driver=False, namespace="specserve")
        cfg = ServeConfig(port=0, verifiers=dict(count=1, max_batch=2, max_len=256, threads=1),
                          drafter_pools=dict(count=1, kinds=["pld"]))
        dep = deploy(cfg)
        try:
            yield dep, connect_store(None), cfg
        finally:
            shutdown(dep)
            ray.shutdown()


def _listening(pid: int) -> dict[int, str]:
    """port -> address of every socket process `pid` listens on (TCP, v4 and v6)."""
    return {c.laddr.port: c.laddr.ip for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def _loopback(ip: str) -> bool:
    """127.0.0.0/8 or ::1, also as an IPv4-mapped IPv6 address (gRPC's sockets are IPv6 ones)."""
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def _process(actor) -> tuple[int, int]:
    """(pid, port Ray's own core worker listens on) of an actor's process, from Ray's actor table:
    that port is Ray's (guarded by Ray's own token authentication), the others ours."""
    info = ray._private.state.actors(actor._actor_id.hex())
    return info["Pid"], info["Address"]["Port"]


def test_served_services_listen_on_loopback_only(served_cluster):
    dep, store, _ = served_cluster
    registered = []  # our addresses: every service's gRPC and metrics
    for kind in ("verifier", "drafter", "router"):
        services = store.list_services(kind)
        assert services, kind
        for s in services:
            registered += [s.address, s.meta["metrics"]]
    assert len(registered) == 6
    assert all(address.startswith("127.0.0.1:") for address in registered), registered

    ours = {int(address.rsplit(":", 1)[1]) for address in registered}
    seen = set()
    assert len(dep.actors()) == 4  # router, verifier, drafter pool, state store
    for actor in dep.actors():
        pid, ray_port = _process(actor)
        if actor is not dep.state:
            assert ray.get(actor.pid.remote()) == pid
        listening = _listening(pid)
        listening.pop(ray_port, None)
        # every other socket of our processes is ours, and on loopback
        assert all(_loopback(ip) for ip in listening.values()), listening
        seen |= set(listening)
    assert seen == ours  # every registered port is listened on, by one of the actors, on loopback


def test_served_services_share_the_generated_secret(served_cluster):
    dep, store, _ = served_cluster
    secret = store.get_or_create_cluster_secret()  # generated by the first service, kept in the store
    assert len(secret) >= 32
    for kind, stub_type in (("verifier", pb_grpc.VerifierStub), ("drafter", pb_grpc.DrafterStub)):
        (service,) = store.list_services(kind)
        with grpc.insecure_channel(service.address) as channel:
            stub = stub_type(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Release(pb.ReleaseRequest(request_id="nobody"), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, kind
            assert not stub.Release(pb.ReleaseRequest(request_id="nobody"), timeout=10,
                                    metadata=metadata(secret)).released

    # the router holds it too: a request goes through verifier and pool
    with grpc.insecure_channel(dep.address) as channel:
        reply = pb_grpc.SpecserveStub(channel).Generate(pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="Say hello twice: hello hello")], drafter="pld",
            sampling=pb.SamplingParams(max_tokens=6)), timeout=120)
    assert reply.usage.completion_tokens > 0 and reply.text


def test_internal_host_follows_the_cluster(served_cluster):
    from cluster.actors import internal_host, reachable_services
    from cluster.config import ServeConfig
    from cluster.state import EmbeddedStateStore

    assert internal_host(ServeConfig()) == "127.0.0.1"  # auto on one node
    assert internal_host(ServeConfig(security=dict(internal_host="node"))) == ray.util.get_node_ip_address()
    assert internal_host(ServeConfig(security=dict(internal_host="loopback"))) == "127.0.0.1"
    for everywhere in ("0.0.0.0", "::"):
        with pytest.raises(ValueError):
            ServeConfig(security=dict(internal_host=everywhere))

    # a service on another node's loopback (registered before that cluster grew) is not dialled from here
    store, here = EmbeddedStateStore(), ray.get_runtime_context().get_node_id()
    store.register_service("verifier", "a", "127.0.0.1:1", 30, {"node": here})
    store.register_service("verifier", "b", "127.0.0.1:2", 30, {"node": "elsewhere"})
    store.register_service("verifier", "c", "10.0.0.7:3", 30, {"node": "elsewhere"})
    assert [s.service_id for s in reachable_services(store, "verifier")] == ["a", "c"]
