"""AsyncEngine: the engine on its own thread behind asyncio streams (no Ray)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from conftest import make_tiny_checkpoint

from dart_ray import Engine, EngineConfig, PromptTooLongError, SamplingParams
from dart_ray.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStepError,
    QueueFullError,
)

PROMPTS = ["Hello world", "def foo(x):", "The quick brown fox", "1, 2, 3, 4,", "import numpy as np",
           "Once upon a time"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm_dir):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_async") / "llama", "llama",
                                smollm_dir)


def _cfg(model, method="ngram", **kw):
    kw.setdefault("max_batch_size", 4)
    kw.setdefault("max_seq_len", 256)
    return EngineConfig(model=str(model), method=method,
                        drafter="random" if method == "dart" else None, dtype="fp32", num_threads=1,
                        **kw)


async def _drain(gen):
    ids, text, last = [], [], None
    async for o in gen:
        ids.extend(o.new_token_ids)
        text.append(o.new_text)
        last = o
    return ids, "".join(text), last


async def _num_running(aeng) -> int:
    return await aeng.call(lambda e: e.num_running)


@pytest.mark.parametrize("method", ["ngram", "dart"])
def test_concurrent_streams_match_sequential(tiny_llama, method):
    params = [SamplingParams(max_new_tokens=8 + 3 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    ref = Engine.from_config(_cfg(tiny_llama, method))
    # one at a time
    expected = [ref.generate(p, sp)[0] for p, sp in zip(PROMPTS, params, strict=True)]

    aeng = AsyncEngine(lambda: Engine.from_config(_cfg(tiny_llama, method)))
    try:
        async def main():
            return await asyncio.gather(*[_drain(aeng.stream(p, sp))
                                          for p, sp in zip(PROMPTS, params, strict=True)])

        got = asyncio.run(main())
        for (ids, text, last), exp in zip(got, expected, strict=True):
            assert ids == exp.token_ids
            assert text == exp.text
            assert last.finished and last.finish_reason == "length"
            assert last.num_generated_tokens == len(exp.token_ids)
        assert aeng.num_running == 0 and aeng.queue_depth == 0
        # more prompts than rows: the engine's max_batch_size was honoured
        assert aeng.engine.max_batch == 4
    finally:
        aeng.shutdown()


def test_chat_and_lane_without_speculation(tiny_llama):
    from dart_ray.drafters import NoDrafter

    aeng = AsyncEngine(Engine.from_config(_cfg(tiny_llama, "dart")))
    try:
        async def main():
            sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
            a = await _drain(aeng.stream([{"role": "user", "content": "hi"}], sp))
            await aeng.add_lane("none", lambda e: Engine(e.target, NoDrafter(),
                                                         e.config.replace(method="none")))
            b = await _drain(aeng.stream([{"role": "user", "content": "hi"}], sp, lane="none"))
            c = await _drain(aeng.stream("hi", sp, chat=True, lane="none"))
            return a, b, c

        a, b, c = asyncio.run(main())
        assert a[0] == b[0] == c[0]
        assert a[2].stats.draft_tokens > 0 and b[2].stats.draft_tokens == 0
        assert set(aeng.lanes) == {"main", "none"}
    finally:
        aeng.shutdown()


def test_cancellation_frees_row(tiny_llama):
    aeng = AsyncEngine(Engine.from_config(_cfg(tiny_llama, max_batch_size=2)))
    try:
        async def main():
            long = SamplingParams(max_new_tokens=200, ignore_eos=True)
            # 1) consumer stops early (client disconnect closes the generator)
            gen = aeng.stream("Hello", long)
            n = 0
            async for _ in gen:
                n += 1
                if n == 2:
                    break
            await gen.aclose()
            for _ in range(100):
                if await _num_running(aeng) == 0:
                    break
                await asyncio.sleep(0.01)
            assert await _num_running(aeng) == 0
            assert await aeng.call(lambda e: len(e.requests)) == 0

            # 2) the consuming task is cancelled mid-stream
            started = asyncio.Event()

            async def consume():
                async for _ in aeng.stream("Hello", long):
                    started.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(started.wait(), 30)
            assert aeng.num_running >= 0
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                if await _num_running(aeng) == 0:
                    break
                await asyncio.sleep(0.01)
            assert await _num_running(aeng) == 0
            assert await aeng.call(lambda e: (len(e.requests), len(e.waiting))) == (0, 0)
            # the freed rows serve new requests
            sp = SamplingParams(max_new_tokens=5, ignore_eos=True)
            ids, _, last = await _drain(aeng.stream("again", sp))
            assert len(ids) == 5 and last.finish_reason == "length"

        asyncio.run(main())
    finally:
        aeng.shutdown()


def test_bad_prompt_propagates_original_exception(tiny_llama):
    aeng = AsyncEngine(Engine.from_config(_cfg(tiny_llama)))
    try:
        async def main():
            # the engine's own exception
            with pytest.raises((ValueError, TypeError), match="empty"):
                await _drain(aeng.stream([], SamplingParams()))
            with pytest.raises(ValueError, match="token ids"):
                await _drain(aeng.stream([10**7], SamplingParams()))
            with pytest.raises(PromptTooLongError):
                await _drain(aeng.stream(list(range(100, 400)), SamplingParams()))
            with pytest.raises(TypeError):
                await _drain(aeng.stream(3.5, SamplingParams()))
            ids, _, _ = await _drain(aeng.stream("fine",
                                                 SamplingParams(max_new_tokens=3, ignore_eos=True)))
            assert len(ids) == 3

        asyncio.run(main())
        aeng.check_health()
    finally:
        aeng.shutdown()


def test_queue_full(tiny_llama):
    # 1 row + max_queue 2 waiting: the request that takes the free row is not "waiting" (issue 16)
    aeng = AsyncEngine(Engine.from_config(_cfg(tiny_llama, max_batch_size=1)), max_queue=2,
                       retry_after_s=3)
    gate = threading.Event()
    try:
        async def main():
            blocked = aeng.call_future(lambda e: gate.wait(30))   # park the engine thread
            sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
            tasks = [asyncio.create_task(_drain(aeng.stream(p, sp))) for p in ("a", "b", "c")]
            await asyncio.sleep(0.05)
            assert aeng.queue_depth == 2
            with pytest.raises(QueueFullError) as ei:
                await _drain(aeng.stream("d", sp))
            assert ei.value.retry_after_s == 3
            gate.set()
            await asyncio.wrap_future(blocked)
            res = await asyncio.gather(*tasks)
            assert [len(r[0]) for r in res] == [4, 4, 4]
            assert aeng.queue_depth == 0
            ids, _, _ = await _drain(aeng.stream("c", sp))     # room again
            assert len(ids) == 4

        asyncio.run(main())
    finally:
        gate.set()
        aeng.shutdown()


def test_step_error_fails_in_flight_and_keeps_serving(tiny_llama):
    aeng = AsyncEngine(Engine.from_config(_cfg(tiny_llama)))
    try:
        async def main():
            def sabotage(e):
                real = e.step
                state = {"n": 0}

                def step(**kw):
                    state["n"] += 1
                    if state["n"] == 3:
                        raise RuntimeError("boom")
                    return real(**kw)
                e.step = step

            await aeng.call(sabotage)
            sp = SamplingParams(max_new_tokens=50, ignore_eos=True)
            res = await asyncio.gather(_drain(aeng.stream("x", sp)), _drain(aeng.stream("y", sp)),
                                       return_exceptions=True)
            assert all(isinstance(r, EngineStepError) for r in res), res
            assert isinstance(res[0].__cause__, RuntimeError)
            assert aeng.num_step_errors == 1
            aeng.check_health()
            assert await _num_running(aeng) == 0
            ids, _, _ = await _drain(aeng.stream("z",
                                                 SamplingParams(max_new_tokens=6, ignore_eos=True)))
            assert len(ids) == 6

        asyncio.run(main())
    finally:
        aeng.shutdown()


def test_event_loop_not_blocked(tiny_llama):
    """Ticks of the event loop keep coming while the engine decodes."""
    aeng = AsyncEngine(Engine.from_config(_cfg(tiny_llama, "dart")))
    try:
        async def main():
            ticks = 0
            done = False

            async def ticker():
                nonlocal ticks
                while not done:
                    ticks += 1
                    await asyncio.sleep(0.005)

            t = asyncio.create_task(ticker())
            t0 = time.perf_counter()
            await _drain(aeng.stream("tick", SamplingParams(max_new_tokens=40, ignore_eos=True)))
            elapsed = time.perf_counter() - t0
            done = True
            await t
            return ticks, elapsed

        ticks, elapsed = asyncio.run(main())
        # the loop kept running (>= 10% of ideal ticks)
        assert ticks >= max(3, elapsed / 0.005 * 0.1)
    finally:
        aeng.shutdown()


def test_shutdown_and_factory_errors(tiny_llama):
    def bad():
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError):
        AsyncEngine(bad)
    aeng = AsyncEngine(Engine.from_config(_cfg(tiny_llama)))
    aeng.check_health()
    aeng.shutdown()
    with pytest.raises(EngineDeadError):
        aeng.check_health()

    async def main():
        with pytest.raises(EngineDeadError):
            await _drain(aeng.stream("x"))

    asyncio.run(main())


def test_admission_counts_rows_plus_queue(tiny_llama):
    """max_batch_size running + max_queue waiting, then QueueFullError; submitted-but-not-handed
    requests only count as waiting beyond the free rows, on every lane."""
    from dart_ray.drafters import NoDrafter

    rows, max_queue = 2, 3
    aeng = AsyncEngine(Engine.from_config(_cfg(tiny_llama, max_batch_size=rows)),
                       max_queue=max_queue)
    gate = threading.Event()
    try:
        async def main():
            await aeng.add_lane("none", lambda e: Engine(e.target, NoDrafter(),
                                                         e.config.replace(method="none")))
            blocked = aeng.call_future(lambda e: gate.wait(30))   # park: every add stays pending
            sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
            tasks = []
            for i in range(rows):                                   # take the main lane's rows
                tasks.append(asyncio.create_task(_drain(aeng.stream(f"r{i}", sp))))
                await asyncio.sleep(0.01)
                assert aeng.queue_depth == 0 and aeng.num_in_flight == i + 1
            for i in range(max_queue):                              # then fill the queue
                tasks.append(asyncio.create_task(_drain(aeng.stream(f"w{i}", sp))))
                await asyncio.sleep(0.01)
                assert aeng.queue_depth == i + 1
            with pytest.raises(QueueFullError):
                await _drain(aeng.stream("over", sp))
            # another lane's free rows still admit (they are not waiting), its overflow does not
            for i in range(rows):
                tasks.append(asyncio.create_task(_drain(aeng.stream(f"n{i}", sp, lane="none"))))
            await asyncio.sleep(0.02)
            assert aeng.queue_depth == max_queue and aeng.num_in_flight == 2 * rows + max_queue
            with pytest.raises(QueueFullError):
                await _drain(aeng.stream("over", sp, lane="none"))
            gate.set()
            await asyncio.wrap_future(blocked)
            res = await asyncio.gather(*tasks)
            assert all(len(r[0]) == 3 for r in res)
            assert aeng.queue_depth == 0 and aeng.num_running == 0 and aeng.num_in_flight == 0

        asyncio.run(main())
    finally:
        gate.set()
        aeng.shutdown()


def test_request_timing_and_step_observer(tiny_llama):
    seen: list[int] = []
    aeng = AsyncEngine(Engine.from_config(_cfg(tiny_llama)), on_step=seen.append)
    try:
        from dart_ray.engine.async_engine import RequestTiming

        async def main():
            timing = RequestTiming()
            sp = SamplingParams(max_new_tokens=5, ignore_eos=True)
            ids, _, last = await _drain(aeng.stream("time me", sp, timing=timing))
            return timing, ids, last

        timing, ids, last = asyncio.run(main())
        assert timing.submitted <= timing.scheduled <= timing.first_token
        assert sum(seen) == last.num_prompt_tokens + len(ids)   # prompt + generated, over the steps
    finally:
        aeng.shutdown()


def test_lane_count_is_bounded(tiny_llama):
    from dart_ray.drafters import NoDrafter
    from dart_ray.engine.async_engine import LaneLimitError

    def none_lane(e):
        return Engine(e.target, NoDrafter(), e.config.replace(method="none"))

    aeng = AsyncEngine(Engine.from_config(_cfg(tiny_llama)), max_lanes=2)
    try:
        async def main():
            await aeng.add_lane("none", none_lane)
            await aeng.add_lane("none", none_lane)                # existing: no growth, no error
            with pytest.raises(LaneLimitError):
                await aeng.add_lane("other", none_lane)
            assert set(aeng.lanes) == {"main", "none"}

        asyncio.run(main())
    finally:
        aeng.shutdown()

    aeng = AsyncEngine(Engine.from_config(_cfg(tiny_llama)), max_lanes=2)
    try:
        async def racing():                                     # concurrent builds cannot overshoot
            return await asyncio.gather(*[aeng.add_lane(f"l{i}", none_lane) for i in range(4)],
                                        return_exceptions=True)

        res = asyncio.run(racing())
        assert sum(r is None for r in res) == 1 and all(isinstance(r, LaneLimitError) for r in res
                                                        if r is not None)
        assert len(aeng.lanes) == 2
    finally:
        aeng.shutdown()


def test_text_is_made_off_the_engine_thread_and_stop_strings_end_requests_there(tiny_llama):
    """The engine thread computes token ids only: no detokenising runs on it. A stop string found
    on the event loop ends the request exactly as the synchronous engine does (the text before it,
    the ids through the token that completes it), frees its row, and the engine's generated-token
    count keeps only the tokens returned (not those of a step run before the abort arrived)."""
    prompt = PROMPTS[3]
    plain = SamplingParams(max_new_tokens=32, ignore_eos=True)
    ref = Engine.from_config(_cfg(tiny_llama, "ngram", max_batch_size=1))
    full = ref.generate(prompt, plain)[0]
    mid = len(full.text) // 2
    stop = next(full.text[i:i + 2] for i in range(mid, len(full.text) - 1)
                if full.text[i:i + 2].strip())
    sp = SamplingParams(max_new_tokens=32, stop=(stop,), ignore_eos=True)
    want = ref.generate(prompt, sp)[0]
    assert want.finish_reason == "stop" and len(want.token_ids) < len(full.token_ids)

    aeng = AsyncEngine(Engine.from_config(_cfg(tiny_llama, "ngram")))
    tok = aeng.engine.tokenizer
    decode, threads = tok.decode, []

    def spy(*a, **kw):
        threads.append(threading.current_thread())
        return decode(*a, **kw)

    tok.decode = spy
    try:
        stopped = asyncio.run(_drain(aeng.stream(prompt, sp)))
        whole = asyncio.run(_drain(aeng.stream(prompt, plain)))
        running, generated = asyncio.run(
            aeng.call(lambda e: (e.num_running, e.metrics.generated_tokens)))
    finally:
        aeng.shutdown()
    ids, text, last = stopped
    assert (ids, text, last.finish_reason) == (want.token_ids, want.text, "stop")
    assert last.finished and last.num_generated_tokens == len(want.token_ids)
    assert whole[0] == full.token_ids and whole[1] == full.text
    assert threads and aeng._thread not in threads
    # the engine's counter only grows: tokens a step committed past the stop string count too
    assert running == 0 and generated >= len(want.token_ids) + len(full.token_ids)


@pytest.mark.parametrize("detokenize", [True, False])
def test_a_step_gives_each_request_one_delta(tiny_llama, detokenize):
    """A request admitted in a step is decoded in it too; the step returns one delta per request
    (it returned two for such a request, which a consumer timing deltas read as a 0 s gap), whose
    tokens and text are both halves in order."""
    engine = Engine.from_config(_cfg(tiny_llama, "ngram", adaptive=False))
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = [list(range(5, 15)) * 4, list(range(20, 27)) * 5]
    want = [c.token_ids for c in engine.generate(prompts, sp)]
    rids = [engine.add_request(p, sp) for p in prompts]
    got: dict[str, list[int]] = {r: [] for r in rids}
    text: dict[str, str] = {r: "" for r in rids}
    first = True
    while engine.has_unfinished():
        outs = engine.step(detokenize=detokenize)
        ids = [o.request_id for o in outs]
        assert len(ids) == len(set(ids)), ids
        for o in outs:
            if first:                      # admitted and decoded: the prefill token + a decode's
                assert len(o.new_token_ids) >= 2
            got[o.request_id] += o.new_token_ids
            text[o.request_id] += o.new_text
        first = False
    assert [got[r] for r in rids] == want
    if detokenize:
        assert [text[r] for r in rids] == [engine.tokenizer.decode(w) for w in want]


def test_a_submission_racing_shutdown_fails_instead_of_hanging(tiny_llama):
    """``shutdown()`` from another thread between a submitter's health check and its hand-off to
    the engine thread: the submission is refused (``EngineDeadError``); it used to land behind the
    thread's stop and wait forever (requests, ``call`` and ``add_lane`` alike)."""
    sp = SamplingParams(max_new_tokens=3)
    submissions = {"request": lambda a: a.generate([5, 6, 7], sp),
                   "call": lambda a: a.call(lambda e: 1),
                   "add_lane": lambda a: a.add_lane("ar", lambda main: main)}
    for kind, submit in submissions.items():
        aeng = AsyncEngine(Engine.from_config(_cfg(tiny_llama, "none", max_batch_size=1)))
        healthy = aeng.check_health

        def check_health_then_lose_the_race(aeng=aeng, healthy=healthy):
            healthy()                              # passes: not closed yet
            t = threading.Thread(target=aeng.shutdown, kwargs={"timeout_s": 10})
            t.start()
            t.join()

        aeng.check_health = check_health_then_lose_the_race

        async def main(aeng=aeng, submit=submit):
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(submit(aeng), 10)

        asyncio.run(main())
        assert not aeng._thread.is_alive(), kind


