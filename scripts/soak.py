"""Soak a running specserve server: streaming clients for a given time, then what it
left behind.

    specserve serve &                      # or with SPECSERVE_REDIS_URL set
    python scripts/soak.py --http http://127.0.0.1:8000 --grpc 127.0.0.1:50051 \\
        --clients 16 --minutes 10 --max-tokens 64 --out /tmp/soak.json

Each client thread loops streaming chat completions over the Spec-Bench dev prompts
(greedy): over HTTP with the official `openai` client, or, with --grpc, every second
client over gRPC with `specserve.client.Client.stream`. Every request's start, end,
latency, time to first token, tokens and error (a raised error, or a stream that ended
without a finish reason) is recorded; a window (--window, a minute by default) reports
requests, errors and p50/p99 latency and time to first token.

While the clients run, the resident memory (RSS) of every actor of the server's Ray
cluster is sampled (--sample-every): the actors come from the cluster (`ray.init` on
the server's own cluster, found from the process that listens on the HTTP port; read
only), their processes from psutil. Per actor: the RSS series, its least-squares slope
in MB/min over the second half of the run (the first half is warm-up), and the slope of
its high-water mark (the largest RSS so far that it held for three samples in a row) over
the same half, which is what is flagged: above --max-slope MB/min or above
--max-growth-pct % of its RSS per 10 minutes. A leak raises the high-water mark as fast
as the RSS; a process whose RSS goes up and down inside a band (a cache that is rebuilt,
buffers that come and go), or jumps for one sample (one large batch's scratch), does not
raise it, though a least-squares line over a stretch of the band may slope steeply either
way. The Ray processes of the node (raylet, GCS) and the `specserve serve` driver are sampled too.
Alongside, the verifier rows held (the ingress's /metrics, which gathers every
service's) and the state store's checkpoints.

After the clients stop and the server settles (--settle): verifier rows and drafter
requests held (every one must be freed), and the state store's keys. With Redis (the
server's SPECSERVE_REDIS_URL, here from --redis-url or the environment) every key is
counted by kind (the layout of cluster/state.py); request checkpoints (`ckpt:*`, written
with the verifier's checkpoint TTL, 600 s, and deleted when a request is released) must
be 0, and if not the script waits for their TTLs (up to --ckpt-wait) and counts again.
With the embedded store, its checkpoints are counted through the state actor
(`count_checkpoints`, read only). Either way the count is sampled while the clients run
too (its peak shows that checkpoints were being written).

The JSON (every series) goes to --out and the markdown summary beside it (.md) and to
stdout. Exit status 0 when there were no errors, every row and drafter request was
freed, no checkpoint was left and no actor's memory grew past the thresholds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # specserve.client, cluster.state without an install

QUESTIONS = ROOT.parent / "shared" / "data" / "spec_bench" / "dev.jsonl"
NAMESPACE = "specserve"  # cluster.actors.NAMESPACE
STATE_ACTOR = "specserve-state"  # cluster.actors.STATE_ACTOR
CHECKPOINT_TTL_S = 600.0  # verifier_service.engine.VerifierEngine's checkpoint_ttl_s
MB = 1024 * 1024


# ---------------------------------------------------------------- clients


def load_prompts(path: Path, max_chars: int = 0) -> list[str]:
    """The first turn of every question (of at most max_chars characters, if given: a server
    with a short context refuses the longest)."""
    if not path.exists():
        raise SystemExit(f"questions not found at {path} (--questions)")
    turns = [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]
    turns = [t for t in turns if not max_chars or len(t) <= max_chars]
    if not turns:
        raise SystemExit(f"no question in {path} is at most {max_chars} characters long")
    return turns


class Recorder:
    """Every request's record, and the requests in flight (server-side id -> client)."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.lock = threading.Lock()
        self.records: list[dict[str, Any]] = []
        self.inflight: dict[str, float] = {}

    def now(self) -> float:
        return time.monotonic() - self.t0

    def started(self, rid: str) -> None:
        with self.lock:
            self.inflight[rid] = self.now()

    def add(self, rec: dict[str, Any]) -> None:
        with self.lock:
            self.records.append(rec)
            self.inflight.pop(rec.get("request_id") or "", None)

    def snapshot(self) -> tuple[list[dict[str, Any]], list[str]]:
        with self.lock:
            return list(self.records), list(self.inflight)


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


