"""A serving thread keeps its own torch thread count (runtime.cpu_tuning.own_torch_threads)."""

from __future__ import annotations

import threading

import torch

from runtime.cpu_tuning import own_torch_threads


def test_a_threads_count_stays_its_own_when_another_thread_sets_one_later():
    before = torch.get_num_threads()
    seen = {}
    compute_ready, others_done = threading.Event(), threading.Event()

    def compute():
        own_torch_threads(2)
        compute_ready.set()
        others_done.wait()
        seen["compute"] = torch.get_num_threads()
        torch.ones(1 << 16).sum()  # an op after the others set theirs: the count still holds
        seen["compute after an op"] = torch.get_num_threads()

    def server_thread():
        compute_ready.wait()
        own_torch_threads(1)
        seen["server"] = torch.get_num_threads()
        others_done.set()

    threads = [threading.Thread(target=compute), threading.Thread(target=server_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.set_num_threads(before)
    assert seen == {"compute": 2, "compute after an op": 2, "server": 1}
