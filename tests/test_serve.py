"""The Ray Serve OpenAI-compatible deployment, end to end over HTTP (tiny random model).

Starts Ray + Serve once for the module on a free localhost port; deselect with ``-m "not serve"``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import make_tiny_checkpoint

pytestmark = pytest.mark.serve

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

MODEL_NAME = "tiny"
API_KEY = "sekret-key"
MAX_SEQ_LEN = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(method: str, url: str, body=None, headers=None, timeout: float = 60.0):
    """(status, parsed JSON or text). ``body``: dict (JSON-encoded) or raw bytes/str."""
    data = None
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    if body is not None:
        data = body if isinstance(body, bytes) else (body.encode() if isinstance(body, str) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw, ctype = r.status, r.read(), r.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        status, raw, ctype = e.code, e.read(), e.headers.get("content-type", "")
    if "json" in ctype:
        return status, json.loads(raw)
    return status, raw.decode()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm_dir):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_serve") / "llama", "llama", smollm_dir)


@pytest.fixture(scope="module")
def server(tiny_model):
    import ray
    from ray import serve

    from deployments.openai_app import build_app

    tmp = tempfile.mkdtemp(prefix="drs-", dir="/tmp")       # short: Ray's socket paths must fit
    port = _free_port()
    own_ray = not ray.is_initialized()                        # reuse a Ray another module started
    if own_ray:
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"model": str(tiny_model), "method": "ngram", "dtype": "fp32", "max_batch_size": 4,
                "max_seq_len": MAX_SEQ_LEN, "num_threads": 1, "num_cpus": 0.25, "max_queue": 32,
                "served_model_name": MODEL_NAME}
        secure = {**args, "method": "none", "api_key": API_KEY, "max_batch_size": 1}
        serve.run_many([serve.RunTarget(build_app(args), name="main", route_prefix="/"),
                        serve.RunTarget(build_app(secure), name="secure", route_prefix="/secure")])
        yield {"url": f"http://127.0.0.1:{port}", "port": port}
    finally:
        try:
            serve.shutdown()
        finally:
            if own_ray:
                ray.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Greedy text of the tiny model, computed in-process without speculation (the oracle)."""
    from dart_ray import Engine, EngineConfig, SamplingParams

    eng = Engine.from_config(EngineConfig(model=str(tiny_model), method="none", dtype="fp32",
                                          max_batch_size=1, max_seq_len=MAX_SEQ_LEN, num_threads=1))

    def ref(prompt, max_tokens, chat=False):
        c = eng.generate(prompt, SamplingParams(max_new_tokens=max_tokens), chat=chat)[0]
        return c.text, c.finish_reason, len(c.token_ids), c.num_prompt_tokens

    return ref


def _metric(text: str, name: str, labels: str = "") -> float:
    pat = re.escape(name) + (r"\{[^}]*" + re.escape(labels) + r"[^}]*\}" if labels else r"(\{[^}]*\})?") + r" (\S+)"
    m = re.search(r"^" + pat + r"$", text, re.MULTILINE)
    assert m, f"{name} {labels} not in metrics"
    return float(m.groups()[-1])


# ---- happy paths ------------------------------------------------------------------------------------
def test_models_and_health(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL_NAME]
    status, body = _http("GET", server["url"] + "/health")
    assert status == 200 and body["status"] == "ok"
    status, body = _http("GET", server["url"] + "/v1/models/" + MODEL_NAME)
    assert status == 200 and body["max_model_len"] == MAX_SEQ_LEN


def test_completion_matches_reference_and_stream(client, reference):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0)
    text, reason, n, n_prompt = reference(prompt, 20)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == reason
    assert r.object == "text_completion" and r.model == MODEL_NAME
    assert r.usage.completion_tokens == n and r.usage.prompt_tokens == n_prompt
    assert r.usage.total_tokens == n + n_prompt
    spec = r.usage.model_extra["speculative"]
    assert spec["method"] == "ngram" and spec["steps"] >= 1 and spec["mean_accepted_len"] >= 1.0
    assert {"draft_tokens", "accepted_tokens"} <= set(spec)

    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n


def test_chat_nonstream_stream_and_override(client, reference):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=16, temperature=0)
    text, _, n, n_prompt = reference(msgs, 16, chat=True)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == n

    stream = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.total_tokens == n + n_prompt

    # per-request: no speculation (an AR lane sharing the weights) -> same greedy text
    r2 = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=16, temperature=0,
                                        extra_body={"speculative": False})
    assert r2.choices[0].message.content == text
    spec = r2.usage.model_extra["speculative"]
    assert spec["method"] == "none" and spec["draft_tokens"] == 0
    r3 = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=16, temperature=0,
                                        extra_body={"speculative": {"method": "ngram"}})
    assert r3.choices[0].message.content == text


def test_sampling_params_and_stop(client):
    kw = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.8,
          "top_p": 0.9, "seed": 7}
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b                                      # seeded sampling is reproducible
    full = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12,
                                     temperature=0).choices[0].text
    stop = full[3:6]
    if stop.strip():
        r = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12,
                                      temperature=0, stop=[stop])
        assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
        assert full.startswith(r.choices[0].text)


