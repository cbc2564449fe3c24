"""Tensor-parallel replicas on Ray: rank 0 is the replica process itself, ranks 1.. are actors.

A replica with ``tensor_parallel_size = N`` reserves N bundles in one placement group
(:func:`deployments.placement.deployment_placement`, STRICT_PACK: all N on one node; Serve
schedules the replica actor in bundle 0). Inside the replica, :func:`start_tp_group`:

1. starts one :class:`TPWorker` actor per rank 1..N-1 in bundles 1..N-1 of that placement group;
2. forms a torch.distributed group with them (NCCL on CUDA, gloo on CPU) over
   ``tcp://<rank-0 address>:<free port>`` — 127.0.0.1 when every rank is on rank 0's node (always
   with STRICT_PACK), rank 0's node IP otherwise (a PACK/SPREAD group split over nodes);
3. every rank loads the target and keeps its shard
   (:func:`dart_ray.parallel.apply_tensor_parallel`), concurrently; the workers then follow rank 0's
   commands (:func:`dart_ray.parallel.follower_loop`);
4. builds rank 0's :class:`~dart_ray.Engine` over the group, with the drafter and tree search in the
   replica process, next to the engine (DART's taps never cross processes).

The returned :class:`TPReplicaGroup` holds the engine and the workers;
:meth:`TPReplicaGroup.shutdown` releases them. The workers are owned by the replica, so Ray also
kills them if the replica dies.

Node loss: with STRICT_PACK the whole group lives on one node, so losing the node loses every rank
at once and Serve re-creates the replica (a new placement group, all N bundles on one node again).
If a group does span nodes and only a worker's node is lost, rank 0's next collective fails
(the group is marked failed) and :meth:`TPReplicaGroup.check_health` raises, so Serve's health
check replaces the replica as a whole; a worker whose replica died is killed by Ray with its owner.
No half of a group keeps serving.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dart_ray import EngineConfig
from dart_ray.parallel.launch import (
    DEFAULT_LOAD_TIMEOUT_S,
    build_tp_engine,
    free_port,
    load_shard,
    wait_ready,
)
from dart_ray.parallel.lockstep import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    TPGroup,
    follower_loop,
    init_tp_group,
    local_group,
)

logger = logging.getLogger("ray.serve")

ACTOR_START_TIMEOUT_S = 120.0
"""Bound on the worker actors being scheduled and started (placement included)."""


def _is_gpu(device: str) -> bool:
    return device.startswith("cuda")


class TPWorker:
    """Rank ``rank`` (> 0) of a replica's TP group. Methods run in call order (one at a time):
    :meth:`setup` joins the group and loads the shard, :meth:`run` follows rank 0 until shutdown."""

    def __init__(self, config: EngineConfig, rank: int, world: int) -> None:
        import torch

        if config.num_threads:            # else torch's default, which Ray sets from num_cpus
            torch.set_num_threads(config.num_threads)
        self.config, self.rank, self.world = config, rank, world
        self.tp: TPGroup | None = None
        self.model = None

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def setup(self, init_method: str, timeout_s: float, idle_timeout_s: float) -> dict:
        self.tp = init_tp_group(self.rank, self.world, init_method, self.config.device, timeout_s,
                                idle_timeout_s)
        try:
            self.model = load_shard(self.config, self.tp).model
        except BaseException:
            # rank 0's readiness barrier fails now instead of timing out
            self.tp.close()
            raise
        plan = self.model.tp_plan
        return {"rank": self.rank, "pid": os.getpid(), "kv_heads": plan.kv_heads,
                "q_heads": plan.q_heads}

    def run(self, load_timeout_s: float) -> int:
        """Wait for every rank to be loaded, then execute rank 0's commands; returns their count."""
        if self.tp is None or self.model is None:
            raise RuntimeError(f"TP worker rank {self.rank} was not set up")
        try:
            wait_ready(self.tp, load_timeout_s)
            return follower_loop(self.model, self.tp)
        finally:
            self.tp.close()


@dataclass
class TPReplicaGroup:
    """Rank 0's engine plus the worker actors of ranks 1..N-1."""

    engine: object
    tp: TPGroup
    workers: list = field(default_factory=list)
    runs: list = field(default_factory=list)
    """ObjectRefs of the workers' :meth:`TPWorker.run` (they resolve when a worker leaves its
    loop)."""

    def check_health(self) -> None:
        """Raise if the group failed or a worker left its loop (died or failed) while it should
        run."""
        if self.engine is not None:
            self.engine.model.check_health()
        if self.runs:
            done, _ = ray.wait(self.runs, num_returns=1, timeout=0)
            if done:
                ray.get(done)  # raises the worker's error, if any
                raise RuntimeError("a tensor-parallel worker exited")

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Release the workers (and kill any that do not return in time); leave the group."""
        try:
            if self.engine is not None:
                self.engine.model.shutdown()
            if self.runs:
                ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s)
        finally:
            for w in self.workers:
                ray.kill(w)
            self.tp.close()


def _master_addr(workers: list, timeout_s: float) -> str:
    here = ray.util.get_node_ip_address()
    ips = ray.get([w.node_ip.remote() for w in workers], timeout=timeout_s)
    return "127.0.0.1" if all(ip == here for ip in ips) else here


def start_tp_group(config: EngineConfig, world: int, placement_group=None,
                   num_cpus_per_worker: float = 1.0, timeout_s: float = DEFAULT_TIMEOUT_S,
                   load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
                   idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S) -> TPReplicaGroup:
    """Make this process rank 0 of a ``world``-rank TP group with worker actors; build its engine.

    ``placement_group``: where the workers go (rank r in bundle r); None = the placement group this
    process runs in, if any (a Serve replica with ``placement_group_bundles``), else anywhere.
    ``num_cpus_per_worker`` must fit a bundle; on CUDA each worker also takes one GPU.
    """
    if world == 1:
        tp = local_group(config.device)
        return TPReplicaGroup(build_tp_engine(config, tp, load_timeout_s), tp)
    if placement_group is None:
        placement_group = ray.util.get_current_placement_group()
    opts: dict = {"num_cpus": num_cpus_per_worker, "max_restarts": 0}
    if _is_gpu(config.device):
        opts["num_gpus"] = 1
    actor_cls = ray.remote(TPWorker)
    workers = []
    for r in range(1, world):
        o = dict(opts)
        if placement_group is not None:
            o["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group, placement_group_bundle_index=r)
        workers.append(actor_cls.options(**o).remote(config, r, world))
    tp = None
    try:
        addr = _master_addr(workers, ACTOR_START_TIMEOUT_S)
        init_method = f"tcp://{addr}:{free_port(addr)}"
        setups = [w.setup.remote(init_method, timeout_s, idle_timeout_s) for w in workers]
        # queued behind setup (in-order actors)
        runs = [w.run.remote(load_timeout_s) for w in workers]
        tp = init_tp_group(0, world, init_method, config.device, timeout_s, idle_timeout_s)
        try:
            # loads concurrently with the workers
            engine = build_tp_engine(config, tp, load_timeout_s)
        except BaseException:
            ready, _ = ray.wait(setups, num_returns=len(setups), timeout=5.0)
            ray.get(ready)                                        # prefer a worker's own error
            raise
        infos = ray.get(setups, timeout=timeout_s)
        logger.info("tensor-parallel group up: %s", infos)
    except BaseException:
        for w in workers:
            ray.kill(w)
        if tp is not None:
            tp.close()
        raise
    return TPReplicaGroup(engine, tp, workers, runs)
