"""All-reduce through shared memory, for the CPU ranks of a tensor-parallel target.

The ranks of a CPU target all run on one node (verifier_service/tp_group.py), so
their partial sums need not cross a socket: gloo's all-reduce is a round trip over
loopback, this one a copy and a few reads of memory (docs/SERVING.md, Tensor
parallelism, has both measured), and a pass makes two per decoder layer.

One segment in /dev/shm, created by rank 0 with mode 0600, its pages reserved at once
(without room the group keeps gloo's), and unlinked as soon as every rank has mapped
it (nothing is left behind if a rank dies), holds two banks
of one slot a rank, and one counter a rank on a cache line of its own. An
all-reduce writes the rank's tensor into its slot of the bank of this call's
parity, then its counter; once every counter has reached the call, each rank adds
the slots up in rank order, in float32, so every rank gets the same bits. Two banks
make a slot safe to reuse: a rank writes into a bank only after every other rank
has posted the call after the one that last read it. A tensor larger than a slot
goes through in slot-sized pieces. SPECSERVE_TP_ALLREDUCE=gloo keeps gloo's.

The counter is written after the slot and read before it; x86's stores and loads
are not reordered among themselves, so this needs no fence there. Elsewhere
(`available` is False) the group keeps gloo's all-reduce.

A rank waiting for the others checks every WATCH_S that they are still alive, so a
dead rank fails the pass at once (RuntimeError), as a broken gloo socket would.
"""

from __future__ import annotations

import logging
import os
import platform
import secrets
import time
from pathlib import Path

import psutil
import torch

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 1 << 20  # a decode or verification pass fits one slot; longer prefills go in pieces
COUNTER_STRIDE = 8  # int64s: one cache line a rank's counter
SPINS_BEFORE_YIELD = 64  # then yield the core to a rank that shares it
WATCH_S = 0.05  # how often a waiting rank checks that the others are alive
CHOICES = ("auto", "gloo")  # SPECSERVE_TP_ALLREDUCE: shared memory where `available`, or always gloo's


def available() -> bool:
    """Whether the CPU ranks all-reduce through shared memory here: on x86 with /dev/shm,
    unless SPECSERVE_TP_ALLREDUCE is `gloo`."""
    choice = os.environ.get("SPECSERVE_TP_ALLREDUCE", "auto")
    if choice not in CHOICES:
        raise ValueError(f"SPECSERVE_TP_ALLREDUCE must be auto or gloo, got {choice!r}")
    return (choice == "auto" and platform.machine().lower() in ("x86_64", "amd64") and SHM_DIR.is_dir()
            and os.access(SHM_DIR, os.W_OK))


class SharedMemoryAllReduce:
    """The all-reduce of rank `rank` of `world` through one mapped segment; `join` makes it."""

    def __init__(self, rank: int, world: int, segment: torch.Tensor, pids: list[int]):
        self.rank, self.world, self.calls, self.pids = rank, world, 0, pids
        self.banks = segment[:2 * world * SLOT_BYTES].view(2, world, SLOT_BYTES)
        self.counters = segment[2 * world * SLOT_BYTES:].view(torch.int64).view(world, COUNTER_STRIDE)[:, 0]

    @classmethod
    def join(cls, rank: int, world: int, store, barrier) -> "SharedMemoryAllReduce | None":
        """Every rank of the group at once: rank 0 creates the segment, `store` (the group's
        torch.distributed store) carries its name and the ranks' process ids, and once every
        rank has mapped it (`barrier`, the group's own) rank 0 unlinks it. None on every rank
        when rank 0 cannot reserve the segment (a full /dev/shm): the group keeps gloo's."""
        size = 2 * world * SLOT_BYTES + world * COUNTER_STRIDE * 8
        if rank == 0:
            store.set("shm_allreduce", str(_create(size) or ""))
        name = store.get("shm_allreduce").decode()
        if not name:
            return None
        store.set(f"pid{rank}", str(os.getpid()))
        pids = [int(store.get(f"pid{r}")) for r in range(world)]
        segment = torch.from_file(name, shared=True, size=size, dtype=torch.uint8)
        barrier()  # every rank has mapped it
        if rank == 0:
            Path(name).unlink()
        return cls(rank, world, segment, pids)

    def __call__(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place (CPU tensors of any float dtype)."""
        if not t.is_contiguous():
            whole = t.contiguous()
            self(whole)
            t.copy_(whole)
            return
        flat = t.view(-1)
        step = SLOT_BYTES // t.element_size()
        for start in range(0, flat.numel(), step):
            self._reduce(flat[start:start + step])

    def _reduce(self, piece: torch.Tensor) -> None:
        self.calls += 1
        call, n = self.calls, piece.numel()
        bank = self.banks[call % 2]
        bank[self.rank, :n * piece.element_size()].view(piece.dtype).copy_(piece)
        self.counters[self.rank] = call
        self._wait(call)
        slots = bank[:, :n * piece.element_size()]
        total = slots[0].view(piece.dtype).to(torch.float32, copy=True)  # never add into a slot
        for r in range(1, self.world):
            total += slots[r].view(piece.dtype)
        piece.copy_(total)

    def _wait(self, call: int) -> None:
        spins, watched = 0, time.monotonic()
        while int(self.counters.min()) < call:
            spins += 1
            if spins < SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()
            if time.monotonic() - watched > WATCH_S:
                self._check_alive(call)
                watched = time.monotonic()

    def _check_alive(self, call: int) -> None:
        for r, pid in enumerate(self.pids):
            if int(self.counters[r]) < call and not _alive(pid):
                raise RuntimeError(f"tensor-parallel rank {r} (pid {pid}) died: the all-reduce cannot complete")


def _create(size: int) -> Path | None:
    """A new segment of `size` bytes, mode 0600, its pages reserved now (a full /dev/shm
    then fails here, not with SIGBUS at a later write); None, with a warning, if it cannot."""
    path = SHM_DIR / f"specserve-tp-{secrets.token_hex(8)}"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as e:
        log.warning("tensor-parallel all-reduce: no shared memory segment (%s); gloo's all-reduce runs", e)
        return None
    try:
        os.posix_fallocate(fd, 0, size)
        return path
    except OSError as e:
        path.unlink()
        log.warning("tensor-parallel all-reduce: %s has no room for %d bytes (%s); gloo's all-reduce runs",
                    SHM_DIR, size, e)
        return None
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
