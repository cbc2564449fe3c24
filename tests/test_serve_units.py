"""Pure parts of the Serve deployment: args, placement, request parsing, metrics, CLI (no Ray cluster)."""

from __future__ import annotations

import json

import pytest

from deployments.config import ServeArgs
from deployments.metrics import ServerMetrics
from deployments.placement import placement_options, replica_actor_options
from deployments.protocol import APIError, parse_chat, parse_completion, parse_json, sse, usage


# ---- args ------------------------------------------------------------------------------------------
def test_serve_args_defaults_and_validation():
    a = ServeArgs.from_dict({"method": "ngram", "decoding": {"tree_budget": 40}, "num_cpus": 0.5})
    assert a.engine_config().decoding.tree_budget == 40 and a.engine_config().method == "ngram"
    assert ServeArgs.from_dict(None) == ServeArgs()
    with pytest.raises(ValueError, match=r"unknown keys \['modle'\]"):
        ServeArgs.from_dict({"modle": "x"})
    with pytest.raises(ValueError, match="method"):
        ServeArgs.from_dict({"method": "eagle9"})
    with pytest.raises(ValueError, match="max_batch_size must be an integer"):
        ServeArgs.from_dict({"max_batch_size": "8"})
    with pytest.raises(ValueError, match="DecodingConfig"):
        ServeArgs.from_dict({"decoding": {"depth": 3}})
    with pytest.raises(ValueError, match="tree_budget"):
        ServeArgs.from_dict({"decoding": {"tree_budget": 0}})
    with pytest.raises(ValueError, match="num_cpus"):
        ServeArgs.from_dict({"num_cpus": -1})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ServeArgs.from_dict({"tensor_parallel_size": 0})
    assert ServeArgs(api_key="k").redacted()["api_key"] == "***"


def test_build_app_options_and_tp_hook():
    from deployments.openai_app import build_app, deployment_options

    opts = deployment_options(ServeArgs(num_cpus=0.5, max_batch_size=4, max_queue=10))
    assert opts["ray_actor_options"] == {"num_cpus": 0.5}
    assert opts["max_ongoing_requests"] >= 14 and "placement_group_bundles" not in opts
    tp = deployment_options(ServeArgs(tensor_parallel_size=2, num_cpus=1))
    assert tp["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    build_app({"method": "ngram", "num_cpus": 0.1})              # builds without a cluster
    build_app({"tensor_parallel_size": 2, "method": "ngram", "num_cpus": 0.1})  # TP builds too
    with pytest.raises(ValueError, match="unknown keys"):
        build_app({"foo": 1})


# ---- placement ------------------------------------------------------------------------------------
def test_placement_options():
    assert placement_options(1, "cpu", 2) == {"placement_group_bundles": [{"CPU": 2.0}],
                                              "placement_group_strategy": "PACK"}
    o = placement_options(4, "cuda", 1.5)
    assert o["placement_group_strategy"] == "PACK"
    assert o["placement_group_bundles"] == [{"CPU": 1.5, "GPU": 1.0}] * 4
    # the replica actor (rank 0) fits the first bundle
    ra = replica_actor_options("cuda:0", 1.5)
    assert ra["num_cpus"] <= o["placement_group_bundles"][0]["CPU"]
    assert ra["num_gpus"] <= o["placement_group_bundles"][0]["GPU"]
    assert placement_options(2, "cpu", 0.5, strategy="STRICT_PACK")["placement_group_strategy"] == "STRICT_PACK"
    for bad in [(0, "cpu", 1), (2.0, "cpu", 1), (2, "", 1), (2, "cpu", -1), (True, "cpu", 1)]:
        with pytest.raises(ValueError):
            placement_options(*bad)


# ---- request parsing -------------------------------------------------------------------------------
def _err(fn, body) -> APIError:
    with pytest.raises(APIError) as ei:
        fn(body)
    return ei.value


def test_parse_completion():
    r = parse_completion({"prompt": "hi", "max_tokens": 5, "temperature": 0, "stop": "x", "seed": 3,
                          "stream": True, "stream_options": {"include_usage": True}, "top_k": -1})
    assert (r.prompt, r.max_tokens, r.temperature, r.stop, r.seed, r.top_k) == ("hi", 5, 0.0, ("x",), 3, 0)
    assert r.stream and r.include_usage and not r.chat and r.speculative is None
    assert parse_completion({"prompt": ["hi"]}).prompt == "hi"
    assert parse_completion({"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_completion({"prompt": [[1, 2]]}).prompt == [1, 2]
    assert parse_completion({"prompt": "x"}).max_tokens == 16                 # OpenAI's default
    assert parse_completion({"prompt": "x", "speculative": False}).speculative == "none"
    assert parse_completion({"prompt": "x", "speculative": {"method": "ngram"}}).speculative == "ngram"
    assert parse_completion({"prompt": "x", "stream_options": {"include_usage": True}}).include_usage is False
    assert _err(parse_completion, {}).code == "missing_required_parameter"
    assert _err(parse_completion, {"prompt": ["a", "b"]}).code == "unsupported_value"
    assert _err(parse_completion, {"prompt": 5}).code == "invalid_type"
    assert _err(parse_completion, {"prompt": "x", "max_tokens": 0}).param == "max_tokens"
    assert _err(parse_completion, {"prompt": "x", "max_tokens": True}).code == "invalid_type"
    assert _err(parse_completion, {"prompt": "x", "top_p": 0}).param == "top_p"
    assert _err(parse_completion, {"prompt": "x", "stop": [""]}).param == "stop"
    assert _err(parse_completion, {"prompt": "x", "n": 3}).status == 400
    assert _err(parse_completion, {"prompt": "x", "logprobs": 2}).code == "unsupported_value"
    assert _err(parse_completion, {"prompt": "x", "presence_penalty": 0.5}).code == "unsupported_value"
    assert parse_completion({"prompt": "x", "presence_penalty": 0, "user": "u"}).user == "u"
    assert _err(parse_completion, {"prompt": "x", "speculative": {"method": "x"}}).param == "speculative"


def test_parse_chat_and_json():
    r = parse_chat({"messages": [{"role": "developer", "content": "be brief"},
                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}],
                    "max_completion_tokens": 7})
    assert r.chat and r.prompt == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert r.max_tokens == 7
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}).max_tokens is None
    assert _err(parse_chat, {"messages": []}).param == "messages"
    assert _err(parse_chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).code \
        == "unsupported_value"
    assert _err(parse_json, b"[1, 2]").code == "invalid_json"
    assert _err(parse_json, b"").code == "invalid_json"
    assert _err(parse_json, b"\xff\xfe").code == "invalid_json"
    assert parse_json(b'{"a": 1}') == {"a": 1}


