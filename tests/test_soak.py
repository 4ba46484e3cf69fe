"""The soak (scripts/soak.py), short: `specserve serve` as a user starts it (a local Ray
cluster, the embedded store), six streaming clients for 45 s, half over HTTP and half
over gRPC; no request fails, every verifier row and drafter request is freed at the end,
no checkpoint is left, every actor's memory was sampled, and the report is written. (The
10-minute run: `python scripts/soak.py --minutes 10`.) Also the script's Redis view (keys
by kind, checkpoint TTLs) against a real redis-server, and its arithmetic."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis_server import redis_server_fixture
from serve_process import specserve_serve

ROOT = Path(__file__).resolve().parents[1]
SOAK = ROOT / "scripts" / "soak.py"
SOAK_S = 45
SERVICES = {"ServeReplica:specserve:OpenAIIngress", "ServeReplica:specserve:Router",
            "ServeReplica:specserve:Verifier", "ServeReplica:specserve:DrafterPool", "StateStoreActor"}

redis_url = redis_server_fixture()


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = tmp_path_factory.mktemp("soak") / "serve.toml"
    with specserve_serve(config, '[drafter_pools]\nkinds = ["pld"]\n[verifiers]\nmax_len = 1024\nthreads = 1\n') as served:
        yield served.http, served.grpc


def test_short_soak_leaves_nothing_behind(server, tmp_path):
    http, grpc = server
    out = tmp_path / "soak.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "SPECSERVE_REDIS_URL")}
    run = subprocess.run([sys.executable, str(SOAK), "--http", http, "--grpc", grpc, "--clients", "6",
                          "--minutes", str(SOAK_S / 60), "--max-tokens", "16", "--max-prompt-chars", "1500",
                          "--window", "15", "--sample-every", "3", "--settle", "30", "--out", str(out)],
                         check=False, capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=SOAK_S + 120)
    log = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode in (0, 1), log  # 1: a check failed (memory may not settle in 45 s), asserted below
    report = json.loads(out.read_text())
    assert out.with_suffix(".md").read_text().startswith("# specserve soak"), log

    s = report["summary"]
    assert s["requests"] > 0 and s["http_requests"] > 0 and s["grpc_requests"] > 0, log
    assert s["errors"] == 0, report["error_messages"]
    assert all(r["finish_reason"] in ("stop", "length") and r["tokens"] > 0 for r in report["requests"])
    assert sum(w["requests"] for w in report["windows"]) == s["requests"] and len(report["windows"]) == 3

    end = report["end"]
    assert end["verifiers"] == 1 and end["rows_held"] == 0, end
    assert end["drafters"] == 1 and end["drafter_requests_held"] == 0, end
    assert end["peak_rows_held"] > 0  # the gauge was read while rows were held

    st = report["store"]
    assert st["kind"] == "embedded", st
    assert st["checkpoints_at_end"] == 0 and end["checkpoints_left"] == 0, st
    assert st["peak_checkpoints"] > 0, st  # the count finds checkpoints while requests run

    by_class = {m["class"]: m for m in report["memory"]}
    assert SERVICES <= set(by_class), sorted(by_class)
    for cls in SERVICES:
        m = by_class[cls]
        assert m["samples"] >= SOAK_S // 3 - 2 and all(v > 0 for v in m["rss_mb"]), m
        assert m["slope_mb_per_min"] is not None and not m["restarted"], m
    assert {"raylet", "gcs_server"} <= set(by_class)
    assert report["checks"]["0 errors"] and report["checks"]["every verifier row freed"]


def test_redis_view_counts_keys_by_kind_and_checkpoint_ttls(redis_url):
    from cluster.state import RedisStateStore

    soak = _soak_module()
    prefix = f"soaktest{time.monotonic_ns()}:"
    store = RedisStateStore(redis_url, prefix=prefix)
    store.register_service("verifier", "v1", "127.0.0.1:1", ttl_s=30)
    store.record_acceptance("pld", "qa", 4, 2)
    store.save_checkpoint("r1-0", {"tokens": [1]}, ttl_s=600)
    store.save_checkpoint("r2-0", {"tokens": [2]}, ttl_s=0.2)
    view = soak.Store(redis_url, prefix, None)
    assert view.kind == "redis"
    assert view.keys_by_kind() == {"accept": 2, "ckpt": 2, "svc": 1, "svcs": 1}
    assert view.checkpoints() == 2
    time.sleep(0.3)
    ttls = view.checkpoint_ttls()
    assert len(ttls) == 1 and 590 < ttls[0] <= 600
    store.delete_checkpoint("r1-0")
    assert view.checkpoint_ttls() == [] and "ckpt" not in view.keys_by_kind()


def test_windows_and_memory_slopes():
    soak = _soak_module()
    recs = [{"start": t - 1.0, "end": t, "latency": 1.0 + (t % 3), "ttft": 0.1, "tokens": 8,
             "error": "boom" if t == 50 else None} for t in range(1, 121)]
    recs.append({"start": 119.0, "end": 125.0, "latency": 6.0, "ttft": 0.2, "tokens": 8, "error": None})
    w = soak.windows(recs, 120.0, 60.0)
    assert [x["requests"] for x in w] == [59, 62] and [x["errors"] for x in w] == [1, 0]
    assert w[1]["p99_s"] > w[0]["p99_s"]  # the request ending after the run counts in the last window

    t = [float(i * 5) for i in range(25)]  # 0..120 s
    flat = {"class": "A", "name": "", "pids": [1], "t": t, "rss_mb": [500.0 + (i % 2) * 0.1 for i in range(25)]}
    # grows 6 MB/min, but only in the second half: the first half is warm-up
    leak = {"class": "B", "name": "", "pids": [2, 3], "t": t,
            "rss_mb": [300.0 if ti < 60 else 300.0 + (ti - 60) / 60 * 6 for ti in t]}
    rows = {r["class"]: r for r in soak.memory_report({"a": flat, "b": leak}, 120.0, 5.0, 1.0)}
    assert not rows["A"]["flagged"] and abs(rows["A"]["slope_mb_per_min"]) < 0.5
    assert rows["B"]["flagged"] and rows["B"]["slope_mb_per_min"] == pytest.approx(6.0, rel=1e-3)
    assert rows["B"]["restarted"] and rows["B"]["samples_second_half"] == 13
    assert rows["B"]["peak_slope_mb_per_min"] == pytest.approx(6.0, rel=1e-3)  # a leak raises the high-water mark
    small = {"class": "C", "name": "", "pids": [4], "t": t, "rss_mb": [30.0 + ti / 60 * 0.3 for ti in t]}
    row = soak.memory_report({"c": small}, 120.0, 5.0, 1.0)[0]  # 10 % per 10 min, but 0.3 MB/min: noise
    assert row["growth_pct_per_10min"] > 1.0 and not row["flagged"]

    # up and down in a band: 2,310 MB, down to 2,210 at the half, back up to 2,310 at the end; the
    # second half's least-squares line climbs 100 MB/min, the high-water mark not at all
    band = {"class": "D", "name": "", "pids": [5], "t": t, "rss_mb": [2210.0 + abs(ti - 60) / 60 * 100 for ti in t]}
    row = soak.memory_report({"d": band}, 120.0, 5.0, 1.0)[0]
    assert row["slope_mb_per_min"] == pytest.approx(100.0) and row["peak_slope_mb_per_min"] == 0.0
    assert not row["flagged"]
    # the same band, but each peak 30 MB above the last: growth, flagged
    climbing = dict(band, rss_mb=[y + ti / 60 * 30 for y, ti in zip(band["rss_mb"], t)])
    row = soak.memory_report({"d": climbing}, 120.0, 5.0, 1.0)[0]
    assert row["peak_slope_mb_per_min"] > 5.0 and row["flagged"]
    # flat, but one sample 100 MB up late in the run (one large batch's scratch, given back): not growth
    spike = dict(flat, rss_mb=[y + (100.0 if ti == 100 else 0.0) for y, ti in zip(flat["rss_mb"], t)])
    row = soak.memory_report({"a": spike}, 120.0, 5.0, 1.0)[0]
    assert row["peak_slope_mb_per_min"] < 0.5 and not row["flagged"]
    # the same jump, kept: growth, flagged
    step = dict(flat, rss_mb=[y + (100.0 if ti >= 100 else 0.0) for y, ti in zip(flat["rss_mb"], t)])
    row = soak.memory_report({"a": step}, 120.0, 5.0, 1.0)[0]
    assert row["flagged"]
