"""The processes of a tensor-parallel target (runtime/tp.py) on one machine.

Every rank joins one torch.distributed group: gloo on the CPU, NCCL on CUDA
(rank r on cuda:r), chosen by the device. All ranks run on one node (locally,
or a Ray placement group packed onto one node), so the rendezvous needs no
network at all: a FileStore in a private directory (mode 0700) instead of a
TCP store, whose server would listen on every interface; and the collectives'
own sockets are bound to the loopback interface (GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME), never reachable from another machine. CPU ranks add their
partial sums through shared memory instead (verifier_service/shm_allreduce.py).

Rank 0 lives in the caller's process and drives the model through
`TensorParallelTarget`; `start_local_group` spawns the other ranks as local
processes (`specserve generate --tensor-parallel N`); cluster/actors.py places
them as Ray actors for a served verifier. Each rank counts its collectives
(`COUNTS`), which is how tests and the benchmark see the communication.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from runtime import loading
from runtime.gguf_convert import converted_gguf_dir
from runtime.config import ModelConfig
from runtime.cpu_tuning import CpuTuning, apply_cpu_tuning
from runtime.model import Transformer
from runtime.quantize import INT4_GROUP, MODES as WEIGHT_ONLY_MODES, quantize, quantized_weights
from runtime.tp import TensorParallelTarget, check_tp, check_tp_groups, serve_rank, shard_model, shard_weights
from verifier_service import shm_allreduce

log = logging.getLogger(__name__)

# A worker rank waits in a broadcast for rank 0's next call as long as the verifier is idle;
# rank 0 dying closes the sockets, which ends the wait at once.
IDLE_WAIT = datetime.timedelta(days=7)
JOIN_TIMEOUT_S = 30.0


@dataclass
class CommCounts:
    """This process's collectives since the last `reset`."""
    all_reduces: int = 0
    all_reduce_bytes: int = 0
    broadcasts: int = 0  # rank 0's calls to the others (each is a size, then a payload)
    broadcast_bytes: int = 0

    def reset(self) -> None:
        self.__init__()


COUNTS = CommCounts()


def loopback_interface() -> str:
    """The name of this machine's loopback interface ('lo' on Linux)."""
    import psutil
    import socket

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addresses):
            return name
    raise RuntimeError("no loopback interface found for the tensor-parallel group")


def rank_device(device: str, rank: int) -> str:
    """The device of rank `rank`: one GPU each on CUDA (a Ray actor sees only its own)."""
    return f"cuda:{rank % torch.cuda.device_count()}" if device == "cuda" else device


# the CPU ranks' all-reduce through shared memory (verifier_service/shm_allreduce.py), if any
_shm_all_reduce: shm_allreduce.SharedMemoryAllReduce | None = None


def join_group(rank: int, world: int, store_dir: str, device: str) -> None:
    """Join the group of `world` ranks that meet in `store_dir` (gloo, or NCCL on CUDA; on the
    CPU the all-reduces go through shared memory where the machine allows)."""
    cuda = device.startswith("cuda")
    os.environ["NCCL_SOCKET_IFNAME" if cuda else "GLOO_SOCKET_IFNAME"] = loopback_interface()
    if cuda:
        torch.cuda.set_device(torch.device(rank_device(device, rank)))
    store = dist.FileStore(str(Path(store_dir) / "rendezvous"), world)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world,
                            timeout=IDLE_WAIT)
    global _shm_all_reduce
    if not cuda and world > 1 and shm_allreduce.available():
        _shm_all_reduce = shm_allreduce.SharedMemoryAllReduce.join(rank, world, store, dist.barrier)


def leave_group() -> None:
    global _shm_all_reduce
    _shm_all_reduce = None
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(t: torch.Tensor) -> None:
    (_shm_all_reduce or dist.all_reduce)(t)
    COUNTS.all_reduces += 1
    COUNTS.all_reduce_bytes += t.numel() * t.element_size()


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def send(ops: list) -> None:
    """Rank 0: hand `ops` to every other rank."""
    payload = torch.frombuffer(bytearray(pickle.dumps(ops)), dtype=torch.uint8)
    dist.broadcast(torch.tensor([payload.numel()], device=_comm_device()), 0)
    dist.broadcast(payload.to(_comm_device()), 0)
    COUNTS.broadcasts += 1
    COUNTS.broadcast_bytes += payload.numel() + 8


def receive() -> list:
    """Another rank: the next ops rank 0 sends (only rank 0 of this trusted group writes them)."""
    size = torch.zeros(1, dtype=torch.long, device=_comm_device())
    dist.broadcast(size, 0)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=_comm_device())
    dist.broadcast(payload, 0)
    return pickle.loads(payload.cpu().numpy().tobytes())


@dataclass(frozen=True)
class CheckpointLoader:
    """Loads the plain (untuned) target from a converted checkpoint directory, in any process,
    and says what precision its ranks run (`dtype`) and where int4 weights come from: the
    4-bit blocks of `gguf`, the checkpoint's source, where it is one."""
    directory: str
    dtype: str = "float32"
    gguf: str | None = None
    cache_dir: str | None = None

    def __call__(self, device: str) -> Transformer:
        return loading.load_hf_dir(Path(self.directory), device, loading.parse_dtype(self.dtype))

    def int4_blocks(self) -> dict[str, tuple] | None:
        if self.dtype != "int4" or self.gguf is None:
            return None
        from runtime.gguf_blocks import cached_int4_blocks

        return cached_int4_blocks(self.gguf, Path(self.directory))