def test_sse_and_usage():
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    u = usage(3, 4, {"steps": 2, "draft_tokens": 10, "accepted_tokens": 2, "accepted_per_depth": [2],
                     "mean_accepted_len": 2.0}, "dart")
    assert u["total_tokens"] == 7 and u["speculative"]["mean_accepted_len"] == 2.0
    json.dumps(u)


# ---- metrics ---------------------------------------------------------------------------------------
def test_metrics_render():
    m = ServerMetrics("tiny")
    m.finished("stop", 0.3, 5, 7)
    m.ttft.observe(0.02)
    m.error(400)
    stats = {"main": ("dart", {"row_steps": 10, "spec_row_steps": 10, "draft_tokens": 100, "draft_depth_tokens": 30,
                               "accepted_tokens": 6, "accepted_per_depth": [4, 2], "generated_tokens": 16,
                               "prompt_tokens": 5}),
             "none": ("none", {"row_steps": 3, "draft_tokens": 0, "accepted_tokens": 0,
                               "accepted_per_depth": [], "generated_tokens": 3, "prompt_tokens": 2})}
    text = m.render(stats, queue_depth=2, num_running=1, num_positions=4)
    lines = set(text.splitlines())
    assert 'vllm:spec_decode_num_drafts_total{model_name="tiny"} 10.0' in lines        # AR lane excluded
    # issue 16: vLLM's draft tokens of a tree = its depth per draft; all nodes have their own name
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="tiny"} 30.0' in lines
    assert 'dart_ray:spec_decode_tree_nodes_total{model_name="tiny"} 100.0' in lines
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"} 6.0' in lines
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="1"} 2.0' in lines
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="3"} 0.0' in lines
    assert 'dart_ray:generation_tokens_total{model_name="tiny"} 19.0' in lines
    assert 'dart_ray:queue_depth{model_name="tiny"} 2.0' in lines
    assert 'dart_ray:num_running{model_name="tiny"} 1.0' in lines
    assert 'dart_ray:request_latency_seconds_bucket{model_name="tiny",le="0.5"} 1.0' in lines
    assert 'dart_ray:request_latency_seconds_bucket{model_name="tiny",le="0.25"} 0.0' in lines
    assert 'dart_ray:request_latency_seconds_count{model_name="tiny"} 1.0' in lines
    assert 'dart_ray:time_to_first_token_seconds_bucket{model_name="tiny",le="+Inf"} 1.0' in lines
    assert 'dart_ray:request_errors_total{model_name="tiny",status="400"} 1.0' in lines
    assert "# TYPE dart_ray:request_latency_seconds histogram" in lines
    for line in text.splitlines():                                   # well-formed exposition
        assert line.startswith("# ") or len(line.rsplit(" ", 1)) == 2


