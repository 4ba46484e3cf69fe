"""A real, throwaway redis-server for tests.

Use from a test module:

    from redis_server import redis_server_fixture
    redis_url = redis_server_fixture()

Tests fail (not skip) when redis-server is missing: the Redis store must be
tested wherever the suite runs; scripts/install_redis.sh installs it.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import pytest
import redis

START_TIMEOUT_S = 10.0
PORT_ATTEMPTS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_ping(proc: subprocess.Popen, url: str) -> bool:
    """True once the server answers PING; False if it exited first."""
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    return True
            time.sleep(0.05)
    finally:
        client.close()
    raise TimeoutError(f"redis-server at {url} did not answer PING within {START_TIMEOUT_S} s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def running_redis(workdir: Path) -> Iterator[str]:
    """Run redis-server on a free loopback port, without persistence; yield its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not on PATH; install it with scripts/install_redis.sh", pytrace=False)
    log_path = workdir / "redis.log"
    # The free port may be taken between probing and binding; then redis
    # exits at once and we retry with another.
    for _ in range(PORT_ATTEMPTS):
        port = _free_port()
        url = f"redis://127.0.0.1:{port}/0"
        with open(log_path, "ab") as log:
            args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir)]
            args += ["--save", "", "--appendonly", "no"]  # nothing written to disk
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        try:
            if _wait_for_ping(proc, url):
                yield url
                return
        finally:
            _stop(proc)
    pytest.fail(f"redis-server would not start; log:\n{log_path.read_text()[-2000:]}", pytrace=False)


def redis_server_fixture(scope: Literal["session", "package", "module"] = "session") -> Callable:
    """A fixture yielding the URL of a fresh redis-server, stopped at the end of `scope`."""

    @pytest.fixture(scope=scope)
    def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
        with running_redis(tmp_path_factory.mktemp("redis")) as url:
            yield url

    return redis_url