def http_request(client, model: str, prompt: str, max_tokens: int, rec: Recorder) -> dict[str, Any]:
    start = rec.now()
    out: dict[str, Any] = {"api": "http", "start": start, "ttft": None, "tokens": 0, "finish_reason": None,
                           "request_id": None, "error": None}
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if out["request_id"] is None and chunk.id:
                out["request_id"] = chunk.id
                rec.started(out["request_id"])
            for choice in chunk.choices:
                if choice.delta and choice.delta.content and out["ttft"] is None:
                    out["ttft"] = rec.now() - start
                if choice.finish_reason:
                    out["finish_reason"] = choice.finish_reason
            if chunk.usage is not None:
                out["tokens"] = chunk.usage.completion_tokens
        if out["finish_reason"] is None:
            out["error"] = "the stream ended without a finish reason"
    except Exception as e:  # noqa: BLE001 - every failure is a soak error, recorded
        out["error"] = _error_text(e)
    out["end"] = rec.now()
    out["latency"] = out["end"] - start
    return out


def grpc_request(client, prompt: str, max_tokens: int, rec: Recorder) -> dict[str, Any]:
    start = rec.now()
    rid = f"soak-{uuid.uuid4().hex}"
    out: dict[str, Any] = {"api": "grpc", "start": start, "ttft": None, "tokens": 0, "finish_reason": None,
                           "request_id": rid, "error": None}
    rec.started(rid)
    try:
        for chunk in client.stream(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                   temperature=0.0, request_id=rid):
            if chunk.token_ids and out["ttft"] is None:
                out["ttft"] = rec.now() - start
            out["tokens"] += len(chunk.token_ids)
            if chunk.finish_reason:
                out["finish_reason"] = chunk.finish_reason
        if out["finish_reason"] is None:
            out["error"] = "the stream ended without a finish reason"
    except Exception as e:  # noqa: BLE001
        out["error"] = _error_text(e)
    out["end"] = rec.now()
    out["latency"] = out["end"] - start
    return out


