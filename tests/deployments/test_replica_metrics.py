"""An engine replica's ``/metrics`` against what its clients saw: the real ``DartRayServer`` class
built in-process on a tiny random Llama (no Ray), its ``generate`` and ``metrics`` called
directly."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dart_ray import SamplingParams
from deployments.protocol import APIError, parse_completion

PROMPT = list(range(5, 15)) * 6          # repetitive: prompt lookup accepts several tokens a step


@pytest.fixture
def server(tiny_dirs):
    from deployments.serving import DartRayServer

    cls = getattr(DartRayServer, "func_or_class", DartRayServer)
    s = cls({"engine": {"model": str(tiny_dirs["llama"]), "method": "ngram", "dtype": "fp32",
                        "max_batch_size": 2, "max_seq_len": 256, "adaptive": False,
                        "num_threads": 1},
             "replica_niceness": None})
    yield s
    s.aengine.shutdown()


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def _complete(server, body: dict, rid: str, between=None) -> list:
    """Every item ``generate`` yields for a completion request (``between()`` awaited after each
    one)."""
    items = []
    async for o in server.generate(parse_completion(body), rid):
        assert not isinstance(o, APIError), o
        items.append(o)
        if between is not None:
            await between()
    return items


def _multi_token_step(server) -> tuple[list[int], list[int]]:
    """(tokens before, tokens of) the first greedy delta after the first that carries >= 3
    tokens: a step that accepted drafts."""
    async def deltas():
        return [list(o.new_token_ids) async for o in server.aengine.stream(
            PROMPT, SamplingParams(max_new_tokens=120, ignore_eos=True))]

    before: list[int] = []
    for i, d in enumerate(asyncio.run(deltas())):
        if i > 0 and len(d) >= 3:
            return before, d
        before += d
    pytest.skip("the tiny model's greedy text gave prompt lookup no multi-token step")


def test_generation_tokens_count_what_clients_got_and_only_grow(server):
    """A stop string that completes inside a multi-token step: the engine computed tokens past it
    that no client sees. ``vllm:generation_tokens`` counts what was streamed (the sum of usage),
    also when that step was the request's last (``max_tokens`` reached in it), and never falls
    between scrapes (it used to be the engine's count, taken back once the stop string was found:
    a Prometheus counter that fell, read as a reset)."""
    tok = server.tokenizers._proto
    before, step = _multi_token_step(server)
    stop = tok.decode(before + step[:1])
    # the stop string completes at the step's first token: mid-stream, and in a final output
    async def run(rid: str, max_tokens: int, seen: list[float]) -> list:
        async def scrape():
            seen.append(_value(await server.metrics(), "vllm:generation_tokens_total"))

        await scrape()
        items = await _complete(server, {"prompt": PROMPT, "max_tokens": max_tokens,
                                         "temperature": 0, "ignore_eos": True, "stop": [stop]},
                                rid, between=scrape)
        await asyncio.sleep(0.2)                       # the engine thread handles the abort
        await scrape()
        return items

    for rid, max_tokens in (("mid", 100), ("last", len(before) + len(step))):
        seen: list[float] = []
        items = asyncio.run(run(rid, max_tokens, seen))
        last = items[-1]
        assert last.finished and last.finish_reason == "stop", rid
        assert last.num_generated_tokens == len(before) + 1, rid
        assert seen == sorted(seen), (rid, seen)                       # a counter only grows
        assert seen[-1] - seen[0] == last.num_generated_tokens, (rid, seen)
        assert _value(asyncio.run(server.metrics()), "dart_ray:generation_tokens_total") \
            == seen[-1]


def test_a_request_admitted_in_a_step_gets_one_delta_from_it(server):
    """A request is prefilled and decoded in the same step: its client gets one delta for that step
    (it got two, and the inter-token latency histogram a ~0 s sample per request)."""
    items = asyncio.run(_complete(server, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                           "ignore_eos": True}, "one"))
    assert len(items[0].new_token_ids) >= 2          # the prefill's token and the first decode's
    text = asyncio.run(server.metrics())
    assert _value(text, "vllm:inter_token_latency_seconds_count") == len(items) - 1


def test_metrics_answer_while_a_step_holds_the_engine_thread(server):
    """``/metrics`` reads the counters without waiting for a step boundary: a long step (a big
    prefill, a lane build, a stuck device) must not push scrapes past Prometheus's timeout. Failed
    steps are exported."""
    release, entered = threading.Event(), threading.Event()

    def block(engine):
        entered.set()
        release.wait(30)

    server.aengine.call_future(block)                # holds the engine thread
    assert entered.wait(10)
    try:
        text = asyncio.run(asyncio.wait_for(server.metrics(), 5))
    finally:
        release.set()
    assert _value(text, "vllm:num_requests_running") == 0
    assert _value(text, "dart_ray:engine_step_errors_total") == 0
