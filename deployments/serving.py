"""The engine deployment: ``DartRayServer`` owns a replica's engines and streams their outputs.

It speaks no HTTP. The ingress (:mod:`deployments.routes`) calls it through a Serve
``DeploymentHandle``::

    handle.options(stream=True).generate.remote(request, request_id)
        -> RequestOutput ..., or APIError
    handle.model_card.remote() / health.remote() / metrics.remote(openmetrics, ingress_snapshot)

A replica loads its engine once (:func:`~deployments.engine_factory.make_engine`, the hook tensor
parallelism plugs into) and owns it on a background thread
(:class:`~dart_ray.engine.async_engine.AsyncEngine`), with per-request engine *lanes*
(``"speculative": ...``) built on first use on the same thread. Admission happens here, where the
tokenizer is: the model name, the prompt's size before tokenising (characters or token ids), then
tokenising off the engine thread (:class:`TokenizerPool`), ``prompt + max_tokens <= max_model_len``,
the queue bound (``QueueFullError``). A request that fails admission, or fails later, ends its
stream with one :class:`~deployments.protocol.APIError` item instead of raising, so the caller gets
the error itself (not Ray's wrapper) and the replica's log is not a traceback per refused request.

A generation cancelled by the caller (the client went away: Serve cancels the handle call) aborts
its request in the engine: its batch row is free at the next step boundary.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from ray import serve

from dart_ray import Engine, RequestOutput, SamplingParams, allocator_in_use, encode_prompt
from dart_ray.engine.async_engine import MAIN_LANE, AsyncEngine, LaneLimitError, RequestTiming
from deployments.config import ServeArgs
from deployments.engine_factory import ReplicaEngine, lane_factory, make_engine
from deployments.errors import ReplicaLostError, engine_error
from deployments.metrics import ServerMetrics
from deployments.protocol import (
    APIError,
    GenerationRequest,
    bad,
    model_not_found,
    now,
    prompt_size,
)
from deployments.replica import prepare_replica_process, replica_labels

logger = logging.getLogger("ray.serve")

DEPLOYMENT_NAME = "DartRayServer"


# ---- tokenisation off the engine thread ----------------------------------------------------------
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

    def _encode(self, prompt, chat: bool, add_special_tokens: bool) -> list[int]:
        return encode_prompt(self._tokenizer(), prompt, chat, add_special_tokens)

    async def encode(self, prompt, chat: bool, add_special_tokens: bool) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self._encode, prompt, chat, add_special_tokens)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---- what the engine thread reports --------------------------------------------------------------
def _engine_info(e: Engine) -> tuple[dict, object]:
    """(what the model card says of the main engine, its tokenizer)."""
    return {"root": e.target.model_id, "max_model_len": int(e.max_model_len),
            "speculative_method": e.config.method, "dtype": e.config.dtype,
            "dtype_reason": e.dtype_choice.reason, "machine": e.fingerprint.summary(),
            "allocator": allocator_in_use(),
            "adaptive_speculation": e.controller is not None}, e.tokenizer


def draft_positions(engines: dict) -> int:
    """Draft positions /metrics lists (``accepted_per_pos``): the deepest position a tree can
    reach in the schedules the speculating lanes decode with now (a loaded profile's, else
    ``engine.decoding``): ``draft_depth``, or DART's prompt-lookup paths (``lookup_len``) where
    deeper; 0 when every lane is plain AR."""
    return max((e.schedule.max_positions(lookups=e.config.method == "dart")
                for e in engines.values() if e.config.method != "none"), default=0)


def _kv_usage(engines: dict) -> float:
    """Committed KV slots of the running rows / (rows x max_model_len), over the lanes."""
    used = cap = 0
    for e in engines.values():
        try:
            used += int(sum(e.cache.lengths[:e.num_running]))
            cap += e.max_batch * int(e.max_model_len)
        except Exception:    # an engine without a local cache (e.g. a TP proxy)
            logger.debug("no KV usage for %s", type(e).__name__, exc_info=True)
    return min(1.0, used / cap) if cap else 0.0


class _Track:
    """Per-request metric bookkeeping: TTFT, inter-token gaps, the end (vLLM's request histograms).
    Times are taken on the engine replica, from the request's arrival there."""

    def __init__(self, metrics: ServerMetrics, t0: float, max_tokens: int,
                 num_prompt: int) -> None:
        self.metrics, self.t0, self.max_tokens = metrics, t0, max_tokens
        self.num_prompt = num_prompt
        self.timing = RequestTiming()
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.done = False

    def output(self, o: RequestOutput) -> None:
        t = time.perf_counter()
        self.metrics.generated(len(o.new_token_ids))
        if self.first_at is None:
            self.first_at = t
            self.metrics.first_token(t - self.t0)
        elif o.new_token_ids and self.last_at is not None:
            self.metrics.inter_token(t - self.last_at)
        if o.new_token_ids or self.last_at is None:
            self.last_at = t

    def finished(self, last: RequestOutput | None, reason: str | None = None) -> None:
        """The request ended with ``last`` (None: before its first output, aborted)."""
        if self.done:
            return
        self.done = True
        t = time.perf_counter()
        self.metrics.finished(reason or (last and last.finish_reason) or "stop", t - self.t0,
                              self.num_prompt, last.num_generated_tokens if last else 0,
                              timing=self.timing, first_token_s=self.first_at, end_s=t,
                              max_tokens=self.max_tokens)

    def aborted(self, last: RequestOutput | None) -> None:
        """The caller went away after ``last`` (None: while the request waited for a row)."""
        if not self.done:
            self.metrics.aborted += 1
            self.finished(last, "abort")


# ---- the deployment ------------------------------------------------------------------------------
@serve.deployment(name=DEPLOYMENT_NAME, health_check_period_s=5.0, health_check_timeout_s=30.0,
                  graceful_shutdown_timeout_s=5.0, graceful_shutdown_wait_loop_s=0.5)
class DartRayServer:
    """One engine replica: the engine (and its lanes) on a thread, admission, per-request
    metrics."""

    def __init__(self, args: dict | ServeArgs) -> None:
        self.args = ServeArgs.from_dict(args)
        self._hooks = ReplicaEngine(engine=None)  # type: ignore[arg-type]

        def build() -> Engine:
            built = make_engine(self.args)
            if isinstance(built, ReplicaEngine):
                self._hooks = built
                return built.engine
            return built

        # before the threads below start
        nice = prepare_replica_process(self.args.replica_niceness)
        self.server_metrics: ServerMetrics | None = None
        self.aengine = AsyncEngine(build, max_queue=self.args.max_queue,
                                   max_lanes=self.args.max_lanes,
                                   retry_after_s=self.args.retry_after_s,
                                   on_step=self._observe_step)
        info, tokenizer = self.aengine.call_future(_engine_info).result()
        self.model_id, self.method = info["root"], info["speculative_method"]
        self.max_model_len = info["max_model_len"]
        """Prompt + generated tokens a request can use (the engine keeps its tree scratch
        beyond)."""
        self.tokenizers = TokenizerPool(tokenizer, self.args.tokenizer_workers)
        self.max_prompt_chars = (self.args.max_prompt_chars
                                 or self.max_model_len * max_token_chars(tokenizer))
        self.model_name = self.args.served_model_name or self.model_id
        self.accepted_models = {self.model_name, self.model_id}
        self.card = {"id": self.model_name, "object": "model", "created": now(),
                     "owned_by": "dart-ray", "parent": None, **info}
        """The ``/v1/models`` entry of this replica's model."""
        replica, node = replica_labels()
        self.replica_id = replica
        self.server_metrics = ServerMetrics(self.model_name, replica=replica, node=node,
                                            max_model_len=self.max_model_len)
        if self.args.allow_speculative_override and not self.args.api_key:
            logger.warning("allow_speculative_override is on without an api_key: any client may "
                           "build up to %d engine lanes", self.args.max_lanes - 1)
        logger.info("dart-ray engine replica ready: model=%s method=%s max_model_len=%d nice=%s "
                    "args=%s", self.model_name, self.method, self.max_model_len, nice,
                    self.args.redacted())

    def _observe_step(self, num_tokens: int) -> None:
        if self.server_metrics is not None:
            self.server_metrics.observe_iteration(num_tokens)

    # ---- Serve hooks -----------------------------------------------------------------------------
    def check_health(self) -> None:
        self.aengine.check_health()
        if self._hooks.check_health is not None:
            self._hooks.check_health()

    def reconfigure(self, user_config: dict) -> None:
        """Serve ``user_config``: ``{"decoding": {...}}`` or ``{"profile": name}`` (no reload);
        every lane takes the new schedule (lanes built later copy it from the main engine)."""
        from dart_ray import DecodingConfig, DecodingSchedule, load_profile
        from dart_ray.profiles import check_profile_hardware

        user_config = dict(user_config or {})
        unknown = set(user_config) - {"decoding", "profile"}
        if unknown:
            raise ValueError(f"unknown user_config keys {sorted(unknown)}; "
                             "known: ['decoding', 'profile']")
        if user_config.get("profile") and user_config.get("decoding"):
            raise ValueError("user_config gives both 'profile' and 'decoding'; a profile replaces "
                             "the decoding knobs: give one of them")
        from_profile = bool(user_config.get("profile"))
        if from_profile:
            schedule = load_profile(user_config["profile"])
        elif user_config.get("decoding"):
            schedule = DecodingSchedule.constant(
                self.args.engine.decoding.replace(**user_config["decoding"]))
        elif "decoding" in user_config:
            schedule = DecodingSchedule.constant(DecodingConfig())
        else:
            return

        def apply(engines: dict) -> None:
            for e in engines.values():
                if from_profile and getattr(e, "fingerprint", None) is not None:
                    check_profile_hardware(schedule, e.fingerprint)   # warns once, as at start
                e.set_decoding(schedule)

        self.aengine.call_future(apply, lane=None).result()

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

    # ---- what the ingress calls ------------------------------------------------------------------
    async def generate(self, req: GenerationRequest,
                       request_id: str) -> AsyncIterator[RequestOutput | APIError]:
        """Admit ``req`` and stream its outputs (deltas; the last one is ``finished``). A refusal or
        a failure is the stream's last item, an :class:`APIError`. Cancelling the call (closing the
        stream) aborts the request in the engine."""
        t0 = time.perf_counter()
        agen = track = last = None
        try:
            lost = self._group_failure()
            if lost is not None:                     # a failed TP group takes no request
                raise lost
            self._check_model(req.model)
            self._check_prompt_size(req)             # before a lane is built or anything tokenised
            lane = await self._lane(req.speculative)
            ids = await self._prepare(req)
            params = self._params(req, len(ids))
            track = _Track(self.server_metrics, t0, params.max_new_tokens, len(ids))
            agen = self.aengine.stream(ids, params, request_id=request_id, lane=lane,
                                       timing=track.timing)
            async for o in agen:
                track.output(o)
                last = o
                if o.finished:          # counted before the yield: a consumer may stop at it
                    track.finished(o)
                yield o
        except (asyncio.CancelledError, GeneratorExit):
            if track is not None and (last is None or not last.finished):
                # the caller went away (queued or streaming): aclose() below aborts the request
                track.aborted(last)
            raise
        except Exception as e:  # noqa: BLE001 - the stream ends with the error, in-band
            yield engine_error(self._group_failure() or e, self.args.retry_after_s)
        finally:
            if agen is not None:
                await agen.aclose()

    def _group_failure(self) -> ReplicaLostError | None:
        """A :class:`ReplicaLostError` when this replica can serve no more (its tensor-parallel
        group failed), else None: a request it fails is then retryable elsewhere (503
        ``replica_lost``; the ingress resubmits one with no output yet), not a 500 of its own."""
        if self._hooks.check_health is None:
            return None
        try:
            self._hooks.check_health()
        except Exception as failed:  # noqa: BLE001 - any failure of the group's health
            return ReplicaLostError(f"this engine replica's tensor-parallel group failed "
                                    f"({failed}); Serve replaces the replica")
        return None

    def model_card(self) -> dict:
        """The ``/v1/models`` entry of this replica's model."""
        return self.card

    def health(self) -> dict:
        """``/health``: raises if the engine cannot serve, else its queue state (and which
        replica)."""
        self.check_health()
        return {"status": "ok", "queue_depth": self.aengine.queue_depth,
                "num_running": self.aengine.num_running, "replica": self.replica_id}

    async def metrics(self, openmetrics: bool = False, ingress: dict | None = None) -> str:
        """``/metrics`` of this replica (Prometheus text), with the asking ingress's counters."""

        def snapshot(engines: dict) -> tuple[dict, float, int]:
            return ({name: (e.config.method, dataclasses.asdict(e.stats()))
                     for name, e in engines.items()},
                    _kv_usage(engines), draft_positions(engines))

        # read now, not between steps: a scrape must answer while a long step (or a lane build,
        # or a stuck device) holds the engine thread
        stats, kv, positions = self.aengine.peek(snapshot)
        return self.server_metrics.render(stats, self.aengine.queue_depth, self.aengine.num_running,
                                          positions, kv_cache_usage=kv, openmetrics=openmetrics,
                                          ingress=ingress,
                                          step_errors=self.aengine.num_step_errors)

    def pid(self) -> int:
        """The replica process id (tests kill it to exercise replica loss)."""
        return os.getpid()

    def lanes(self) -> list[str]:
        """The engine lanes this replica holds (tests check the bound)."""
        return list(self.aengine.lanes)

    # ---- admission -------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_models:
            raise model_not_found(model, self.model_name)

    def _too_long(self, req: GenerationRequest, num_prompt: int) -> APIError:
        return APIError(400, f"This model's maximum context length is {self.max_model_len} "
                             f"tokens. However, your prompt has {num_prompt} tokens (at least one "
                             "must be left to generate).",
                        "invalid_request_error", req.prompt_param, "context_length_exceeded")

    def _check_prompt_size(self, req: GenerationRequest) -> None:
        """Refuse prompts that cannot fit the context before tokenising them."""
        chars, n_ids = prompt_size(req)
        if n_ids is not None and n_ids >= self.max_model_len:
            raise self._too_long(req, n_ids)
        if chars > self.max_prompt_chars:
            raise APIError(400, f"The prompt has {chars} characters, more than this server "
                                f"tokenises ({self.max_prompt_chars}; the model's maximum context "
                                f"length is {self.max_model_len} tokens).",
                           "invalid_request_error", req.prompt_param, "context_length_exceeded")

    async def _lane(self, method: str | None) -> str:
        """The engine lane for a per-request method, built on first use (the ingress has checked
        the API key: with one set, only authenticated clients get here)."""
        if method is None or method == self.method:
            return MAIN_LANE
        if not self.args.allow_speculative_override or self.args.tensor_parallel_size > 1:
            raise bad(f"this server does not run per-request speculative overrides "
                      f"(it runs {self.method!r})", "speculative", "unsupported_value")
        if method in self.aengine.lanes:
            return method
        try:
            await self.aengine.add_lane(method, lane_factory(method))
        except LaneLimitError:
            raise bad(f"speculative method {method!r} is unavailable: this server runs at "
                      f"most {self.args.max_lanes} engine lanes "
                      f"({sorted(self.aengine.lanes)}) (max_lanes)",
                      "speculative", "unsupported_value") from None
        except Exception as e:  # noqa: BLE001 - e.g. no drafter shipped for this target
            raise bad(f"speculative method {method!r} is unavailable: {e}", "speculative",
                      "unsupported_value") from None
        return method

    async def _prepare(self, req: GenerationRequest) -> list[int]:
        """Token ids of the prompt (tokenised off the engine thread), admitted against
        ``max_model_len`` exactly as the engine admits them:
        prompt + max_tokens <= max_model_len."""
        if req.max_tokens is not None and req.max_tokens > self.max_model_len:
            raise bad(f"max_tokens={req.max_tokens} exceeds the context length "
                      f"{self.max_model_len}", "max_tokens", "context_length_exceeded")
        ids = req.token_ids
        if ids is None:
            try:
                ids = await self.tokenizers.encode(req.prompt, req.chat, req.add_special_tokens)
            except Exception as e:  # noqa: BLE001 - tokenizer / chat template rejected the input
                raise bad(f"invalid prompt: {e}", req.prompt_param) from None
        if not ids:
            raise bad("prompt is empty", req.prompt_param)
        if len(ids) >= self.max_model_len:
            raise self._too_long(req, len(ids))
        if req.max_tokens is not None and len(ids) + req.max_tokens > self.max_model_len:
            raise bad(f"This model's maximum context length is {self.max_model_len} tokens. "
                      f"However, you requested {len(ids) + req.max_tokens} tokens ({len(ids)} in "
                      f"the prompt, {req.max_tokens} for the completion).", "max_tokens",
                      "context_length_exceeded")
        return ids

    def _params(self, req: GenerationRequest, num_prompt: int) -> SamplingParams:
        max_new = (req.max_tokens if req.max_tokens is not None
                   else max(1, self.max_model_len - num_prompt))
        try:
            return SamplingParams(max_new_tokens=max_new, temperature=req.temperature,
                                  top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=req.stop,
                                  stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos)
        except ValueError as e:
            raise bad(str(e)) from None
