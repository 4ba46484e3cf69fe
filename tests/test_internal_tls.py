"""Internal calls over mutual TLS (`[security] internal_tls_cert_file`, `_key_file`,
`_ca_file`, issue 66).

A verifier and a drafter pool served with the cluster's certificate accept only TLS
from a caller holding a certificate the cluster's CA signed, and still want the cluster
secret; a coordinator with both drives a request end to end. A certificate that is
missing, not PEM, not the key's, of another CA, expired, or not naming the address a
service registers is a clear error before anything serves. (Across real hosts:
tests/test_netns_cluster.py.)"""

from __future__ import annotations

import grpc
import pytest
import torch
from pydantic import ValidationError

from certs import ClusterCa
from cluster.config import SecuritySettings, ServeConfig
from drafter_service.pool import DrafterPool
from drafter_service.servicer import serve as serve_drafters
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from protos.server import CLUSTER_SECRET_METADATA, MutualTls
from router.coordinator import Channels, Coordinator, Job
from router.stats import RoundStats
from speculative.decoding import generate
from speculative.sampling import SamplingParams
from tiny import TINY, tiny_model
from verifier_service.engine import VerifierEngine
from verifier_service.servicer import serve as serve_verifier

SECRET = "s3cret-of-this-test-cluster-0123456789"
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
GREEDY = SamplingParams(max_tokens=12)


@pytest.fixture(scope="module")
def ca():
    return ClusterCa()


@pytest.fixture(scope="module")
def tls(ca) -> MutualTls:
    return MutualTls(*ca.issue(), ca.pem)


@pytest.fixture(scope="module")
def services(tls):
    """(verifier address, pool address, engine, pool) on loopback, with mutual TLS and SECRET."""
    torch.set_num_threads(1)
    target = tiny_model(0)
    engine, pool = VerifierEngine(target, max_batch=2, max_len=64), DrafterPool(target, kinds=["pld"])
    (vs, vport), (ds, dport) = (serve_verifier(engine, secret=SECRET, mutual_tls=tls),
                                serve_drafters(pool, secret=SECRET, mutual_tls=tls))
    yield f"127.0.0.1:{vport}", f"127.0.0.1:{dport}", engine, pool, target
    ds.stop(None)
    vs.stop(None)
    engine.close()


def job(request_id: str) -> Job:
    return Job(request_id=request_id, prompt_ids=PROMPT, params=GREEDY, drafters=(("pld", 1.0),),
               draft_length=4, tree_budget=6, vocab_size=TINY.vocab_size, eos_token_ids=())


def stats_call(channel: grpc.Channel, secret: str | None = SECRET):
    md = [(CLUSTER_SECRET_METADATA, secret)] if secret else []
    return pb_grpc.VerifierStub(channel).Stats(pb.VerifierStatsRequest(), metadata=md, timeout=10)


def test_a_coordinator_with_certificate_and_secret_drives_a_request(services, tls):
    verifier, drafters, engine, pool, target = services
    coordinator = Coordinator(verifiers=lambda: [verifier], drafters=lambda: [drafters],
                              channels=Channels(secret=SECRET, tls=tls))
    stats = RoundStats()
    tokens = [t for new in coordinator.run(job("tls"), stats) for t in new]
    coordinator.services.channels.close()
    assert tokens == generate(target, PROMPT, GREEDY).token_ids
    assert stats.draft_tokens > 0  # the pool was called, over TLS
    assert engine.stats()["active_requests"] == 0 and pool.active_requests() == 0


