"""`specserve serve` as a user starts it, in a subprocess on free ports, for the tests
that need the whole application (HTTP, soak)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

START_TIMEOUT_S = 300
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    http: str  # http://127.0.0.1:PORT
    grpc: str  # 127.0.0.1:PORT
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)  # what it printed so far


@contextmanager
def specserve_serve(config: Path, config_text: str,
                    while_starting: Callable[[str], None] | None = None) -> Iterator[Served]:
    """Write `config_text` to `config`, start `specserve serve` with it (local Ray cluster,
    embedded store), call `while_starting(http base)` every 0.2 s until it says it is serving,
    yield it, and stop it with SIGINT."""
    config.write_text(config_text)
    http, grpc_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "SPECSERVE_REDIS_URL")}
    proc = subprocess.Popen([sys.executable, "-m", "commands.cli", "serve", "--config", str(config), "--port",
                             str(grpc_port), "--http-port", str(http)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    served = Served(f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc_port}", proc)
    threading.Thread(target=lambda: served.lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and not any("serving on" in line for line in served.lines):
            assert proc.poll() is None, "".join(served.lines)
            if while_starting is not None:
                while_starting(served.http)
            time.sleep(0.2)
        assert any("serving on" in line for line in served.lines), "".join(served.lines)
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