def client_loop(i: int, args, model: str, prompts: list[str], rec: Recorder, stop: threading.Event) -> None:
    use_grpc = bool(args.grpc) and i % 2 == 1
    if use_grpc:
        from specserve.client import Client

        metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
        client = Client(args.grpc, timeout=args.request_timeout, metadata=metadata, max_attempts=1)
    else:
        import openai

        client = openai.OpenAI(base_url=f"{args.http}/v1", api_key=args.api_key or "none", max_retries=0,
                               timeout=args.request_timeout)
    k = i * max(1, len(prompts) // args.clients)  # clients start at different prompts
    try:
        while not stop.is_set():
            prompt = prompts[k % len(prompts)]
            k += 1
            r = (grpc_request(client, prompt, args.max_tokens, rec) if use_grpc
                 else http_request(client, model, prompt, args.max_tokens, rec))
            r["client"] = i
            rec.add(r)
    finally:
        client.close()


# ---------------------------------------------------------------- the server's processes


def _local(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "") or host.startswith("127.")


def _listener(port: int) -> psutil.Process | None:
    """The local process listening on a TCP port (the Serve proxy for the HTTP port)."""
    pid = next((c.pid for c in psutil.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid), None)
    return None if pid is None else psutil.Process(pid)


def ray_cluster_of_port(port: int) -> tuple[str | None, str | None]:
    """(GCS address, RAY_AUTH_MODE) of the Ray cluster whose process listens on `port`: the
    --gcs-address of its raylet parent, and the auth mode its workers run with. (None, None)
    when it cannot be told (then Ray's "auto")."""
    try:
        proc = _listener(port)
        if proc is None:
            return None, None
        mode = proc.environ().get("RAY_AUTH_MODE")
        for p in [proc, *proc.parents()]:
            for arg in p.cmdline():
                if arg.startswith("--gcs-address="):
                    return arg.split("=", 1)[1], mode
    except (psutil.Error, OSError):
        pass
    return None, None


def connect_ray(address: str | None, auth_mode: str | None) -> str:
    """Join the server's cluster as a read-only driver; returns the address joined. Before
    Ray is imported: it reads RAY_AUTH_MODE once, at import."""
    if address:
        os.environ["RAY_ADDRESS"] = address
        # Ray presents its token only to clusters it found itself ("auto" without RAY_ADDRESS);
        # for one named by address, RAY_AUTH_MODE=token tells it to, as the cluster's workers run
        if auth_mode and "RAY_AUTH_MODE" not in os.environ:
            os.environ["RAY_AUTH_MODE"] = auth_mode
    import ray

    ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    return address or "auto"


class ActorSource:
    """The live actors of the joined cluster: ray.util.state when the cluster runs a
    dashboard (its state API), else the GCS actor table (`specserve serve` starts Ray
    without a dashboard)."""

    def __init__(self):
        import ray

        self.nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        self.kind = "gcs"
        try:
            from ray.util.state import list_actors

            found = list_actors(filters=[("state", "=", "ALIVE")], detail=True, timeout=5)
            # a dashboard on the default port may belong to another cluster on this machine
            if found and all(a.node_id in self.nodes for a in found):
                self.kind = "state-api"
        except Exception:  # noqa: BLE001, S110 - no dashboard: the GCS table
            pass

    def actors(self) -> list[dict[str, Any]]:
        """{"id", "class", "name", "pid", "node"} of every live actor."""
        if self.kind == "state-api":
            from ray.util.state import list_actors

            return [{"id": a.actor_id, "class": a.class_name, "name": a.name or "", "pid": a.pid, "node": a.node_id}
                    for a in list_actors(filters=[("state", "=", "ALIVE")], detail=True, timeout=10)]
        import ray

        table = ray._private.state.actors()  # the GCS table: no public API without a dashboard
        return [{"id": a["ActorID"], "class": a["ActorClassName"], "name": a.get("Name") or "", "pid": a.get("Pid"),
                 "node": (a.get("Address") or {}).get("NodeID")}
                for a in table.values() if a.get("State") == "ALIVE"]


def system_processes(http_port: int) -> dict[str, int]:
    """The node's Ray processes and the serving driver, from the HTTP port's listener."""
    found: dict[str, int] = {}
    try:
        proc = _listener(http_port)
        if proc is None:
            return found
        raylet = next((p for p in proc.parents() if p.name() == "raylet"), None)
        if raylet is None:
            return found
        found["raylet"] = raylet.pid
        driver = raylet.parent()
        if driver is not None and driver.pid != 1:
            found["driver (specserve serve)"] = driver.pid
            for child in driver.children():
                if child.name() == "gcs_server":
                    found["gcs_server"] = child.pid
    except (psutil.Error, OSError):
        pass
    return found


def rss(pid: int | None) -> int | None:
    if not pid:
        return None
    try:
        return psutil.Process(pid).memory_info().rss
    except (psutil.Error, OSError):
        return None


# ---------------------------------------------------------------- metrics and the store


def scrape_held(http: str, headers: dict[str, str]) -> dict[str, Any]:
    """Verifier rows and drafter requests held, summed over the instances /metrics reports."""
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(f"{http}/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    out: dict[str, Any] = {"rows_held": None, "verifiers": 0, "drafter_requests_held": None, "drafters": 0,
                           "scrape_errors": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "specserve_verifier_rows_held":
                out["rows_held"] = (out["rows_held"] or 0) + s.value
                out["verifiers"] += 1
            elif s.name == "specserve_drafter_requests_held":
                out["drafter_requests_held"] = (out["drafter_requests_held"] or 0) + s.value
                out["drafters"] += 1
            elif s.name == "specserve_metrics_scrape_errors_total":
                out["scrape_errors"] += s.value
    return out


class Store:
    """Read-only views of the server's state store."""

    def __init__(self, redis_url: str | None, prefix: str, embedded_actor):
        self.prefix = prefix
        self.redis = None
        self.actor = embedded_actor
        if embedded_actor is None and redis_url:
            import redis

            self.redis = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=10)
        self.kind = "embedded" if self.actor is not None else "redis" if self.redis is not None else "unknown"

    def keys_by_kind(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for key in self.redis.scan_iter(match=f"{self.prefix}*", count=1000):
            counts[key[len(self.prefix):].split(":", 1)[0]] += 1
        return dict(sorted(counts.items()))

    def checkpoint_ttls(self) -> list[float]:
        """Seconds left of every checkpoint key in Redis."""
        keys = list(self.redis.scan_iter(match=f"{self.prefix}ckpt:*", count=1000))
        if not keys:
            return []
        with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.pttl(key)
            return [max(p, 0) / 1000 for p in pipe.execute() if p != -2]

    def checkpoints(self) -> int:
        """Request checkpoints stored (verifiers key them by ids of their own)."""
        if self.redis is not None:
            return self.keys_by_kind().get("ckpt", 0)
        import ray

        return ray.get(self.actor.call.remote("count_checkpoints"), timeout=60)


# ---------------------------------------------------------------- sampling


class Sampler(threading.Thread):
    """Every `every` seconds: each actor's RSS, rows held, checkpoints."""

    def __init__(self, every: float, rec: Recorder, http: str, headers: dict[str, str], actors: ActorSource | None,
                 system: dict[str, int], store: Store | None):
        super().__init__(name="soak-sampler", daemon=True)
        self.every, self.rec, self.http, self.headers = every, rec, http, headers
        self.source, self.system, self.store = actors, system, store
        self.stop_event = threading.Event()
        self.memory: dict[str, dict[str, Any]] = {}  # key -> {"class", "name", "pids", "t", "rss_mb"}
        self.held: list[dict[str, Any]] = []
        self.ckpt: list[dict[str, Any]] = []
        self.errors: list[str] = []

    def run(self) -> None:
        while True:
            self.sample()
            if self.stop_event.wait(self.every):
                return

    def sample(self) -> None:
        t = self.rec.now()
        procs: list[tuple[str, str, str, int | None]] = []
        if self.source is not None:
            try:
                procs += [(a["id"], a["class"], a["name"], a["pid"]) for a in self.source.actors()
                          if a["node"] in self.source.nodes]
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"{t:.0f}s actors: {_error_text(e)}")
        procs += [(f"process:{name}", name, "", pid) for name, pid in self.system.items()]
        for key, cls, name, pid in procs:
            value = rss(pid)
            if value is None:
                continue
            m = self.memory.setdefault(key, {"class": cls, "name": name, "pids": [], "t": [], "rss_mb": []})
            if pid not in m["pids"]:
                m["pids"].append(pid)  # a second pid: the actor was restarted
            m["t"].append(round(t, 2))
            m["rss_mb"].append(round(value / MB, 2))
        try:
            self.held.append({"t": round(t, 2), **scrape_held(self.http, self.headers)})
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"{t:.0f}s metrics: {_error_text(e)}")
        if self.store is not None and self.store.kind != "unknown":
            try:
                _, inflight = self.rec.snapshot()
                self.ckpt.append({"t": round(t, 2), "in_flight": len(inflight),
                                  "checkpoints": self.store.checkpoints()})
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"{t:.0f}s store: {_error_text(e)}")


