"""Placement of a tensor-parallel replica (pure functions, no Ray import).

One replica = rank 0 (runs in the replica actor itself, next to the HTTP ingress) plus
``tensor_parallel_size - 1`` worker actors. Serve reserves one placement group per replica:
bundle 0 holds the replica actor (= rank 0), bundles 1.. hold the other ranks. ``PACK`` keeps the
ranks on as few nodes as possible (all-reduce per layer wants them close).
"""

from __future__ import annotations


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

    Returns ``{"placement_group_bundles": [...], "placement_group_strategy": "PACK"}``. The first
    bundle is where Serve schedules the replica actor, so the replica's ``ray_actor_options``
    (see :func:`replica_actor_options`) must fit in it; rank 0 runs inside the replica.
    """
    if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) \
            or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}")
    if not isinstance(device, str) or not device:
        raise ValueError(f"device must be a non-empty string, got {device!r}")
    if not isinstance(num_cpus_per_worker, (int, float)) or isinstance(num_cpus_per_worker, bool) \
            or num_cpus_per_worker < 0:
        raise ValueError(f"num_cpus_per_worker must be a number >= 0, got {num_cpus_per_worker!r}")
    if strategy not in ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"):
        raise ValueError(f"unknown placement strategy {strategy!r}")
    bundles = [worker_bundle(device, num_cpus_per_worker) for _ in range(tensor_parallel_size)]
    return {"placement_group_bundles": bundles, "placement_group_strategy": strategy}


def replica_actor_options(device: str, num_cpus: float) -> dict:
    """``ray_actor_options`` of the replica actor (rank 0): fits bundle 0 of :func:`placement_options`."""
    opts: dict = {"num_cpus": float(num_cpus)}
    if _is_gpu(device):
        opts["num_gpus"] = 1.0
    return opts
