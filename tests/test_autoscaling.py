"""Autoscaling of the Serve application, each service on its own signal, with short
delays: a burst of concurrent HTTP requests raises the router, verifier and
drafter-pool replicas above their minimum, quiet brings them back, and every
request during scale-up and scale-down succeeds with the oracle's output."""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import openai
import pytest
import ray
from ray import serve

from cluster.config import ServeConfig
from cluster.ray_start import start_local_ray
from deploy.app import APP_NAME, start_app
from oracle import MAX_TOKENS, PROMPTS, near_tie_or_equal
from redis_server import redis_server_fixture
from serve_process import free_port
from test_http_api import MODEL

redis_url = redis_server_fixture(scope="module")  # the store a cluster shares, as in production

SERVICES = ("Router", "Verifier", "DrafterPool")
CONFIG = dict(
    port=0,
    # a model drafter on every round (no adaptive shortening under load), so drafting is real work
    router=dict(default_drafter="small-general", adaptive=False),
    routers=dict(count=1, max_count=2, target_ongoing=2),
    verifiers=dict(count=1, max_count=2, max_len=1024, threads=1, target_occupancy=0.25),
    drafter_pools=dict(count=1, max_count=2, kinds=["small-general"], target_busy=0.1),
    autoscaling=dict(upscale_delay_s=1, downscale_delay_s=4, metrics_interval_s=0.5, look_back_period_s=2,
                     graceful_shutdown_s=30),
    registry=dict(heartbeat_s=0.5, service_ttl_s=3.0),
)


TRICKLE_PAUSE_S = 2 * (CONFIG["autoscaling"]["downscale_delay_s"] + CONFIG["autoscaling"]["look_back_period_s"])


def running_replicas() -> dict[str, int]:
    deployments = serve.status().applications[APP_NAME].deployments
    return {name: deployments[name].replica_states.get("RUNNING", 0) for name in SERVICES}


class ReplicaWatch:
    """Polls the replica counts in the background; `peak` is the most seen of each."""

    def __init__(self):
        self.peak = dict.fromkeys(SERVICES, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            for name, n in running_replicas().items():
                self.peak[name] = max(self.peak[name], n)

    def scaled_up(self) -> bool:
        """Whether every service has run two replicas."""
        return all(n >= 2 for n in self.peak.values())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def app(redis_url):
    cfg = ServeConfig.model_validate({**CONFIG, "http": {"port": free_port()}})
    start_local_ray(num_cpus=2, resources={"verifier": 2, "drafter": 2}, include_dashboard=False,
                    log_to_driver=False, namespace="specserve")
    try:
        start_app(cfg, redis_url, progress=lambda _: None)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.http.port}/v1", api_key="none", timeout=300,
                            max_retries=0)
    finally:
        serve.shutdown()
        ray.shutdown()


def ask(client: openai.OpenAI, i: int) -> list[int]:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[i][1]}],
                                       max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True})
    return r.choices[0].token_ids


def burst(client: openai.OpenAI, watch: ReplicaWatch, concurrent: int = 8,
          most: int = 32) -> list[tuple[int, list[int]]]:
    """Keep `concurrent` requests in flight until every service has run two replicas (or
    `most` were sent), then let those in flight finish: (prompt index, output) of each."""
    sent: dict = {}
    with ThreadPoolExecutor(concurrent) as pool:
        while len(sent) < most and not watch.scaled_up():
            while sum(not f.done() for f in sent) < concurrent and len(sent) < most:
                i = len(sent) % 10
                sent[pool.submit(ask, client, i)] = i
            wait([f for f in sent if not f.done()], timeout=0.5, return_when=FIRST_COMPLETED)
    return [(i, f.result()) for f, i in sent.items()]


def test_burst_scales_each_service_up_and_quiet_scales_back(app, hf_oracle):
    assert running_replicas() == dict.fromkeys(SERVICES, 1)
    watch = ReplicaWatch()
    try:
        outputs = burst(app, watch)
    finally:
        watch.stop()
    assert all(watch.peak[name] == 2 for name in SERVICES), watch.peak

    # quiet: back to the minimum, while a trickle of requests still succeeds as replicas drain
    # (compared with the oracle afterwards: computing it here would outlast the scale-down).
    # The pauses outlast the downscale delay and look-back, or a request a second would keep
    # the pool's drafting above its target and the pool up.
    deadline = time.monotonic() + 120
    trickled = []
    while running_replicas() != dict.fromkeys(SERVICES, 1):
        assert time.monotonic() < deadline, running_replicas()
        i = len(trickled) % 10
        trickled.append((i, ask(app, i)))
        time.sleep(TRICKLE_PAUSE_S)
    assert trickled, "the replicas were back to one before any request was sent during scale-down"
    for i, ids in outputs:
        near_tie_or_equal(hf_oracle, i, ids, "during scale-up")
    for i, ids in trickled:
        near_tie_or_equal(hf_oracle, i, ids, "during scale-down")
    near_tie_or_equal(hf_oracle, 0, ask(app, 0), "after scale-down")
