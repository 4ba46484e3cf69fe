"""Placement on a Ray cluster of several nodes on one machine: one verifier node
and two drafter nodes (custom resources); every actor lands on a node whose
resources allow it, and requests through it give the single-process output."""

from __future__ import annotations

import grpc
import pytest
import ray
from ray.cluster_utils import Cluster

from cluster.config import ServeConfig
from cluster.local import LocalEngine, Request
from raw_actors import deploy, shutdown
from conftest import dev_prompts
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from speculative.sampling import SamplingParams

CONFIG = ServeConfig(port=0, verifiers=dict(count=1, max_len=1024, threads=1),
                     drafter_pools=dict(count=2, kinds=["pld"]), registry=dict(heartbeat_s=0.5, service_ttl_s=3.0))


@pytest.fixture(scope="module")
def three_nodes():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = {
        "verifier": [c.add_node(num_cpus=1, resources={"verifier": 1})],
        "drafter": [c.add_node(num_cpus=1, resources={"drafter": 1}) for _ in range(2)],
    }
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="specserve", log_to_driver=False)
    yield c, {kind: {n.node_id for n in ns} for kind, ns in nodes.items()}
    ray.shutdown()
    c.shutdown()


def test_actors_placed_by_resources_and_outputs_match(three_nodes, smollm2):
    _, node_ids = three_nodes
    dep = deploy(CONFIG)  # no Redis URL: the embedded store in its own actor
    try:
        assert {ray.get(a.node_id.remote()) for a in dep.verifiers} <= node_ids["verifier"]
        drafter_nodes = [ray.get(a.node_id.remote()) for a in dep.drafters]
        assert set(drafter_nodes) <= node_ids["drafter"]
        engine = LocalEngine(*smollm2)
        with grpc.insecure_channel(dep.address) as channel:
            stub = pb_grpc.SpecserveStub(channel)
            for _, prompt in dev_prompts(3):
                want = engine.run(Request(prompt, True, SamplingParams(max_tokens=16), "pld",
                                          CONFIG.router.draft_length))
                got = stub.Generate(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=prompt)],
                                                       sampling=pb.SamplingParams(max_tokens=16)), timeout=120)
                assert list(got.token_ids) == want.token_ids
    finally:
        shutdown(dep)
