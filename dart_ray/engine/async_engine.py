"""An asyncio front for the synchronous :class:`~dart_ray.engine.Engine`.

The engine is single-threaded: every call on it must come from one thread. :class:`AsyncEngine`
starts a dedicated daemon thread that owns the engine (it may even build it, from a factory) and
runs ``step()`` while there is work. Coroutines talk to it through a thread-safe inbox:

    caller (event loop)                          engine thread
    -------------------                          -------------
    stream(): add -> inbox  ------------------>  engine.add_request()   (errors go back as-is)
              await per-request asyncio.Queue <- step(detokenize=False) outputs (token ids),
              text + stop strings (RequestText)    routed by request id with
                                                   loop.call_soon_threadsafe
    ended by a stop string, cancelled or
    closed early: abort -> inbox ------------->  engine.abort()          (frees the row)
    call(fn): fn -> inbox  ------------------->  fn(engine) between steps, result via a future

The event loop never blocks on the engine: it only puts items into a queue and awaits futures.
Detokenising happens on the event loop, per request, as its consumer reads it: the engine thread
only computes token ids, so no request's text (a long one, or many streams) delays a step. A stop
string ends a request there: its stream returns the text before it and the ids through the token
that completes it, and the engine is told to abort the request (a step it may have run meanwhile
is not streamed; the engine's ``generated_tokens`` still counts it: a counter that only grows,
tokens computed. What reached the client is the server's count, ``vllm:generation_tokens``).

Besides the main engine, the thread can own extra *lanes*: further engines (e.g. a plain
autoregressive one sharing the target weights) built on demand with :meth:`AsyncEngine.add_lane`.
All lanes step on the same thread, one after another, so they never run concurrently.

Admission: each lane has ``rows`` batch rows (its engine's ``max_batch``). A request is *waiting*
only when its lane's rows are all taken by earlier requests (submitted but not yet handed to the
engine counts as taking a row if one is free): ``queue_depth`` = sum over lanes of
``max(0, in flight - rows)``. A new request that would wait while ``max_queue`` already wait raises
:class:`QueueFullError` (``retry_after_s`` says when to retry). So a lane accepts ``rows`` running +
``max_queue`` waiting, then refuses.

Lanes are bounded too (``max_lanes`` engines, the main one included): beyond it
:meth:`add_lane` raises :class:`LaneLimitError`, so no request pattern grows memory without bound.

Failure model:
* a bad prompt (``add_request`` raises) fails only that stream, with the original exception;
* the waiting queue is bounded (``max_queue``): beyond it :class:`QueueFullError` is raised;
* an exception in ``step()`` fails every request in flight on that lane with
  :class:`EngineStepError` (the cause chained), the requests are aborted and the loop keeps serving;
* after :meth:`shutdown` (or if the thread died) new work raises :class:`EngineDeadError` and
  :meth:`check_health` raises.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from dart_ray.config import SamplingParams
from dart_ray.engine.detok import RequestText
from dart_ray.engine.engine import Engine
from dart_ray.engine.request import RequestOutput

logger = logging.getLogger(__name__)

MAIN_LANE = "main"


class AsyncEngineError(RuntimeError):
    """Base class of the errors raised by :class:`AsyncEngine` itself."""


class QueueFullError(AsyncEngineError):
    """Too many requests are waiting for a batch row; retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class LaneLimitError(AsyncEngineError):
    """``max_lanes`` engines exist already; no further lane is built."""


class EngineDeadError(AsyncEngineError):
    """The engine thread is not running (shut down, or failed to start)."""


class EngineStepError(AsyncEngineError):
    """``engine.step()`` raised while this request was in flight; the request was aborted."""


@dataclass
class RequestTiming:
    """Timestamps (``time.perf_counter()``) of one request, filled in as it goes (for metrics)."""

    submitted: float | None = None
    """Handed to :meth:`AsyncEngine.stream` (accepted into the queue)."""
    scheduled: float | None = None
    """Start of the engine step that admitted it (prefill); ``scheduled - submitted`` = queue
    time."""
    first_token: float | None = None
    """End of that step (its first token was produced)."""


@dataclass
class _Stream:
    request_id: str
    lane: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    text: RequestText
    """Its text and stop strings (used on the event loop)."""
    done: bool = False
    timing: RequestTiming | None = None
    started: bool = False
    """Its first output was produced (set on the engine thread)."""