def checkpoint_loader(source: str | None, dtype: str = "float32", cache_dir: str | None = None) -> CheckpointLoader:
    """A loader of `source` (converted first here, so that the ranks do not convert it at once)."""
    loading.parse_dtype(dtype)
    path = gguf = loading.resolve_source(source)
    if path.suffix == ".gguf":
        path = converted_gguf_dir(path, cache_dir)
    return CheckpointLoader(str(path), dtype, str(gguf) if gguf.suffix == ".gguf" else None, cache_dir)


def check_precision(config: ModelConfig, world: int, dtype: str) -> None:
    """Raise InvalidArgument naming `tensor_parallel` unless `world` ranks split this model in
    `dtype`: int4's groups of inputs must not straddle two ranks."""
    check_tp(config, world)
    if dtype == "int4":
        check_tp_groups(config, world, INT4_GROUP)


def load_shard(make_model: Callable[[str], Transformer], rank: int, world: int, device: str,
               tuning: CpuTuning | None) -> Transformer:
    """This rank's shard of the plain model `make_model` builds, in the precision it names
    (its `dtype`, float32 if none; int8 and int4 weights the slice of the whole model's, as
    one process quantises them), then CPU-tuned (unless None)."""
    model = make_model(rank_device(device, rank))
    dtype = getattr(make_model, "dtype", "float32")
    whole = None
    if dtype in WEIGHT_ONLY_MODES:  # before sharding: a row-parallel int8 row keeps its whole row's scale
        blocks = make_model.int4_blocks() if hasattr(make_model, "int4_blocks") else None
        whole = quantized_weights(model, dtype, blocks)
    shard_model(model, rank, world, all_reduce)
    if dtype in WEIGHT_ONLY_MODES + ("bfloat16",):
        quantize(model, dtype, whole and shard_weights(model.config, whole, rank, world), tuning or CpuTuning(),
                 getattr(make_model, "cache_dir", None))
    if tuning is not None:
        apply_cpu_tuning(model, tuning)
    return model


def run_rank(rank: int, world: int, store_dir: str, make_model: Callable[[str], Transformer], device: str,
             tuning: CpuTuning | None, threads: int) -> None:
    """A rank other than 0: join, load its shard, replay rank 0's calls until stopped."""
    torch.set_num_threads(threads)
    join_group(rank, world, store_dir, device)
    try:
        serve_rank(load_shard(make_model, rank, world, device, tuning), receive)
    finally:
        leave_group()


def threads_per_rank(world: int) -> int:
    """Torch threads of each rank: the cores shared out, so ranks do not contend for them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // world)


class LocalGroup:
    """A tensor-parallel target whose other ranks are processes spawned on this machine;
    rank 0 runs in this process (`target`). `close` stops them."""

    def __init__(self, world: int, make_model: Callable[[str], Transformer], config: ModelConfig,
                 device: str = "cpu", tuning: CpuTuning | None = CpuTuning(), threads: int | None = None):
        check_precision(config, world, getattr(make_model, "dtype", "float32"))  # before any process starts
        threads = threads or threads_per_rank(world)
        self._store_dir = tempfile.mkdtemp(prefix="specserve-tp-")  # mode 0700: only this user meets here
        context = multiprocessing.get_context("spawn")
        self.processes = [context.Process(target=run_rank, daemon=True, name=f"tp-rank-{rank}",
                                          args=(rank, world, self._store_dir, make_model, device, tuning, threads))
                          for rank in range(1, world)]
        for p in self.processes:
            p.start()
        self._caller_threads = torch.get_num_threads()  # this process's, back on close
        try:
            torch.set_num_threads(threads)
            join_group(0, world, self._store_dir, device)
            self.target = TensorParallelTarget(load_shard(make_model, 0, world, device, tuning), send)
        except BaseException:
            self._kill()
            raise

    def close(self) -> None:
        """Stop the other ranks and leave the group (again: nothing)."""
        try:
            self.target.stop()
            for p in self.processes:
                p.join(JOIN_TIMEOUT_S)
        except RuntimeError:  # a rank is gone, the group broken: what is left is killed
            log.warning("the tensor-parallel group was broken when it closed", exc_info=True)
        finally:
            leave_group()
            self._kill()
            torch.set_num_threads(self._caller_threads)

    def _kill(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(self._store_dir, ignore_errors=True)

    def __enter__(self) -> "LocalGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()



def load_local(source: str | None, world: int, device: str = "cpu", dtype: str = "float32",
               cache_dir: str | None = None, tuning: CpuTuning = CpuTuning()):
    """`loading.load`'s (model, tokenizer), the model a tensor-parallel target of `world` ranks
    on this machine, and their group; the other ranks stop on its `close`, or when this
    process exits."""
    loader = checkpoint_loader(source, dtype, cache_dir)
    tokenizer, config = loading.load_tokenizer(loader.directory)
    group = LocalGroup(world, loader, config, device, tuning if device == "cpu" else None)
    atexit.register(group.close)
    return group.target, tokenizer, group
