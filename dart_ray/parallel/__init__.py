"""Tensor parallelism, applied to a built model as a transform (the model code knows nothing of it).

* :mod:`dart_ray.parallel.tp` — :func:`apply_tensor_parallel` shards a Transformer in place
  (column-parallel qkv / gate_up, row-parallel o / down + all-reduce).
* :mod:`dart_ray.parallel.lockstep` — rank 0 runs the Engine through model/cache proxies that
  broadcast each call; ranks 1.. run :func:`follower_loop`.
* :mod:`dart_ray.parallel.launch` — building rank 0's engine, the follower entry point, and
  :func:`start_local_tp` (local processes). The Ray actors are in ``deployments.tp``.

No Ray import here.
"""

from dart_ray.parallel.launch import LocalTPGroup, build_tp_engine, start_local_tp, tp_worker_main
from dart_ray.parallel.lockstep import (
    TPCacheProxy,
    TPGroup,
    TPModelProxy,
    follower_loop,
    init_tp_group,
    local_group,
)
from dart_ray.parallel.tp import (
    RowParallelLinear,
    ShardPlan,
    apply_tensor_parallel,
    new_tp_cache,
    shard_plan,
    split_sizes,
)

__all__ = [
    "LocalTPGroup", "RowParallelLinear", "ShardPlan", "TPCacheProxy", "TPGroup", "TPModelProxy",
    "apply_tensor_parallel", "build_tp_engine", "follower_loop", "init_tp_group", "local_group",
    "new_tp_cache", "shard_plan", "split_sizes", "start_local_tp", "tp_worker_main",
]
