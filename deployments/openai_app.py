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
"""

from __future__ import annotations

from typing import Any

from ray import serve

from deployments.config import ServeArgs
from deployments.engine_factory import check_tensor_parallel
from deployments.placement import deployment_placement, ingress_actor_options
from deployments.routes import DartRayIngress
from deployments.serving import DartRayServer

__all__ = ["DartRayIngress", "DartRayServer", "build_app", "deployment_options",
           "ingress_options"]

CONTROL_CALLS = 16
"""Room each replica keeps for calls beside the requests (``/health``, ``/metrics``, model card)."""


def _engine_max_ongoing(args: ServeArgs) -> int:
    """Requests one engine replica holds at once: the rows of every lane it may build plus its
    queue (beyond that the engine answers 503 ``queue_full``), plus the control calls."""
    lanes = args.max_lanes if args.allow_speculative_override else 1
    return args.engine.max_batch_size * lanes + args.max_queue + CONTROL_CALLS


def deployment_options(args: ServeArgs) -> dict[str, Any]:
    """Serve options of the engine deployment (``DartRayServer``): replica resources, request
    bounds, TP placement."""
    # the engine's own queue is the bound; placement: replica resources, TP bundles or the cap
    return {"num_replicas": args.num_replicas, "max_ongoing_requests": _engine_max_ongoing(args),
            **deployment_placement(args)}


def ingress_options(args: ServeArgs) -> dict[str, Any]:
    """Serve options of the ingress deployment (``DartRayIngress``): its own replica count and
    resources (:func:`~deployments.placement.ingress_actor_options`), and room for every request the
    engine replicas can hold at once (each open stream is one ongoing request of the ingress)."""
    engine_bound = _engine_max_ongoing(args) * args.num_replicas
    return {"num_replicas": args.ingress_num_replicas,
            "max_ongoing_requests": engine_bound + CONTROL_CALLS,
            "ray_actor_options": ingress_actor_options(args.ingress_num_cpus, args.ingress_on_head)}


def build_app(args: dict | None = None) -> serve.Application:
    """Serve application builder (``import_path: deployments.openai_app:build_app``): the ingress,
    bound to a handle of the engine deployment."""
    a = ServeArgs.from_dict(args)
    check_tensor_parallel(a)
    plain = a.to_dict()
    engine = DartRayServer.options(**deployment_options(a)).bind(plain)
    return DartRayIngress.options(**ingress_options(a)).bind(plain, engine)
