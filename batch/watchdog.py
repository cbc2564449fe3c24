"""A stall guard for the job's Ray Data pipeline: no committed batch for too long ends the run.

Ray Data restarts a lost actor and re-runs its batches, but some losses leave its actor pool with
no schedulable actor and blocks still queued (a dead actor that keeps its slot; see
ray-project/ray#62746 and #41258). The pipeline then waits forever and no exception is raised: a
batch job on a cluster that lost a node could hang instead of finishing.

:func:`consume` iterates the pipeline on a helper thread and hands each output to the caller; when
nothing arrives for ``stall_timeout_s`` it shuts the pipeline's streaming executor down (which
kills its actors, so they release the output directory's worker lock) and raises
:class:`PipelineStalled`. The job then resumes from its committed parts (``batch.job``), which is
safe because every committed part is complete and named by its ids.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

log = logging.getLogger(__name__)

_END = object()


class PipelineStalled(RuntimeError):
    """No output from the pipeline for longer than the stall timeout."""


def _streaming_executors() -> set:
    """Ray Data streaming executors alive in this process (each is a thread)."""
    try:
        from ray.data._internal.execution.streaming_executor import StreamingExecutor
    except ImportError:  # moved in another Ray version: the stall is still reported, see below
        return set()
    return {t for t in threading.enumerate() if isinstance(t, StreamingExecutor)}


def consume(make_iter: Callable[[], Iterable[Any]], stall_timeout_s: float | None,
            poll_s: float = 1.0) -> Iterator[Any]:
    """Yield what ``make_iter()`` yields; raise :class:`PipelineStalled` after ``stall_timeout_s``
    seconds without an item (None: wait forever). Exceptions of the iterator are re-raised here."""
    if stall_timeout_s is None:
        yield from make_iter()
        return
    if stall_timeout_s <= 0:
        raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
    before = _streaming_executors()
    items: queue.Queue = queue.Queue(maxsize=64)
    stop = threading.Event()

    def run() -> None:
        try:
            for item in make_iter():
                if stop.is_set():
                    return
                items.put(item)
            items.put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the consuming thread
            items.put(e)

    worker = threading.Thread(target=run, name="dart-ray-batch-consumer", daemon=True)
    worker.start()
    last = time.monotonic()
    try:
        while True:
            try:
                item = items.get(timeout=poll_s)
            except queue.Empty:
                idle = time.monotonic() - last
                if idle > stall_timeout_s:
                    stop.set()
                    stopped = _shutdown(_streaming_executors() - before)
                    worker.join(timeout=min(30.0, stall_timeout_s))  # unblocked by the shutdown
                    raise PipelineStalled(
                        f"no batch finished for {idle:.0f} s (stall timeout {stall_timeout_s:.0f} "
                        "s); "
                        + ("the pipeline was stopped" if stopped else
                           "could not find the Ray Data executor to stop it")) from None
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            last = time.monotonic()
            yield item
    finally:
        stop.set()


def _shutdown(executors: set) -> bool:
    """Force-shutdown ``executors`` (kills their actors); whether there was one."""
    for ex in executors:
        try:
            ex.shutdown(force=True, exception=PipelineStalled("stalled"))
        except Exception:  # noqa: BLE001 - best effort; the caller reports the stall either way
            log.exception("could not shut down the stalled Ray Data executor")
    return bool(executors)
