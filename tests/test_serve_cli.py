"""`specserve serve` as a user starts it (the README's main job): a local Ray
cluster, the embedded store, the router on the asked port; a client gets an
answer; a second server on the same ports refuses to start; SIGTERM stops it
cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from serve_process import free_port
from specserve.client import Client


def listeners(port: int) -> set[int]:
    return {c.pid for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
            and c.laddr.port == port}


def test_serve_answers_and_stops_on_sigterm(tmp_path):
    port, http_port = free_port(), free_port()
    config = tmp_path / "serve.toml"
    config.write_text('[drafter_pools]\nkinds = ["pld"]\n[verifiers]\nmax_len = 1024\nthreads = 1\n')
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "SPECSERVE_REDIS_URL")}
    command = [sys.executable, "-m", "commands.cli", "serve", "--config", str(config), "--port", str(port),
               "--http-port", str(http_port)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if "serving on" in line:
                break
        assert any(f":{port}" in line and "serving on" in line for line in lines), "".join(lines)
        with Client(f"127.0.0.1:{port}", timeout=120) as client:
            out = client.generate(messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
        assert len(out.token_ids) == 8 and out.text
        assert (Path.home() / ".ray" / "auth_token").stat().st_mode & 0o777 == 0o600  # a credential
        owners = {p.pid for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]}
        held = {p: listeners(p) for p in (port, http_port)}
        assert all(held.values()) and set().union(*held.values()) <= owners
        # a second server on the same ports refuses, naming the port, before it starts anything
        second = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        assert second.returncode == 2 and f"127.0.0.1:{port} is in use" in second.stderr, second.stderr
        assert {p: listeners(p) for p in (port, http_port)} == held  # the first serves alone
        with Client(f"127.0.0.1:{port}", timeout=120) as client:
            assert client.generate(messages=[{"role": "user", "content": "Say hello."}], max_tokens=8).text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        # what the user reads: specserve's own lines, nothing that reads as a fault when there is none
        said = "".join(lines) + proc.stdout.read()
        for noise in ("Connecting to existing Serve app", "(raylet)", "killed by `ray.kill`", "Traceback"):
            assert noise not in said, said
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
