"""Starting a local Ray cluster (or joining one), again when a start stalls.

Ray gives a starting raylet 30 s to register with the GCS (a constant in its code),
and a starting GCS `RAY_gcs_server_port_wait_time_s` (30 s by default) to publish its
port. Now and then, on a busy 2-core machine, a start does neither: a raylet or GCS that
writes no log at all, and sometimes twice in a row. The processes a stalled start left
are stopped, each stall is described (what each process was doing, which of the
session's logs exist) in a warning, and Ray starts again, up to `ATTEMPTS` times; the
error after the last names every stall."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import psutil
import ray

log = logging.getLogger(__name__)

# what ray.init raises when the raylet did not register, or when a process it waits on (the GCS
# first) did not publish its port in a file
STALLED = ("timed out during startup", "Timed out waiting for file")
ATTEMPTS = 3
PAUSE_S = 5.0  # between attempts: what held up a start may be passing load


def init_ray(cfg) -> None:
    """Join RAY_ADDRESS, or start a local cluster offering the services' resources
    (`cfg`: a cluster.config.ServeConfig)."""
    from .actors import NAMESPACE

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(namespace=NAMESPACE, log_to_driver=False, logging_level=logging.getLogger("ray").getEffectiveLevel())
        return
    resources: dict[str, float] = {}
    for part in (cfg.verifiers, cfg.drafter_pools):
        most = max(part.count, part.max_count or 0)  # room for every replica autoscaling may start
        for name, amount in part.resources.items():
            resources[name] = resources.get(name, 0) + amount * most
    start_local_ray(namespace=NAMESPACE, resources=resources, include_dashboard=False, log_to_driver=False,
                    logging_level=logging.getLogger("ray").getEffectiveLevel())
    keep_private(RAY_AUTH_TOKEN)


# the credential a new local cluster's processes authenticate with (Ray writes it at start)
RAY_AUTH_TOKEN = Path.home() / ".ray" / "auth_token"


def keep_private(path: Path) -> None:
    """Make a credential readable by its owner only (Ray writes its token with the umask's mode)."""
    try:
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
    except FileNotFoundError:
        pass


class RayStartStalled(RuntimeError):
    """Every attempt to start a local Ray cluster stalled."""


def start_local_ray(**init_kwargs) -> None:
    """`ray.init(**init_kwargs)` starting a new local cluster; a stalled start is retried."""
    me = psutil.Process()
    temp_dir = Path(init_kwargs.get("_temp_dir") or _default_temp_dir())
    stalls: list[str] = []
    for attempt in range(1, ATTEMPTS + 1):
        before = {p.pid for p in me.children(recursive=True)}
        sessions = _sessions(temp_dir)
        try:
            umask = os.umask(0o077)  # what Ray writes as it starts (its auth token) is for this user
            try:
                ray.init(**init_kwargs)
            finally:
                os.umask(umask)
            return
        except Exception as e:  # Ray raises a bare Exception or a RuntimeError for these
            if not any(marker in str(e) for marker in STALLED):
                raise
            left = [p for p in me.children(recursive=True) if p.pid not in before]
            stalls.append(f"try {attempt}: {e} Left running: {', '.join(_describe(p) for p in left) or 'nothing'}. "
                          f"{_session_logs(_sessions(temp_dir) - sessions)}")
            log.warning("Ray's start stalled (%s); stopping what it left running and starting again", stalls[-1])
            _stop(left)
        if attempt < ATTEMPTS:
            time.sleep(PAUSE_S)
    raise RayStartStalled(f"Ray's local start stalled {ATTEMPTS} times: " + " | ".join(stalls))


def _default_temp_dir() -> str:
    try:
        from ray._common.utils import get_default_ray_temp_dir  # Ray's own rule (RAY_TMPDIR, TMPDIR)
        return get_default_ray_temp_dir()
    except ImportError:
        return "/tmp/ray"


def _sessions(temp_dir: Path) -> set[Path]:
    try:
        return {p for p in temp_dir.glob("session_2*") if p.is_dir()}
    except OSError:
        return set()


def _session_logs(new: set[Path]) -> str:
    """Which process logs the stalled start's session has (a process that opened none never really ran)."""
    if not new:
        return "No new session directory."
    session = max(new, key=lambda p: p.stat().st_mtime)
    logs = sorted(p.name for p in (session / "logs").glob("*.*") if p.is_file())
    return f"Session {session.name} logs: {', '.join(logs) or 'none'}."


def _describe(p: psutil.Process) -> str:
    try:
        if p.status() == psutil.STATUS_ZOMBIE:  # its command line is gone, its name is not
            return f"{p.name()} exited with {p.wait(0)}"
        status = p.status()
        waiting = f" in {_wchan(p.pid)}" if status in (psutil.STATUS_SLEEPING, psutil.STATUS_DISK_SLEEP) else ""
        return f"{_name(p)} {status}{waiting} (threads: {p.num_threads()})"
    except psutil.Error:
        return f"pid {p.pid} gone"


def _name(p: psutil.Process) -> str:
    """The program, or for Python the script it runs (Ray's monitors and dashboard are scripts)."""
    args = p.cmdline()
    program = os.path.basename(args[0]) if args else p.name()
    script = next((a for a in args[1:] if a.endswith(".py")), None) if program.startswith("python") else None
    return os.path.basename(script) if script else program


def _wchan(pid: int) -> str:
    """The kernel function a sleeping process waits in (what a stalled process is stuck on)."""
    try:
        return Path(f"/proc/{pid}/wchan").read_text().strip() or "?"
    except OSError:
        return "?"


def _stop(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)
