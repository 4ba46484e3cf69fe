"""`specserve serve` as a user starts it (the README's main job): a local Ray
cluster, the embedded store, the router on the asked port; a client gets an
answer; SIGTERM stops it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from serve_process import free_port
from specserve.client import Client


def test_serve_answers_and_stops_on_sigterm(tmp_path):
    port = free_port()
    config = tmp_path / "serve.toml"
    config.write_text('[drafter_pools]\nkinds = ["pld"]\n[verifiers]\nmax_len = 1024\nthreads = 1\n')
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "SPECSERVE_REDIS_URL")}
    proc = subprocess.Popen([sys.executable, "-m", "commands.cli", "serve", "--config", str(config),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
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
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
