"""Runs a layer group's attentions (speculative.easyspec) at the same time, on threads.

torch releases the GIL inside its ops, so the group's attentions overlap on
threads of one process. Each worker owns its share of the cores as torch
threads (`own_torch_threads`): a worker with as many as the caller would
oversubscribe the CPU. Groups of one need no threads: `make_runner` gives the
sequential runner then.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from runtime.cpu_tuning import own_torch_threads
from speculative.easyspec import Jobs, run_sequentially


class LayerThreads:
    """`parallel` worker threads, each with cores // parallel torch threads (at least 1)."""

    def __init__(self, parallel: int, cores: int | None = None):
        share = max(1, (cores or os.cpu_count() or 1) // parallel)
        self._pool = ThreadPoolExecutor(parallel, thread_name_prefix="easyspec",
                                        initializer=own_torch_threads, initargs=(share,))

    def __call__(self, jobs: Jobs) -> list[torch.Tensor]:
        futures = [self._pool.submit(job) for job in jobs]
        return [f.result() for f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=False)


_shared: dict[int, LayerThreads] = {}  # by width, for every drafter of the process
_shared_lock = threading.Lock()


def make_runner(parallel: int, threads: bool = True) -> Callable[[Jobs], list[torch.Tensor]]:
    """How a drafter runs a group of `parallel` attentions: on the process's shared
    LayerThreads of that width, or one after another (`threads` False, or one layer)."""
    if parallel <= 1 or not threads:
        return run_sequentially
    with _shared_lock:
        if parallel not in _shared:
            _shared[parallel] = LayerThreads(parallel)
        return _shared[parallel]