# ---- errors ---------------------------------------------------------------------------------------------
ERROR_CASES = [
    ("/v1/completions", b"{not json", 400, "invalid_json"),
    ("/v1/completions", {"model": MODEL_NAME}, 400, "missing_required_parameter"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "invalid_type"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "context_length_exceeded"),
    ("/v1/completions", {"prompt": "hello " * 400, "max_tokens": 4}, 400, "context_length_exceeded"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model_not_found"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "unsupported_value"),
    ("/v1/completions", {"prompt": "hi", "temperature": 5}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": [10**8], "max_tokens": 4}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "speculative": {"method": "hydra"}}, 400, "invalid_value"),
    # a known method whose drafter is not available for this (tiny) model: a clear 400, server keeps serving
    ("/v1/completions", {"prompt": "hi", "speculative": {"method": "eagle"}}, 400, "unsupported_value"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "max_tokens": 10**6}, 400, "context_length_exceeded"),
    ("/v1/chat/completions", {"model": MODEL_NAME}, 400, "missing_required_parameter"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value"),
    ("/v1/nope", {"prompt": "hi"}, 404, "not_found"),
]


def test_errors_are_openai_style_and_server_keeps_serving(server, client):
    for path, body, status, code in ERROR_CASES:
        got, resp = _http("POST", server["url"] + path, body)
        assert got == status, (path, body, got, resp)
        err = resp["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], resp
        assert err["code"] == code, (path, body, resp)
    r = client.completions.create(model=MODEL_NAME, prompt="still alive?", max_tokens=5, temperature=0)
    assert r.usage.completion_tokens >= 1
    import openai

    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", n=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi")


def test_metrics_counters_increase(server, client):
    status, before = _http("GET", server["url"] + "/metrics")
    assert status == 200
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "dart_ray:generation_tokens_total",
                 "dart_ray:queue_depth", "dart_ray:num_running", "dart_ray:request_latency_seconds_count",
                 "dart_ray:time_to_first_token_seconds_count"):
        _metric(before, name)
    _metric(before, "vllm:spec_decode_num_accepted_tokens_per_pos_total", 'position="0"')
    client.completions.create(model=MODEL_NAME, prompt="1 2 3 1 2 3 1 2 3", max_tokens=12, temperature=0)
    _, after = _http("GET", server["url"] + "/metrics")
    assert _metric(after, "vllm:spec_decode_num_drafts_total") > _metric(before, "vllm:spec_decode_num_drafts_total")
    assert _metric(after, "dart_ray:generation_tokens_total") >= _metric(before, "dart_ray:generation_tokens_total") + 12
    assert (_metric(after, "dart_ray:request_latency_seconds_count")
            == _metric(before, "dart_ray:request_latency_seconds_count") + 1)
    assert _metric(after, "dart_ray:num_running") == 0


def test_api_key(server):
    import openai

    base = server["url"] + "/secure"
    status, resp = _http("POST", base + "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    assert status == 401 and resp["error"]["code"] == "invalid_api_key"
    status, _ = _http("GET", base + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert status == 401
    assert _http("GET", base + "/health")[0] == 200              # health stays open
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
    c = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    r = c.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1 and r.usage.model_extra["speculative"]["method"] == "none"


def test_concurrent_streaming_clients(server, reference):
    import openai

    prompts = [f"Story number {i}:" for i in range(8)]
    expected = [reference(p, 16)[0] for p in prompts]
    results: list = [None] * len(prompts)
    errors: list = []

    def worker(i: int) -> None:
        try:
            c = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
            s = c.completions.create(model=MODEL_NAME, prompt=prompts[i], max_tokens=16, temperature=0, stream=True)
            results[i] = "".join(ch.choices[0].text for ch in s if ch.choices)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert errors == []
    assert results == expected


def test_client_disconnect_mid_stream_frees_rows(server):
    import http.client

    _, m0 = _http("GET", server["url"] + "/metrics")
    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "abc", "max_tokens": 200, "ignore_eos": True,
                                                        "stream": True, "temperature": 0}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    conn.close()                                                # walk away mid-stream
    aborted0 = _metric(m0, "dart_ray:request_aborted_total")
    deadline = time.time() + 30
    while time.time() < deadline:
        _, m = _http("GET", server["url"] + "/metrics")
        if _metric(m, "dart_ray:num_running") == 0 and _metric(m, "dart_ray:request_aborted_total") > aborted0:
            break
        time.sleep(0.2)
    assert _metric(m, "dart_ray:request_aborted_total") == aborted0 + 1
    assert _metric(m, "dart_ray:num_running") == 0
    gen = _metric(m, "dart_ray:generation_tokens_total") - _metric(m0, "dart_ray:generation_tokens_total")
    assert gen < 200                                            # stopped early: the row was freed


def test_replica_killed_is_replaced(server, client):
    """SIGKILL the replica process: Serve starts a new one and requests succeed again."""
    from ray import serve

    handle = serve.get_app_handle("main")
    pid = handle.pid.remote().result(timeout_s=30)
    assert pid != os.getpid()
    os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 120
    last_err = None
    while time.time() < deadline:
        try:
            status, body = _http("POST", server["url"] + "/v1/completions",
                                 {"prompt": "back?", "max_tokens": 3, "temperature": 0}, timeout=10)
            if status == 200:
                break
            last_err = (status, body)
        except Exception as e:  # noqa: BLE001 - connection reset while the replica is down
            last_err = e
        time.sleep(0.5)
    else:
        pytest.fail(f"replica not replaced within 120 s: {last_err!r}")
    assert body["usage"]["completion_tokens"] >= 1
    new_pid = serve.get_app_handle("main").pid.remote().result(timeout_s=30)
    assert new_pid != pid
