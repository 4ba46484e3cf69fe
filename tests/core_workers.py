"""Worker processes, one per core and pinned to it, for tests made of many independent
CPU-bound runs, and the oracle.

- One torch thread per process does more work per core, on a small model, than one
  process on every core: its passes are too small for torch's threads to share well,
  and the threads' waiting still takes the cores.
- The workers start at the lowest priority (nice 19) on what the selected tests will ask
  of them (conftest: each test module's `background_jobs`), so they work while the
  cores would idle, as tests of servers wait on them, and step aside for those tests.
  A call a test waits on goes before those queued ahead, and none is made twice.
- Spawned, so that no torch thread pool or gRPC state is forked. A worker runs
  everything on its core, torch included (`cpu_cores()` is 1 there, so `specserve
  generate` run in it takes one thread, as a user's pinned one would)."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
WORKERS = len(CORES)
SHARES = 8 * WORKERS  # calls a test's seeded runs are split into: a few seconds each, so a waiting call starts soon


def seed_shares(n: int) -> list[range]:
    """Seeds 0..n-1 in SHARES interleaved shares (the runs of each seed are independent)."""
    return [range(i, n, SHARES) for i in range(SHARES)]


def _start_worker(started) -> None:
    """Lowest priority, pinned to the next core, one torch thread; models loaded once (cli_json)."""
    # no progress bars (transformers' own, and the raw tqdm of its GGUF loading): a worker's output is not captured
    os.environ.update(HF_HUB_DISABLE_PROGRESS_BARS="1", TQDM_DISABLE="1")
    import torch

    from cluster.local import LocalEngine, pin_threads

    with started.get_lock():
        core = CORES[started.value % len(CORES)]
        started.value += 1
    _exit_with_parent()
    _lowest_priority()
    pin_threads([core])
    torch.set_num_threads(1)
    LocalEngine.load = classmethod(_load_once(LocalEngine.load.__func__))


def _exit_with_parent() -> None:
    """End this worker once the test session's process is gone: killed (a timeout's SIGKILL),
    it runs no `stop()`, and a worker in a session of its own (`_lowest_priority`) gets no
    signal from its terminal either, so it would live on, busy with queued oracle runs."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def _lowest_priority() -> None:
    """Nice 19, in a session of its own whose autogroup is niced too: Linux shares the CPU
    between sessions' autogroups first, so a niced worker beside the tests' servers (Ray
    starts its processes in sessions of their own) would otherwise still take half of it."""
    os.nice(19)
    try:
        os.setsid()
        with open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write("19")
    except OSError:  # no autogroups here: nice alone orders the processes
        pass


def _load_once(load):
    engines: dict = {}

    def load_once(cls, *args, **kwargs):
        from drafter_service import registry

        key = (args, tuple(sorted(kwargs.items())))
        if key not in engines:
            engines[key] = load(cls, *args, **kwargs)
        with registry._load_lock:
            registry._memories.pop(id(engines[key].model), None)
        return engines[key]

    return load_once


class Workers:
    """The worker processes and two queues of calls for them: `submit_once` (a test waits
    on it) before `submit_ahead` (a test will ask for it later). Each worker is handed one
    call at a time, so that a call a test waits on starts as soon as a worker is free."""

    def __init__(self):
        spawn = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(WORKERS, mp_context=spawn, initializer=_start_worker,
                                         initargs=(spawn.Value("i", 0),))
        self._futures: dict[tuple, Future] = {}  # every call's, by (function, arguments)
        self._now: list[tuple] = []
        self._ahead: list[tuple] = []
        self._running = 0
        self._changed = threading.Condition()
        self._stopped = False
        threading.Thread(target=self._hand_out, daemon=True).start()

    def submit_once(self, fn, *args) -> Future:
        """`fn(*args)` in a worker, next; the same future for the same call (its arguments hashable)."""
        return self._queue(self._now, fn, args)

    def results(self, calls: list[tuple]) -> list:
        """Each call's `fn(*args)` result, in order: all are queued (as `submit_once`) before
        this waits, so they run side by side."""
        futures = [self.submit_once(*call) for call in calls]
        return [future.result() for future in futures]

    def submit_ahead(self, fn, *args) -> None:
        """`fn(*args)` in a worker once the calls queued before it are handed out."""
        self._queue(self._ahead, fn, args)

    def _queue(self, queue: list, fn, args) -> Future:
        key = (fn.__module__, fn.__qualname__, args)
        with self._changed:
            if key not in self._futures:
                self._futures[key] = Future()
                queue.append((key, fn, args))
            elif queue is self._now and (call := next((c for c in self._ahead if c[0] == key), None)):
                self._ahead.remove(call)
                self._now.append(call)
            self._changed.notify()
            return self._futures[key]

    def _hand_out(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(self._can_hand_out)
                if self._stopped:
                    return
                key, fn, args = (self._now or self._ahead).pop(0)
                self._running += 1
            self._pool.submit(fn, *args).add_done_callback(lambda done, key=key: self._finish(key, done))

    def _can_hand_out(self) -> bool:
        return self._stopped or (self._running < WORKERS and bool(self._now or self._ahead))

    def _finish(self, key: tuple, done: Future) -> None:
        if done.cancelled():  # at shutdown
            self._futures[key].cancel()
        elif done.exception() is not None:
            self._futures[key].set_exception(done.exception())
        else:
            self._futures[key].set_result(done.result())
        with self._changed:
            self._running -= 1
            self._changed.notify()

    def shutdown(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()
        self._pool.shutdown(cancel_futures=True)


_workers: Workers | None = None


def workers() -> Workers:
    """This session's workers, started on first use."""
    global _workers
    if _workers is None:
        _workers = Workers()
    return _workers


def stop() -> None:
    global _workers
    if _workers is not None:
        _workers.shutdown()
        _workers = None


def cli_json(argv: tuple[str, ...]) -> dict:
    """`specserve generate ... --json` run in a worker (commands.cli.main), its JSON output.
    As a fresh CLI process would start, but with the model loaded once per worker: the load
    is memoised on its arguments and the drafters' memory (the suffix index, the recycling
    table, fused calibrations) is dropped before each call."""
    from commands.cli import main as cli_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(list(argv))
    assert code == 0, f"specserve {' '.join(argv)} exited {code}"
    return json.loads(out.getvalue())