def test_callers_without_the_clusters_certificate_are_refused(services, ca, tls):
    verifier, *_ = services
    # in the clear: the port speaks only TLS
    with grpc.insecure_channel(verifier) as channel, pytest.raises(grpc.RpcError) as refused:
        stats_call(channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # TLS that trusts the service but presents no certificate: the handshake is refused
    with grpc.secure_channel(verifier, grpc.ssl_channel_credentials(ca.pem)) as channel, \
            pytest.raises(grpc.RpcError) as refused:
        stats_call(channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # a certificate another CA signed, for the same names
    other = ClusterCa("another cluster")
    with MutualTls(*other.issue(), ca.pem).channel(verifier) as channel, pytest.raises(grpc.RpcError) as refused:
        stats_call(channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # the cluster's certificate, and no secret: authenticated by TLS, still refused by the secret
    with tls.channel(verifier) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            stats_call(channel, secret=None)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stats_call(channel).active_requests == 0  # both: served


def test_a_caller_checks_the_services_certificate(services, ca):
    """A router holding the cluster's certificate refuses a service whose certificate another
    CA signed (a service in its place), or one that does not name the address it dials."""
    verifier, *_ = services
    with MutualTls(*ca.issue(), ClusterCa("not ours").pem).channel(verifier) as channel, \
            pytest.raises(grpc.RpcError) as refused:
        stats_call(channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # a caller's own names are not checked (the CA's signature is what admits it)...
    with MutualTls(*ca.issue(ips=("10.9.9.9",), names=("elsewhere",)), ca.pem).channel(verifier) as channel:
        assert stats_call(channel).active_requests == 0
    # ...the service's are: it names 127.0.0.1 and localhost, not the name this caller expects
    with MutualTls(*ca.issue(), ca.pem, server_name="elsewhere").channel(verifier) as channel, \
            pytest.raises(grpc.RpcError) as refused:
        stats_call(channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with MutualTls(*ca.issue(), ca.pem, server_name="localhost").channel(verifier) as channel:
        assert stats_call(channel).active_requests == 0


# --- a bad or missing certificate: a clear error before anything serves


def config_error(**security) -> str:
    with pytest.raises(ValidationError) as bad:
        ServeConfig(security=security)
    return str(bad.value)


def test_the_three_files_go_together(tmp_path, ca):
    files = ca.write(tmp_path)
    for left_out in files:
        given = {k: v for k, v in files.items() if k != left_out}
        assert f"({left_out} missing)" in config_error(**given)
    assert "internal_tls_server_name needs" in config_error(internal_tls_server_name="x")
    assert SecuritySettings(**files).internal_tls() is not None
    assert SecuritySettings().internal_tls() is None


def test_a_missing_file_is_named(tmp_path, ca):
    files = ca.write(tmp_path)
    files["internal_tls_key_file"] = str(tmp_path / "nowhere.pem")
    assert f"internal_tls_key_file: no file at {tmp_path / 'nowhere.pem'}" in config_error(**files)


@pytest.mark.parametrize("fault, says", [
    ("garbage-certificate", "do not load as a PEM pair"),
    ("another-key", "do not load as a PEM pair (KEY_VALUES_MISMATCH)"),
    ("garbage-ca", "the CA file holds no PEM certificate"),
    ("another-ca", "not accepted: unable to get local issuer certificate"),
    ("expired", "not accepted: certificate has expired"),
    ("server-name", "not accepted: Hostname mismatch"),
])
def test_a_bad_certificate_says_what_is_wrong(tmp_path, ca, fault, says):
    files = ca.write(tmp_path, expired=fault == "expired")
    if fault == "garbage-certificate":
        open(files["internal_tls_cert_file"], "wb").write(b"not a certificate\n")
    elif fault == "another-key":
        open(files["internal_tls_key_file"], "wb").write(ca.issue()[1])
    elif fault == "garbage-ca":
        open(files["internal_tls_ca_file"], "wb").write(b"-----BEGIN NOTHING-----\n")
    elif fault == "another-ca":
        open(files["internal_tls_ca_file"], "wb").write(ClusterCa("other").pem)
    elif fault == "server-name":
        files["internal_tls_server_name"] = "not-in-the-certificate"
    message = config_error(**files)
    assert says in message, message
    assert files["internal_tls_cert_file"] in message  # which files


def test_a_service_checks_its_certificate_names_its_address(tmp_path, ca):
    """Without a server name, callers check a service's certificate for the address it
    registers: a service whose certificate does not name its node's address says so at start."""
    security = SecuritySettings(**ca.write(tmp_path, ips=("10.213.0.3",)))
    security.internal_tls(check=True, address="10.213.0.3")
    with pytest.raises(ValueError, match=r"internal TLS for 10\.213\.0\.4: the certificate is not accepted: "
                                         r"IP address mismatch"):
        security.internal_tls(check=True, address="10.213.0.4")
