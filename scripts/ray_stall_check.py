"""Make a stalled Ray start for real and check that start_local_ray recovers from it.

The first start gets a stand-in for one of Ray's processes that sleeps instead of
starting: a raylet that never registers, so Ray's own 30 s wait runs out, or (`--process
gcs`) a GCS that never publishes its port, with Ray's wait for it cut to 10 s.
start_local_ray must stop what that start left running (named in its warning) and start
a working cluster. About 35 s (raylet) or 15 s (gcs):

    python scripts/ray_stall_check.py [--process raylet|gcs]
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path

import psutil
import ray
import ray._private.services as services

from cluster.ray_start import start_local_ray

EXECUTABLES = {"raylet": "RAYLET_EXECUTABLE", "gcs": "GCS_SERVER_EXECUTABLE"}
GCS_WAIT_S = "10"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--process", choices=sorted(EXECUTABLES), default="raylet", help="which process stalls")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.process == "gcs":
        os.environ["RAY_gcs_server_port_wait_time_s"] = GCS_WAIT_S
    name = EXECUTABLES[args.process]
    real = getattr(services, name)
    stand_in = Path(tempfile.mkdtemp()) / os.path.basename(real)
    stand_in.write_text("#!/bin/sh\nexec sleep 600\n")
    stand_in.chmod(0o755)
    attempts = []
    init = ray.init

    def stalling_first_init(**kwargs):
        attempts.append(kwargs)
        setattr(services, name, str(stand_in) if len(attempts) == 1 else real)
        return init(**kwargs)

    ray.init = stalling_first_init
    started = time.monotonic()
    try:
        start_local_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)
        left = [p.pid for p in psutil.Process().children(recursive=True) if "sleep" in " ".join(p.cmdline())]
        alive = sum(node["Alive"] for node in ray.nodes())
        answer = ray.get(ray.remote(lambda: 42).remote())
        print(f"started in {time.monotonic() - started:.1f} s after {len(attempts)} attempts; nodes alive: {alive}; "
              f"stand-in {args.process} processes left: {len(left)}; a task answered {answer}")
        assert len(attempts) == 2 and alive == 1 and not left and answer == 42
    finally:
        ray.init = init
        ray.shutdown()
        os.unlink(stand_in)


if __name__ == "__main__":
    main()
