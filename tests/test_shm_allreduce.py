"""The CPU ranks' all-reduce through shared memory (verifier_service/shm_allreduce.py): real
spawned ranks in a gloo group, each checking its sums against the inputs of every rank."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from verifier_service import shm_allreduce, tp_group

pytestmark = pytest.mark.skipif(not shm_allreduce.available(), reason="no shared-memory all-reduce on this machine")

WORLD = 3
# (numel, dtype, contiguous): a pass's activations, several slots' worth (pieces), bfloat16, a strided view
CASES = [(6 * 576, torch.float32, True), (700_000, torch.float32, True), (6 * 576, torch.bfloat16, True),
         (4 * 96, torch.float32, False)]
ROUNDS = 5  # each case again: both banks reused


def inputs(rank: int, case: int, round_: int) -> torch.Tensor:
    numel, dtype, contiguous = CASES[case]
    g = torch.Generator().manual_seed(1000 * rank + 10 * case + round_)
    t = torch.randn(numel * (1 if contiguous else 2), generator=g).to(dtype)
    return t if contiguous else t[::2]


def _rank(rank: int, store_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    tp_group.join_group(rank, WORLD, store_dir, "cpu")
    try:
        result = {"shm": tp_group._shm_all_reduce is not None}
        for round_ in range(ROUNDS):
            for case in range(len(CASES)):
                t = inputs(rank, case, round_)
                tp_group.all_reduce(t)
                result[(case, round_)] = t.clone()
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        tp_group.leave_group()


def segments() -> set[str]:
    return {p.name for p in shm_allreduce.SHM_DIR.glob("specserve-tp-*")}


def test_every_rank_gets_the_same_sum_in_rank_order(tmp_path):
    (tmp_path / "store").mkdir()
    before = segments()
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert all(r["shm"] for r in results)
    assert segments() <= before  # unlinked once every rank had mapped it
    for round_ in range(ROUNDS):
        for case in range(len(CASES)):
            want = inputs(0, case, round_).float()
            for r in range(1, WORLD):
                want += inputs(r, case, round_).float()
            want = want.to(CASES[case][1])
            for r in range(WORLD):
                assert torch.equal(results[r][(case, round_)], want), (case, round_, r)


def _dying_rank(rank: int, store_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    tp_group.join_group(rank, 2, store_dir, "cpu")
    tp_group.all_reduce(torch.ones(8))
    if rank == 1:
        os._exit(0)  # gone without a word, as a killed rank
    started = time.monotonic()
    try:
        tp_group.all_reduce(torch.ones(8))
        outcome = "completed"
    except RuntimeError as e:
        outcome = str(e)
    (Path(out_dir) / "outcome.txt").write_text(f"{outcome}\n{time.monotonic() - started:.2f}")


def test_a_dead_rank_fails_the_all_reduce_at_once(tmp_path):
    (tmp_path / "store").mkdir()
    context = mp.get_context("spawn")
    ranks = [context.Process(target=_dying_rank, args=(r, str(tmp_path / "store"), str(tmp_path))) for r in (0, 1)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(60)
    outcome, seconds = (tmp_path / "outcome.txt").read_text().splitlines()
    assert "rank 1" in outcome and "died" in outcome
    assert float(seconds) < 5


def test_gloo_can_be_chosen_and_bad_choices_are_named(monkeypatch):
    monkeypatch.setenv("SPECSERVE_TP_ALLREDUCE", "gloo")
    assert not shm_allreduce.available()
    monkeypatch.setenv("SPECSERVE_TP_ALLREDUCE", "nccl")
    with pytest.raises(ValueError, match="SPECSERVE_TP_ALLREDUCE must be auto or gloo"):
        shm_allreduce.available()


def test_no_room_in_dev_shm_leaves_gloo_and_no_segment(caplog):
    before = segments()
    assert shm_allreduce._create(1 << 50) is None  # more than any /dev/shm holds
    assert segments() <= before
    assert "gloo's all-reduce runs" in caplog.text
