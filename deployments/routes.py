"""The HTTP side of the server: routes, request reading, SSE, and the ingress deployment.

``DartRayIngress`` is a light Serve deployment (no model, no tokenizer, ``ingress_num_cpus``,
default 0, on the head node by default) that holds the OpenAI routes and calls the engine
deployment (:class:`~deployments.serving.DartRayServer`) through a ``DeploymentHandle``::

    GET  /v1/models, /v1/models/{id}                  -> engine.model_card
    POST /v1/completions, /v1/chat/completions        -> engine.generate (streamed), as JSON or SSE
    GET  /health   (open)                             -> engine.health
    GET  /metrics                                     -> engine.metrics (+ this ingress's counters)

What happens here: the API key (one dependency on every route but ``/health``), the body cap (413)
before anything is parsed, JSON -> :class:`~deployments.protocol.GenerationRequest`, response and
SSE formatting, and what to do when the engine replica serving a request is lost:

* **before its first output** (queued, tokenising, prefilling): nothing was sent, so the request is
  resubmitted, up to ``max_replica_retries`` times, and Serve routes it to a live replica;
* **after it**: a stream ends with ``data: {"error": {..., "code": "replica_lost"}}`` and
  ``data: [DONE]``; a JSON request gets 503 ``replica_lost`` with ``Retry-After``. The client
  retries (OpenAI clients retry 503s by themselves).

A client that disconnects cancels its handle call; Serve propagates the cancellation to the engine
replica, which aborts the request (its batch row is free at the next step).

The routes are built per replica by :func:`build_api` around an :class:`Ingress`, which knows the
engine only as an :class:`EngineClient`; tests drive it with a fake one, no Ray needed.
"""

# no `from __future__ import annotations`: FastAPI reads the routes' annotations (Request)
# at runtime.

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.config import ServeArgs
from deployments.drain import DrainGate, follow_control
from deployments.errors import (
    REPLICA_LOST,
    ReplicaLostError,
    engine_error,
    http_error,
    is_replica_lost,
)
from deployments.metrics import (
    OPENMETRICS_CONTENT_TYPE,
    TEXT_CONTENT_TYPE,
    IngressMetrics,
    wants_openmetrics,
)
from deployments.protocol import (
    SSE_DONE,
    APIError,
    GenerationRequest,
    SSEChunks,
    completion_response,
    error_body,
    model_not_found,
    new_id,
    now,
    parse_chat,
    parse_completion,
    parse_json,
    sse,
    too_large,
    usage,
)
from deployments.replica import prepare_replica_process, replica_labels

logger = logging.getLogger("ray.serve")

INGRESS_NAME = "DartRayIngress"
RETRY_BACKOFF_S = 0.1
"""Wait before the first resubmission after a lost replica; x3 for each further one
(0.1, 0.3, 0.9 s): time for Serve's router to drop the dead replica, bounded by
``max_replica_retries``."""


class EngineClient:
    """How the ingress reaches the engine deployment: a Serve ``DeploymentHandle`` to
    :class:`~deployments.serving.DartRayServer`."""

    def __init__(self, handle) -> None:
        self._handle = handle
        # once: each `handle.<method>` / `.options()` makes a new handle object
        self._generate = handle.options(stream=True, method_name="generate")

    def generate(self, req: GenerationRequest, request_id: str):
        """The engine's stream of outputs for ``req``: an async iterator with ``cancel()``."""
        return self._generate.remote(req, request_id)

    async def call(self, method: str, *args) -> Any:
        return await getattr(self._handle, method).remote(*args)


def _cancel(stream) -> None:
    """Best-effort cancel of an engine stream (the engine aborts the request)."""
    try:
        stream.cancel()
    except Exception:
        logger.debug("cancelling an engine stream failed", exc_info=True)


async def _next(stream):
    """The stream's next item; an early end is a lost replica (the engine ends every stream with a
    finished output or an error item)."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise ReplicaLostError("the engine stream ended before its final output") from None


async def _outputs(stream, first) -> AsyncIterator[Any]:
    """A request's outputs, ``first`` (already received) to the finished one; an error item is
    raised. The caller cancels ``stream`` if it stops before the finished output."""
    o = first
    while True:
        if isinstance(o, APIError):
            raise o
        yield o
        if o.finished:
            return
        o = await _next(stream)


def _usage(last, method: str) -> dict:
    return usage(last.num_prompt_tokens, last.num_generated_tokens, last.stats.to_dict(), method)


def counts_errors(path: str) -> bool:
    """Whether an error answered on ``path`` counts in ``dart_ray:request_errors``: the OpenAI API
    (``/v1/...``) and ``/metrics`` (a scraper with a wrong key), not ``/health`` probes or a
    scanner's unknown paths."""
    return path.startswith("/v1/") or path == "/metrics"