# ---------------------------------------------------------------- analysis


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def windows(records: list[dict[str, Any]], duration: float, width: float) -> list[dict[str, Any]]:
    """Requests by the window they ended in (those ending after the run count in the last)."""
    n = max(1, math.ceil(duration / width - 1e-9))
    out = []
    for w in range(n):
        lo, hi = w * width, min((w + 1) * width, duration)
        last = w == n - 1
        rs = [r for r in records if lo <= r["end"] < hi or (last and r["end"] >= hi)]
        ok = [r for r in rs if not r["error"]]
        lat = [r["latency"] for r in ok]
        ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
        tokens = sum(r["tokens"] for r in ok)
        out.append({"window": w, "start_s": round(lo, 1), "end_s": round(hi, 1), "requests": len(rs),
                    "errors": len(rs) - len(ok), "p50_s": pct(lat, 50), "p99_s": pct(lat, 99),
                    "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
                    "tokens_per_s": round(tokens / max(hi - lo, 1e-9), 2)})
    return out


# samples in a row a size must last to raise the high-water mark: a leak keeps what it takes,
# a transient allocation (one large batch's scratch) gives it back
HELD_SAMPLES = 3


def slope_mb_per_min(t: list[float], y: list[float]) -> float | None:
    if len(t) < 3 or max(t) - min(t) <= 0:
        return None
    return float(np.polyfit(np.asarray(t) / 60.0, np.asarray(y), 1)[0])


