"""Starting a local Ray cluster, once more when its first start stalls.

Ray gives a starting raylet 30 s to register with the GCS (a constant in its code),
and a starting GCS `RAY_gcs_server_port_wait_time_s` (30 s by default) to publish its
port. Now and then, on a busy 2-core machine, the first start of a process does
neither: a raylet or GCS that writes no log at all. The processes that start left
behind are stopped (named in the warning, with how each ended, for diagnosis) and
Ray starts again, once."""

from __future__ import annotations

import logging
import os

import psutil
import ray

log = logging.getLogger(__name__)

# what ray.init raises when the raylet did not register, or when a process it waits on (the GCS
# first) did not publish its port in a file
STALLED = ("timed out during startup", "Timed out waiting for file")


def start_local_ray(**init_kwargs) -> None:
    """`ray.init(**init_kwargs)` starting a new local cluster; a stalled start is retried once."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    try:
        ray.init(**init_kwargs)
        return
    except Exception as e:  # Ray raises a bare Exception or a RuntimeError for these
        if not any(marker in str(e) for marker in STALLED):
            raise
        left = [p for p in me.children(recursive=True) if p.pid not in before]
        log.warning("Ray's start stalled (%s); stopping what it left running (%s) and starting again",
                    e, ", ".join(_describe(p) for p in left) or "nothing")
        _stop(left)
    ray.init(**init_kwargs)


def _describe(p: psutil.Process) -> str:
    try:
        if p.status() == psutil.STATUS_ZOMBIE:  # its command line is gone, its name is not
            return f"{p.name()} exited with {p.wait(0)}"
        return f"{_name(p)} {p.status()}"
    except psutil.Error:
        return f"pid {p.pid} gone"


def _name(p: psutil.Process) -> str:
    """The program, or for Python the script it runs (Ray's monitors and dashboard are scripts)."""
    args = p.cmdline()
    program = os.path.basename(args[0]) if args else p.name()
    script = next((a for a in args[1:] if a.endswith(".py")), None) if program.startswith("python") else None
    return os.path.basename(script) if script else program


def _stop(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)
