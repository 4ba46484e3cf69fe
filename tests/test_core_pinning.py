"""`verifiers.cores` and `drafter_pools.cores`: a service's process computes on the cores named."""

import os
import subprocess
import sys
import textwrap

import pytest

from cluster.config import ServeConfig
from cluster.local import pin_to_cores


def test_every_thread_and_later_threads_run_on_the_pinned_cores():
    # in a child process: pinning is for the whole process and cannot be undone safely here
    code = textwrap.dedent("""
        import os, threading
        from cluster.local import pin_to_cores
        started = threading.Event(); stop = threading.Event()
        def wait():
            started.set(); stop.wait()
        before = threading.Thread(target=wait); before.start(); started.wait()
        pin_to_cores([0], "verifiers.cores")
        later = []
        t = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0))); t.start(); t.join()
        tasks = {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}
        stop.set(); before.join()
        assert set(map(frozenset, tasks.values())) == {frozenset({0})}, tasks
        assert later == [{0}], later
        print("pinned", len(tasks))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("pinned")


def test_a_core_the_node_lacks_is_refused_naming_the_setting():
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=rf"drafter_pools.cores: cores \[{missing}\]"):
        pin_to_cores([missing], "drafter_pools.cores")


@pytest.mark.parametrize("section", ["verifiers", "drafter_pools"])
def test_cores_must_be_core_ids(section):
    assert getattr(ServeConfig.model_validate({section: {"cores": [1, 0]}}), section).cores == [1, 0]
    for bad in ([-1], []):
        with pytest.raises(ValueError, match=f"{section}.cores"):
            ServeConfig.model_validate({section: {"cores": bad}})
