"""Served against in process with the verifier on a core of its own (docs/BENCHMARKS.md,
"What the served gap is made of"), as a deployment with the verifier on hardware of its own has it.

Starts `specserve serve --config CONFIG` (a config that pins the verifier to core 0 and the pools
to core 1, e.g. bench/configs/served_own_core.toml), moves every other process of that server to
core 1 once it serves, runs the in-process modes on core 0 (one torch thread, beside the idle
server), then the served modes from core 1, and stops the server:

    python scripts/own_core_served.py --config bench/configs/served_own_core.toml --out-dir /tmp/own

The served run also decodes `ar` in process (on core 1, its speed not compared) so that the bench
checks every served output against plain decoding. Only the server's own process tree is moved.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

SERVING_LINE = "serving on"


def descendants(root: int) -> list[int]:
    """`root` and every process under it."""
    proc = psutil.Process(root)
    return [root, *(child.pid for child in proc.children(recursive=True))]


def pin_all_but(root: int, keep_core: int, to_core: int) -> list[str]:
    """Every thread of every process under `root` that may run elsewhere than `keep_core` alone
    goes to `to_core`; what is pinned to `keep_core` (the verifier) stays. Returns what moved."""
    moved = []
    for pid in descendants(root):
        try:
            if os.sched_getaffinity(pid) == {keep_core}:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), {to_core})
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                moved.append(f.read().replace(b"\0", b" ").decode(errors="replace")[:60])
        except (OSError, psutil.Error):
            continue  # a process that ended meanwhile
    return moved


def bench(core: int, modes: list[str], args: argparse.Namespace, out: Path, server: bool) -> dict:
    cmd = ["taskset", "-c", str(core), "specserve", "bench", "--questions", args.questions,
           "--limit-per-category", str(args.limit_per_category), "--max-tokens", str(args.max_tokens),
           "--repeats", "1", "--modes", *modes, "--out", str(out)]
    if server:
        cmd += ["--server", args.server]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def overall(report: dict) -> dict[str, float]:
    return {r["mode"]: r["tokens_per_s"] for r in report["results"] if r["category"] == "overall"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a server config pinning the verifier to core 0")
    parser.add_argument("--server", default="127.0.0.1:50061", help="the config's gRPC address")
    parser.add_argument("--http-port", type=int, default=8061)
    parser.add_argument("--questions", default="../shared/data/spec_bench/dev.jsonl")
    parser.add_argument("--limit-per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=["suffix"], help="drafters, in process and served")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--start-timeout", type=float, default=300.0)
    args = parser.parse_args()
    if not {0, 1} <= os.sched_getaffinity(0):
        sys.exit("own_core_served: needs cores 0 and 1")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log = open(args.out_dir / "serve.log", "w")
    server = subprocess.Popen(["specserve", "serve", "--config", args.config, "--http-port", str(args.http_port)],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + args.start_timeout
        while SERVING_LINE not in (args.out_dir / "serve.log").read_text():
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"own_core_served: the server did not start; see {args.out_dir / 'serve.log'}")
            time.sleep(2)
        time.sleep(5)  # the replicas' first health checks
        moved = pin_all_but(server.pid, keep_core=0, to_core=1)
        print(f"moved {len(moved)} processes of the server to core 1", flush=True)
        local = overall(bench(0, ["ar", *args.modes], args, args.out_dir / "in_process.json", server=False))
        served_report = bench(1, ["ar", "served-ar", *(f"served-{m}" for m in args.modes)], args,
                              args.out_dir / "served.json", server=True)
        served = overall(served_report)
        for mode in ["ar", *args.modes]:
            print(f"served-{mode} / {mode}: {served[f'served-{mode}'] / local[mode]:.2f}x "
                  f"({served[f'served-{mode}']:.1f} / {local[mode]:.1f} tokens/s)")
        print("served outputs equal to ar's:", served_report.get("identical_to_ar"))
    finally:
        subprocess.run(["ray", "stop", "--force"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