def memory_report(mem: dict[str, dict[str, Any]], duration: float, max_slope: float,
                  max_growth_pct: float, noise_slope: float = 0.5) -> list[dict[str, Any]]:
    """Per process: RSS at the start, the half, the end of the load; over the second half the
    slope of the RSS and of its high-water mark (the largest RSS since the start that it held
    for HELD_SAMPLES samples in a row: one sample's spike is not growth). Flagged when
    the high-water mark rises faster than max_slope MB/min, or than max_growth_pct % of the
    RSS per 10 minutes unless under noise_slope MB/min (a small process's page-sized steps)."""
    rows = []
    for key, m in sorted(mem.items(), key=lambda kv: (kv[1]["class"], kv[0])):
        t, y = m["t"], m["rss_mb"]
        load = [(ti, yi) for ti, yi in zip(t, y) if ti <= duration + 1e-6]
        held = [min(yi for _, yi in load[i:i + HELD_SAMPLES]) for i in range(len(load) - HELD_SAMPLES + 1)]
        highs = np.maximum.accumulate(held).tolist() if held else []
        half = [(ti, yi) for ti, yi in load if ti >= duration / 2]
        half_highs = [(ti, hi) for (ti, _), hi in zip(load, highs) if ti >= duration / 2]
        slope = slope_mb_per_min([p[0] for p in half], [p[1] for p in half])
        peak_slope = slope_mb_per_min([p[0] for p in half_highs], [p[1] for p in half_highs])
        mid = float(np.mean([p[1] for p in half])) if half else (y[-1] if y else 0.0)
        growth_pct = None if slope is None or mid <= 0 else slope * 10 / mid * 100  # % of RSS per 10 min
        peak_pct = None if peak_slope is None or mid <= 0 else peak_slope * 10 / mid * 100
        flagged = peak_slope is not None and (
            peak_slope > max_slope or (peak_pct > max_growth_pct and peak_slope > noise_slope))
        rows.append({"key": key, "class": m["class"], "name": m["name"], "pids": m["pids"],
                     "restarted": len(m["pids"]) > 1, "samples": len(y),
                     "samples_second_half": len(half), "rss_start_mb": y[0] if y else None,
                     "rss_half_mb": half[0][1] if half else None, "rss_end_mb": load[-1][1] if load else None,
                     "rss_after_mb": y[-1] if y else None,
                     "slope_mb_per_min": None if slope is None else round(slope, 3),
                     "growth_pct_per_10min": None if growth_pct is None else round(growth_pct, 3),
                     "peak_slope_mb_per_min": None if peak_slope is None else round(peak_slope, 3),
                     "peak_growth_pct_per_10min": None if peak_pct is None else round(peak_pct, 3),
                     "flagged": flagged, "t": t, "rss_mb": y})
    return rows


