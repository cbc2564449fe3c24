"""Where replicas and their tensor-parallel ranks run (pure functions, no Ray import).

Two deployments: the engine replicas (``DartRayServer``, the model) and the HTTP ingress
(``DartRayIngress``, no model). Three rules:

* **Ingress: on the head node** (:func:`ingress_actor_options`), by default, with 0 CPUs: next to
  the head's HTTP proxy, so a worker node's loss never takes the process holding the client's
  stream; the ingress reports the loss of an engine replica to the client instead.
* **Engine replicas across nodes: SPREAD.** Serve schedules replica actors with its SPREAD policy by
  default (a soft preference). ``max_replicas_per_node`` makes it a hard cap: with 1, two replicas
  never share a node, so losing a node loses at most one replica. Serve refuses the cap together
  with placement-group bundles, so it applies to ``tensor_parallel_size == 1`` only; a TP replica
  needs N GPUs on one node, which spreads TP replicas by itself on GPU nodes.
* **One engine replica's TP ranks: STRICT_PACK.** One replica = rank 0 (runs in the replica actor
  itself, with the drafter and the tree search) plus ``tensor_parallel_size - 1`` worker actors.
  Serve reserves one placement group per replica: bundle 0 holds the replica actor (= rank 0),
  bundles 1.. hold the other ranks. ``STRICT_PACK`` puts every bundle on one node or none: the
  per-layer all-reduce stays on the node, and a node loss takes the whole group (never half of it)
  -- Serve then re-creates the replica, whole, wherever N bundles fit again. ``PACK`` (best effort)
  may split the group over nodes when no node has room; use it only if you accept that.

:func:`deployment_placement` turns serve args (a mapping or a ``ServeArgs``) into those Serve
options; the args it reads are ``tensor_parallel_size``, ``device`` (the engine's), ``num_cpus``
and, when present, ``max_replicas_per_node`` (None = no cap) and ``placement_strategy`` (default
``STRICT_PACK``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dart_ray import actor_allocator_env

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
"""Ray placement-group strategies accepted for one replica's TP bundles."""

DEFAULT_TP_STRATEGY = "STRICT_PACK"


def _is_gpu(device: str) -> bool:
    return device.startswith(("cuda", "gpu"))


def worker_bundle(device: str, num_cpus_per_worker: float) -> dict[str, float]:
    """Resources of one rank."""
    bundle: dict[str, float] = {"CPU": float(num_cpus_per_worker)}
    if _is_gpu(device):
        bundle["GPU"] = 1.0
    return bundle


def placement_options(tensor_parallel_size: int, device: str, num_cpus_per_worker: float,
                      strategy: str = "PACK") -> dict:
    """Serve deployment options reserving ``tensor_parallel_size`` ranks for each replica.

    Returns ``{"placement_group_bundles": [...], "placement_group_strategy": strategy}``. The
    default here stays ``PACK`` (the historical value); :func:`deployment_placement` passes
    ``STRICT_PACK`` unless the args say otherwise (see the module docstring). The first bundle is
    where Serve schedules the replica actor, so the replica's ``ray_actor_options`` (see
    :func:`replica_actor_options`) must fit in it; rank 0 runs inside the replica.
    """
    if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) \
            or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, "
                         f"got {tensor_parallel_size!r}")
    if not isinstance(device, str) or not device:
        raise ValueError(f"device must be a non-empty string, got {device!r}")
    if not isinstance(num_cpus_per_worker, (int, float)) or isinstance(num_cpus_per_worker, bool) \
            or num_cpus_per_worker < 0:
        raise ValueError(f"num_cpus_per_worker must be a number >= 0, got {num_cpus_per_worker!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown placement strategy {strategy!r}; one of {list(STRATEGIES)}")
    bundles = [worker_bundle(device, num_cpus_per_worker) for _ in range(tensor_parallel_size)]
    return {"placement_group_bundles": bundles, "placement_group_strategy": strategy}


