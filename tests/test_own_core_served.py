"""scripts/own_core_served.py moves the server's own processes to the other core, and only them:
what is pinned to the verifier's core stays, and nothing outside the server's process tree moves."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "scripts" / "own_core_served.py"

pytestmark = pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs cores 0 and 1")


def load():
    spec = importlib.util.spec_from_file_location("own_core_served", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def children_of(script, pid: int, want: int, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = script.descendants(pid)[1:]
        if len(found) >= want:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{pid} did not start {want} children")


def test_only_the_server_tree_moves_and_the_verifier_core_stays():
    script = load()
    # a "server" with two children: one pinned to core 0 (the verifier), one free
    server = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time\n"
        "pinned = subprocess.Popen(['sleep', '30']); os.sched_setaffinity(pinned.pid, {0})\n"
        "free = subprocess.Popen(['sleep', '30'])\n"
        "time.sleep(30)\n")])
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        kids = children_of(script, server.pid, 2)
        pinned = [p for p in kids if os.sched_getaffinity(p) == {0}]
        free = [p for p in kids if p not in pinned]
        assert len(pinned) == 1 and len(free) == 1
        before = os.sched_getaffinity(bystander.pid)

        moved = script.pin_all_but(server.pid, keep_core=0, to_core=1)

        assert len(moved) == 2  # the server and its free child
        assert os.sched_getaffinity(server.pid) == {1}
        assert os.sched_getaffinity(free[0]) == {1}
        assert os.sched_getaffinity(pinned[0]) == {0}
        assert os.sched_getaffinity(bystander.pid) == before
        assert os.sched_getaffinity(0) >= {0, 1}  # the caller itself is not moved
    finally:
        for p in script.descendants(server.pid)[1:]:
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass
        server.kill()
        bystander.kill()
        server.wait()
        bystander.wait()