def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def markdown(report: dict[str, Any]) -> str:
    s, lines = report["summary"], []
    lines.append(f"# specserve soak: {report['config']['clients']} streaming clients, "
                 f"{report['config']['duration_s'] / 60:.1f} min")
    lines.append("")
    c = report["config"]
    lines.append(f"Server {c['http']}" + (f" and gRPC {c['grpc']} (every second client)" if c["grpc"] else "")
                 + f"; model {c['model']}; max_tokens {c['max_tokens']}, temperature 0; prompts: "
                 f"{c['prompts']} Spec-Bench dev first turns; started {report['started_at']}.")
    lines.append("")
    lines.append(f"**{'PASS' if report['ok'] else 'FAIL'}**: {s['requests']} requests, {s['errors']} errors; "
                 f"latency p50 {_fmt(s['p50_s'])} s, p99 {_fmt(s['p99_s'])} s; time to first token p50 "
                 f"{_fmt(s['ttft_p50_s'])} s, p99 {_fmt(s['ttft_p99_s'])} s; {_fmt(s['tokens_per_s'], 1)} "
                 f"tokens/s; rows held at the end {_fmt(report['end']['rows_held'], 0)}; "
                 f"checkpoints left {_fmt(report['end']['checkpoints_left'], 0)}; "
                 f"memory flagged: {', '.join(s['memory_flagged']) or 'none'}.")
    lines.append("")
    for name, ok in report["checks"].items():
        lines.append(f"- [{'x' if ok else ' '}] {name}")
    lines.append("")
    lines.append(f"## Requests per {c['window_s']:.0f} s window (by end time)")
    lines.append("")
    lines.append("| window | requests | errors | p50 s | p99 s | TTFT p50 s | TTFT p99 s | tokens/s |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for w in report["windows"]:
        lines.append(f"| {w['start_s']:.0f}-{w['end_s']:.0f} s | {w['requests']} | {w['errors']} | "
                     f"{_fmt(w['p50_s'])} | {_fmt(w['p99_s'])} | {_fmt(w['ttft_p50_s'])} | "
                     f"{_fmt(w['ttft_p99_s'])} | {_fmt(w['tokens_per_s'], 1)} |")
    if report["error_messages"]:
        lines.append("")
        lines.append("Errors (first of each kind):")
        lines.append("")
        for msg, n in report["error_messages"].items():
            lines.append(f"- {n} x `{msg}`")
    lines.append("")
    lines.append(f"## Resident memory (sampled every {c['sample_every_s']:g} s; slopes: least squares over "
                 f"the second half, {c['duration_s'] / 2:.0f}-{c['duration_s']:.0f} s)")
    lines.append("")
    lines.append(f"Actors from the {report['actor_source']}. Flagged when the high-water mark (the largest "
                 f"RSS so far held for {HELD_SAMPLES} samples in a row) rises faster than "
                 f"{c['max_slope_mb_per_min']:g} MB/min, or than "
                 f"{c['max_growth_pct']:g} % of RSS per 10 min when over {c['noise_slope_mb_per_min']:g} MB/min.")
    lines.append("")
    lines.append("| process | pid | samples | start MB | half MB | end MB | after settle MB | slope MB/min | "
                 "% per 10 min | high-water slope MB/min | high-water % per 10 min | flag |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for m in report["memory"]:
        label = m["class"] if m["key"].startswith("process:") or not m["name"] else f"{m['class']}"
        flag = ("GROWS" if m["flagged"] else "flat") + (" (restarted)" if m["restarted"] else "")
        lines.append(f"| {label} | {','.join(map(str, m['pids']))} | {m['samples']} | {_fmt(m['rss_start_mb'], 1)} | "
                     f"{_fmt(m['rss_half_mb'], 1)} | {_fmt(m['rss_end_mb'], 1)} | {_fmt(m['rss_after_mb'], 1)} | "
                     f"{_fmt(m['slope_mb_per_min'], 3)} | {_fmt(m['growth_pct_per_10min'], 3)} | "
                     f"{_fmt(m['peak_slope_mb_per_min'], 3)} | {_fmt(m['peak_growth_pct_per_10min'], 3)} | {flag} |")
    e = report["end"]
    lines.append("")
    lines.append(f"## At the end (after the clients stopped and {e['settled_s']:.1f} s of settling)")
    lines.append("")
    lines.append("| what | value |")
    lines.append("|---|---:|")
    lines.append(f"| verifier rows held (sum over {e['verifiers']} verifier(s)) | {_fmt(e['rows_held'], 0)} |")
    lines.append(f"| drafter requests held (sum over {e['drafters']} pool(s)) | "
                 f"{_fmt(e['drafter_requests_held'], 0)} |")
    lines.append(f"| peak rows held while running | {_fmt(e['peak_rows_held'], 0)} |")
    lines.append(f"| metrics scrape errors (ingress counter) | {_fmt(e['scrape_errors'], 0)} |")
    st = report["store"]
    lines.append("")
    lines.append(f"### State store: {st['kind']}")
    lines.append("")
    if st["kind"] == "redis":
        lines.append(f"Keys under `{st['prefix']}` by kind (cluster/state.py's layout) at the end:")
        lines.append("")
        lines.append("| kind | keys |")
        lines.append("|---|---:|")
        for k, n in st["keys_at_end"].items():
            lines.append(f"| `{k}` | {n} |")
        if not st["keys_at_end"]:
            lines.append("| (none) | 0 |")
        lines.append("")
        lines.append(f"Checkpoints (`ckpt:*`, TTL {CHECKPOINT_TTL_S:g} s, deleted on release): "
                     f"{st['checkpoints_at_end']} at the end"
                     + (f" (seconds left: min {min(st['checkpoint_ttls_s']):.0f}, max "
                        f"{max(st['checkpoint_ttls_s']):.0f})" if st["checkpoint_ttls_s"] else "")
                     + (f"; {st['checkpoints_after_wait']} after waiting {st['waited_s']:.0f} s"
                        if st["checkpoints_after_wait"] is not None else "")
                     + f"; peak while running {_fmt(st['peak_checkpoints'], 0)}.")
    elif st["kind"] == "embedded":
        lines.append(f"Checkpoints (counted through the state actor, `count_checkpoints`): "
                     f"{st['checkpoints_at_end']} at the end; peak while running {_fmt(st['peak_checkpoints'], 0)}.")
    else:
        lines.append("Not inspected (no state actor in the cluster and no Redis URL).")
    if report["sampler_errors"]:
        lines.append("")
        lines.append(f"Sampler errors: {len(report['sampler_errors'])} (first: `{report['sampler_errors'][0]}`)")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--http", default="http://127.0.0.1:8000", help="the server's HTTP base URL")
    p.add_argument("--grpc", default="", help="the server's gRPC host:port: every second client uses it")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--minutes", type=float, default=10.0, help="how long the clients run")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--questions", type=Path, default=QUESTIONS, help="Spec-Bench dev.jsonl")
    p.add_argument("--max-prompt-chars", type=int, default=0,
                   help="only prompts at most this long (a server with a short max_len refuses longer ones)")
    p.add_argument("--out", type=Path, default=Path("soak.json"), help="the JSON; the markdown goes beside (.md)")
    p.add_argument("--window", type=float, default=60.0, help="seconds per reporting window")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between memory samples")
    p.add_argument("--settle", type=float, default=30.0,
                   help="after the clients stop, wait up to this long for every row to be freed")
    p.add_argument("--ckpt-wait", type=float, default=0.0,
                   help="Redis: if checkpoints are left, wait up to this long for their TTLs")
    p.add_argument("--max-slope", type=float, default=5.0,
                   help="flag a high-water mark rising faster than this (MB/min)")
    p.add_argument("--max-growth-pct", type=float, default=1.0,
                   help="flag high-water growth above this %% of RSS per 10 min, when also above --noise-slope")
    p.add_argument("--noise-slope", type=float, default=0.5,
                   help="MB/min: a slope under this is never flagged by --max-growth-pct")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY", ""))
    p.add_argument("--ray-address", default="",
                   help="the server's Ray cluster (default: found from the HTTP port's process, else 'auto')")
    p.add_argument("--no-ray", action="store_true", help="sample no actor memory (the server is remote)")
    p.add_argument("--redis-url", default=os.environ.get("SPECSERVE_REDIS_URL", ""),
                   help="the server's Redis (default: SPECSERVE_REDIS_URL)")
    p.add_argument("--redis-prefix", default="specserve:")
    a = p.parse_args(argv)
    a.http = a.http.rstrip("/")
    if a.clients < 1 or a.minutes <= 0 or a.max_tokens < 1:
        p.error("--clients, --minutes and --max-tokens must be positive")
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with urllib.request.urlopen(urllib.request.Request(f"{args.http}/v1/models", headers=headers), timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    prompts = load_prompts(args.questions, args.max_prompt_chars)
    duration = args.minutes * 60
    url = urllib.parse.urlsplit(args.http)
    http_port = url.port or (443 if url.scheme == "https" else 80)

    actors, system, store, joined = None, {}, None, None
    if not args.no_ray:
        address, auth_mode = (ray_cluster_of_port(http_port) if _local(url.hostname or "") and not args.ray_address
                              else (args.ray_address or None, None))
        joined = connect_ray(address, auth_mode)
        import ray
        actors = ActorSource()
        system = system_processes(http_port) if _local(url.hostname or "") else {}
        try:
            embedded = ray.get_actor(STATE_ACTOR, namespace=NAMESPACE)
        except ValueError:  # no state actor: the server keeps its state in Redis
            embedded = None
        store = Store(args.redis_url or None, args.redis_prefix, embedded)
    elif args.redis_url:
        store = Store(args.redis_url, args.redis_prefix, None)

    t0 = time.monotonic()
    started_at = time.strftime("%Y-%m-%d %H:%M:%S")
    rec = Recorder(t0)
    sampler = Sampler(args.sample_every, rec, args.http, headers, actors, system, store)
    sampler.start()
    stop = threading.Event()
    threads = [threading.Thread(target=client_loop, args=(i, args, model, prompts, rec, stop), name=f"soak-{i}",
                                daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    with tqdm(total=round(duration), unit="s", desc="soak", disable=None) as bar:
        said = 0  # windows reported on a line (when the bar is off: no terminal)
        while (elapsed := rec.now()) < duration:
            time.sleep(min(1.0, duration - elapsed))
            bar.update(min(round(rec.now()), bar.total) - bar.n)
            done, _ = rec.snapshot()
            recent = [r["latency"] for r in done[-200:] if not r["error"]]
            errors = sum(1 for r in done if r["error"])
            bar.set_postfix(requests=len(done), errors=errors, p99=pct(recent, 99), refresh=False)
            if bar.disable and rec.now() >= (said + 1) * args.window:
                said += 1
                print(f"soak: {rec.now():.0f}/{duration:.0f} s, {len(done)} requests, {errors} errors, "
                      f"recent p99 {pct(recent, 99)} s", flush=True)
    stop.set()
    for t in threads:  # requests in flight finish (none is cancelled)
        t.join(timeout=args.request_timeout + 30)
    load_end = rec.now()

    # settle: every row and drafter request freed
    settle_start, held = rec.now(), None
    while True:
        try:
            held = scrape_held(args.http, headers)
        except Exception as e:  # noqa: BLE001
            sampler.errors.append(f"settle metrics: {_error_text(e)}")
        if held and held["rows_held"] == 0 and not held["drafter_requests_held"]:
            break
        if rec.now() - settle_start >= args.settle:
            break
        time.sleep(1.0)
    settled = rec.now() - settle_start
    sampler.sample()  # the memory after settling
    sampler.stop_event.set()
    sampler.join(timeout=60)

    records, _ = rec.snapshot()
    records.sort(key=lambda r: r["start"])
    ok_records = [r for r in records if not r["error"]]
    lat = [r["latency"] for r in ok_records]
    ttft = [r["ttft"] for r in ok_records if r["ttft"] is not None]
    errors_by_msg: dict[str, int] = defaultdict(int)
    for r in records:
        if r["error"]:
            errors_by_msg[r["error"][:200]] += 1

    # the state store
    st: dict[str, Any] = {"kind": store.kind if store else "unknown", "prefix": args.redis_prefix,
                          "keys_at_end": {}, "checkpoints_at_end": None, "checkpoint_ttls_s": [],
                          "checkpoints_after_wait": None, "waited_s": 0.0,
                          "peak_checkpoints": max((p["checkpoints"] for p in sampler.ckpt), default=None),
                          "series": sampler.ckpt}
    if store is not None and store.kind != "unknown":
        if store.redis is not None:
            st["keys_at_end"] = store.keys_by_kind()
            st["checkpoint_ttls_s"] = store.checkpoint_ttls()
            st["checkpoints_at_end"] = len(st["checkpoint_ttls_s"])
            if st["checkpoints_at_end"] and args.ckpt_wait > 0:
                wait = min(args.ckpt_wait, max(st["checkpoint_ttls_s"]) + 1)
                time.sleep(wait)
                st["waited_s"] = wait
                st["checkpoints_after_wait"] = len(store.checkpoint_ttls())
        else:
            st["checkpoints_at_end"] = store.checkpoints()
    checkpoints_left = (st["checkpoints_after_wait"] if st["checkpoints_after_wait"] is not None
                        else st["checkpoints_at_end"])

    memory = memory_report(sampler.memory, duration, args.max_slope, args.max_growth_pct, args.noise_slope)
    held = held or {}
    end = {"rows_held": held.get("rows_held"), "verifiers": held.get("verifiers", 0),
           "drafter_requests_held": held.get("drafter_requests_held"), "drafters": held.get("drafters", 0),
           "scrape_errors": held.get("scrape_errors"), "settled_s": round(settled, 1),
           "peak_rows_held": max((h["rows_held"] or 0 for h in sampler.held), default=None),
           "checkpoints_left": checkpoints_left}
    checks = {
        "0 errors": not any(r["error"] for r in records) and bool(records),
        "every verifier row freed": end["rows_held"] == 0,
        "every drafter request freed": end["drafter_requests_held"] in (0, None) and end["drafters"] > 0,
        "memory flat (no actor flagged)": bool(memory) and not any(m["flagged"] for m in memory),
        "no actor restarted": not any(m["restarted"] for m in memory),
        "no checkpoint left": checkpoints_left == 0 if checkpoints_left is not None else False,
    }
    if args.no_ray:
        checks.pop("memory flat (no actor flagged)")
        checks.pop("no actor restarted")
    report = {
        "started_at": started_at,
        "config": {"http": args.http, "grpc": args.grpc, "model": model, "clients": args.clients,
                   "duration_s": duration, "max_tokens": args.max_tokens, "prompts": len(prompts),
                   "window_s": args.window, "sample_every_s": args.sample_every, "settle_s": args.settle,
                   "max_slope_mb_per_min": args.max_slope, "max_growth_pct": args.max_growth_pct,
                   "noise_slope_mb_per_min": args.noise_slope,
                   "ray_address": joined, "cores": os.cpu_count()},
        "summary": {"requests": len(records), "errors": len(records) - len(ok_records),
                    "http_requests": sum(r["api"] == "http" for r in records),
                    "grpc_requests": sum(r["api"] == "grpc" for r in records),
                    "p50_s": pct(lat, 50), "p99_s": pct(lat, 99), "ttft_p50_s": pct(ttft, 50),
                    "ttft_p99_s": pct(ttft, 99), "tokens": sum(r["tokens"] for r in ok_records),
                    "tokens_per_s": round(sum(r["tokens"] for r in ok_records) / max(load_end, 1e-9), 2),
                    "load_s": round(load_end, 1),
                    "memory_flagged": [m["class"] for m in memory if m["flagged"]]},
        "checks": checks,
        "ok": all(checks.values()),
        "windows": windows(records, duration, args.window),
        "error_messages": dict(errors_by_msg),
        "actor_source": {"state-api": "Ray state API", "gcs": "GCS actor table"}.get(
            actors.kind if actors else "", "nowhere (--no-ray)"),
        "memory": memory,
        "held_series": sampler.held,
        "end": end,
        "store": st,
        "sampler_errors": sampler.errors,
        "requests": records,
    }
    md = markdown(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    if not args.no_ray:
        import ray

        ray.shutdown()
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
