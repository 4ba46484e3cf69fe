"""Starting a local Ray cluster, once more when its first start stalls.

Ray gives a starting raylet 30 s to register with the GCS (a constant in its code).
Now and then, on a busy 2-core machine, the first start of a process never
registers: a raylet or GCS that writes no log at all. The processes that start left
behind are stopped (named in the warning, with how each ended, for diagnosis) and
Ray starts again, once."""

from __future__ import annotations

import logging

import psutil
import ray

log = logging.getLogger(__name__)

STALLED = "timed out during startup"


def start_local_ray(**init_kwargs) -> None:
    """`ray.init(**init_kwargs)` starting a new local cluster; a stalled start is retried once."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    try:
        ray.init(**init_kwargs)
        return
    except Exception as e:  # Ray raises a bare Exception for this
        if STALLED not in str(e):
            raise
        left = [p for p in me.children(recursive=True) if p.pid not in before]
        log.warning("Ray's start stalled (%s); stopping what it left running (%s) and starting again",
                    e, ", ".join(_describe(p) for p in left) or "nothing")
        _stop(left)
    ray.init(**init_kwargs)


def _describe(p: psutil.Process) -> str:
    try:
        name = p.name()
        if p.status() == psutil.STATUS_ZOMBIE:
            return f"{name} exited with {p.wait(0)}"
        return f"{name} {p.status()}"
    except psutil.Error:
        return f"pid {p.pid} gone"


def _stop(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)
