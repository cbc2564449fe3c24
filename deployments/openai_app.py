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
on another engine *lane* sharing the target weights, built on first use on the same engine thread
(off by default: ``allow_speculative_override``; at most ``max_lanes`` engines).

Nothing a request carries runs on the engine thread before the engine needs it: the body is read
with a size cap (413), the prompt's size is checked (characters, or token ids) before tokenising,
and tokenising (chat template included) runs in a small thread pool with its own tokenizer copies;
the engine gets token ids. So one huge request cannot stall the other streams.
"""

# no `from __future__ import annotations`: FastAPI must see real annotations (Request) through
# Serve's class-based-view wrapper.

import asyncio
import copy
import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from dart_ray import Engine, PromptTooLongError, SamplingParams, encode_prompt
from dart_ray.engine.async_engine import (
    MAIN_LANE,
    AsyncEngine,
    EngineDeadError,
    EngineStepError,
    LaneLimitError,
    QueueFullError,
    RequestTiming,
)
from deployments.config import ServeArgs
from deployments.metrics import (
    OPENMETRICS_CONTENT_TYPE,
    TEXT_CONTENT_TYPE,
    ServerMetrics,
    wants_openmetrics,
)
from deployments.placement import deployment_placement
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
    prompt_size,
    sse,
    too_large,
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
        from dart_ray.profiles import apply_profile

        apply_profile(engine, args.profile)        # warns once when tuned on other hardware
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


# ---- replica process and tokenisation ------------------------------------------------------------------
def reset_niceness(target: int | None) -> int | None:
    """Set every thread of this process to nice ``target`` if it is nicer (Ray starts workers at nice
    15). Returns the nice value now, or None if ``target`` is None. Raising priority needs
    CAP_SYS_NICE or RLIMIT_NICE; without it a warning is logged and the process stays as it is."""
    if target is None or not hasattr(os, "setpriority"):
        return None
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
        except PermissionError:
            logger.warning("replica runs at nice %d: no permission to lower it to %d (grant CAP_SYS_NICE or "
                           "RLIMIT_NICE, or start Ray with worker_niceness=%d)",
                           os.getpriority(os.PRIO_PROCESS, 0), target, target)
            break
        except OSError:                  # the thread ended meanwhile
            continue
    return os.getpriority(os.PRIO_PROCESS, 0)


def keep_serve_grpc_on_loopback() -> bool:
    """Serve starts each replica's inter-deployment gRPC server on ``[::]:0`` (every interface) right
    after the replica's ``__init__``, whatever Ray's node address. On a node whose Ray address is
    loopback (``dart-ray serve``'s local Ray), bind it to that address instead, so nothing of the
    replica listens beyond loopback. Returns True if it did (no-op on a routable node address or a
    Serve without that hook)."""
    import ray

    from deployments.run import is_loopback

    try:
        from ray.serve._private import replica as serve_replica
    except ImportError:
        return False
    ip = ray.util.get_node_ip_address()
    original = getattr(serve_replica, "add_port_to_grpc_server", None)
    if original is None or not is_loopback(ip):
        return False
    if getattr(original, "dart_ray_loopback", False):
        return True

    def add_port(server, address: str):
        if address.startswith("[::]:"):
            address = f"{ip}:{address[len('[::]:'):]}"
        return original(server, address)

    add_port.dart_ray_loopback = True
    serve_replica.add_port_to_grpc_server = add_port
    return True


def max_token_chars(tokenizer) -> int:
    """Characters of the longest vocabulary entry: an upper bound of the characters one token
    covers (byte-level entries spell one byte per character, and a character is >= 1 byte)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


class TokenizerPool:
    """Tokenises prompts on ``workers`` threads, each with its own copy of the tokenizer (no Rust
    tokenizer object is shared with the engine thread's detokeniser or between threads)."""

    def __init__(self, tokenizer, workers: int) -> None:
        self._proto = copy.deepcopy(tokenizer)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dart-ray-tokenize")

    def _tokenizer(self):
        tok = getattr(self._local, "tok", None)
        if tok is None:
            with self._lock:                 # deepcopy reads the prototype: one at a time
                tok = self._local.tok = copy.deepcopy(self._proto)
        return tok

    def _encode(self, prompt, chat: bool) -> list[int]:
        return encode_prompt(self._tokenizer(), prompt, chat)

    async def encode(self, prompt, chat: bool) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._encode, prompt, chat)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _replica_labels() -> tuple[str | None, str | None]:
    """(Serve replica id, Ray node id) of this process; (None, None) outside a Serve replica."""
    try:
        ctx = serve.get_replica_context()
        replica = getattr(getattr(ctx, "replica_id", None), "unique_id", None) or ctx.replica_tag
    except Exception:  # noqa: BLE001 - not in a replica (tests construct the class directly)
        return None, None
    try:
        import ray

        node = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001
        node = None
    return str(replica), node


