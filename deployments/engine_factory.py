"""Building a replica's engines from :class:`~deployments.config.ServeArgs`.

:func:`make_engine` is the single place a replica creates its engine (the hook tensor parallelism
plugs into); :func:`lane_factory` builds the extra per-method engines ("lanes") that share its
target weights. Both run on the engine thread of the replica (see
:class:`~dart_ray.engine.async_engine.AsyncEngine`); nothing here knows about HTTP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dart_ray import Engine, ModelLoadError
from deployments.config import ServeArgs


def check_tensor_parallel(args: ServeArgs) -> None:
    """Fail at build time for a model the TP transform cannot split: an HF directory here, or a
    GGUF (the embedded default included) already converted here; other references are checked
    when the replica loads them (nothing is converted at build time)."""
    if args.tensor_parallel_size <= 1:
        return
    from dart_ray.models.loading import converted_dir, read_model_args
    from dart_ray.parallel import shard_plan

    try:
        model_dir = converted_dir(args.engine.model)
    except ModelLoadError:
        return                      # not readable here: the replica's load reports it
    if model_dir is not None:
        shard_plan(read_model_args(model_dir), 0, args.tensor_parallel_size)


@dataclass
class ReplicaEngine:
    """An engine plus the resources it needs released (what a tensor-parallel build returns)."""

    engine: Engine
    check_health: Callable[[], None] | None = None
    """Raises if a resource behind the engine (e.g. a TP worker actor) is gone."""
    shutdown: Callable[[], None] | None = None
    """Releases those resources; called once when the replica stops, after the engine thread."""


def make_engine(args: ServeArgs) -> Engine | ReplicaEngine:
    """Build the replica's engine (runs once, on the engine thread of the replica).

    A tensor-parallel engine (rank 0 here, ranks 1.. as actors in the replica's placement group,
    see :mod:`deployments.placement`) plugs in by returning a :class:`ReplicaEngine` whose
    ``engine`` has the Engine interface (all its calls then happen on the engine thread) and whose
    hooks Serve's health check and the replica's shutdown call.
    """
    check_tensor_parallel(args)
    group = None
    if args.tensor_parallel_size > 1:
        from deployments.tp import start_tp_group

        group = start_tp_group(args.engine, args.tensor_parallel_size,
                               num_cpus_per_worker=args.num_cpus)
        engine = group.engine
    else:
        engine = Engine.from_config(args.engine)
    if args.profile:
        from dart_ray.profiles import apply_profile

        apply_profile(engine, args.profile)        # warns once when tuned on other hardware
    if group is not None:
        return ReplicaEngine(engine=engine, check_health=group.check_health,
                             shutdown=group.shutdown)
    return engine


def lane_factory(method: str) -> Callable[[Engine], Engine]:
    """An engine for ``method`` sharing the main engine's target weights (own KV cache and drafter)
    and its decoding schedule (a loaded profile's knobs, else ``engine.decoding``)."""

    def build(main: Engine) -> Engine:
        from dart_ray.drafters import make_drafter

        # the main engine's drafter path belongs to its method; another method uses its
        # shipped default
        keep = main.config.drafter == "random" and method in ("dart", "eagle")
        cfg = main.config.replace(method=method, drafter=main.config.drafter if keep else None)
        engine = Engine(main.target, make_drafter(cfg, main.target), cfg)
        engine.set_decoding(main.schedule)
        return engine

    return build
