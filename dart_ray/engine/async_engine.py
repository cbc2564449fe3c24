"""An asyncio front for the synchronous :class:`~dart_ray.engine.Engine`.

The engine is single-threaded: every call on it must come from one thread. :class:`AsyncEngine`
starts a dedicated daemon thread that owns the engine (it may even build it, from a factory) and
runs ``step()`` while there is work. Coroutines talk to it through a thread-safe inbox:

    caller (event loop)                          engine thread
    -------------------                          -------------
    stream(): add -> inbox  ------------------>  engine.add_request()   (errors go back as-is)
              await per-request asyncio.Queue <- step() outputs, routed by request id with
                                                 loop.call_soon_threadsafe
    cancelled / closed early: abort -> inbox -->  engine.abort()          (frees the row)
    call(fn): fn -> inbox  ------------------->  fn(engine) between steps, result via a future

The event loop never blocks on the engine: it only puts items into a queue and awaits futures.

Besides the main engine, the thread can own extra *lanes*: further engines (e.g. a plain
autoregressive one sharing the target weights) built on demand with :meth:`AsyncEngine.add_lane`.
All lanes step on the same thread, one after another, so they never run concurrently.

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
from dart_ray.engine.engine import Engine
from dart_ray.engine.request import RequestOutput

logger = logging.getLogger(__name__)

MAIN_LANE = "main"


class AsyncEngineError(RuntimeError):
    """Base class of the errors raised by :class:`AsyncEngine` itself."""


class QueueFullError(AsyncEngineError):
    """Too many requests are waiting for a batch row; retry later."""


class EngineDeadError(AsyncEngineError):
    """The engine thread is not running (shut down, or failed to start)."""


class EngineStepError(AsyncEngineError):
    """``engine.step()`` raised while this request was in flight; the request was aborted."""


@dataclass
class _Stream:
    request_id: str
    lane: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    done: bool = False


@dataclass
class _Lane:
    name: str
    engine: Engine
    streams: dict[str, _Stream] = field(default_factory=dict)
    step_errors: int = 0


# inbox commands
@dataclass
class _Add:
    stream: _Stream
    prompt: Any
    params: SamplingParams
    chat: bool


@dataclass
class _Abort:
    request_id: str
    lane: str


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
                 name: str = "dart-ray-engine", start_timeout_s: float | None = None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending_adds = 0          # adds put into the inbox, not yet handed to an engine
        self._engine_waiting = 0        # requests inside engines, not yet given a row
        self._num_running = 0
        self._closed = False
        self._fatal: BaseException | None = None
        self._lanes: dict[str, _Lane] = {}
        self._stream_index: dict[str, _Stream] = {}   # request id -> stream (all lanes; guarded by _lock)
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
        """Requests submitted but not yet decoding (inbox + engines' waiting queues)."""
        return self._pending_adds + self._engine_waiting

    @property
    def num_running(self) -> int:
        """Requests holding a batch row (all lanes)."""
        return self._num_running

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
    async def stream(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                     chat: bool = False, lane: str = MAIN_LANE) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its outputs (deltas) until it finishes.

        Raises the engine's own exception for a bad prompt (``ValueError``, ``TypeError``,
        ``PromptTooLongError``), :class:`QueueFullError` when too many requests wait,
        :class:`EngineStepError` if a step failed mid-request. Closing the iterator early or
        cancelling the consuming task aborts the request in the engine.
        """
        st = self._submit(prompt, params or SamplingParams(), request_id, chat, lane)
        try:
            while True:
                item = await st.queue.get()
                if isinstance(item, BaseException):
                    st.done = True
                    raise item
                if item.finished:
                    st.done = True
                yield item
                if st.done:
                    return
        finally:
            if not st.done:
                st.done = True
                self._inbox.put(_Abort(st.request_id, st.lane))
            with self._lock:
                if self._stream_index.get(st.request_id) is st:
                    del self._stream_index[st.request_id]

    def _submit(self, prompt, params: SamplingParams, request_id: str | None, chat: bool, lane: str) -> _Stream:
        self.check_health()
        loop = asyncio.get_running_loop()
        rid = request_id or uuid.uuid4().hex
        with self._lock:
            if lane not in self._lanes:
                raise ValueError(f"unknown engine lane {lane!r} (have {sorted(self._lanes)})")
            if rid in self._stream_index:
                raise ValueError(f"duplicate request id {rid!r}")
            if self._pending_adds + self._engine_waiting >= self.max_queue:
                raise QueueFullError(f"{self.max_queue} requests are already waiting; retry later")
            st = _Stream(rid, lane, loop, asyncio.Queue())
            self._stream_index[rid] = st
            self._pending_adds += 1
        self._inbox.put(_Add(st, prompt, params, chat))
        return st

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       chat: bool = False, lane: str = MAIN_LANE) -> tuple[list[int], str, RequestOutput]:
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

    def call_future(self, fn: Callable[[Engine], Any], lane: str | None = MAIN_LANE) -> concurrent.futures.Future:
        """Like :meth:`call` for synchronous callers: returns a ``concurrent.futures.Future``."""
        self.check_health()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Call(fn, lane, fut))
        return fut

    async def encode(self, prompt, chat: bool = False) -> list[int]:
        """Tokenise on the engine thread (the tokenizer is not shared across threads)."""
        return await self.call(lambda e: e.encode_prompt(prompt, chat))

    async def add_lane(self, name: str, factory: Callable[[Engine], Engine]) -> None:
        """Build another engine on the engine thread (``factory(main_engine)``) unless ``name`` exists."""
        self.check_health()
        if name in self._lanes:
            return
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_AddLane(name, factory, fut))
        await asyncio.wrap_future(fut)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; requests still in flight fail with :class:`EngineDeadError`."""
        if self._closed and not self._thread.is_alive():
            return
        self._closed = True
        self._inbox.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self, engine) -> None:
        try:
            if not isinstance(engine, Engine) and callable(engine):
                engine = engine()
            self._lanes[MAIN_LANE] = _Lane(MAIN_LANE, engine)
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
            self._closed = True
            self._fail_all(EngineDeadError("engine is shut down"))

    def _loop(self) -> None:
        while True:
            cmds = []
            if not any(l.engine.has_unfinished() for l in self._lanes.values()):
                cmds.append(self._inbox.get())                    # idle: block until work arrives
            while True:
                try:
                    cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for c in cmds:
                if c is _STOP:
                    return
                self._handle(c)
            for lane in list(self._lanes.values()):
                if lane.engine.has_unfinished():
                    self._step(lane)
            self._publish()

    def _handle(self, c) -> None:
        if isinstance(c, _Add):
            st = c.stream
            with self._lock:
                self._pending_adds -= 1
            if st.done:          # consumer went away before the add was processed
                return
            try:
                lane = self._lanes[st.lane]
                lane.engine.add_request(c.prompt, c.params, request_id=st.request_id, chat=c.chat)
                lane.streams[st.request_id] = st
            except Exception as e:  # noqa: BLE001 - the caller gets the original exception
                self._deliver(st, e)
            self._publish()
        elif isinstance(c, _Abort):
            lane = self._lanes.get(c.lane)
            if lane is not None and lane.streams.pop(c.request_id, None) is not None:
                try:
                    lane.engine.abort(c.request_id)
                except Exception:
                    logger.exception("abort of %s failed", c.request_id)
        elif isinstance(c, _Call):
            if not c.future.set_running_or_notify_cancel():
                return
            try:
                target = ({k: l.engine for k, l in self._lanes.items()} if c.lane is None
                          else self._lanes[c.lane].engine)
                c.future.set_result(c.fn(target))
            except BaseException as e:  # noqa: BLE001
                c.future.set_exception(e)
        elif isinstance(c, _AddLane):
            try:
                if c.name not in self._lanes:
                    self._lanes[c.name] = _Lane(c.name, c.factory(self._lanes[MAIN_LANE].engine))
                c.future.set_result(None)
            except BaseException as e:  # noqa: BLE001
                c.future.set_exception(e)

    def _step(self, lane: _Lane) -> None:
        try:
            outputs = lane.engine.step()
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
        self._publish()                      # counters are current before anyone sees the outputs
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

    def _publish(self) -> None:
        waiting = running = 0
        for lane in self._lanes.values():
            waiting += len(lane.engine.waiting)
            running += lane.engine.num_running
        self._engine_waiting, self._num_running = waiting, running

    def _fail_all(self, err: BaseException) -> None:
        for lane in self._lanes.values():
            for st in lane.streams.values():
                self._deliver(st, err)
            lane.streams.clear()
        # adds still sitting in the inbox
        while True:
            try:
                c = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(c, _Add):
                self._deliver(c.stream, err)
            elif isinstance(c, (_Call, _AddLane)) and not c.future.done():
                c.future.set_exception(err)
        with self._lock:
            self._pending_adds = 0
        self._engine_waiting = self._num_running = 0
