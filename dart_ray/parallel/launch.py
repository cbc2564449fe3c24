"""Building tensor-parallel engines: rank 0's engine, the followers' entry point, local launching.

Every rank loads the target, shards it with :func:`~dart_ray.parallel.tp.apply_tensor_parallel`,
and meets the others at a readiness barrier. Rank 0 then wraps its shard in a
:class:`~dart_ray.parallel.lockstep.TPModelProxy` and builds an ordinary
:class:`~dart_ray.engine.Engine` (drafter and tree search in the same process, so DART's taps never
cross processes); ranks 1.. run :func:`~dart_ray.parallel.lockstep.follower_loop`.

:func:`start_local_tp` does this with local processes (``torch.multiprocessing``, spawn): the
calling process is rank 0. The Ray version, with the ranks as actors in a placement group, is
``deployments.tp.start_tp_group``.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dart_ray.config import EngineConfig
from dart_ray.parallel.lockstep import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    Leader,
    TPGroup,
    TPModelProxy,
    follower_loop,
    init_tp_group,
)
from dart_ray.parallel.tp import apply_tensor_parallel

logger = logging.getLogger("dart_ray.parallel")

DEFAULT_LOAD_TIMEOUT_S = 600.0
"""Bound on every rank loading and sharding its weights (the readiness barrier)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for the rendezvous ``tcp://host:port``)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_device(device: str, rank: int) -> str:
    """Local launching: ``cuda`` means one GPU per rank (``cuda:<rank>``); explicit devices pass."""
    return f"cuda:{rank}" if device == "cuda" else device


def load_shard(config: EngineConfig, tp: TPGroup):
    """Load the target (full weights, then keep this rank's shard); returns the LoadedTarget."""
    from dart_ray.models import load_target

    target = load_target(config.model, config.dtype, config.device, config.max_seq_len)
    apply_tensor_parallel(target.model, tp.rank, tp.world, tp.group)
    return target


def wait_ready(tp: TPGroup, timeout_s: float = DEFAULT_LOAD_TIMEOUT_S) -> None:
    """Barrier after loading: every rank has its shard (names the missing rank on timeout)."""
    if tp.world > 1:
        dist.monitored_barrier(group=tp.ctrl, timeout=datetime.timedelta(seconds=timeout_s))


def build_tp_engine(config: EngineConfig, tp: TPGroup,
                    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S):
    """Rank 0: load + shard the target, wait for the followers, build the Engine over the group.

    The engine is a plain :class:`~dart_ray.engine.Engine`; ``engine.model`` is the
    :class:`TPModelProxy` (call ``engine.model.shutdown()`` to release the followers).
    """
    from dart_ray.drafters import make_drafter
    from dart_ray.engine import Engine

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    target = load_shard(config, tp)
    wait_ready(tp, load_timeout_s)
    target = dataclasses.replace(target, model=TPModelProxy(target.model, Leader(tp)))
    return Engine(target, make_drafter(config, target), config)


def run_follower(config: EngineConfig, tp: TPGroup,
                 load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S) -> int:
    """Ranks 1..N-1: load + shard, wait for the others, follow rank 0 until it shuts the group
    down."""
    target = load_shard(config, tp)
    wait_ready(tp, load_timeout_s)
    return follower_loop(target.model, tp)


def tp_worker_main(rank: int, world: int, init_method: str, config: EngineConfig,
                   timeout_s: float = DEFAULT_TIMEOUT_S,
                   load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
                   idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S) -> None:
    """Process entry point of a follower rank (``config.device`` is this rank's device)."""
    torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) // world))
    tp = init_tp_group(rank, world, init_method, config.device, timeout_s, idle_timeout_s)
    try:
        n = run_follower(config, tp, load_timeout_s)
        logger.info("rank %d: follower done after %d commands", rank, n)
    finally:
        tp.close()


@dataclass
class LocalTPGroup:
    """A TP engine whose followers are local processes; :meth:`shutdown` when done."""

    engine: object
    tp: TPGroup
    processes: list = field(default_factory=list)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Release and join the followers (terminating any that do not exit in time), leave the
        group."""
        try:
            if self.engine is not None:
                self.engine.model.shutdown()
        finally:
            _join_or_kill(self.processes, timeout_s)
            self.tp.close()

    def __enter__(self) -> LocalTPGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _join_or_kill(processes: list, timeout_s: float) -> None:
    for p in processes:
        p.join(timeout_s)
    for p in processes:
        if p.is_alive():
            logger.warning("TP follower pid %s did not exit; terminating", p.pid)
            p.terminate()
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)


def start_local_tp(config: EngineConfig, world: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                   load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
                   host: str = "127.0.0.1") -> LocalTPGroup:
    """This process becomes rank 0 of a ``world``-rank group; ranks 1.. are spawned processes.

    With ``config.device == "cuda"``, rank r uses ``cuda:r`` (NCCL); on CPU the ranks use gloo.
    """
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"the tensor-parallel size must be an integer >= 1, got {world!r}")
    if world == 1:
        from dart_ray.parallel.lockstep import local_group
        tp = local_group(config.device)
        return LocalTPGroup(build_tp_engine(config, tp, load_timeout_s), tp)
    import torch.multiprocessing as mp

    init_method = f"tcp://{host}:{free_port(host)}"
    ctx = mp.get_context("spawn")
    procs = []
    for r in range(1, world):
        cfg = config.replace(device=rank_device(config.device, r))
        p = ctx.Process(target=tp_worker_main,
                        args=(r, world, init_method, cfg, timeout_s, load_timeout_s), daemon=True,
                        name=f"dart-ray-tp{r}")
        p.start()
        procs.append(p)
    tp = None
    try:
        tp = init_tp_group(0, world, init_method, rank_device(config.device, 0), timeout_s)
        engine = build_tp_engine(config.replace(device=str(tp.device)), tp, load_timeout_s)
    except BaseException:
        _join_or_kill(procs, 0.0)
        if tp is not None:
            tp.close()
        raise
    return LocalTPGroup(engine, tp, procs)
