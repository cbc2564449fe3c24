"""Every failure a request can meet, mapped to one OpenAI-style error (status, JSON body, headers).

The body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``
(:class:`~deployments.protocol.APIError`). The ingress answers with it as JSON, or, once an SSE
stream has started, as a last ``data: {"error": ...}`` event followed by ``data: [DONE]``. Errors
found while reading a request (400 malformed, 401 key, 404 model or route, 413 body) are APIErrors
raised where they are found; :func:`engine_error` maps everything else:

* 400 ``context_length_exceeded``: the prompt (or prompt + ``max_tokens``) exceeds the context;
* 400 ``invalid_value``: a prompt the engine refuses (``InvalidPromptError``: empty, ids outside
  the vocabulary; ``param: prompt``) or another value it refuses (ValueError / TypeError);
* 503 ``queue_full`` + ``Retry-After``: the engine's queue is full, or Serve's back-pressure;
* 503 ``engine_unavailable``: the engine deployment failed to deploy;
* **503 ``replica_lost`` + ``Retry-After``**: the engine replica serving the request (its process or
  its node, or a worker of its tensor-parallel group, or its engine thread: shut down by Serve's
  graceful stop, or dead) was lost after the request's first output;
  nothing more comes, the client retries (a loss *before* the first output is retried on another
  replica by the ingress, unseen -- also a replica whose TP group failed, which refuses new
  requests with this error until Serve replaces it);
* 500 ``engine_error``: an engine step failed (the requests of that step fail, the server goes on);
* 500 (no code): anything else.

A lost replica is recognised by the exception Ray or Serve raises at the caller of a handle:
:class:`ray.exceptions.RayActorError` (``ActorDiedError``, ``ActorUnavailableError``), a crashed
worker or node, a lost object, Serve's ``ReplicaUnavailableError``; :class:`ReplicaLostError` is
raised by the ingress itself when an engine stream ends without its final output.
"""

from __future__ import annotations

from dart_ray import InvalidPromptError, PromptTooLongError
from dart_ray.engine.async_engine import EngineDeadError, EngineStepError, QueueFullError
from deployments.protocol import APIError

REPLICA_LOST = "replica_lost"
"""``code`` of the error a request gets when the engine replica serving it is lost."""


class ReplicaLostError(RuntimeError):
    """The engine replica serving a request went away before the request finished (its stream
    ended without a finished output, or every retry found no live replica)."""


def _replica_lost_types() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex
    from ray.serve.exceptions import ReplicaUnavailableError

    return (ReplicaLostError, rex.RayActorError, rex.WorkerCrashedError, rex.NodeDiedError,
            rex.ObjectLostError, rex.LocalRayletDiedError, ReplicaUnavailableError)


def is_replica_lost(e: BaseException) -> bool:
    """Whether ``e`` says the engine replica (its process or its node) is gone, so the request
    can be retried elsewhere. Ray-free callers (unit tests) still get True for ReplicaLostError."""
    if isinstance(e, ReplicaLostError):
        return True
    try:
        return isinstance(e, _replica_lost_types())
    except ImportError:             # no Ray installed: nothing else can signal a lost replica
        return False


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, round(seconds)))}


def _queue_full(e: BaseException, retry_after_s: float) -> APIError:
    return APIError(503, f"server overloaded: {e}", "server_error", None, "queue_full",
                    _retry_after(retry_after_s))


def _unavailable(message: str) -> APIError:
    return APIError(503, f"engine unavailable: {message}", "server_error", None,
                    "engine_unavailable")


def engine_error(e: BaseException, retry_after_s: float = 1.0) -> APIError:
    """The OpenAI-style error for ``e`` (see the module table). ``retry_after_s`` goes into the
    ``Retry-After`` header of retryable 503s that do not carry their own (a lost replica)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, PromptTooLongError):
        return APIError(400, str(e), "invalid_request_error", "prompt", "context_length_exceeded")
    if isinstance(e, InvalidPromptError):
        return APIError(400, str(e), "invalid_request_error", "prompt", "invalid_value")
    if isinstance(e, QueueFullError):
        return _queue_full(e, e.retry_after_s)
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), "server_error", None, "engine_error")
    if isinstance(e, EngineDeadError) or is_replica_lost(e):
        # a stopped engine thread (Serve's graceful stop shuts it down with requests still
        # queued, or it died) serves nothing more either: as a lost replica, a request with no
        # output yet is resubmitted to a live one by the ingress
        return APIError(503, f"the engine replica serving this request was lost "
                             f"({type(e).__name__}: {e}); nothing more will come for it: retry "
                             "the request", "server_error", None, REPLICA_LOST,
                        _retry_after(retry_after_s))
    serve_error = _serve_unavailable(e, retry_after_s)
    if serve_error is not None:
        return serve_error
    if isinstance(e, (ValueError, TypeError)):
        return APIError(400, str(e), "invalid_request_error", None, "invalid_value")
    return APIError(500, f"internal error: {e!r}", "server_error", None, None)


def _serve_unavailable(e: BaseException, retry_after_s: float) -> APIError | None:
    """Serve's own refusals: back-pressure at the handle, a deployment that failed to deploy."""
    try:
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
    except ImportError:
        return None
    if isinstance(e, BackPressureError):
        return _queue_full(e, e.retry_after_s or retry_after_s)
    if isinstance(e, DeploymentUnavailableError):
        return _unavailable(e.message)
    return None


def http_error(status: int, detail: str) -> APIError:
    """Starlette's own HTTP errors (unknown route 404, wrong verb 405) as OpenAI-style bodies."""
    return APIError(status, detail, "invalid_request_error", None,
                    "not_found" if status == 404 else None)
