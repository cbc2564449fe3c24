"""Draining ``dart-ray serve`` on Ctrl-C / SIGTERM: the requests in flight finish, new ones get 503.

    dart-ray serve (run_local) -- ServeControl (named actor, 0 CPUs) <-- every ingress replica
        | SIGTERM: control.start_drain()                                polls it (draining?) and
        | wait: every replica saw the drain and has no open request     reports its open requests
        v serve.shutdown(), Ray down

An ingress replica counts its open HTTP requests in :class:`DrainGate` (an ASGI middleware: a
request is open until its whole response, an SSE stream included, is sent). Once it knows the
server drains, it answers new generation requests (every POST) ``503 shutting_down`` with
``Retry-After``, and ``/health`` 503, so a load balancer stops sending. ``run_local`` waits until
every replica it heard from has seen the drain and has no open request, or ``drain_timeout_s``.
Then whatever is still open is cut (:func:`cut`): every replica cancels its open requests, which
cancels their engine calls (the engine aborts them), so Serve's shutdown that follows has nothing
left to wait for. Only ``dart-ray serve`` starts the control actor: under ``serve deploy`` the
ingress finds none and none of this runs (Serve's own graceful shutdown applies).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

from deployments.protocol import SSE_DONE, error_body, sse

logger = logging.getLogger("ray.serve")

CONTROL_NAME = "dart-ray-serve-control"
CONTROL_NAMESPACE = "dart-ray"
POLL_S = 0.25
"""How often an ingress replica reports to the control actor."""
GONE_S = 5.0
"""A replica not heard from for this long is gone (it has nothing left to drain)."""
CUT_WAIT_S = 5.0
"""How long :func:`cut` waits for the replicas to cancel their open requests."""
SERVING, DRAINING, CUTTING = 0, 1, 2
"""The server's state, as :meth:`ServeControl.poll` answers it."""


class ServeControl:
    """The drain flag and every ingress replica's open requests (a Ray actor, see
    :func:`start_control`)."""

    def __init__(self) -> None:
        self.state = SERVING
        self.replicas: dict[str, tuple[float, int]] = {}
        """replica -> (time of its last report, its open requests then)."""
        self.reports_since_drain: dict[str, int] = {}

    @property
    def draining(self) -> bool:
        return self.state != SERVING

    def poll(self, replica: str, open_requests: int) -> int:
        """A replica's report; returns the server's state (SERVING, DRAINING or CUTTING)."""
        self.replicas[replica] = (time.time(), int(open_requests))
        if self.draining:
            self.reports_since_drain[replica] = self.reports_since_drain.get(replica, 0) + 1
        return self.state

    def start_drain(self) -> None:
        self.state = max(self.state, DRAINING)

    def start_cut(self) -> None:
        self.state = CUTTING

    def drained(self) -> tuple[bool, int]:
        """(every replica still reporting has counted its open requests knowing of the drain, and
        has none; the open requests of those replicas). A replica learns of the drain in the
        answer to its first report after it started, so its second report is the first whose
        count admits no new request."""
        now = time.time()
        alive = {r: n for r, (t, n) in self.replicas.items() if now - t < GONE_S}
        seen = all(self.reports_since_drain.get(r, 0) >= 2 for r in alive)
        open_requests = sum(alive.values())
        return self.draining and seen and open_requests == 0, open_requests


def start_control():
    """The control actor of this ``dart-ray serve`` (created before the applications deploy)."""
    import ray

    actor = ray.remote(num_cpus=0)(ServeControl)
    return actor.options(name=CONTROL_NAME, namespace=CONTROL_NAMESPACE,
                         get_if_exists=True).remote()


def drain(control, timeout_s: float) -> int:
    """Start draining and wait until it is done or ``timeout_s`` passed; returns the requests still
    open at the end (for :func:`cut`)."""
    import ray

    ray.get(control.start_drain.remote())
    deadline = time.monotonic() + timeout_s
    open_requests = 0
    announced = False
    while time.monotonic() < deadline:
        done, open_requests = ray.get(control.drained.remote())
        if done:
            return 0
        if open_requests and not announced:
            print(f"draining: waiting for {open_requests} open request(s) to finish (up to "
                  f"{timeout_s:g} s; new ones get 503)", flush=True)
            announced = True
        time.sleep(POLL_S)
    return open_requests


