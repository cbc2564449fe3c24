"""OpenAI-compatible Ray Serve application around the dart-ray engine.

    serve run deployments.openai_app:build_app model=... method=dart
    # or: dart-ray serve --config deployments/serve_default.yaml

One deployment, ``DartRayServer``: a FastAPI ingress whose replica loads the engine once (through
:func:`make_engine`, the hook tensor parallelism plugs into) and owns it on a background thread
(:class:`~dart_ray.engine.async_engine.AsyncEngine`). Routes:

    GET  /v1/models, /v1/models/{id}
    POST /v1/completions, /v1/chat/completions      (JSON, or SSE with "stream": true)
    GET  /health                                    (no API key needed)
    GET  /metrics                                   (Prometheus text, vLLM-compatible names)

Per-request ``"speculative": false`` (or ``{"method": <one of dart_ray.METHODS>}``) runs the request
on another engine *lane* sharing the target weights, built on first use on the same engine thread.
"""

# no `from __future__ import annotations`: FastAPI must see real annotations (Request) through
# Serve's class-based-view wrapper.

import asyncio
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from dart_ray import Engine, PromptTooLongError, SamplingParams
from dart_ray.engine.async_engine import (
    MAIN_LANE,
    AsyncEngine,
    AsyncEngineError,
    EngineDeadError,
    EngineStepError,
    QueueFullError,
)
from deployments.config import ServeArgs
from deployments.metrics import ServerMetrics
from deployments.placement import placement_options, replica_actor_options
from deployments.protocol import (
    SSE_DONE,
    APIError,
    GenerationRequest,
    bad,
    chunk,
    completion_response,
    error_body,
    new_id,
    now,
    parse_chat,
    parse_completion,
    parse_json,
    sse,
    usage,
    usage_chunk,
)

logger = logging.getLogger("ray.serve")

DEPLOYMENT_NAME = "DartRayServer"


# ---- engine construction (the tensor-parallel hook) -------------------------------------------------
def check_tensor_parallel(args: ServeArgs) -> None:
    """Fail at build time for a model the TP transform cannot split (local HF directories only;
    other model references are checked when the replica loads them)."""
    if args.tensor_parallel_size > 1 and args.model and (Path(args.model) / "config.json").is_file():
        from dart_ray.models.loading import read_model_args
        from dart_ray.parallel import shard_plan

        shard_plan(read_model_args(Path(args.model)), 0, args.tensor_parallel_size)


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

    This is the single place a replica creates its engine: a tensor-parallel engine (rank 0 here,
    ranks 1.. as actors in the replica's placement group, see :mod:`deployments.placement`) plugs
    in by returning a :class:`ReplicaEngine` whose ``engine`` has the Engine interface (all its
    calls then happen on the engine thread) and whose hooks Serve's health check and the replica's
    shutdown call.
    """
    check_tensor_parallel(args)
    group = None
    if args.tensor_parallel_size > 1:
        from deployments.tp import start_tp_group

        group = start_tp_group(args.engine_config(), args.tensor_parallel_size,
                               num_cpus_per_worker=args.num_cpus)
        engine = group.engine
    else:
        engine = Engine.from_config(args.engine_config())
    if args.profile:
        from dart_ray.profiles import load_profile

        engine.set_decoding(load_profile(args.profile))
    if group is not None:
        return ReplicaEngine(engine=engine, check_health=group.check_health, shutdown=group.shutdown)
    return engine


def lane_factory(method: str) -> Callable[[Engine], Engine]:
    """An engine for ``method`` sharing the main engine's target weights (own KV cache and drafter)."""

    def build(main: Engine) -> Engine:
        from dart_ray.drafters import make_drafter

        # the main engine's drafter path belongs to its method; another method uses its shipped default
        keep = main.config.drafter == "random" and method in ("dart", "eagle")
        cfg = main.config.replace(method=method, drafter=main.config.drafter if keep else None)
        engine = Engine(main.target, make_drafter(cfg, main.target), cfg)
        engine.set_decoding(main.decoding)
        return engine

    return build


# ---- the FastAPI app ---------------------------------------------------------------------------------
app = FastAPI(title="dart-ray", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):   # unknown routes, wrong verbs
    code = "not_found" if exc.status_code == 404 else None
    return JSONResponse(error_body(str(exc.detail), "invalid_request_error", None, code), exc.status_code)


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception):
    logger.exception("unhandled error")
    return JSONResponse(error_body(f"internal error: {exc!r}", "server_error", None, None), 500)


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, PromptTooLongError):
        return APIError(400, str(e), "invalid_request_error", "prompt", "context_length_exceeded")
    if isinstance(e, QueueFullError):
        return APIError(503, f"server overloaded: {e}", "server_error", None, "queue_full")
    if isinstance(e, EngineDeadError):
        return APIError(503, f"engine unavailable: {e}", "server_error", None, "engine_unavailable")
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), "server_error", None, "engine_error")
    if isinstance(e, (ValueError, TypeError)):
        return APIError(400, str(e), "invalid_request_error", None, "invalid_value")
    return APIError(500, f"internal error: {e!r}", "server_error", None, None)