def replica_actor_options(device: str, num_cpus: float) -> dict:
    """``ray_actor_options`` of the replica actor (rank 0): fits bundle 0 of
    :func:`placement_options`. A CPU replica also gets the fast allocator's variables as its
    ``runtime_env`` (``dart_ray.actor_allocator_env``: read from this process's environment and
    libraries; ``DART_RAY_ALLOCATOR=system`` leaves them out)."""
    opts: dict = {"num_cpus": float(num_cpus)}
    if _is_gpu(device):
        opts["num_gpus"] = 1.0
    # a CPU engine runs ~25 % faster under jemalloc (or glibc's huge-page tunable); both are
    # process-start settings, so the replica actor starts with them (dart_ray.allocator)
    env = actor_allocator_env(device=device)
    if env:
        opts["runtime_env"] = {"env_vars": env}
    return opts


HEAD_NODE_RESOURCE = "node:__internal_head__"
"""Resource Ray gives the head node only (1.0); asking for a sliver of it pins an actor there."""


def ingress_actor_options(num_cpus: float, on_head: bool) -> dict:
    """``ray_actor_options`` of an ingress replica: ``num_cpus`` (0 fits a head started with
    ``--num-cpus=0``) and, with ``on_head``, a sliver of the head-only resource, so the ingress runs
    next to the head's HTTP proxy and no worker-node loss takes it (or its open streams) down."""
    if not isinstance(num_cpus, (int, float)) or isinstance(num_cpus, bool) or num_cpus < 0:
        raise ValueError(f"num_cpus must be a number >= 0, got {num_cpus!r}")
    opts: dict = {"num_cpus": float(num_cpus)}
    if on_head:
        opts["resources"] = {HEAD_NODE_RESOURCE: 0.001}
    return opts


def spread_options(max_replicas_per_node: int | None) -> dict:
    """Serve options capping replicas per node (``{}`` = no cap: Serve's soft SPREAD only)."""
    if max_replicas_per_node is None:
        return {}
    if not isinstance(max_replicas_per_node, int) or isinstance(max_replicas_per_node, bool) \
            or max_replicas_per_node < 1:
        raise ValueError(f"max_replicas_per_node must be an integer >= 1 or null, "
                         f"got {max_replicas_per_node!r}")
    return {"max_replicas_per_node": max_replicas_per_node}


def _get(args: Any, name: str, default: Any) -> Any:
    """``args[name]`` / ``args.name``, else the engine's (``device`` lives in ``args.engine``, or
    flat in older args), else ``default``."""
    if isinstance(args, Mapping):
        if name in args:
            return args[name]
        engine = args.get("engine")
    else:
        if hasattr(args, name):
            return getattr(args, name)
        engine = getattr(args, "engine", None)
    return default if engine is None else _get(engine, name, default)


def deployment_placement(args: Any) -> dict:
    """Serve options placing the replicas of ``args`` (a mapping or a ``ServeArgs``).

    ``ray_actor_options`` of the replica, plus either the TP placement group (``tensor_parallel_size
    > 1``: one bundle per rank, ``placement_strategy``, default STRICT_PACK) or the per-node cap
    (``max_replicas_per_node``, TP = 1 only: Serve does not combine it with bundles).
    """
    tp = _get(args, "tensor_parallel_size", 1)
    device = _get(args, "device", "cpu")
    num_cpus = _get(args, "num_cpus", 1.0)
    cap = _get(args, "max_replicas_per_node", None)
    strategy = _get(args, "placement_strategy", None) or DEFAULT_TP_STRATEGY
    opts: dict = {"ray_actor_options": replica_actor_options(device, num_cpus)}
    if tp > 1:
        if cap is not None:
            raise ValueError("max_replicas_per_node cannot be combined with "
                             "tensor_parallel_size > 1 "
                             "(Serve refuses it with placement-group bundles); a TP replica's "
                             "STRICT_PACK group already needs a node with room for all its ranks")
        opts.update(placement_options(tp, device, num_cpus, strategy))
    else:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown placement strategy {strategy!r}; one of {list(STRATEGIES)}")
        opts.update(spread_options(cap))
    return opts