@dataclass
class _Lane:
    name: str
    engine: Engine
    rows: int
    """Batch rows of this lane's engine (its ``max_batch``)."""
    streams: dict[str, _Stream] = field(default_factory=dict)
    step_errors: int = 0
    # admission counters (guarded by AsyncEngine._lock)
    pending: int = 0
    """Submitted, not yet handed to the engine."""
    waiting: int = 0
    """In the engine's waiting queue (published after every add and step)."""
    running: int = 0
    """Holding a batch row (published after every add and step)."""

    @property
    def in_flight(self) -> int:
        return self.pending + self.waiting + self.running

    @property
    def queued(self) -> int:
        """Requests that cannot get a row now: beyond the lane's rows."""
        return max(0, self.in_flight - self.rows)


def _rows_of(engine) -> int:
    rows = getattr(engine, "max_batch", None)
    if rows is None:
        rows = engine.config.max_batch_size
    return int(rows)


# inbox commands
@dataclass
class _Add:
    stream: _Stream
    prompt: Any
    params: SamplingParams
    chat: bool


@dataclass
class _Abort:
    stream: _Stream


@dataclass
class _Call:
    fn: Callable[[Engine], Any]
    lane: str | None
    future: concurrent.futures.Future


@dataclass
class _AddLane:
    name: str
    factory: Callable[[Engine], Engine]
    future: concurrent.futures.Future


_STOP = object()


