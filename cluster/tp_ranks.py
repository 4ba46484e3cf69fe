"""A served verifier's tensor-parallel ranks (`[verifiers] tensor_parallel`): the
verifier's own process is rank 0 and serves gRPC; ranks 1..N-1 are Ray actors on
the same node. Under Ray Serve the replica and its ranks share a STRICT_PACK
placement group (deploy/app.py gives each verifier replica N bundles, rank r in
bundle r); a verifier outside one pins its ranks to its own node.

If any rank dies the whole group restarts: rank 0 exits, Ray starts the verifier
again with a fresh group, and its requests resume from their checkpoints, as
after any verifier death (the same output, verifier_service/engine.py).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from cluster.config import ServeConfig
from cluster.env import cache_dir_from_env, cpu_tuning_from_env

log = logging.getLogger(__name__)

RANK_BUNDLE = {"CPU": 0.01}  # a bundle that only places a rank beside its verifier


def placement_bundles(cfg: ServeConfig) -> list[dict[str, float]]:
    """A verifier replica's placement group: its own resources, then one bundle a rank."""
    return [dict(cfg.verifiers.resources)] + [dict(RANK_BUNDLE)] * (cfg.verifiers.tensor_parallel - 1)


@ray.remote(num_cpus=0, max_restarts=0)
class TensorParallelRank:
    def run(self, *args) -> None:
        from verifier_service.tp_group import run_rank

        run_rank(*args)

    def pid(self) -> int:
        return os.getpid()


class ServedRanks:
    """Ranks 1..N-1 of this verifier, started and joined; `target` is rank 0's model."""

    def __init__(self, cfg: ServeConfig, threads: int):
        from runtime import loading
        from runtime.tp import TensorParallelTarget
        from verifier_service import tp_group

        world = cfg.verifiers.tensor_parallel
        loader = tp_group.checkpoint_loader(cfg.model, cfg.dtype, cache_dir_from_env())
        _, config = loading.load_tokenizer(loader.directory)
        tp_group.check_precision(config, world, cfg.dtype)
        tuning = cpu_tuning_from_env() if cfg.device == "cpu" else None
        store_dir = tempfile.mkdtemp(prefix="specserve-tp-")  # mode 0700; all ranks share this node
        gpus = 1 if cfg.device.startswith("cuda") else 0  # a GPU a rank on CUDA (NCCL)
        self.ranks = [TensorParallelRank.options(scheduling_strategy=_beside_me(rank), num_gpus=gpus).remote()
                      for rank in range(1, world)]
        self._runs = [actor.run.remote(rank, world, store_dir, loader, cfg.device, tuning, threads)
                      for rank, actor in enumerate(self.ranks, start=1)]
        tp_group.join_group(0, world, store_dir, cfg.device)
        model = tp_group.load_shard(loader, 0, world, cfg.device, tuning)
        self.target = TensorParallelTarget(model, tp_group.send)
        self._closing = False
        threading.Thread(target=self._watch, name="tp-ranks-watch", daemon=True).start()

    def rank_pids(self) -> list[int]:
        return ray.get([actor.pid.remote() for actor in self.ranks])

    def close(self) -> None:
        """End the ranks (the verifier is shutting down: no forward runs any more)."""
        self._closing = True
        for actor in self.ranks:
            ray.kill(actor)

    def _watch(self) -> None:
        """A rank's run returns only when stopped: had it died, restart the whole group."""
        ray.wait(self._runs, num_returns=1, timeout=None)
        if not self._closing:
            log.error("a tensor-parallel rank of this verifier died: restarting the verifier and its ranks")
            os._exit(1)  # Ray starts the verifier again; its rank actors die with it (it owns them)


def _beside_me(rank: int):
    group = ray.util.get_current_placement_group()
    if group is not None and len(group.bundle_specs) > rank:
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
