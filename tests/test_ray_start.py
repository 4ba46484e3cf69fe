"""A local Ray start that stalls is cleaned up and retried once (cluster.ray_start).

The stall itself (a raylet that never registers within Ray's fixed 30 s, a GCS that
never publishes its port) cannot be made on demand, so ray.init is replaced: its first
call leaves a real child process running, as a stalled start does, and raises Ray's
exception (scripts/ray_stall_check.py makes both stalls for real)."""

from __future__ import annotations

import logging
import subprocess
import sys

import psutil
import pytest

from cluster import ray_start

RAY_STALL = Exception("The current node timed out during startup. This could happen because some of the "
                      "raylet failed to startup or the GCS has become overloaded.")
GCS_STALL = RuntimeError("Timed out waiting for file /tmp/ray/session_2026-11-27_18-31-33_734949_30709/"
                         "gcs_server_port_e4c129ea29f1e22e629c930d5b83321d2bae77571b3791035ed96ec0")


def fake_init(outcomes: list):
    calls, children = [], []

    def init(**kwargs):
        calls.append(kwargs)
        outcome = outcomes.pop(0)
        if outcome is not None:
            children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
            raise outcome
    return init, calls, children


@pytest.mark.parametrize("stall", [RAY_STALL, GCS_STALL], ids=["raylet", "gcs"])
def test_a_stalled_start_is_stopped_and_started_again(monkeypatch, caplog, stall):
    init, calls, children = fake_init([stall, None])
    monkeypatch.setattr(ray_start.ray, "init", init)
    with caplog.at_level(logging.WARNING, logger=ray_start.__name__):
        ray_start.start_local_ray(num_cpus=2, namespace="x")
    assert calls == [{"num_cpus": 2, "namespace": "x"}] * 2
    assert children[0].poll() is not None, "the stalled start's process was left running"
    assert "stalled" in caplog.text and "python" in caplog.text  # names what it stopped


def test_a_second_stall_and_other_errors_are_raised(monkeypatch):
    init, calls, children = fake_init([RAY_STALL, RAY_STALL])
    monkeypatch.setattr(ray_start.ray, "init", init)
    with pytest.raises(Exception, match="timed out during startup"):
        ray_start.start_local_ray()
    assert len(calls) == 2
    for child in children:
        child.kill()
        child.wait()

    init, calls, children = fake_init([ValueError("bad resources")])
    monkeypatch.setattr(ray_start.ray, "init", init)
    with pytest.raises(ValueError, match="bad resources"):
        ray_start.start_local_ray()
    assert len(calls) == 1  # not a stall: not retried, and nothing it started is touched
    assert psutil.pid_exists(children[0].pid) and children[0].poll() is None
    children[0].kill()
    children[0].wait()