def test_a_stop_token_is_counted_and_its_text_left_out(tiny_llama):
    """The server's path (text made on the event loop): a request a stop id ended keeps the id
    and counts it, its text is not in the output, as the synchronous path does and vLLM does."""
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    eng = Engine.from_config(_cfg(tiny_llama, "ngram"))
    full = eng.generate(PROMPTS[0], sp)[0].token_ids
    stop = full[5]
    first = full.index(stop)
    aeng = AsyncEngine(eng)
    try:
        ids, text, last = asyncio.run(aeng.generate(
            PROMPTS[0], SamplingParams(max_new_tokens=16, ignore_eos=True,
                                       stop_token_ids=(stop,))))
    finally:
        aeng.shutdown()
    assert ids == full[:first + 1] and last.finish_reason == "stop"
    assert last.num_generated_tokens == first + 1
    assert text == eng.tokenizer.decode(full[:first], skip_special_tokens=True)


def test_outputs_of_step_driven_requests_survive_a_stream_running_the_steps(tiny_llama):
    """A request added with ``add_request`` (its caller drives ``step()``) runs on while another
    caller's ``generate`` steps the engine: its outputs from those steps come with the next
    ``step()`` (they were dropped, and it finished without its caller ever seeing the end)."""
    eng = Engine.from_config(_cfg(tiny_llama, "ngram", adaptive=False))
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    alone = eng.generate(PROMPTS[0], sp)[0].token_ids
    rid = eng.add_request(PROMPTS[0], sp)
    got = [t for o in eng.step() for t in o.new_token_ids]
    eng.generate(PROMPTS[1], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert eng.has_unfinished()
    last = None
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id == rid
            got += o.new_token_ids
            last = o
    assert got == alone and last.finished and last.finish_reason == "length"


def test_held_outputs_end_with_their_request_and_never_merge_into_a_new_one(tiny_llama):
    """Outputs a stream's steps made for an ``add_request`` request and no ``step()`` returned yet:
    ``abort()`` returns them inside its final output (nothing follows it), a failed step ends
    such a request with a final output at the next ``step()``, and its id cannot be reused until
    they are returned (the next step merged the old request's final delta into the new one's)."""
    eng = Engine.from_config(_cfg(tiny_llama, "ngram", adaptive=False))
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    eng.add_request(PROMPTS[0], sp, request_id="A")
    seen = [t for o in eng.step() for t in o.new_token_ids]
    for _ in eng.stream(PROMPTS[1], SamplingParams(max_new_tokens=3, ignore_eos=True)):
        pass
    final = eng.abort("A")
    assert final.finished and final.finish_reason == "abort"
    assert len(seen) + len(final.new_token_ids) == final.num_generated_tokens > len(seen)
    assert eng.step() == [] and not eng.has_unfinished()

    eng.add_request(PROMPTS[0], SamplingParams(max_new_tokens=2, ignore_eos=True),
                    request_id="B")
    for _ in eng.stream(PROMPTS[1], SamplingParams(max_new_tokens=8, ignore_eos=True)):
        pass                                               # B finished in the stream's steps
    with pytest.raises(ValueError, match="step first"):
        eng.add_request(PROMPTS[0], sp, request_id="B")
    (done,) = eng.step()
    assert done.request_id == "B" and done.finished and done.num_generated_tokens == 2
    eng.add_request(PROMPTS[0], sp, request_id="B")       # now a new request of that id

    def failing_decode(*a, **kw):
        raise RuntimeError("boom")

    eng.step()                                             # B admitted
    eng._decode = failing_decode
    with pytest.raises(RuntimeError, match="boom"):
        eng.step()
    (end,) = eng.step()
    assert end.request_id == "B" and end.finished and end.finish_reason == "abort"
    assert not eng.has_unfinished()