class AsyncEngine:
    """Owns an :class:`Engine` on a background thread and streams its outputs to coroutines.

    ``engine`` is either a built Engine or a zero-argument factory returning one; a factory runs on
    the engine thread (the constructor waits for it and re-raises its exception).
    """

    def __init__(self, engine: Engine | Callable[[], Engine], max_queue: int = 256,
                 name: str = "dart-ray-engine", start_timeout_s: float | None = None,
                 max_lanes: int | None = None, retry_after_s: float = 1.0,
                 on_step: Callable[[int], None] | None = None) -> None:
        """``max_lanes``: engines this front may own, the main one included (None = unbounded).
        ``retry_after_s``: what :class:`QueueFullError` tells callers. ``on_step(num_tokens)`` runs
        on the engine thread after every step with the tokens it processed (prompt + generated)."""
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if max_lanes is not None and max_lanes < 1:
            raise ValueError(f"max_lanes must be >= 1 or None, got {max_lanes}")
        if retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
        self.max_queue = max_queue
        self.max_lanes = max_lanes
        self.retry_after_s = retry_after_s
        self._on_step = on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._leftover: collections.deque = collections.deque()
        """Commands the engine thread took from its inbox after the stop (failed on exit)."""
        self._closed = False
        self._fatal: BaseException | None = None
        self._lanes: dict[str, _Lane] = {}
        # request id -> stream (all lanes; guarded by _lock)
        self._stream_index: dict[str, _Stream] = {}
        self.last_step_time = time.monotonic()
        self.num_step_errors = 0
        self.last_step_error: str | None = None
        self._ready = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(engine,), name=name, daemon=True)
        self._thread.start()
        try:
            self._ready.result(timeout=start_timeout_s)
        except BaseException:
            self._closed = True
            self._inbox.put(_STOP)
            raise

    # ---- introspection (any thread) ---------------------------------------------------------
    @property
    def engine(self) -> Engine:
        """The main engine. Only touch it from the engine thread (see :meth:`call`)."""
        return self._lanes[MAIN_LANE].engine

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a batch row: beyond their lane's rows (submitted requests that a
        free row is waiting for do not count)."""
        with self._lock:
            return sum(lane.queued for lane in self._lanes.values())

    @property
    def num_running(self) -> int:
        """Requests holding a batch row (all lanes)."""
        with self._lock:
            return sum(lane.running for lane in self._lanes.values())

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not finished (all lanes)."""
        with self._lock:
            return sum(lane.in_flight for lane in self._lanes.values())

    @property
    def lanes(self) -> tuple[str, ...]:
        return tuple(self._lanes)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._closed and self._fatal is None

    def check_health(self) -> None:
        """Raise if the engine thread cannot serve (Ray Serve calls this through the replica)."""
        if self._fatal is not None:
            raise EngineDeadError(f"engine thread died: {self._fatal!r}") from self._fatal
        if self._closed:
            raise EngineDeadError("engine is shut down")
        if not self._thread.is_alive():
            raise EngineDeadError("engine thread is not running")

    # ---- submission (event loop) ------------------------------------------------------------
    async def stream(self, prompt, params: SamplingParams | None = None,
                     request_id: str | None = None, chat: bool = False, lane: str = MAIN_LANE,
                     timing: RequestTiming | None = None) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its outputs (deltas) until it finishes.

        Raises the engine's own exception for a bad prompt (``ValueError``, ``TypeError``,
        ``PromptTooLongError``), :class:`QueueFullError` when too many requests wait,
        :class:`EngineStepError` if a step failed mid-request. Closing the iterator early or
        cancelling the consuming task aborts the request in the engine. ``timing``, if given, is
        filled in as the request is queued, scheduled and produces its first token.
        """
        st = self._submit(prompt, params or SamplingParams(), request_id, chat, lane, timing)
        try:
            while True:
                item = await st.queue.get()
                if isinstance(item, BaseException):
                    st.done = True
                    raise item
                out = self._text(st, item)
                if out.finished:
                    st.done = True
                yield out
                if st.done:
                    return
        finally:
            if not st.done:
                st.done = True
                self._inbox.put(_Abort(st))
            with self._lock:
                if self._stream_index.get(st.request_id) is st:
                    del self._stream_index[st.request_id]

    def _text(self, st: _Stream, item: RequestOutput) -> RequestOutput:
        """The engine's token-id output ``item`` with its text; a stop string found in it ends the
        request (the engine is told to abort it)."""
        # the engine ends a request on stop ids and lengths only (stop strings are found here):
        # a "stop" is a stop id, whose text is left out
        ids, text, stopped = st.text.push(item.new_token_ids, item.finished,
                                          stop_id=item.finished and item.finish_reason == "stop"
                                          and bool(item.new_token_ids))
        if not stopped:
            item.new_text = text
            return item
        if not item.finished:                      # the engine still runs it: free its row
            self._inbox.put(_Abort(st))
        return RequestOutput(request_id=item.request_id, new_token_ids=ids, new_text=text,
                             finished=True, finish_reason="stop",
                             num_prompt_tokens=item.num_prompt_tokens,
                             num_generated_tokens=st.text.num_tokens, stats=item.stats)

    def _submit(self, prompt, params: SamplingParams, request_id: str | None, chat: bool, lane: str,
                timing: RequestTiming | None = None) -> _Stream:
        self.check_health()
        loop = asyncio.get_running_loop()
        rid = request_id or uuid.uuid4().hex
        with self._lock:
            ln = self._lanes.get(lane)
            if ln is None:
                raise ValueError(f"unknown engine lane {lane!r} (have {sorted(self._lanes)})")
            if rid in self._stream_index:
                raise ValueError(f"duplicate request id {rid!r}")
            would_wait = ln.in_flight >= ln.rows
            if would_wait and sum(other.queued for other in self._lanes.values()) >= self.max_queue:
                raise QueueFullError(f"all {ln.rows} batch rows are busy and {self.max_queue} "
                                     "requests are already waiting; retry in "
                                     f"{self.retry_after_s:g} s", self.retry_after_s)
            text = RequestText(ln.engine.tokenizer, params.stop)
            st = _Stream(rid, lane, loop, asyncio.Queue(), text, timing=timing)
            if timing is not None:
                timing.submitted = time.perf_counter()
            self._put_locked(_Add(st, prompt, params, chat))    # raises once shut down
            self._stream_index[rid] = st
            ln.pending += 1
        return st

    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, chat: bool = False,
                       lane: str = MAIN_LANE) -> tuple[list[int], str, RequestOutput]:
        """Drain :meth:`stream`: (token ids, text, last output)."""
        ids: list[int] = []
        text: list[str] = []
        last = None
        async for o in self.stream(prompt, params, request_id, chat, lane):
            ids.extend(o.new_token_ids)
            text.append(o.new_text)
            last = o
        return ids, "".join(text), last

    async def call(self, fn: Callable[[Engine], Any], lane: str | None = MAIN_LANE) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps; await its result.

        ``lane=None`` passes the dict of all lanes' engines instead.
        """
        return await asyncio.wrap_future(self.call_future(fn, lane))

    def call_future(self, fn: Callable[[Engine], Any],
                    lane: str | None = MAIN_LANE) -> concurrent.futures.Future:
        """Like :meth:`call` for synchronous callers: returns a ``concurrent.futures.Future``."""
        self.check_health()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._put(_Call(fn, lane, fut))
        return fut

    def peek(self, fn: Callable[[dict[str, Engine]], Any]) -> Any:
        """``fn(engines)`` (lane -> engine) now, on the caller's thread, without waiting for a step
        boundary as :meth:`call` does: for reading counters (a server's ``/metrics``), which must
        answer while a long step, a lane build or a stuck device holds the engine thread. ``fn``
        must only read; the engine thread may be mid-step, so one reading can mix two steps'
        values (each counter only grows)."""
        with self._lock:
            engines = self._engines()
        return fn(engines)

    def _engines(self) -> dict[str, Engine]:
        """Lane name -> its engine."""
        return {name: ln.engine for name, ln in self._lanes.items()}

    async def encode(self, prompt, chat: bool = False,
                     add_special_tokens: bool | None = None) -> list[int]:
        """Tokenise on the engine thread (blocks stepping while it runs; servers tokenise elsewhere
        and pass token ids, see ``deployments.serving``)."""
        return await self.call(lambda e: e.encode_prompt(prompt, chat, add_special_tokens))

    async def add_lane(self, name: str, factory: Callable[[Engine], Engine]) -> None:
        """Build another engine on the engine thread (``factory(main_engine)``) unless ``name``
        exists.

        Raises :class:`LaneLimitError` when ``max_lanes`` engines exist already (checked here and
        again on the engine thread, so concurrent calls cannot overshoot)."""
        self.check_health()
        if name in self._lanes:
            return
        self._check_lane_limit(name)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._put(_AddLane(name, factory, fut))
        await asyncio.wrap_future(fut)

    def _put(self, cmd) -> None:
        """Hand ``cmd`` to the engine thread, or raise :class:`EngineDeadError` once it is closed:
        the check and the put hold the lock :meth:`shutdown` and the thread's exit take, so no
        command lands after the thread's last look at its inbox (it would wait forever)."""
        with self._lock:
            self._put_locked(cmd)

    def _put_locked(self, cmd) -> None:
        if self._closed:
            raise EngineDeadError("engine is shut down")
        self._inbox.put(cmd)

    def _check_lane_limit(self, name: str) -> None:
        full = self.max_lanes is not None and len(self._lanes) >= self.max_lanes
        if full and name not in self._lanes:
            raise LaneLimitError(f"this engine serves at most {self.max_lanes} lanes "
                                 f"(have {sorted(self._lanes)}); {name!r} is not built")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; requests still in flight fail with :class:`EngineDeadError`."""
        if self._closed and not self._thread.is_alive():
            return
        with self._lock:
            self._closed = True
            self._inbox.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self, engine) -> None:
        try:
            if not isinstance(engine, Engine) and callable(engine):
                engine = engine()
            self._lanes[MAIN_LANE] = _Lane(MAIN_LANE, engine, _rows_of(engine))
        except BaseException as e:  # noqa: BLE001 - reported to the constructor
            self._fatal = e
            self._ready.set_exception(e)
            return
        self._ready.set_result(None)
        try:
            self._loop()
        except BaseException as e:
            logger.exception("engine loop died")
            self._fatal = e
        finally:
            with self._lock:             # from here on no command is put (see _put)
                self._closed = True
            self._fail_all(EngineDeadError("engine is shut down"))

    def _loop(self) -> None:
        while True:
            cmds = []
            if not any(lane.engine.has_unfinished() for lane in self._lanes.values()):
                cmds.append(self._inbox.get())                    # idle: block until work arrives
            while True:
                try:
                    cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for i, c in enumerate(cmds):
                if c is _STOP:
                    # what came after the stop in this batch is failed with the rest (_run)
                    for later in reversed(cmds[i + 1:]):
                        self._leftover.appendleft(later)
                    return
                self._handle(c)
            for lane in list(self._lanes.values()):
                if lane.engine.has_unfinished():
                    self._step(lane)
            self._publish()

    def _handle(self, c) -> None:
        if isinstance(c, _Add):
            st = c.stream
            lane = self._lanes[st.lane]
            if not st.done:      # else: the consumer went away before the add was processed
                try:
                    lane.engine.add_request(c.prompt, c.params, request_id=st.request_id,
                                            chat=c.chat)
                    # before any output is delivered (the consumer reads it after the step)
                    st.text.set_prompt(lane.engine.requests[st.request_id].prompt_ids)
                    lane.streams[st.request_id] = st
                except Exception as e:  # noqa: BLE001 - the caller gets the original exception
                    self._deliver(st, e)
            self._publish(handed=lane)   # pending -> engine counters in one step (no gap)
        elif isinstance(c, _Abort):
            st = c.stream
            lane = self._lanes.get(st.lane)
            if lane is None:
                return
            if lane.streams.pop(st.request_id, None) is not None:
                try:
                    lane.engine.abort(st.request_id)
                except Exception:
                    logger.exception("abort of %s failed", st.request_id)
        elif isinstance(c, _Call):
            if not c.future.set_running_or_notify_cancel():
                return
            try:
                target = (self._engines() if c.lane is None
                          else self._lanes[c.lane].engine)
                c.future.set_result(c.fn(target))
            except BaseException as e:  # noqa: BLE001
                c.future.set_exception(e)
        elif isinstance(c, _AddLane):
            try:
                if c.name not in self._lanes:
                    self._check_lane_limit(c.name)
                    engine = c.factory(self._lanes[MAIN_LANE].engine)
                    with self._lock:
                        self._lanes[c.name] = _Lane(c.name, engine, _rows_of(engine))
                c.future.set_result(None)
            except BaseException as e:  # noqa: BLE001
                c.future.set_exception(e)

    def _step(self, lane: _Lane) -> None:
        t_start = time.perf_counter()
        try:
            outputs = lane.engine.step(detokenize=False)
        except Exception as e:
            logger.exception("engine step failed on lane %s", lane.name)
            self.num_step_errors += 1
            lane.step_errors += 1
            self.last_step_error = repr(e)
            err = EngineStepError(f"engine step failed: {e!r}")
            err.__cause__ = e
            for rid, st in list(lane.streams.items()):
                try:
                    lane.engine.abort(rid)
                except Exception:
                    logger.exception("abort of %s after a failed step failed", rid)
                self._deliver(st, err)
            lane.streams.clear()
            self._publish()
            return
        self.last_step_time = time.monotonic()
        t_end = time.perf_counter()
        self._publish()                      # counters are current before anyone sees the outputs
        num_tokens = 0
        for o in outputs:                    # first outputs: admitted (prefilled) in this step
            num_tokens += len(o.new_token_ids)
            st = lane.streams.get(o.request_id)
            if st is not None and not st.started:
                st.started = True
                num_tokens += o.num_prompt_tokens
                if st.timing is not None:
                    st.timing.scheduled, st.timing.first_token = t_start, t_end
        if self._on_step is not None:
            try:
                self._on_step(num_tokens)
            except Exception:
                logger.exception("on_step callback failed")
        for o in outputs:
            st = lane.streams.get(o.request_id)
            if st is None:
                continue
            if o.finished:
                del lane.streams[o.request_id]
            if not self._deliver(st, o):
                lane.streams.pop(o.request_id, None)
                if not o.finished:
                    lane.engine.abort(o.request_id)

    def _deliver(self, st: _Stream, item) -> bool:
        """Hand ``item`` to the stream's event loop; False if that loop is gone."""
        try:
            st.loop.call_soon_threadsafe(st.queue.put_nowait, item)
            return True
        except RuntimeError:  # loop closed
            return False

    def _publish(self, handed: _Lane | None = None) -> None:
        """Copy the engines' waiting/running counts into the lanes (``handed``: one pending add of
        that lane has just been handed to its engine, or failed)."""
        with self._lock:
            if handed is not None:
                handed.pending -= 1
            for lane in self._lanes.values():
                lane.waiting = len(lane.engine.waiting)
                lane.running = lane.engine.num_running

    def _fail_all(self, err: BaseException) -> None:
        for lane in self._lanes.values():
            for st in lane.streams.values():
                self._deliver(st, err)
            lane.streams.clear()
        # commands taken after the stop, and those still sitting in the inbox
        while True:
            try:
                c = self._leftover.popleft() if self._leftover else self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(c, _Add):
                self._deliver(c.stream, err)
            elif isinstance(c, (_Call, _AddLane)) and not c.future.done():
                c.future.set_exception(err)
        with self._lock:
            for lane in self._lanes.values():
                lane.pending = lane.waiting = lane.running = 0