# ---- CLI and config file -----------------------------------------------------------------------------
def test_cli_and_default_config():
    from deployments.cli import build_parser, overrides_from
    from deployments.run import load_serve_config

    a = build_parser().parse_args(["--port", "9000", "--model", "/m", "--method", "ngram", "--dtype", "fp32",
                                   "--replica-cpus", "0.5"])
    assert a.port == 9000 and a.host is None
    assert overrides_from(a) == {"model": "/m", "method": "ngram", "dtype": "fp32", "num_cpus": 0.5}
    cfg = load_serve_config(None)
    app = cfg["applications"][0]
    assert app["import_path"] == "deployments.openai_app:build_app"
    ServeArgs.from_dict(app["args"])                                   # the shipped args validate
    assert cfg["http_options"]["host"] == "127.0.0.1"


def test_load_serve_config_errors(tmp_path):
    from deployments.run import load_serve_config

    p = tmp_path / "bad.yaml"
    p.write_text("applications: []\n")
    with pytest.raises(ValueError, match="applications"):
        load_serve_config(p)
    with pytest.raises(FileNotFoundError):
        load_serve_config(tmp_path / "missing.yaml")


def test_engine_errors_map_to_http_statuses():
    from dart_ray import PromptTooLongError
    from dart_ray.engine.async_engine import EngineDeadError, EngineStepError, QueueFullError
    from deployments.openai_app import _engine_error

    cases = [(QueueFullError("full"), 503, "queue_full"), (EngineDeadError("dead"), 503, "engine_unavailable"),
             (EngineStepError("boom"), 500, "engine_error"),
             (PromptTooLongError("long"), 400, "context_length_exceeded"),
             (ValueError("bad"), 400, "invalid_value"), (TypeError("bad"), 400, "invalid_value"),
             (RuntimeError("?"), 500, None)]
    for exc, status, code in cases:
        e = _engine_error(exc)
        assert (e.status, e.code) == (status, code), exc
        assert set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_tp_args_checked_at_build_time(tiny_dirs):
    from deployments.openai_app import build_app

    model = str(tiny_dirs["llama"])            # 2 KV heads: TP=2 splits, TP=3 cannot
    build_app({"model": model, "method": "ngram", "tensor_parallel_size": 2, "num_cpus": 0.1})
    with pytest.raises(ValueError):
        build_app({"model": model, "method": "ngram", "tensor_parallel_size": 3, "num_cpus": 0.1})