def _engine_info(e: Engine) -> dict:
    return {"model_id": e.target.model_id, "max_model_len": int(getattr(e, "max_model_len", e.max_seq_len)),
            "method": e.config.method, "chunk_len": e.decoding.chunk_len, "tokenizer": e.tokenizer,
            "dtype": e.config.dtype, "dtype_reason": e.dtype_choice.reason, "machine": e.fingerprint.summary(),
            "adaptive": e.controller is not None}


def _kv_usage(engines: dict) -> float:
    """Committed KV slots of the running rows / (rows x max_model_len), over the lanes."""
    used = cap = 0
    for e in engines.values():
        try:
            used += int(sum(e.cache.lengths[:e.num_running]))
            cap += e.max_batch * int(getattr(e, "max_model_len", e.max_seq_len))
        except Exception:    # an engine without a local cache (e.g. a TP proxy)
            logger.debug("no KV usage for %s", type(e).__name__, exc_info=True)
    return min(1.0, used / cap) if cap else 0.0


class _Track:
    """Per-request metric bookkeeping: TTFT, inter-token gaps, the end (vLLM's request histograms)."""

    def __init__(self, metrics: ServerMetrics, t0: float, max_tokens: int) -> None:
        self.metrics, self.t0, self.max_tokens = metrics, t0, max_tokens
        self.timing = RequestTiming()
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.done = False

    def output(self, o) -> None:
        t = time.perf_counter()
        if self.first_at is None:
            self.first_at = t
            self.metrics.first_token(t - self.t0)
        elif o.new_token_ids and self.last_at is not None:
            self.metrics.inter_token(t - self.last_at)
        if o.new_token_ids or self.last_at is None:
            self.last_at = t

    def finished(self, last, reason: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        t = time.perf_counter()
        self.metrics.finished(reason or last.finish_reason or "stop", t - self.t0, last.num_prompt_tokens,
                              last.num_generated_tokens, timing=self.timing, first_token_s=self.first_at, end_s=t,
                              max_tokens=self.max_tokens)

    def aborted(self, last) -> None:
        if not self.done:
            self.metrics.aborted += 1
            self.finished(last, "abort")


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
        return APIError(503, f"server overloaded: {e}", "server_error", None, "queue_full",
                        {"Retry-After": str(max(1, round(e.retry_after_s)))})
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

        nice = reset_niceness(self.args.replica_niceness)   # before the threads below start
        keep_serve_grpc_on_loopback()
        self.server_metrics: ServerMetrics | None = None
        self.aengine = AsyncEngine(build, max_queue=self.args.max_queue, max_lanes=self.args.max_lanes,
                                   retry_after_s=self.args.retry_after_s, on_step=self._observe_step)
        info = self.aengine.call_future(_engine_info).result()
        self.engine_info = {k: v for k, v in info.items() if k != "tokenizer"}
        self.model_id, self.method, self.chunk_len = info["model_id"], info["method"], info["chunk_len"]
        self.max_model_len = info["max_model_len"]
        """Prompt + generated tokens a request can use (the engine keeps its tree scratch beyond)."""
        self.tokenizers = TokenizerPool(info["tokenizer"], self.args.tokenizer_workers)
        self.max_prompt_chars = self.args.max_prompt_chars or self.max_model_len * max_token_chars(info["tokenizer"])
        self.model_name = self.args.served_model_name or self.model_id
        self.accepted_models = {self.model_name, self.model_id}
        self.created = now()
        replica, node = _replica_labels()
        self.server_metrics = ServerMetrics(self.model_name, replica=replica, node=node,
                                            max_model_len=self.max_model_len)
        if self.args.allow_speculative_override and not self.args.api_key:
            logger.warning("allow_speculative_override is on without an api_key: any client may build up to "
                           "%d engine lanes", self.args.max_lanes - 1)
        logger.info("dart-ray replica ready: model=%s method=%s max_model_len=%d nice=%s args=%s", self.model_name,
                    self.method, self.max_model_len, nice, self.args.redacted())

    def _observe_step(self, num_tokens: int) -> None:
        if self.server_metrics is not None:
            self.server_metrics.observe_iteration(num_tokens)

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

    def lanes(self) -> list[str]:
        """The engine lanes this replica holds (tests check the bound)."""
        return list(self.aengine.lanes)

    def __del__(self) -> None:
        pool = getattr(self, "tokenizers", None)
        if pool is not None:
            pool.shutdown()
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
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)

    async def _read_body(self, request: Request) -> bytes:
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

    async def _parse(self, raw: bytes, parse: Callable[[dict], GenerationRequest]) -> GenerationRequest:
        if len(raw) < (256 << 10):
            return parse(parse_json(raw))
        # a large body: decode it off the event loop, which keeps streaming the other requests
        return await asyncio.get_running_loop().run_in_executor(None, lambda: parse(parse_json(raw)))

    def _check_prompt_size(self, req: GenerationRequest) -> None:
        """Refuse prompts that cannot fit the context before tokenising them."""
        chars, n_ids = prompt_size(req)
        param = "messages" if req.chat else "prompt"
        if n_ids is not None and n_ids >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                           f"your prompt has {n_ids} tokens (at least one must be left to generate).",
                           "invalid_request_error", param, "context_length_exceeded")
        if chars > self.max_prompt_chars:
            raise APIError(400, f"The prompt has {chars} characters, more than this server tokenises "
                           f"({self.max_prompt_chars}; the model's maximum context length is {self.max_model_len} "
                           "tokens).", "invalid_request_error", param, "context_length_exceeded")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_models:
            raise APIError(404, f"The model `{model}` does not exist (this server serves `{self.model_name}`).",
                           "invalid_request_error", "model", "model_not_found")

    async def _lane(self, method: str | None) -> tuple[str, str]:
        """The engine lane for a per-request method (``_auth`` has run: with an ``api_key`` set only
        authenticated clients get here)."""
        if method is None or method == self.method:
            return MAIN_LANE, self.method
        if not self.args.allow_speculative_override or self.args.tensor_parallel_size > 1:
            raise bad(f"this server does not run per-request speculative overrides (it runs {self.method!r})",
                      "speculative", "unsupported_value")
        if method not in self.aengine.lanes:
            try:
                await self.aengine.add_lane(method, lane_factory(method))
            except LaneLimitError:
                raise bad(f"speculative method {method!r} is unavailable: this server runs at most "
                          f"{self.args.max_lanes} engine lanes ({sorted(self.aengine.lanes)}) (max_lanes)",
                          "speculative", "unsupported_value") from None
            except Exception as e:  # noqa: BLE001 - e.g. no drafter shipped for this target
                raise bad(f"speculative method {method!r} is unavailable: {e}", "speculative",
                          "unsupported_value") from None
        return method, method

    async def _prepare(self, req: GenerationRequest) -> list[int]:
        """Token ids of the prompt (tokenised off the engine thread), admitted against
        ``max_model_len`` exactly as the engine admits them: prompt + max_tokens <= max_model_len."""
        if req.max_tokens is not None and req.max_tokens > self.max_model_len:
            raise bad(f"max_tokens={req.max_tokens} exceeds the context length {self.max_model_len}", "max_tokens",
                      "context_length_exceeded")
        self._check_prompt_size(req)
        param = "messages" if req.chat else "prompt"
        if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], dict):
            ids = list(req.prompt)                  # token ids: nothing to tokenise
        else:
            try:
                ids = await self.tokenizers.encode(req.prompt, req.chat)
            except Exception as e:  # noqa: BLE001 - tokenizer / chat template rejected the input
                raise bad(f"invalid prompt: {e}", param) from None
        if not ids:
            raise bad("prompt is empty", param)
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                           f"your prompt has {len(ids)} tokens (at least one must be left to generate).",
                           "invalid_request_error", param, "context_length_exceeded")
        if req.max_tokens is not None and len(ids) + req.max_tokens > self.max_model_len:
            raise bad(f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                      f"{len(ids) + req.max_tokens} tokens ({len(ids)} in the prompt, {req.max_tokens} for the "
                      "completion).", "max_tokens", "context_length_exceeded")
        return ids

    def _params(self, req: GenerationRequest, num_prompt: int) -> SamplingParams:
        max_new = req.max_tokens if req.max_tokens is not None else max(1, self.max_model_len - num_prompt)
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
                "root": self.model_id, "parent": None, "max_model_len": self.max_model_len,
                "speculative_method": self.method, "dtype": self.engine_info["dtype"],
                "dtype_reason": self.engine_info["dtype_reason"], "machine": self.engine_info["machine"],
                "adaptive_speculation": self.engine_info["adaptive"]}

    @app.get("/metrics")
    async def metrics(self, request: Request):
        try:
            self._auth(request)
        except APIError as e:
            return self._error(e)

        def snapshot(engines: dict) -> tuple[dict, float]:
            return {name: (e.config.method, dataclasses.asdict(e.stats())) for name, e in engines.items()}, \
                _kv_usage(engines)

        stats, kv = await self.aengine.call(snapshot, lane=None)
        positions = self.chunk_len if self.method != "none" else 0
        om = wants_openmetrics(request.headers.get("accept"))
        text = self.server_metrics.render(stats, self.aengine.queue_depth, self.aengine.num_running, positions,
                                          kv_cache_usage=kv, openmetrics=om)
        return PlainTextResponse(text, media_type=OPENMETRICS_CONTENT_TYPE if om else TEXT_CONTENT_TYPE)

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
            req = await self._parse(await self._read_body(request), parse)
            self._check_model(req.model)
            self._check_prompt_size(req)             # before a lane is built or anything tokenised
            lane, method = await self._lane(req.speculative)
            ids = await self._prepare(req)
            params = self._params(req, len(ids))
            rid = new_id(req.kind)
            track = _Track(self.server_metrics, t0, params.max_new_tokens)
            agen = self.aengine.stream(ids, params, request_id=rid, lane=lane, timing=track.timing)
            first = await agen.__anext__()           # surfaces queue-full / engine errors before headers
        except StopAsyncIteration:                   # cannot happen: a stream ends with a finished output
            return self._error(APIError(500, "empty stream", "server_error"))
        except Exception as e:  # noqa: BLE001
            if agen is not None:
                await agen.aclose()
            return self._error(_engine_error(e))
        track.output(first)
        created = now()
        if req.stream:
            return StreamingResponse(self._sse(req, rid, created, method, agen, first, track),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        text, last = [first.new_text], first
        try:
            if not first.finished:
                async for o in agen:
                    track.output(o)
                    text.append(o.new_text)
                    last = o
        except asyncio.CancelledError:
            track.aborted(last)                      # client went away; aclose() below aborts the request
            raise
        except Exception as e:  # noqa: BLE001
            return self._error(_engine_error(e))
        finally:
            await agen.aclose()
        use = usage(last.num_prompt_tokens, last.num_generated_tokens, last.stats.to_dict(), method)
        track.finished(last)
        return JSONResponse(completion_response(req, rid, created, self.model_name, "".join(text),
                                                last.finish_reason, use), headers={"X-Request-Id": rid})

    async def _sse(self, req: GenerationRequest, rid: str, created: int, method: str, agen, first, track: _Track):
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
                track.output(o)
            if req.include_usage:
                use = usage(last.num_prompt_tokens, last.num_generated_tokens, last.stats.to_dict(), method)
                yield sse(usage_chunk(req, rid, created, name, use))
            yield SSE_DONE
            track.finished(last)
        except (asyncio.CancelledError, GeneratorExit):
            track.aborted(last)                      # client went away: agen.aclose() aborts the request
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
        # the engine's own queue (rows of every lane + max_queue, then HTTP 503) is the bound; leave
        # room for /health, /metrics
        "max_ongoing_requests": args.max_batch_size * (args.max_lanes if args.allow_speculative_override else 1)
        + args.max_queue + 16,
    }
    opts.update(deployment_placement(args))   # replica resources; TP bundles or the per-node cap
    return opts


def build_app(args: dict | None = None) -> serve.Application:
    """Serve application builder (``import_path: deployments.openai_app:build_app``)."""
    a = ServeArgs.from_dict(args)
    check_tensor_parallel(a)
    return DartRayServer.options(**deployment_options(a)).bind(a.to_dict())