class Ingress:
    """Request handling of one ingress replica (what the routes of :func:`build_api` call)."""

    def __init__(self, args: ServeArgs, engine: EngineClient,
                 metrics: IngressMetrics | None = None) -> None:
        self.args = args
        self.engine = engine
        self.metrics = metrics or IngressMetrics()
        self._identity: dict | None = None
        """Served model name and default method, from the first model card (the same on every
        engine replica: they share the args)."""
        self.open_tasks: set = set()
        """The tasks of the HTTP requests this replica is answering
        (:class:`~deployments.drain.DrainGate`)."""
        self.loop = None
        """The event loop they run on (set by the gate)."""
        self.draining = False
        """The server shuts down: new generation requests get 503 (:mod:`deployments.drain`)."""
        self.cutting = False
        """The drain has ended: the open requests are being cancelled (each says so)."""

    @property
    def open_requests(self) -> int:
        return len(self.open_tasks)

    # ---- the API key: one dependency of every route but /health ----------------------------------
    def authorize(self, request: Request) -> None:
        key = self.args.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" \
                or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "invalid_request_error", None, "invalid_api_key")

    def error_response(self, e: APIError, path: str) -> JSONResponse:
        """``e`` as the HTTP answer to a request for ``path`` (counted where
        :func:`counts_errors`)."""
        if counts_errors(path):
            self.metrics.error(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)

    # ---- reading a request -----------------------------------------------------------------------
    async def read_body(self, request: Request) -> bytes:
        """The body, refused (413) as soon as it is larger than ``max_body_bytes``."""
        cap = self.args.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise too_large(cap)
        buf = bytearray()
        async for part in request.stream():
            buf += part
            if len(buf) > cap:
                raise too_large(cap)
        return bytes(buf)

    async def parse(self, raw: bytes,
                    parse: Callable[[dict], GenerationRequest]) -> GenerationRequest:
        if len(raw) < (256 << 10):
            return parse(parse_json(raw))
        # a large body: decode it off the event loop, which keeps streaming the other requests
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: parse(parse_json(raw)))

    # ---- calling the engine deployment -----------------------------------------------------------
    async def _retrying(self, what: str, attempt: Callable[[int], Awaitable[Any]]) -> Any:
        """``attempt(n)`` for n = 0, 1, ...: again (after a short backoff) while it fails because
        the engine replica was lost, at most ``max_replica_retries`` more times. Other errors, and
        the last loss, are raised as OpenAI-style errors
        (:func:`~deployments.errors.engine_error`)."""
        n = 0
        while True:
            try:
                return await attempt(n)
            except APIError:
                raise
            except Exception as e:
                lost = is_replica_lost(e)
                if not lost or n >= self.args.max_replica_retries:
                    if lost:
                        logger.warning("%s: engine replica lost, %d retries spent: %r", what, n, e)
                    raise engine_error(e, self.args.retry_after_s) from e
                logger.warning("%s: engine replica lost before any output (%r); "
                               "resubmitting (%d/%d)", what, e,
                               n + 1, self.args.max_replica_retries)
            self.metrics.retried()
            await asyncio.sleep(RETRY_BACKOFF_S * 3 ** n)
            n += 1

    async def call(self, method: str, *args) -> Any:
        """A unary call of the engine deployment (resubmitted if its replica is lost)."""
        return await self._retrying(method, lambda _: self.engine.call(method, *args))

    async def model_card(self) -> dict:
        card = await self.call("model_card")
        self._identity = {"model": card["id"], "method": card["speculative_method"]}
        return card

    async def identity(self) -> dict:
        if self._identity is None:
            await self.model_card()
        return self._identity

    async def open(self, req: GenerationRequest, rid: str) -> tuple[Any, Any]:
        """Submit ``req`` and wait for its first item (an output, or the engine's refusal); a
        replica lost before that is retried. Returns (stream, first item)."""

        async def attempt(n: int):
            stream = self.engine.generate(req, rid if n == 0 else f"{rid}-retry{n}")
            try:
                first = await _next(stream)
            except BaseException:
                _cancel(stream)
                raise
            if isinstance(first, APIError) and first.code == REPLICA_LOST:
                # the replica took the request but can serve no more (a failed TP group)
                raise ReplicaLostError(first.message)
            return stream, first

        return await self._retrying(f"request {rid}", attempt)

    # ---- generation ------------------------------------------------------------------------------
    def _cut(self, e: Exception, rid: str) -> APIError:
        """The error of a request that ``e`` ended after its first output (a lost replica: the
        retryable ``replica_lost``)."""
        err = engine_error(e, self.args.retry_after_s)
        if err.code == REPLICA_LOST:
            logger.warning("request %s: engine replica lost after the first output: %r", rid, e)
        return err

    async def generate(self, request: Request, parse: Callable[[dict], GenerationRequest]):
        req = await self.parse(await self.read_body(request), parse)
        identity = await self.identity()
        rid = new_id(req.kind)
        stream, first = await self.open(req, rid)
        if isinstance(first, APIError):              # refused by the engine: the stream has ended
            raise first
        created, model = now(), identity["model"]
        method = req.speculative or identity["method"]
        if req.stream:
            return StreamingResponse(self._sse(SSEChunks(req, rid, created, model), method, stream,
                                               first),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        text, last = [], first
        try:
            async for o in _outputs(stream, first):
                text.append(o.new_text)
                last = o
        except APIError:
            raise
        except Exception as e:
            raise self._cut(e, rid) from e
        finally:
            if not last.finished:
                _cancel(stream)
        return JSONResponse(completion_response(req, rid, created, model, "".join(text),
                                                last.finish_reason, _usage(last, method)),
                            headers={"X-Request-Id": rid})

    async def _sse(self, chunks: SSEChunks, method: str, stream, first) -> AsyncIterator[bytes]:
        last = first
        try:
            if chunks.req.kind == "chat":
                yield chunks.role()
            async for o in _outputs(stream, first):
                last = o
                if o.new_text:
                    yield chunks.text(o.new_text)
                if o.finished:
                    yield chunks.finish(o.finish_reason)
            if chunks.req.include_usage:
                yield chunks.usage(_usage(last, method))
            yield SSE_DONE
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band, then end it
            err = self._cut(e, chunks.rid)
            self.metrics.error(err.status)
            yield sse(err.body())
            yield SSE_DONE
        finally:                                     # also on the client going away (cancelled)
            if not last.finished:
                _cancel(stream)


def build_api(ingress: Ingress) -> FastAPI:
    """The FastAPI app of one ingress replica."""
    app = FastAPI(title="dart-ray", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return ingress.error_response(exc, request.url.path)

    # unknown routes, wrong verbs
    @app.exception_handler(StarletteHTTPException)
    async def starlette_error(request: Request, exc: StarletteHTTPException):
        return ingress.error_response(http_error(exc.status_code, str(exc.detail)),
                                      request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error")
        return ingress.error_response(APIError(500, f"internal error: {exc!r}", "server_error",
                                               None, None), request.url.path)

    @app.get("/health")                            # open: load balancers probe it without a key
    async def health():
        try:
            return await ingress.call("health")
        except Exception as e:  # noqa: BLE001
            message = e.message if isinstance(e, APIError) else str(e)
            return JSONResponse(error_body(message, "server_error", None, "unhealthy"),
                                status_code=503)

    # the API key, for every route below
    api = APIRouter(dependencies=[Depends(ingress.authorize)])

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [await ingress.model_card()]}

    @api.get("/v1/models/{model:path}")
    async def model(model: str):
        card = await ingress.model_card()
        if model not in (card["id"], card["root"]):
            raise model_not_found(model, card["id"])
        return card

    @api.get("/metrics")
    async def metrics(request: Request):
        om = wants_openmetrics(request.headers.get("accept"))
        text = await ingress.call("metrics", om, ingress.metrics.snapshot())
        return PlainTextResponse(text,
                                 media_type=OPENMETRICS_CONTENT_TYPE if om else TEXT_CONTENT_TYPE)

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await ingress.generate(request, parse_completion)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await ingress.generate(request, parse_chat)

    app.include_router(api)
    app.add_middleware(DrainGate, ingress=ingress)
    return app


try:
    # the app is built per replica (__serve_build_asgi_app__)
    _late_bound_ingress = serve.ingress()
except TypeError as e:
    # a Ray Serve whose ingress() needs the app up front
    raise ImportError("deployments.routes needs a Ray Serve whose serve.ingress() builds the app "
                      "at replica start (`__serve_build_asgi_app__`; Ray 2.60 has it): "
                      "upgrade ray[serve]") from e


@serve.deployment(name=INGRESS_NAME)
@_late_bound_ingress
class DartRayIngress:
    """The HTTP ingress: routes, auth, SSE; the engine deployment behind a handle."""

    def __init__(self, args: dict | ServeArgs, engine) -> None:
        a = ServeArgs.from_dict(args)
        nice = prepare_replica_process(a.replica_niceness)
        replica, node = replica_labels()
        self.ingress = Ingress(a, EngineClient(engine), IngressMetrics(replica, node))
        follow_control(self.ingress, f"{node}/{replica}")    # drains with `dart-ray serve`
        logger.info("dart-ray ingress ready: nice=%s max_replica_retries=%d api_key=%s", nice,
                    a.max_replica_retries, "set" if a.api_key else "none")

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self.ingress)