# ---- issue 16: hardening (pure parts) ------------------------------------------------------------------
def test_hardening_args_defaults_and_validation():
    a = ServeArgs()
    assert a.allow_speculative_override is False and a.max_lanes == 2
    assert a.max_body_bytes == 4 * 1024 * 1024 and a.max_prompt_chars is None and a.replica_niceness == 0
    for bad in ({"max_lanes": 0}, {"max_body_bytes": 10}, {"max_prompt_chars": 0}, {"tokenizer_workers": 0},
                {"replica_niceness": 40}, {"retry_after_s": -1}, {"max_prompt_chars": "1"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServeArgs.from_dict(bad)
    from deployments.openai_app import deployment_options

    on = deployment_options(ServeArgs(max_batch_size=4, max_queue=10, allow_speculative_override=True, max_lanes=3))
    assert on["max_ongoing_requests"] >= 4 * 3 + 10


def test_metrics_exposition_parses_with_vllm_names():
    from prometheus_client.parser import text_string_to_metric_families

    from dart_ray.engine.async_engine import RequestTiming
    from deployments.metrics import VLLM_METRICS, token_buckets

    m = ServerMetrics("tiny", replica="r1", node="n1", max_model_len=256)
    m.first_token(0.05)
    m.inter_token(0.02)
    m.observe_iteration(12)
    m.finished("length", 0.5, 5, 8, timing=RequestTiming(submitted=1.0, scheduled=1.1, first_token=1.2),
               first_token_s=1.25, end_s=1.5, max_tokens=8)
    stats = {"main": ("dart", {"row_steps": 4, "spec_row_steps": 3, "draft_tokens": 40, "draft_depth_tokens": 12,
                               "accepted_tokens": 5, "accepted_per_depth": [3, 2], "generated_tokens": 9,
                               "prompt_tokens": 5})}
    text = m.render(stats, queue_depth=0, num_running=0, num_positions=4, kv_cache_usage=0.25)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(VLLM_METRICS) <= set(fams)
    assert fams["vllm:prompt_tokens"].type == "counter" and fams["vllm:e2e_request_latency_seconds"].type == "histogram"
    for f in fams.values():
        for s in f.samples:
            assert (s.labels["model_name"], s.labels["replica"], s.labels["node"]) == ("tiny", "r1", "n1")
    v = {s.name: s.value for f in fams.values() for s in f.samples if set(s.labels) == {"model_name", "replica", "node"}}
    assert v["vllm:spec_decode_num_drafts_total"] == 3 and v["vllm:spec_decode_num_draft_tokens_total"] == 12
    assert v["vllm:spec_decode_num_accepted_tokens_total"] == 5 and v["dart_ray:spec_decode_tree_nodes_total"] == 40
    assert v["vllm:kv_cache_usage_perc"] == 0.25 and v["vllm:num_preemptions_total"] == 0
    assert abs(v["vllm:request_queue_time_seconds_sum"] - 0.1) < 1e-9
    assert abs(v["vllm:request_decode_time_seconds_sum"] - 0.25) < 1e-9
    assert abs(v["vllm:request_time_per_output_token_seconds_sum"] - 0.25 / 7) < 1e-9
    assert v["vllm:iteration_tokens_total_sum"] == 12
    assert token_buckets(256) == (1, 2, 5, 10, 20, 50, 100, 200)
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as parse_openmetrics,
    )

    om = m.render(stats, queue_depth=0, num_running=0, num_positions=4, kv_cache_usage=0.25, openmetrics=True)
    assert {f.name: f.type for f in parse_openmetrics(om)} == {f.name: f.type for f in fams.values()}
    assert "# TYPE vllm:prompt_tokens counter" in om.splitlines() and om.endswith("# EOF\n")
    assert "# TYPE vllm:prompt_tokens_total counter" in text.splitlines()        # the 0.0.4 convention


def test_queue_full_maps_to_503_with_retry_after():
    from dart_ray.engine.async_engine import QueueFullError
    from deployments.openai_app import _engine_error

    e = _engine_error(QueueFullError("full", retry_after_s=2.4))
    assert (e.status, e.code, e.headers) == (503, "queue_full", {"Retry-After": "2"})


def test_prompt_size_and_token_bound():
    from deployments.openai_app import max_token_chars
    from deployments.protocol import prompt_size

    assert prompt_size(parse_completion({"prompt": "abcd"})) == (4, None)
    assert prompt_size(parse_completion({"prompt": [1, 2, 3]})) == (0, 3)
    assert prompt_size(parse_chat({"messages": [{"role": "system", "content": "ab"},
                                                {"role": "user", "content": "cde"}]})) == (5, None)

    class Tok:
        def get_vocab(self):
            return {"a": 0, "Ġhello": 1, "<|im_start|>": 2}

    assert max_token_chars(Tok()) == 12


def test_reset_niceness_lowers_to_target():
    import os

    from deployments.openai_app import reset_niceness

    assert reset_niceness(None) is None
    now = os.getpriority(os.PRIO_PROCESS, 0)
    assert reset_niceness(now) == now                       # already there: nothing to do
    assert reset_niceness(19) == now                        # never raises niceness


def test_loopback_helpers_and_cli_flags():
    from deployments.cli import build_parser
    from deployments.run import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("example.com")
    a = build_parser().parse_args([])
    assert a.ray_node_ip == "127.0.0.1" and not a.insecure_no_ray_auth and a.address is None
    a = build_parser().parse_args(["--address", "10.0.0.1:6379", "--insecure-no-ray-auth"])
    assert a.address == "10.0.0.1:6379" and a.insecure_no_ray_auth


def test_grafana_dashboard_reads_exported_metrics():
    import re
    from pathlib import Path

    from prometheus_client.parser import text_string_to_metric_families

    dash = json.loads((Path(__file__).resolve().parents[1] / "deployments/grafana/dart_ray_dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    m = ServerMetrics("m", "r", "n")
    m.error(503)                                     # so the errors family has a sample
    text = m.render({"main": ("dart", {})}, 0, 0, 2)
    samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    used = {m for e in exprs for m in re.findall(r"(?:vllm|dart_ray):[a-z0-9_]+", e)}
    assert used and not used - samples, used - samples
    assert all('model_name="$model_name"' in e for e in exprs)
