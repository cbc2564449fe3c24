"""The stall guard of the batch pipeline (batch/watchdog.py), without Ray."""

from __future__ import annotations

import threading
import time

import pytest

from batch.watchdog import PipelineStalled, consume


def test_items_pass_through_in_order():
    assert list(consume(lambda: iter(range(100)), stall_timeout_s=5.0,
                        poll_s=0.01)) == list(range(100))


def test_no_timeout_iterates_directly():
    assert list(consume(lambda: [1, 2, 3], stall_timeout_s=None)) == [1, 2, 3]


def test_iterator_errors_reach_the_caller():
    def gen():
        yield 1
        raise KeyError("boom")

    got = []
    with pytest.raises(KeyError, match="boom"):
        for x in consume(gen, stall_timeout_s=5.0, poll_s=0.01):
            got.append(x)
    assert got == [1]


def test_a_stalled_iterator_raises_after_the_timeout():
    release = threading.Event()

    def gen():
        yield "first"
        release.wait(30)            # hangs like a pipeline whose actor pool is gone
        yield "never"

    got = []
    t0 = time.monotonic()
    with pytest.raises(PipelineStalled, match="no batch finished"):
        for x in consume(gen, stall_timeout_s=0.5, poll_s=0.05):
            got.append(x)
    release.set()
    assert got == ["first"] and 0.5 <= time.monotonic() - t0 < 10


def test_slow_but_steady_progress_is_not_a_stall():
    def gen():
        for i in range(6):
            time.sleep(0.2)          # each item well inside the timeout; the total is not
            yield i

    assert list(consume(gen, stall_timeout_s=0.6, poll_s=0.05)) == list(range(6))


def test_bad_timeout_is_refused():
    with pytest.raises(ValueError, match="stall_timeout_s"):
        list(consume(lambda: [1], stall_timeout_s=0))