@serve.deployment(name=DEPLOYMENT_NAME, health_check_period_s=5.0, health_check_timeout_s=30.0,
                  graceful_shutdown_timeout_s=5.0, graceful_shutdown_wait_loop_s=0.5)
@serve.ingress(app)
class DartRayServer:
    def __init__(self, args: dict | ServeArgs) -> None:
        self.args = ServeArgs.from_dict(args)
        self._hooks = ReplicaEngine(engine=None)  # type: ignore[arg-type]

        def build() -> Engine:
            built = make_engine(self.args)
            if isinstance(built, ReplicaEngine):
                self._hooks = built
                return built.engine
            return built

        self.aengine = AsyncEngine(build, max_queue=self.args.max_queue)
        info = self.aengine.call_future(
            lambda e: (e.target.model_id, e.max_seq_len, e.config.method, e.decoding.chunk_len)).result()
        self.model_id, self.max_seq_len, self.method, self.chunk_len = info
        self.model_name = self.args.served_model_name or self.model_id
        self.accepted_models = {self.model_name, self.model_id}
        self.created = now()
        self.server_metrics = ServerMetrics(self.model_name)
        logger.info("dart-ray replica ready: model=%s method=%s args=%s", self.model_name, self.method,
                    self.args.redacted())

    # ---- Serve hooks and handle methods ------------------------------------------------------------
    def check_health(self) -> None:
        self.aengine.check_health()
        if self._hooks.check_health is not None:
            self._hooks.check_health()

    def reconfigure(self, user_config: dict) -> None:
        """Serve ``user_config``: ``{"decoding": {...}}`` or ``{"profile": name}`` (no reload)."""
        from dart_ray import DecodingConfig

        user_config = dict(user_config or {})
        unknown = set(user_config) - {"decoding", "profile"}
        if unknown:
            raise ValueError(f"unknown user_config keys {sorted(unknown)}; known: ['decoding', 'profile']")
        if user_config.get("profile"):
            from dart_ray.profiles import load_profile

            schedule = load_profile(user_config["profile"])
            self.aengine.call_future(lambda e: e.set_decoding(schedule)).result()
        elif user_config.get("decoding"):
            dec = self.args.decoding_config().replace(**user_config["decoding"])
            self.aengine.call_future(lambda e: e.set_decoding(dec)).result()
        elif "decoding" in user_config:
            self.aengine.call_future(lambda e: e.set_decoding(DecodingConfig())).result()

    def pid(self) -> int:
        """The replica process id (tests kill it to exercise replica recovery)."""
        return os.getpid()

    def __del__(self) -> None:
        aeng = getattr(self, "aengine", None)
        if aeng is not None:
            aeng.shutdown(timeout_s=5.0)
        hooks = getattr(self, "_hooks", None)
        if hooks is not None and hooks.shutdown is not None:
            hooks.shutdown, shutdown = None, hooks.shutdown
            shutdown()

    # ---- helpers ---------------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        key = self.args.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "invalid_request_error", None, "invalid_api_key")

    def _error(self, e: APIError) -> JSONResponse:
        self.server_metrics.error(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_models:
            raise APIError(404, f"The model `{model}` does not exist (this server serves `{self.model_name}`).",
                           "invalid_request_error", "model", "model_not_found")

    async def _lane(self, method: str | None) -> tuple[str, str]:
        if method is None or method == self.method:
            return MAIN_LANE, self.method
        if not self.args.allow_speculative_override or self.args.tensor_parallel_size > 1:
            raise bad(f"this server does not run per-request speculative overrides (it runs {self.method!r})",
                      "speculative", "unsupported_value")
        if method not in self.aengine.lanes:
            try:
                await self.aengine.add_lane(method, lane_factory(method))
            except Exception as e:  # noqa: BLE001 - e.g. no drafter shipped for this target
                raise bad(f"speculative method {method!r} is unavailable: {e}", "speculative",
                          "unsupported_value") from None
        return method, method

    async def _prepare(self, req: GenerationRequest) -> list[int]:
        if req.max_tokens is not None and req.max_tokens > self.max_seq_len:
            raise bad(f"max_tokens={req.max_tokens} exceeds the context length {self.max_seq_len}", "max_tokens",
                      "context_length_exceeded")

        def encode(e: Engine) -> list[int]:
            ids = e.encode_prompt(req.prompt, req.chat)
            e.check_prompt(ids)
            return ids

        try:
            ids = await self.aengine.call(encode)
        except PromptTooLongError as e:
            raise APIError(400, str(e), "invalid_request_error", "messages" if req.chat else "prompt",
                           "context_length_exceeded") from None
        except AsyncEngineError:
            raise
        except Exception as e:  # noqa: BLE001 - tokenizer / chat template rejected the input
            raise bad(f"invalid prompt: {e}", "messages" if req.chat else "prompt") from None
        if req.max_tokens is not None and len(ids) + req.max_tokens > self.max_seq_len:
            raise bad(f"This model's maximum context length is {self.max_seq_len} tokens. However, you requested "
                      f"{len(ids) + req.max_tokens} tokens ({len(ids)} in the prompt, {req.max_tokens} for the "
                      "completion).", "max_tokens", "context_length_exceeded")
        return ids

    def _params(self, req: GenerationRequest, num_prompt: int) -> SamplingParams:
        max_new = req.max_tokens if req.max_tokens is not None else max(1, self.max_seq_len - num_prompt)
        try:
            return SamplingParams(max_new_tokens=max_new, temperature=req.temperature, top_p=req.top_p,
                                  top_k=req.top_k, seed=req.seed, stop=req.stop,
                                  stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos)
        except ValueError as e:
            raise bad(str(e)) from None

    # ---- routes ------------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self):
        try:
            self.check_health()
        except Exception as e:  # noqa: BLE001
            return JSONResponse(error_body(str(e), "server_error", None, "unhealthy"), status_code=503)
        return {"status": "ok", "queue_depth": self.aengine.queue_depth, "num_running": self.aengine.num_running}

    @app.get("/v1/models")
    async def models(self, request: Request):
        try:
            self._auth(request)
        except APIError as e:
            return self._error(e)
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request):
        try:
            self._auth(request)
            self._check_model(model)
        except APIError as e:
            return self._error(e)
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "dart-ray",
                "root": self.model_id, "parent": None, "max_model_len": self.max_seq_len,
                "speculative_method": self.method}

    @app.get("/metrics")
    async def metrics(self, request: Request):
        try:
            self._auth(request)
        except APIError as e:
            return self._error(e)

        def snapshot(engines: dict) -> dict:
            out = {}
            for name, e in engines.items():
                d = dataclasses.asdict(e.stats())
                out[name] = (e.config.method, d)
            return out

        stats = await self.aengine.call(snapshot, lane=None)
        positions = self.chunk_len if self.method != "none" else 0
        text = self.server_metrics.render(stats, self.aengine.queue_depth, self.aengine.num_running, positions)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._generate(request, parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._generate(request, parse_chat)

    async def _generate(self, request: Request, parse: Callable[[dict], GenerationRequest]):
        t0 = time.perf_counter()
        agen = None
        try:
            self._auth(request)
            req = parse(parse_json(await request.body()))
            self._check_model(req.model)
            lane, method = await self._lane(req.speculative)
            ids = await self._prepare(req)
            params = self._params(req, len(ids))
            rid = new_id(req.kind)
            agen = self.aengine.stream(ids, params, request_id=rid, lane=lane)
            first = await agen.__anext__()           # surfaces queue-full / engine errors before headers
        except StopAsyncIteration:                   # cannot happen: a stream ends with a finished output
            return self._error(APIError(500, "empty stream", "server_error"))
        except Exception as e:  # noqa: BLE001
            if agen is not None:
                await agen.aclose()
            return self._error(_engine_error(e))
        self.server_metrics.ttft.observe(time.perf_counter() - t0)
        created = now()
        if req.stream:
            return StreamingResponse(self._sse(req, rid, created, method, agen, first, t0),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        text, last = [first.new_text], first
        try:
            if not first.finished:
                async for o in agen:
                    text.append(o.new_text)
                    last = o
        except asyncio.CancelledError:
            self.server_metrics.aborted += 1         # client went away; aclose() below aborts the request
            raise
        except Exception as e:  # noqa: BLE001
            return self._error(_engine_error(e))
        finally:
            await agen.aclose()
        use = usage(last.num_prompt_tokens, last.num_generated_tokens, last.stats.to_dict(), method)
        self.server_metrics.finished(last.finish_reason or "stop", time.perf_counter() - t0, last.num_prompt_tokens,
                              last.num_generated_tokens)
        return JSONResponse(completion_response(req, rid, created, self.model_name, "".join(text),
                                                last.finish_reason, use), headers={"X-Request-Id": rid})

    async def _sse(self, req: GenerationRequest, rid: str, created: int, method: str, agen, first, t0: float):
        name = self.model_name
        last = first
        try:
            if req.kind == "chat":
                yield sse(chunk(req, rid, created, name, "", role=True))
            o = first
            while True:
                last = o
                if o.new_text:
                    yield sse(chunk(req, rid, created, name, o.new_text))
                if o.finished:
                    yield sse(chunk(req, rid, created, name, None if req.kind == "chat" else "",
                                    finish_reason=o.finish_reason))
                    break
                o = await agen.__anext__()
            if req.include_usage:
                use = usage(last.num_prompt_tokens, last.num_generated_tokens, last.stats.to_dict(), method)
                yield sse(usage_chunk(req, rid, created, name, use))
            yield SSE_DONE
            self.server_metrics.finished(last.finish_reason or "stop", time.perf_counter() - t0, last.num_prompt_tokens,
                                  last.num_generated_tokens)
        except (asyncio.CancelledError, GeneratorExit):
            self.server_metrics.aborted += 1         # client went away: agen.aclose() aborts the request
            raise
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            err = _engine_error(e)
            self.server_metrics.error(err.status)
            yield sse(err.body())
            yield SSE_DONE
        finally:
            await agen.aclose()


# ---- the application builder --------------------------------------------------------------------------
def deployment_options(args: ServeArgs) -> dict[str, Any]:
    """Serve options of the deployment: replica resources, request bounds, TP placement."""
    opts: dict[str, Any] = {
        "num_replicas": args.num_replicas,
        # the engine's own queue (max_queue -> HTTP 503) is the bound; leave room for /health, /metrics
        "max_ongoing_requests": args.max_batch_size + args.max_queue + 16,
        "ray_actor_options": replica_actor_options(args.device, args.num_cpus),
    }
    if args.tensor_parallel_size > 1:
        opts.update(placement_options(args.tensor_parallel_size, args.device, args.num_cpus))
    return opts


def build_app(args: dict | None = None) -> serve.Application:
    """Serve application builder (``import_path: deployments.openai_app:build_app``)."""
    a = ServeArgs.from_dict(args)
    check_tensor_parallel(a)
    return DartRayServer.options(**deployment_options(a)).bind(a.to_dict())
