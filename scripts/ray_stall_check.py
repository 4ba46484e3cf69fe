"""Make a stalled Ray start for real and check that start_local_ray recovers from it.

The first start gets a stand-in raylet that sleeps instead of registering, so Ray's
own 30 s wait runs out; start_local_ray must stop what that start left running (named
in its warning) and start a working cluster. About 35 s:

    python scripts/ray_stall_check.py
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import psutil
import ray
import ray._private.services as services

from cluster.ray_start import start_local_ray


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    real_raylet = services.RAYLET_EXECUTABLE
    stand_in = Path(tempfile.mkdtemp()) / "raylet"
    stand_in.write_text("#!/bin/sh\nexec sleep 600\n")
    stand_in.chmod(0o755)
    attempts = []
    init = ray.init

    def stalling_first_init(**kwargs):
        attempts.append(kwargs)
        services.RAYLET_EXECUTABLE = str(stand_in) if len(attempts) == 1 else real_raylet
        return init(**kwargs)

    ray.init = stalling_first_init
    started = time.monotonic()
    try:
        start_local_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)
        left = [p.pid for p in psutil.Process().children(recursive=True) if "sleep" in " ".join(p.cmdline())]
        alive = sum(node["Alive"] for node in ray.nodes())
        answer = ray.get(ray.remote(lambda: 42).remote())
        print(f"started in {time.monotonic() - started:.1f} s after {len(attempts)} attempts; nodes alive: {alive}; "
              f"stand-in raylets left: {len(left)}; a task answered {answer}")
        assert len(attempts) == 2 and alive == 1 and not left and answer == 42
    finally:
        ray.init = init
        ray.shutdown()
        os.unlink(stand_in)


if __name__ == "__main__":
    main()
