"""OpenAI-compatible Ray Serve application around the dart-ray engine: the application builder.

    serve run deployments.openai_app:build_app model=... method=dart
    # or: dart-ray serve --config deployments/serve_default.yaml

Two deployments, like Ray Serve LLM's ingress + LLM server::

    client -> Serve HTTP proxy
        -> DartRayIngress (routes, auth, SSE; no model)      deployments/routes.py
               | DeploymentHandle, .options(stream=True)
               v
           DartRayServer x num_replicas (engine + lanes)     deployments/serving.py
               | AsyncEngine (engine thread)
               v
           Engine (built by make_engine)                     deployments/engine_factory.py

Errors of every kind map to OpenAI-style bodies in :mod:`deployments.errors`. Because the HTTP
stream is held by the ingress and not by the engine replica, the loss of an engine replica (its
process or its node) no longer cuts a client's stream silently: a request that had no output yet
is resubmitted to another replica, one that had is ended with a retryable ``replica_lost`` error.

This module keeps the names other code imports from it (``build_app``, ``deployment_options``,
``DartRayServer``, ``make_engine``, ...), re-exported from the modules above.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from deployments.config import ServeArgs
from deployments.engine_factory import (
    ReplicaEngine,
    check_tensor_parallel,
    lane_factory,
    make_engine,
)
from deployments.errors import REPLICA_LOST, ReplicaLostError, engine_error, is_replica_lost
from deployments.placement import deployment_placement, ingress_actor_options
from deployments.replica import keep_serve_grpc_on_loopback, reset_niceness
from deployments.routes import INGRESS_NAME, DartRayIngress, EngineClient, Ingress, build_api
from deployments.serving import (
    DEPLOYMENT_NAME,
    DartRayServer,
    TokenizerPool,
    draft_positions,
    max_token_chars,
)

_engine_error = engine_error
"""Older name of :func:`deployments.errors.engine_error`."""

__all__ = [
    "DEPLOYMENT_NAME", "INGRESS_NAME", "REPLICA_LOST", "DartRayIngress", "DartRayServer",
    "EngineClient", "Ingress", "ReplicaEngine", "ReplicaLostError", "TokenizerPool", "build_api",
    "build_app", "check_tensor_parallel", "deployment_options", "draft_positions", "engine_error",
    "ingress_options", "is_replica_lost", "keep_serve_grpc_on_loopback", "lane_factory",
    "make_engine", "max_token_chars", "reset_niceness",
]


def deployment_options(args: ServeArgs) -> dict[str, Any]:
    """Serve options of the engine deployment (``DartRayServer``): replica resources, request
    bounds, TP placement."""
    opts: dict[str, Any] = {
        "num_replicas": args.num_replicas,
        # the engine's own queue (rows of every lane + max_queue, then HTTP 503) is the bound; leave
        # room for the ingress's /health, /metrics and model-card calls
        "max_ongoing_requests": args.engine.max_batch_size
        * (args.max_lanes if args.allow_speculative_override else 1)
        + args.max_queue + 16,
    }
    opts.update(deployment_placement(args))   # replica resources; TP bundles or the per-node cap
    return opts


def ingress_options(args: ServeArgs) -> dict[str, Any]:
    """Serve options of the ingress deployment (``DartRayIngress``): its own replica count and
    resources (:func:`~deployments.placement.ingress_actor_options`), and room for every request the
    engine replicas can hold at once (each open stream is one ongoing request of the ingress)."""
    engine_bound = deployment_options(args)["max_ongoing_requests"] * args.num_replicas
    return {"num_replicas": args.ingress_num_replicas, "max_ongoing_requests": engine_bound + 16,
            "ray_actor_options": ingress_actor_options(args.ingress_num_cpus, args.ingress_on_head)}


def build_app(args: dict | None = None) -> serve.Application:
    """Serve application builder (``import_path: deployments.openai_app:build_app``): the ingress,
    bound to a handle of the engine deployment."""
    a = ServeArgs.from_dict(args)
    check_tensor_parallel(a)
    engine = DartRayServer.options(**deployment_options(a)).bind(a.to_dict())
    return DartRayIngress.options(**ingress_options(a)).bind(a.to_dict(), engine)
