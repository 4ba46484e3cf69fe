"""A local Ray start that stalls is cleaned up and retried (cluster.ray_start).

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


@pytest.fixture(autouse=True)
def no_pause(monkeypatch):
    monkeypatch.setattr(ray_start, "PAUSE_S", 0.0)


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
    # names what it stopped and what that was doing
    assert "stalled" in caplog.text and "Left running: python " in caplog.text, caplog.text


def test_every_try_stalling_is_raised_naming_each_stall(monkeypatch, tmp_path):
    init, calls, children = fake_init([RAY_STALL, GCS_STALL, RAY_STALL])

    def init_making_a_session(**kwargs):
        session = tmp_path / f"session_2026-11-29_00-54-3{len(calls)}_447631_1" / "logs"
        session.mkdir(parents=True)
        (session / "gcs_server.out").write_text("")
        init(**kwargs)

    monkeypatch.setattr(ray_start.ray, "init", init_making_a_session)
    with pytest.raises(ray_start.RayStartStalled) as info:
        ray_start.start_local_ray(_temp_dir=str(tmp_path))
    assert len(calls) == ray_start.ATTEMPTS == 3
    message = str(info.value)
    assert [f"try {n}:" in message for n in (1, 2, 3)] == [True] * 3, message
    assert "timed out during startup" in message and "Timed out waiting for file" in message
    assert "Session session_2026-11-29_00-54-30_447631_1 logs: gcs_server.out." in message  # the raylet wrote none
    assert all(child.poll() is not None for child in children), "a stalled start's process was left running"


def test_other_errors_are_raised_untouched(monkeypatch):
    init, calls, children = fake_init([ValueError("bad resources")])
    monkeypatch.setattr(ray_start.ray, "init", init)
    with pytest.raises(ValueError, match="bad resources"):
        ray_start.start_local_ray()
    assert len(calls) == 1  # not a stall: not retried, and nothing it started is touched
    assert psutil.pid_exists(children[0].pid) and children[0].poll() is None
    children[0].kill()
    children[0].wait()