def cut(control, wait_s: float = CUT_WAIT_S) -> int:
    """Tell every ingress replica to cancel its open requests (their engine calls are cancelled
    with them) and wait up to ``wait_s`` until none is open; returns the count still open."""
    import ray

    ray.get(control.start_cut.remote())
    deadline = time.monotonic() + wait_s
    while True:
        done, open_requests = ray.get(control.drained.remote())
        if done or time.monotonic() >= deadline:
            return open_requests
        time.sleep(POLL_S)


class DrainGate:
    """ASGI middleware of an ingress replica: counts its open HTTP requests and, while the server
    drains, refuses new generation requests and reports ``/health`` unhealthy (503)."""

    def __init__(self, app, ingress) -> None:
        self.app = app
        self.ingress = ingress

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ing = self.ingress
        if ing.draining and (scope.get("method") == "POST" or scope.get("path") == "/health"):
            if scope.get("method") == "POST":        # a refused request; a refused probe is not
                ing.metrics.error(503)
            await _refuse(send)
            return
        task = asyncio.current_task()
        ing.loop = asyncio.get_running_loop()
        ing.open_tasks.add(task)
        sent = {"started": False, "sse": False, "done": False}

        async def watched_send(message) -> None:
            if message["type"] == "http.response.start":
                sent["started"] = True
                sent["sse"] = any(k.lower() == b"content-type"
                                  and v.startswith(b"text/event-stream")
                                  for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                sent["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except asyncio.CancelledError:
            if not ing.cutting or sent["done"]:
                raise                               # a client that left: nothing to tell
            # cut at the end of a drain: the client still hears why its request ended
            ing.metrics.error(503)
            try:
                if not sent["started"]:
                    await _refuse(send)
                elif sent["sse"]:
                    await send({"type": "http.response.body", "body": _SSE_CUT,
                                "more_body": False})
                else:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            except Exception:  # noqa: BLE001 - the client is gone too
                logger.debug("could not tell a cut request's client", exc_info=True)
        finally:
            ing.open_tasks.discard(task)


_SHUTTING_DOWN = error_body("the server is shutting down: retry the request (on another server)",
                            "server_error", None, "shutting_down")


async def _refuse(send) -> None:
    body = json.dumps(_SHUTTING_DOWN).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


_SSE_CUT = sse(_SHUTTING_DOWN) + SSE_DONE
"""How a stream cut at the end of a drain ends: an in-band error event, then ``[DONE]`` (as a
stream whose replica was lost ends)."""


def cancel_open_requests(ingress) -> None:
    """Cancel every request ``ingress`` is answering (from any thread): the cut at the end of a
    drain. A cancelled request cancels its engine call, which aborts it in the engine."""
    loop = ingress.loop
    if loop is None:
        return
    ingress.cutting = True
    for task in list(ingress.open_tasks):
        loop.call_soon_threadsafe(task.cancel)


def follow_control(ingress, replica: str) -> threading.Thread | None:
    """In an ingress replica: report ``ingress.open_requests`` to this server's control actor every
    :data:`POLL_S` and set ``ingress.draining`` from its answer (a daemon thread). None when no
    ``dart-ray serve`` started a control actor."""
    import ray

    try:
        control = ray.get_actor(CONTROL_NAME, namespace=CONTROL_NAMESPACE)
    except ValueError:
        return None

    def loop() -> None:
        while True:
            try:
                state = ray.get(control.poll.remote(replica, ingress.open_requests), timeout=10)
            except Exception:  # noqa: BLE001 - the control actor went away: the server is stopping
                logger.debug("drain control unreachable", exc_info=True)
                return
            ingress.draining = state != SERVING
            if state == CUTTING and not ingress.cutting:    # once: a second cancel would cut
                cancel_open_requests(ingress)               # the gate's final event short
            time.sleep(POLL_S)

    t = threading.Thread(target=loop, name="dart-ray-drain", daemon=True)
    t.start()
    return t
