"""Pure parts of the Serve deployment: args, placement, request parsing, metrics, CLI (no Ray
cluster)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dart_ray import DecodingConfig, DecodingSchedule, EngineConfig, SamplingParams
from deployments.config import ServeArgs
from deployments.metrics import IngressMetrics, ServerMetrics
from deployments.placement import placement_options, replica_actor_options
from deployments.protocol import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    APIError,
    parse_chat,
    parse_completion,
    parse_json,
    sse,
    usage,
)


# ---- args ----------------------------------------------------------------------------------------
def test_serve_args_defaults_and_validation():
    a = ServeArgs.from_dict({"method": "ngram", "decoding": {"tree_budget": 40}, "num_cpus": 0.5})
    assert a.engine.decoding.tree_budget == 40 and a.engine.method == "ngram"
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
    with pytest.raises(ValueError, match="allow_speculative_override needs tensor_parallel_size 1"):
        ServeArgs.from_dict({"tensor_parallel_size": 2, "allow_speculative_override": True})
    assert ServeArgs(api_key="k").redacted()["api_key"] == "***"


def test_serve_args_hold_one_engine_config_nested_or_flat():
    """Issue 18: the engine's settings are one EngineConfig under ``engine``; flat keys (older
    configs, ``dart-ray serve`` overrides) are routed into it and win over the nested ones."""
    nested = ServeArgs.from_dict({"engine": {"method": "ngram", "max_batch_size": 4,
                                             "decoding": {"tree_budget": 40}}, "num_cpus": 0.5})
    flat = ServeArgs.from_dict({"method": "ngram", "max_batch_size": 4,
                                "decoding": {"tree_budget": 40}, "num_cpus": 0.5})
    assert nested == flat and isinstance(nested.engine, EngineConfig)
    assert nested.engine == EngineConfig(method="ngram", max_batch_size=4,
                                         decoding=DecodingConfig(tree_budget=40))
    assert ServeArgs.from_dict(nested.to_dict()) == nested  # round trip, engine nested
    assert nested.to_dict()["engine"]["decoding"]["tree_budget"] == 40
    over = ServeArgs.from_dict({"engine": {"method": "dart", "dtype": "bf16"}, "method": "none"})
    assert (over.engine.method, over.engine.dtype) == ("none", "bf16")  # flat wins, the rest stays
    assert ServeArgs.from_dict({"adaptive": None}).engine.adaptive is True    # old "engine default"
    assert ServeArgs.from_dict({"adaptive": False}).engine.adaptive is False
    assert ServeArgs.from_dict({"engine": None}) == ServeArgs()
    assert ServeArgs(engine={"device": "cuda"}).engine.device == "cuda"     # a mapping is read too
    with pytest.raises(ValueError, match=r"unknown EngineConfig fields \['modle'\]"):
        ServeArgs.from_dict({"engine": {"modle": "x"}})
    with pytest.raises(ValueError, match="max_seq_len must be an integer"):
        ServeArgs.from_dict({"engine": {"max_seq_len": 1.5}})
    with pytest.raises(ValueError, match="engine must be a mapping"):
        ServeArgs.from_dict({"engine": "dart", "method": "none"})
    # placement reads the engine's device: a CUDA engine's replica asks for a GPU
    from deployments.openai_app import deployment_options

    gpu = deployment_options(ServeArgs(engine=EngineConfig(device="cuda"), tensor_parallel_size=2,
                                       num_cpus=1))
    assert gpu["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert gpu["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    cuda = deployment_options(ServeArgs.from_dict({"device": "cuda"}))
    assert cuda["ray_actor_options"]["num_gpus"] == 1.0


def test_build_app_options_and_tp_hook(monkeypatch):
    monkeypatch.setenv("DART_RAY_ALLOCATOR", "system")   # placement only (allocator: below)
    from deployments.openai_app import build_app, deployment_options

    opts = deployment_options(ServeArgs(num_cpus=0.5, engine=EngineConfig(max_batch_size=4),
                                        max_queue=10))
    assert opts["ray_actor_options"] == {"num_cpus": 0.5}
    assert opts["max_ongoing_requests"] >= 14 and "placement_group_bundles" not in opts
    tp = deployment_options(ServeArgs(tensor_parallel_size=2, num_cpus=1))
    assert tp["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    build_app({"method": "ngram", "num_cpus": 0.1})              # builds without a cluster
    build_app({"tensor_parallel_size": 2, "method": "ngram", "num_cpus": 0.1})  # TP builds too
    with pytest.raises(ValueError, match="unknown keys"):
        build_app({"foo": 1})


# ---- placement -----------------------------------------------------------------------------------
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
    assert placement_options(2, "cpu", 0.5, strategy="STRICT_PACK")["placement_group_strategy"] \
        == "STRICT_PACK"
    for bad in [(0, "cpu", 1), (2.0, "cpu", 1), (2, "", 1), (2, "cpu", -1), (True, "cpu", 1)]:
        with pytest.raises(ValueError):
            placement_options(*bad)


# ---- request parsing -----------------------------------------------------------------------------
def _err(fn, body) -> APIError:
    with pytest.raises(APIError) as ei:
        fn(body)
    return ei.value


def test_parse_completion():
    r = parse_completion({"prompt": "hi", "max_tokens": 5, "temperature": 0, "stop": "x", "seed": 3,
                          "stream": True, "stream_options": {"include_usage": True}, "top_k": -1})
    assert (r.prompt, r.max_tokens, r.temperature, r.stop, r.seed, r.top_k) == \
        ("hi", 5, 0.0, ("x",), 3, 0)
    assert r.stream and r.include_usage and not r.chat and r.speculative is None
    assert parse_completion({"prompt": ["hi"]}).prompt == "hi"
    assert parse_completion({"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_completion({"prompt": [[1, 2]]}).prompt == [1, 2]
    assert parse_completion({"prompt": "x"}).max_tokens == 16                 # OpenAI's default
    assert parse_completion({"prompt": "x", "speculative": False}).speculative == "none"
    assert parse_completion({"prompt": "x", "speculative": {"method": "ngram"}}).speculative \
        == "ngram"
    # OpenAI's 400s for what a client may think works
    assert _err(parse_completion, {"prompt": "x", "stream_options": {"include_usage": True}}) \
        .param == "stream_options"
    assert _err(parse_completion, {"prompt": "x", "logprobs": 0}).code == "unsupported_value"
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": False}).chat
    assert _err(parse_chat, {"messages": [{"role": "user", "content": "x"}], "logprobs": 0}) \
        .param == "logprobs"
    for key, value in (("min_tokens", 4), ("min_p", 0.1), ("include_stop_str_in_output", True),
                       ("prompt_logprobs", 1), ("guided_json", {}), ("tool_choice", "auto"),
                       ("tool_choice", {"type": "function"}), ("function_call", "auto")):
        assert _err(parse_completion, {"prompt": "x", key: value}).param == key, key
    assert parse_completion({"prompt": "x", "min_tokens": 0, "min_p": 0,
                             "include_stop_str_in_output": False}).prompt == "x"
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "tool_choice": "none"}).chat
    assert _err(parse_completion, {}).code == "missing_required_parameter"
    assert _err(parse_completion, {"prompt": ["a", "b"]}).code == "unsupported_value"
    assert _err(parse_completion, {"prompt": 5}).code == "invalid_type"
    assert _err(parse_completion, {"prompt": "x", "max_tokens": 0}).param == "max_tokens"
    assert _err(parse_completion, {"prompt": "x", "max_tokens": True}).code == "invalid_type"
    assert _err(parse_completion, {"prompt": "x", "top_p": 0}).param == "top_p"
    assert _err(parse_completion, {"prompt": "x", "stop": [""]}).param == "stop"
    many = [f"s{i}" for i in range(MAX_STOP_STRINGS)]    # searched every step: bounded
    assert parse_completion({"prompt": "x", "stop": many}).stop == tuple(many)
    assert "at most 16" in _err(parse_completion, {"prompt": "x", "stop": [*many, "t"]}).message
    assert parse_completion({"prompt": "x", "stop": "y" * MAX_STOP_CHARS}).stop
    assert _err(parse_completion, {"prompt": "x", "stop": ["y" * (MAX_STOP_CHARS + 1)]}).param \
        == "stop"
    assert _err(parse_completion, {"prompt": "x", "n": 3}).status == 400
    assert _err(parse_completion, {"prompt": "x", "logprobs": 2}).code == "unsupported_value"
    assert _err(parse_completion, {"prompt": "x", "presence_penalty": 0.5}).code \
        == "unsupported_value"
    assert parse_completion({"prompt": "x", "presence_penalty": 0, "user": "u"}).user == "u"
    assert _err(parse_completion, {"prompt": "x", "speculative": {"method": "x"}}).param \
        == "speculative"


def test_parse_chat_and_json():
    r = parse_chat({"messages": [{"role": "developer", "content": "be brief"},
                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}],
                    "max_completion_tokens": 7})
    assert r.chat and r.prompt == [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "a\nb"}]   # as vLLM joins
    assert r.max_tokens == 7
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}).max_tokens is None
    assert _err(parse_chat, {"messages": []}).param == "messages"
    for m in ({"role": "tool", "content": "42", "tool_call_id": "c1"},
              {"role": "assistant", "content": None,
               "tool_calls": [{"id": "c1", "type": "function",
                               "function": {"name": "f", "arguments": "{}"}}]}):
        e = _err(parse_chat, {"messages": [{"role": "user", "content": "x"}, m]})
        assert (e.param, e.code) == ("messages[1]", "unsupported_value")
    assert _err(parse_chat, {"messages": [{"role": "user",
                                           "content": [{"type": "image_url"}]}]}).code \
        == "unsupported_value"
    assert _err(parse_json, b"[1, 2]").code == "invalid_json"
    deep = b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    assert _err(parse_json, deep).code == "invalid_json"           # not a RecursionError 500
    assert _err(parse_json, b"").code == "invalid_json"
    assert _err(parse_json, b"\xff\xfe").code == "invalid_json"
    assert parse_json(b'{"a": 1}') == {"a": 1}


def test_fields_the_server_does_not_honour_are_refused_not_ignored():
    user = {"messages": [{"role": "user", "content": "x"}]}
    # vLLM extras that change the output, and OpenAI features it lacks: refused unless default
    for key, value in (("allowed_token_ids", [1, 2]), ("bad_words", ["x"]),
                       ("use_beam_search", True), ("logits_processors", ["p"]),
                       ("structured_outputs", {"json": {}}), ("return_tokens_as_token_ids", True),
                       ("skip_special_tokens", False), ("truncate_prompt_tokens", 8),
                       ("priority", 1), ("prediction", {"type": "content", "content": "x"}),
                       ("min_p", 1), ("reasoning_effort", "low")):
        for parse, body in ((parse_completion, {"prompt": "x"}), (parse_chat, user)):
            e = _err(parse, {**body, key: value})
            assert (e.param, e.code) == (key, "unsupported_value"), (parse, key)
    for key, value in (("add_generation_prompt", False), ("continue_final_message", True),
                       ("chat_template", "{{ x }}"), ("chat_template_kwargs", {"a": 1})):
        assert _err(parse_chat, {**user, key: value}).code == "unsupported_value", key
        assert _err(parse_completion, {"prompt": "x", key: value}).code == "unknown_parameter"
    assert parse_chat({**user, "add_generation_prompt": True, "continue_final_message": False,
                       "chat_template_kwargs": {}, "skip_special_tokens": True,
                       "modalities": ["text"], "metadata": {"k": "v"}, "store": False,
                       "parallel_tool_calls": True, "request_id": "r1"}).chat
    # a field nobody defines: refused as OpenAI refuses it
    e = _err(parse_completion, {"prompt": "x", "temprature": 0.5})
    assert (e.param, e.code) == ("temprature", "unknown_parameter")
    assert "Unrecognized request argument" in e.message
    assert _err(parse_completion, {"prompt": "x", "tools": []}).code == "unknown_parameter"
    e = _err(parse_chat, {**user, "stream": True,
                          "stream_options": {"continuous_usage_stats": True}})
    assert e.param == "stream_options"
    assert _err(parse_chat, {**user, "stream": True, "stream_options": {"x": 1}}).code \
        == "unknown_parameter"
    # completions honour max_completion_tokens as chat does
    assert parse_completion({"prompt": "x", "max_completion_tokens": 3, "max_tokens": 9}) \
        .max_tokens == 3
    # types and ranges as OpenAI / vLLM take them
    assert _err(parse_completion, {"prompt": "x", "user": 123}).code == "invalid_type"
    assert parse_completion({"prompt": "x", "seed": -1}).seed == -1
    e = _err(parse_completion, {"prompt": "x", "temperature": 1, "top_k": 2 ** 63})
    assert e.param == "top_k"
    assert _err(parse_completion, {"prompt": "x", "top_k": 1e300}).param == "top_k"
    for role in ("user", "system"):
        e = _err(parse_chat, {"messages": [{"role": role, "content": None}]})
        assert e.code == "missing_required_parameter", role
    assert parse_chat({"messages": [{"role": "user", "content": "x"},
                                    {"role": "assistant", "content": None},
                                    {"role": "user", "content": "y"}]}).prompt[1]["content"] == ""
    # what clients send: numbers by value, openai's stream_options and prompt-cache fields,
    # an assistant message echoed back with its empty fields; a message's name reaches the template
    assert parse_chat({**user, "min_tokens": 0.0, "priority": 0.0, "prompt_cache_retention": "24h",
                       "stream": True, "stream_options": {"include_usage": True,
                                                          "include_obfuscation": False}}).stream
    assert _err(parse_chat, {**user, "use_beam_search": 0}).param == "use_beam_search"  # not False
    r = parse_chat({"messages": [{"role": "user", "content": "x", "name": "bob"},
                                 {"role": "assistant", "content": "y", "refusal": None,
                                  "annotations": [], "audio": None, "tool_calls": None}]})
    assert r.prompt == [{"role": "user", "content": "x", "name": "bob"},
                        {"role": "assistant", "content": "y"}]
    e = _err(parse_chat, {"messages": [{"role": "user", "content": "x", "foo": 1}]})
    assert (e.param, e.code) == ("messages[0]", "unknown_parameter") and "foo" in e.message
    assert _err(parse_chat, {"messages": [{"role": "user", "content": "x", "name": 3}]}).code \
        == "invalid_type"
    # BOS: vLLM's defaults (completions add the tokenizer's special tokens, chat does not)
    assert parse_completion({"prompt": "x"}).add_special_tokens
    assert not parse_chat(user).add_special_tokens
    assert not parse_completion({"prompt": "x", "add_special_tokens": False}).add_special_tokens
    assert parse_chat({**user, "add_special_tokens": True}).add_special_tokens


def test_sse_and_usage():
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    u = usage(3, 4, {"steps": 2, "draft_tokens": 10, "accepted_tokens": 2,
                     "accepted_per_depth": [2], "mean_accepted_len": 2.0}, "dart")
    assert u["total_tokens"] == 7 and u["speculative"]["mean_accepted_len"] == 2.0
    json.dumps(u)


def test_sse_chunks_are_the_chunk_objects_encoded():
    """SSEChunks encodes a chunk's constant parts once; every event equals sse(chunk(...))."""
    from deployments.protocol import SSEChunks, chunk, usage_chunk

    use = usage(3, 4, None, "dart")
    with_usage = {"stream": True, "stream_options": {"include_usage": True}}
    reqs = (parse_completion({"prompt": "x", "stream": True}),
            parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True}),
            parse_completion({"prompt": "x", **with_usage}),
            parse_chat({"messages": [{"role": "user", "content": "x"}], **with_usage}))
    assert ["usage" in chunk(r, "c", 1, "m", "t") for r in reqs] == [False, False, True, True]
    assert chunk(reqs[3], "c", 1, "m", "t")["usage"] is None      # null until the usage chunk
    for req in reqs:
        for model in ("tiny", 'a "quoted"\x00text\x00 name', "\x00text\x00"):
            c = SSEChunks(req, "cmpl-1", 123, model)
            for text in ("", "héllo \"wörld\"\n", "\x00text\x00", "</s>\u2028"):
                assert c.text(text) == sse(chunk(req, "cmpl-1", 123, model, text)), (model, text)
            assert c.role() == sse(chunk(req, "cmpl-1", 123, model, "", role=True))
            assert c.finish("stop") == sse(chunk(req, "cmpl-1", 123, model,
                                                 None if req.chat else "", finish_reason="stop"))
            assert c.usage(use) == sse(usage_chunk(req, "cmpl-1", 123, model, use))


def test_prompt_fields_of_a_request():
    ids = parse_completion({"prompt": [1, 2, 3]})
    assert ids.token_ids == [1, 2, 3] and ids.prompt_param == "prompt"
    assert parse_completion({"prompt": "abc"}).token_ids is None
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}]})
    assert chat.token_ids is None and chat.prompt_param == "messages"


# ---- metrics -------------------------------------------------------------------------------------
def test_metrics_render():
    m = ServerMetrics("tiny")
    m.finished("stop", 0.3, 5, 7)
    m.ttft.observe(0.02)
    for n in (16, 3):                    # tokens streamed to clients (not the engines' counts)
        m.generated(n)
    ingress = IngressMetrics()                       # errors are counted where HTTP is answered
    ingress.error(400)
    stats = {"main": ("dart", {"row_steps": 10, "spec_row_steps": 10, "draft_tokens": 100,
                               "draft_depth_tokens": 30, "accepted_tokens": 6,
                               "accepted_per_depth": [4, 2], "generated_tokens": 99,
                               "prompt_tokens": 5}),
             "none": ("none", {"row_steps": 3, "draft_tokens": 0, "accepted_tokens": 0,
                               "accepted_per_depth": [], "generated_tokens": 3,
                               "prompt_tokens": 2})}
    text = m.render(stats, queue_depth=2, num_running=1, num_positions=4,
                    ingress=ingress.snapshot())
    lines = set(text.splitlines())
    assert 'vllm:spec_decode_num_drafts_total{model_name="tiny"} 10.0' in lines  # AR lane excluded
    # issue 16: vLLM's draft tokens of a tree = its depth per draft; all nodes have their own name
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="tiny"} 30.0' in lines
    assert 'dart_ray:spec_decode_tree_nodes_total{model_name="tiny"} 100.0' in lines
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"} 6.0' in lines
    assert ('vllm:spec_decode_num_accepted_tokens_per_pos_total'
            '{model_name="tiny",position="1"} 2.0' in lines)
    assert ('vllm:spec_decode_num_accepted_tokens_per_pos_total'
            '{model_name="tiny",position="3"} 0.0' in lines)
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


# ---- CLI and config file -------------------------------------------------------------------------
def test_cli_and_default_config():
    from deployments.cli import build_parser, overrides_from
    from deployments.run import load_serve_config

    a = build_parser().parse_args(["--port", "9000", "--model", "/m", "--method", "ngram",
                                   "--dtype", "fp32", "--replica-cpus", "0.5"])
    assert a.port == 9000 and a.host is None
    assert overrides_from(a) == {"model": "/m", "method": "ngram", "dtype": "fp32", "num_cpus": 0.5}
    # the engine flags are the shared ones (dart_ray.config.add_engine_args); old spellings
    # still parse
    a = build_parser().parse_args(["--num-threads", "2", "--max-batch-size", "4", "--no-adaptive",
                                   "--method", "ar", "--decoding", '{"tree_budget": 12}',
                                   "--profile", "code"])
    o = overrides_from(a)
    assert o == {"num_threads": 2, "max_batch_size": 4, "adaptive": False, "method": "none",
                 "decoding": {"tree_budget": 12}, "profile": "code"}
    assert overrides_from(build_parser().parse_args(["--threads", "3"])) == {"num_threads": 3}
    with pytest.raises(ValueError, match="--method"):
        overrides_from(build_parser().parse_args(["--method", "auto"]))
    cfg = load_serve_config(None)
    app = cfg["applications"][0]
    assert app["import_path"] == "deployments.openai_app:build_app"
    shipped = ServeArgs.from_dict(app["args"])  # the shipped args validate
    assert shipped.engine == EngineConfig()     # ... and are the engine defaults
    # CLI overrides (flat) go over the shipped file's engine block
    without_profile = {k: v for k, v in o.items() if k != "profile"}
    assert ServeArgs.from_dict({**app["args"], **without_profile}).engine.max_batch_size == 4
    with pytest.raises(ValueError, match="give one of them"):     # the profile would drop them
        ServeArgs.from_dict({**app["args"], **o})
    assert cfg["http_options"]["host"] == "127.0.0.1"


def test_load_serve_config_errors(tmp_path):
    from deployments.run import load_serve_config

    p = tmp_path / "bad.yaml"
    p.write_text("applications: []\n")
    with pytest.raises(ValueError, match="applications"):
        load_serve_config(p)
    with pytest.raises(FileNotFoundError):
        load_serve_config(tmp_path / "missing.yaml")
    # Serve options `dart-ray serve` would not apply are an error naming `serve deploy`, never
    # silently dropped
    app = "applications:\n- {import_path: deployments.openai_app:build_app, args: {}%s}\n"
    p.write_text(app % ", deployments: [{name: DartRayServer, num_replicas: 2}]")
    with pytest.raises(ValueError, match=r"not \['deployments'\].*serve deploy"):
        load_serve_config(p)
    p.write_text("runtime_env: {pip: [x]}\n" + app % "")
    with pytest.raises(ValueError, match=r"not \['runtime_env'\].*serve deploy"):
        load_serve_config(p)
    p.write_text("proxy_location: EveryNode\nhttp_options: {request_timeout_s: 30}\n" + app % "")
    assert load_serve_config(p)["proxy_location"] == "EveryNode"


def test_engine_errors_map_to_http_statuses():
    from dart_ray import PromptTooLongError
    from dart_ray.engine.async_engine import EngineDeadError, EngineStepError, QueueFullError
    from deployments.errors import engine_error

    cases = [(QueueFullError("full"), 503, "queue_full"),
             # a stopped engine thread is a lost replica: retryable elsewhere (it was a plain
             # engine_unavailable, so a request queued at Serve's graceful stop was not retried)
             (EngineDeadError("engine is shut down"), 503, "replica_lost"),
             (EngineStepError("boom"), 500, "engine_error"),
             (PromptTooLongError("long"), 400, "context_length_exceeded"),
             (ValueError("bad"), 400, "invalid_value"), (TypeError("bad"), 400, "invalid_value"),
             (RuntimeError("?"), 500, None)]
    for exc, status, code in cases:
        e = engine_error(exc)
        assert (e.status, e.code) == (status, code), exc
        assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    from dart_ray import InvalidPromptError

    e = engine_error(InvalidPromptError("prompt token ids must be in [0, 10)"))
    assert (e.status, e.code, e.param) == (400, "invalid_value", "prompt")


def test_lost_replica_errors_map_to_retryable_503():
    """Issue 19: whatever Ray or Serve raises when the engine replica (process or node) is gone is a
    503 ``replica_lost`` with ``Retry-After``; Serve's own refusals are 503s too."""
    import ray.exceptions as rex
    from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError

    from deployments.errors import REPLICA_LOST, ReplicaLostError, engine_error, is_replica_lost

    lost = [rex.ActorDiedError(), rex.ActorUnavailableError("gone", b"1" * 16), rex.RayActorError(),
            rex.WorkerCrashedError(), ReplicaUnavailableError("r1"),
            ReplicaLostError("stream ended early")]
    for exc in lost:
        assert is_replica_lost(exc), exc
        e = engine_error(exc, retry_after_s=3)
        assert (e.status, e.code, e.type, e.headers) == (503, REPLICA_LOST, "server_error",
                                                         {"Retry-After": "3"})
        assert "retry" in e.message
    assert not is_replica_lost(RuntimeError("x")) and not is_replica_lost(ValueError("x"))
    bp = engine_error(BackPressureError(num_queued_requests=9, max_queued_requests=8))
    assert (bp.status, bp.code, bp.headers) == (503, "queue_full", {"Retry-After": "1"})


def test_api_error_pickles_whole():
    """The engine deployment sends refusals to the ingress as items: they must survive pickling."""
    import pickle

    e = APIError(503, "full", "server_error", None, "queue_full", {"Retry-After": "2"})
    back = pickle.loads(pickle.dumps(e))
    assert (back.status, back.message, back.type, back.param, back.code, back.headers) == \
        (503, "full", "server_error", None, "queue_full", {"Retry-After": "2"})


def test_tp_args_checked_at_build_time(tiny_dirs):
    from deployments.openai_app import build_app

    model = str(tiny_dirs["llama"])            # 2 KV heads: TP=2 splits, TP=3 cannot
    build_app({"model": model, "method": "ngram", "tensor_parallel_size": 2, "num_cpus": 0.1})
    with pytest.raises(ValueError):
        build_app({"model": model, "method": "ngram", "tensor_parallel_size": 3, "num_cpus": 0.1})


def test_serve_refuses_what_cannot_start_before_serve_waits_for_it(smollm_dir):
    """Caught at the command (before Ray, or before Serve deploys on the Ray it started), not as
    replicas that never start: args errors, a model the TP transform cannot split (the embedded
    default too, whose conversion is cached: 3 KV heads over 4 ranks), and replicas needing more
    CPUs than the local Ray has (Serve would wait forever)."""
    from deployments.run import OUR_APP, app_resources, check_app_args, check_local_resources

    with pytest.raises(ValueError, match="unknown keys"):
        check_app_args(OUR_APP, {"tensor_paralel_size": 2})
    with pytest.raises(ValueError, match="KV heads"):
        check_app_args(OUR_APP, {"method": "ngram", "tensor_parallel_size": 4})
    check_app_args("other.module:app", {"anything": 1})                 # not ours: not checked
    tp2 = {"method": "ngram", "tensor_parallel_size": 2, "num_cpus": 2}
    assert app_resources(OUR_APP, tp2) == {"CPU": 4.0}                 # 2 ranks x 2 CPUs
    assert app_resources(OUR_APP, {"num_replicas": 3, "num_cpus": 0.5,
                                   "ingress_num_cpus": 0.25}) == {"CPU": 1.75}
    apps = [("a", "/", OUR_APP, tp2)]
    with pytest.raises(ValueError, match=r"need 4 CPU \(it has 2\)"):
        check_local_resources(apps, {"CPU": 2.0})
    check_local_resources(apps, {"CPU": 4.0})
    with pytest.raises(ValueError, match="GPU"):
        check_local_resources([("a", "/", OUR_APP, {**tp2, "device": "cuda"})], {"CPU": 8.0})


# ---- issue 16: hardening (pure parts) ------------------------------------------------------------
def test_hardening_args_defaults_and_validation():
    a = ServeArgs()
    assert a.allow_speculative_override is False and a.max_lanes == 2
    assert a.max_body_bytes == 4 * 1024 * 1024 and a.max_prompt_chars is None \
        and a.replica_niceness == 0
    for bad in ({"max_lanes": 0}, {"max_body_bytes": 10}, {"max_prompt_chars": 0},
                {"tokenizer_workers": 0}, {"replica_niceness": 40}, {"retry_after_s": -1},
                {"max_prompt_chars": "1"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServeArgs.from_dict(bad)
    from deployments.openai_app import deployment_options

    on = deployment_options(ServeArgs(engine=EngineConfig(max_batch_size=4), max_queue=10,
                                      allow_speculative_override=True, max_lanes=3))
    assert on["max_ongoing_requests"] >= 4 * 3 + 10


def test_metrics_exposition_parses_with_vllm_names():
    from prometheus_client.parser import text_string_to_metric_families

    from dart_ray.engine.async_engine import RequestTiming
    from deployments.metrics import VLLM_METRICS, token_buckets

    m = ServerMetrics("tiny", replica="r1", node="n1", max_model_len=256)
    m.first_token(0.05)
    m.inter_token(0.02)
    m.observe_iteration(12)
    m.finished("length", 0.5, 5, 8,
               timing=RequestTiming(submitted=1.0, scheduled=1.1, first_token=1.2),
               first_token_s=1.25, end_s=1.5, max_tokens=8)
    stats = {"main": ("dart", {"row_steps": 4, "spec_row_steps": 3, "draft_tokens": 40,
                               "draft_depth_tokens": 12, "accepted_tokens": 5,
                               "accepted_per_depth": [3, 2], "generated_tokens": 9,
                               "prompt_tokens": 5})}
    text = m.render(stats, queue_depth=0, num_running=0, num_positions=4, kv_cache_usage=0.25)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(VLLM_METRICS) <= set(fams)
    assert fams["vllm:prompt_tokens"].type == "counter" \
        and fams["vllm:e2e_request_latency_seconds"].type == "histogram"
    for f in fams.values():
        for s in f.samples:
            assert (s.labels["model_name"], s.labels["replica"], s.labels["node"]) \
                == ("tiny", "r1", "n1")
    v = {s.name: s.value for f in fams.values() for s in f.samples
         if set(s.labels) == {"model_name", "replica", "node"}}
    assert v["vllm:spec_decode_num_drafts_total"] == 3 \
        and v["vllm:spec_decode_num_draft_tokens_total"] == 12
    assert v["vllm:spec_decode_num_accepted_tokens_total"] == 5 \
        and v["dart_ray:spec_decode_tree_nodes_total"] == 40
    assert v["vllm:kv_cache_usage_perc"] == 0.25 and v["vllm:num_preemptions_total"] == 0
    assert abs(v["vllm:request_queue_time_seconds_sum"] - 0.1) < 1e-9
    assert abs(v["vllm:request_decode_time_seconds_sum"] - 0.25) < 1e-9
    assert abs(v["vllm:request_time_per_output_token_seconds_sum"] - 0.25 / 7) < 1e-9
    assert v["vllm:iteration_tokens_total_sum"] == 12
    assert token_buckets(256) == (1, 2, 5, 10, 20, 50, 100, 200)
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as parse_openmetrics,
    )

    om = m.render(stats, queue_depth=0, num_running=0, num_positions=4, kv_cache_usage=0.25,
                  openmetrics=True)
    assert {f.name: f.type for f in parse_openmetrics(om)} \
        == {f.name: f.type for f in fams.values()}
    assert "# TYPE vllm:prompt_tokens counter" in om.splitlines() and om.endswith("# EOF\n")
    assert "# TYPE vllm:prompt_tokens_total counter" in text.splitlines()  # the 0.0.4 convention


def test_queue_full_maps_to_503_with_retry_after():
    from dart_ray.engine.async_engine import QueueFullError
    from deployments.errors import engine_error

    e = engine_error(QueueFullError("full", retry_after_s=2.4))
    assert (e.status, e.code, e.headers) == (503, "queue_full", {"Retry-After": "2"})


def test_prompt_size_and_token_bound():
    from deployments.protocol import prompt_size
    from deployments.serving import max_token_chars

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

    from deployments.replica import reset_niceness

    assert reset_niceness(None) is None
    now = os.getpriority(os.PRIO_PROCESS, 0)
    assert reset_niceness(now) == now                       # already there: nothing to do
    assert reset_niceness(19) == now                        # never raises niceness


def test_loopback_helpers_and_cli_flags():
    from deployments.cli import build_parser
    from deployments.run import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") \
        and not is_loopback("example.com")
    a = build_parser().parse_args([])
    assert a.ray_node_ip == "127.0.0.1" and not a.insecure_no_ray_auth and a.address is None
    a = build_parser().parse_args(["--address", "10.0.0.1:6379", "--insecure-no-ray-auth"])
    assert a.address == "10.0.0.1:6379" and a.insecure_no_ray_auth


def test_grafana_dashboard_reads_exported_metrics():
    import re
    from pathlib import Path

    from prometheus_client.parser import text_string_to_metric_families

    repo = Path(__file__).resolve().parents[2]
    dash = json.loads((repo / "deployments/grafana/dart_ray_dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    m = ServerMetrics("m", "r", "n")
    ingress = IngressMetrics("i", "n")
    ingress.error(503)                               # so the errors family has a sample
    text = m.render({"main": ("dart", {})}, 0, 0, 2, ingress=ingress.snapshot())
    parsed = [s for f in text_string_to_metric_families(text) for s in f.samples]
    samples = {s.name for s in parsed}
    used = {m for e in exprs for m in re.findall(r"(?:vllm|dart_ray):[a-z0-9_]+", e)}
    assert used and not used - samples, used - samples
    assert all('model_name="$model_name"' in e for e in exprs)
    # $replica lists engine replicas: a panel filtering by it must read engine-replica series
    # (the ingress's error counter carries the ingress replica's labels: it showed nothing)
    replica_of = {s.name: s.labels.get("replica") for s in parsed}
    for e in exprs:
        if '$replica' in e:
            for name in re.findall(r"(?:vllm|dart_ray):[a-z0-9_]+", e):
                assert replica_of[name] == "r", (name, e)


# ---- issue 18: one decoding schedule per engine; lanes and /metrics read it ----------------------
def test_lanes_and_metrics_follow_the_loaded_profile(tiny_dirs):
    """With a profile loaded, a per-request lane decodes with the profile's schedule (it used to
    copy the default knobs) and /metrics lists the profile's draft depth (it used to list the
    default's)."""
    from dart_ray import Engine
    from dart_ray.drafters import make_drafter
    from dart_ray.models import load_target
    from deployments.engine_factory import lane_factory
    from deployments.serving import draft_positions

    target = load_target(str(tiny_dirs["llama"]), "fp32", max_seq_len=256)
    cfg = EngineConfig(method="dart", drafter="random", ngram="none", dtype="fp32",
                       max_batch_size=2, max_seq_len=128, adaptive=False)
    main = Engine(target, make_drafter(cfg, target), cfg)
    # no profile: the config's (DART merges prompt-lookup paths of lookup_len tokens: deeper)
    d = DecodingConfig()
    assert draft_positions({"main": main}) == max(d.draft_depth, d.lookup_len) == 10
    profile = DecodingSchedule("lanes",
                               ((1, DecodingConfig(draft_depth=3, tree_budget=5, lookup_len=6)),
                                (1024, DecodingConfig(draft_depth=2, tree_budget=4, top_k=3,
                                                      lookup_paths=0))))
    assert profile.max_positions(lookups=True) == 6 and profile.max_positions(lookups=False) == 3
    main.set_decoding(profile)
    lane = lane_factory("ngram")(main)
    assert lane.config.method == "ngram" and lane.target is main.target
    assert lane.schedule == profile
    for b in (1, 2):
        assert lane.decoding_for(b) == main.decoding_for(b) == profile.for_batch_size(b)
    assert draft_positions({"main": main}) == 6
    assert draft_positions({"ngram": lane}) == 3
    assert draft_positions({"main": main, "ngram": lane}) == 6
    ar = lane_factory("none")(main)
    assert draft_positions({"none": ar}) == 0  # plain AR lists none
    # the lane decodes with those knobs: at batch 1, trees of <= 5 nodes and <= 3 levels
    out = lane.generate(list(range(5, 15)) * 6,
                        SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    assert len(out.token_ids) == 24 and out.stats.accepted_tokens > 0
    assert out.stats.draft_tokens <= 5 * out.stats.steps and len(out.stats.accepted_per_depth) <= 3


def test_reconfigure_sets_the_schedule_of_every_lane(tmp_path):
    """Serve ``user_config`` swaps the schedule of the main engine and of the lanes it holds."""
    import concurrent.futures
    from types import SimpleNamespace

    from dart_ray import save_profile
    from deployments.serving import DartRayServer

    class FakeEngine:
        def __init__(self):
            self.schedule = None

        def set_decoding(self, d):
            self.schedule = d if isinstance(d, DecodingSchedule) else DecodingSchedule.constant(d)

    engines = {"main": FakeEngine(), "ngram": FakeEngine()}

    def call_future(fn, lane="main"):
        fut = concurrent.futures.Future()
        fut.set_result(fn(engines if lane is None else engines[lane]))
        return fut

    server = SimpleNamespace(args=ServeArgs.from_dict({"decoding": {"top_k": 5}}),
                             aengine=SimpleNamespace(call_future=call_future))
    reconfigure = getattr(DartRayServer, "func_or_class", DartRayServer).reconfigure
    reconfigure(server, {"decoding": {"tree_budget": 7}})
    want = DecodingSchedule.constant(DecodingConfig(top_k=5, tree_budget=7))  # over the args' knobs
    assert all(e.schedule == want for e in engines.values())
    prof = DecodingSchedule("p", ((1, DecodingConfig(draft_depth=2)),
                                  (1024, DecodingConfig(draft_depth=3))))
    reconfigure(server, {"profile": str(save_profile(prof, tmp_path / "p.yaml"))})
    assert all(e.schedule == prof for e in engines.values())
    reconfigure(server, {"decoding": {}})
    assert all(e.schedule == DecodingSchedule.constant(DecodingConfig()) for e in engines.values())
    with pytest.raises(ValueError, match="unknown user_config keys"):
        reconfigure(server, {"knobs": {}})


# ---- issue 19: the ingress, apart from the engine deployment -------------------------------------
def test_build_app_is_an_ingress_in_front_of_the_engine_deployment(monkeypatch):
    monkeypatch.setenv("DART_RAY_ALLOCATOR", "system")   # placement only (allocator: below)
    """build_app: the light ingress (no model; 0 CPUs on the head node by default; its own replica
    count) is bound to a handle of the engine deployment, which keeps the replica options."""
    from deployments.openai_app import build_app, deployment_options, ingress_options
    from deployments.placement import HEAD_NODE_RESOURCE, ingress_actor_options

    args = ServeArgs.from_dict({"method": "ngram", "num_cpus": 0.5, "num_replicas": 3,
                                "ingress_num_replicas": 2})
    ingress = build_app(args.to_dict())._bound_deployment
    assert ingress.name == "DartRayIngress" and ingress.num_replicas == 2
    assert ingress.ray_actor_options == {"num_cpus": 0.0, "resources": {HEAD_NODE_RESOURCE: 0.001}}
    engine = ingress.init_args[1]._bound_deployment                  # bound as a handle argument
    assert engine.name == "DartRayServer" and engine.num_replicas == 3
    assert engine.ray_actor_options == deployment_options(args)["ray_actor_options"] \
        == {"num_cpus": 0.5}
    # every request the engine replicas can hold fits the ingress at once
    # (one open stream = one request)
    assert ingress_options(args)["max_ongoing_requests"] \
        >= 3 * deployment_options(args)["max_ongoing_requests"]
    assert ingress_actor_options(0.05, False) == {"num_cpus": 0.05}
    with pytest.raises(ValueError):
        ingress_actor_options(-1, True)


@dataclasses.dataclass
class _InBand:
    """A stream item that is an error the replica yields (its refusals, in-band), not raises."""

    error: Exception


class _Outputs:
    """A fake engine stream: yields ``items`` (an exception item is raised there), then ends;
    ``hang=True`` waits forever after them (a long generation)."""

    def __init__(self, items, hang: bool = False) -> None:
        self.items, self.hang, self.cancelled = list(items), hang, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        import asyncio

        if not self.items:
            if self.hang:
                await asyncio.Event().wait()
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        await asyncio.sleep(0)
        return item.error if isinstance(item, _InBand) else item

    def cancel(self) -> None:
        self.cancelled = True


class _FakeEngine:
    """What the ingress sees of the engine deployment (deployments.routes.EngineClient)."""

    def __init__(self, *attempts, hang: bool = False) -> None:
        self.attempts, self.hang = list(attempts), hang
        self.request_ids: list[str] = []
        self.streams: list[_Outputs] = []

    def generate(self, req, request_id):
        self.request_ids.append(request_id)
        stream = _Outputs(self.attempts.pop(0) if len(self.attempts) > 1
                          else list(self.attempts[0]), self.hang)
        self.streams.append(stream)
        return stream

    async def call(self, method, *args):
        if method == "model_card":
            return {"id": "tiny", "root": "tiny-root", "speculative_method": "ngram",
                    "object": "model"}
        if method == "health":
            return {"status": "ok", "queue_depth": 0, "num_running": 0}
        if method == "metrics":
            return "# metrics\n"
        raise AssertionError(method)


def _out(text: str, n: int, finished: bool = False):
    from dart_ray import RequestOutput, RequestStats

    return RequestOutput(request_id="r", new_token_ids=[n], new_text=text, finished=finished,
                         finish_reason="length" if finished else None, num_prompt_tokens=3,
                         num_generated_tokens=n, stats=RequestStats(steps=n))


def _asgi(app, method: str, path: str, body: dict | bytes | None = None,
          headers: dict | None = None,
          disconnect_after_first_chunk: bool = False,
          on_first_chunk=None) -> tuple[int, dict, bytes]:
    """One HTTP request through an ASGI app in-process: (status, headers, body);
    ``on_first_chunk()`` is called when the first body chunk is sent."""
    import asyncio

    raw = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None
                                                else b"")
    h = {"content-type": "application/json", "content-length": str(len(raw)), **(headers or {})}
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(k.lower().encode(), v.encode()) for k, v in h.items()],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80)}
    out: dict = {"status": None, "headers": {}, "body": b""}

    async def run() -> None:
        first_chunk = asyncio.Event()
        sent_body = False

        async def receive():
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": raw, "more_body": False}
            if disconnect_after_first_chunk:
                await first_chunk.wait()
                return {"type": "http.disconnect"}
            await asyncio.Event().wait()

        async def send(m) -> None:
            if m["type"] == "http.response.start":
                out["status"] = m["status"]
                out["headers"] = {k.decode().lower(): v.decode() for k, v in m.get("headers", [])}
            elif m["type"] == "http.response.body":
                out["body"] += m.get("body", b"")
                if m.get("body"):
                    if on_first_chunk is not None and not first_chunk.is_set():
                        on_first_chunk()
                    first_chunk.set()

        await asyncio.wait_for(app(scope, receive, send), 30)

    asyncio.run(run())
    return out["status"], out["headers"], out["body"]


def _ingress(engine, **args):
    from deployments.routes import Ingress, build_api

    ingress = Ingress(ServeArgs.from_dict(args), engine)
    return ingress, build_api(ingress)


def _events(body: bytes) -> list:
    return [line[len(b"data: "):] for line in body.split(b"\n\n") if line.startswith(b"data: ")]


def test_ingress_auth_is_one_dependency_of_every_route_but_health():
    from fastapi.routing import APIRoute

    ingress, app = _ingress(_FakeEngine([_out("a", 1, True)]), api_key="k")
    for route in app.routes:
        if isinstance(route, APIRoute):
            calls = [d.call for d in route.dependant.dependencies]
            assert (ingress.authorize in calls) == (route.path != "/health"), route.path
    ok = {"Authorization": "Bearer k"}
    for method, path, body in (("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None),
                               ("GET", "/metrics", None),
                               ("POST", "/v1/completions", {"prompt": "x"}),
                               ("POST", "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "x"}]})):
        status, _, resp = _asgi(app, method, path, body, {"Authorization": "Bearer wrong"})
        assert status == 401 and json.loads(resp)["error"]["code"] == "invalid_api_key", path
        assert _asgi(app, method, path, body, ok)[0] == 200, path
    assert _asgi(app, "GET", "/health")[0] == 200                          # open
    status, _, resp = _asgi(app, "GET", "/v1/models/other", None, ok)
    assert status == 404 and json.loads(resp)["error"]["code"] == "model_not_found"
    status, _, resp = _asgi(app, "GET", "/v1/nope", None, ok)
    assert status == 404 and json.loads(resp)["error"]["code"] == "not_found"
    assert ingress.metrics.errors == {"401": 5, "404": 2}                  # counted where answered
    # a scanner's paths outside the API are answered, not counted as request errors
    for path in ("/nope", "/wp-login.php", "/v1"):
        assert _asgi(app, "GET", path, None, ok)[0] == 404
    assert ingress.metrics.errors == {"401": 5, "404": 2}


def test_ingress_refuses_large_bodies_before_the_engine():
    engine = _FakeEngine([_out("a", 1, True)])
    _, app = _ingress(engine, max_body_bytes=1024)
    status, _, resp = _asgi(app, "POST", "/v1/completions", {"prompt": "x" * 2000})
    assert status == 413 and json.loads(resp)["error"]["code"] == "request_too_large"
    status, _, resp = _asgi(app, "POST", "/v1/completions", b"{not json")
    assert status == 400 and json.loads(resp)["error"]["code"] == "invalid_json"
    assert engine.request_ids == []


def test_ingress_resubmits_a_request_whose_replica_is_lost_before_any_output():
    """Lost before the first output (nothing sent yet): resubmitted, the client sees a normal 200;
    each attempt has its own engine request id; the retries are counted."""
    import ray.exceptions as rex

    done = [_out("Hel", 1), _out("lo", 2, True)]
    for stream in (False, True):
        engine = _FakeEngine([rex.ActorDiedError()], [rex.ActorUnavailableError("gone", b"1" * 16)],
                             [], done)
        ingress, app = _ingress(engine, retry_after_s=2)
        status, headers, body = _asgi(app, "POST", "/v1/completions",
                                      {"prompt": "x", "stream": stream})
        assert status == 200
        if stream:
            ev = _events(body)
            assert [json.loads(e)["choices"][0]["text"] for e in ev[:-1]] == ["Hel", "lo", ""] \
                and ev[-1] == b"[DONE]"
        else:
            r = json.loads(body)
            assert r["choices"][0]["text"] == "Hello" \
                and r["usage"]["speculative"]["method"] == "ngram"
        rid = headers["x-request-id"]
        assert engine.request_ids == [rid, f"{rid}-retry1", f"{rid}-retry2", f"{rid}-retry3"]
        assert ingress.metrics.retries == 3 and ingress.metrics.errors == {}
        assert all(s.cancelled for s in engine.streams[:3])


def test_ingress_resubmits_a_request_a_failed_tp_replica_refuses():
    """A replica whose tensor-parallel group failed answers a new request with an in-band 503
    replica_lost (before any output): resubmitted like a lost replica, the client sees a 200; a
    refusal of another kind is the client's answer at once."""
    from deployments.errors import REPLICA_LOST

    lost = APIError(503, "the engine replica's tensor-parallel group failed", "server_error", None,
                    REPLICA_LOST)
    engine = _FakeEngine([_InBand(lost)], [_out("Hel", 1), _out("lo", 2, True)])
    ingress, app = _ingress(engine, retry_after_s=2)
    status, headers, body = _asgi(app, "POST", "/v1/completions", {"prompt": "x"})
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "Hello"
    assert len(engine.request_ids) == 2 and ingress.metrics.retries == 1
    bad = APIError(400, "too long", "invalid_request_error", "prompt", "context_length_exceeded")
    engine = _FakeEngine([_InBand(bad)])
    ingress, app = _ingress(engine)
    status, _, body = _asgi(app, "POST", "/v1/completions", {"prompt": "x"})
    assert status == 400 and len(engine.request_ids) == 1 and ingress.metrics.retries == 0


def test_ingress_gives_up_after_max_replica_retries():
    import ray.exceptions as rex

    engine = _FakeEngine([rex.ActorDiedError()])
    ingress, app = _ingress(engine, max_replica_retries=1, retry_after_s=4)
    for stream in (False, True):
        status, headers, body = _asgi(app, "POST", "/v1/completions",
                                      {"prompt": "x", "stream": stream})
        assert status == 503 and headers["retry-after"] == "4"  # no stream started: plain 503
        assert json.loads(body)["error"]["code"] == "replica_lost"
    assert len(engine.request_ids) == 4 and ingress.metrics.retries == 2 \
        and ingress.metrics.errors == {"503": 2}


def test_ingress_ends_a_cut_stream_with_a_retryable_error_event():
    """Lost after the first output: an SSE stream ends with one error event (replica_lost,
    server_error) and [DONE], no finish_reason; a JSON request gets 503 + Retry-After."""
    import ray.exceptions as rex

    cut = [_out("Hel", 1), _out("lo", 2), rex.ActorDiedError()]
    engine = _FakeEngine(cut)
    ingress, app = _ingress(engine, retry_after_s=3)
    status, _, body = _asgi(app, "POST", "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "x"}], "stream": True})
    assert status == 200
    ev = _events(body)
    assert ev[-1] == b"[DONE]"
    err = json.loads(ev[-2])["error"]
    assert (err["code"], err["type"]) == ("replica_lost", "server_error") and err["message"]
    chunks = [json.loads(e) for e in ev[:-2]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello"
    assert not any(c["choices"][0]["finish_reason"] for c in chunks)
    status, headers, body = _asgi(app, "POST", "/v1/completions", {"prompt": "x"})
    assert status == 503 and headers["retry-after"] == "3"
    assert json.loads(body)["error"]["code"] == "replica_lost"
    # output was seen: no resubmission
    assert len(engine.request_ids) == 2 and ingress.metrics.retries == 0
    assert ingress.metrics.errors == {"503": 2} and all(s.cancelled for s in engine.streams)
    # a stream that just stops (no final output, no error) is a lost replica too
    _, app = _ingress(_FakeEngine([_out("Hel", 1)]))
    ev = _events(_asgi(app, "POST", "/v1/completions", {"prompt": "x", "stream": True})[2])
    assert json.loads(ev[-2])["error"]["code"] == "replica_lost" and ev[-1] == b"[DONE]"


def test_ingress_passes_engine_refusals_and_does_not_retry_other_errors():
    refusal = APIError(400, "too long", "invalid_request_error", "prompt",
                       "context_length_exceeded")
    engine = _FakeEngine([refusal])
    _, app = _ingress(engine)
    status, _, body = _asgi(app, "POST", "/v1/completions", {"prompt": "x", "stream": True})
    assert status == 400 and json.loads(body)["error"]["code"] == "context_length_exceeded"
    engine = _FakeEngine([RuntimeError("boom")])
    ingress, app = _ingress(engine)
    status, _, body = _asgi(app, "POST", "/v1/completions", {"prompt": "x"})
    assert status == 500 and len(engine.request_ids) == 1 and ingress.metrics.retries == 0
    queue_full = APIError(503, "full", "server_error", None, "queue_full", {"Retry-After": "2"})
    status, headers, _ = _asgi(_ingress(_FakeEngine([queue_full]))[1], "POST", "/v1/completions",
                               {"prompt": "x"})
    assert status == 503 and headers["retry-after"] == "2"


def test_ingress_cancels_the_engine_stream_when_the_client_goes_away():
    engine = _FakeEngine([_out("a", 1), _out("b", 2)], hang=True)
    _, app = _ingress(engine)
    status, _, body = _asgi(app, "POST", "/v1/completions", {"prompt": "x", "stream": True},
                            disconnect_after_first_chunk=True)
    assert status == 200 and b"[DONE]" not in body
    assert engine.streams[0].cancelled  # -> the engine aborts the request


def test_ingress_reports_an_engine_error_after_output_in_band():
    """An error item after the first output (e.g. a failed engine step): an SSE stream ends with
    that error and [DONE]; a JSON request gets its status. Either way the stream is cancelled."""
    failed = APIError(500, "step failed", "server_error", None, "engine_error")
    engine = _FakeEngine([_out("Hel", 1), failed])
    ingress, app = _ingress(engine)
    status, _, body = _asgi(app, "POST", "/v1/completions", {"prompt": "x", "stream": True})
    ev = _events(body)
    assert status == 200 and ev[-1] == b"[DONE]"
    assert json.loads(ev[0])["choices"][0]["text"] == "Hel"
    assert json.loads(ev[-2])["error"]["code"] == "engine_error"
    status, _, body = _asgi(app, "POST", "/v1/completions", {"prompt": "x"})
    assert status == 500 and json.loads(body)["error"]["code"] == "engine_error"
    assert all(s.cancelled for s in engine.streams) and ingress.metrics.errors == {"500": 2}


def test_a_consumer_that_stops_at_the_finished_output_is_finished_one_that_leaves_aborted():
    """The replica's generate counts a request's end when its finished output passes, so a
    consumer that stops there (without pulling the end of the stream) is not an abort."""
    import asyncio
    import types

    from dart_ray.engine.request import RequestOutput, RequestStats
    from deployments.serving import DartRayServer

    outs = [RequestOutput(request_id="r", new_token_ids=[1], new_text="a", finished=False,
                          finish_reason=None, num_prompt_tokens=2, num_generated_tokens=1,
                          stats=RequestStats()),
            RequestOutput(request_id="r", new_token_ids=[2], new_text="b", finished=True,
                          finish_reason="length", num_prompt_tokens=2, num_generated_tokens=2,
                          stats=RequestStats())]

    async def stream(*a, **kw):
        for o in outs:
            yield o

    async def lane(speculative):
        return "main"

    async def prepare(req):
        return [5, 6]

    metrics = ServerMetrics("tiny")
    fake = types.SimpleNamespace(
        _hooks=types.SimpleNamespace(check_health=None), _group_failure=lambda: None,
        _check_model=lambda m: None, _check_prompt_size=lambda r: None, _lane=lane,
        _prepare=prepare, _params=lambda req, n: SamplingParams(max_new_tokens=2),
        server_metrics=metrics, aengine=types.SimpleNamespace(stream=stream),
        args=types.SimpleNamespace(retry_after_s=1.0))
    gen_fn = DartRayServer.func_or_class.generate

    async def consume(stop_at_finished: bool) -> None:
        agen = gen_fn(fake, parse_completion({"prompt": "x"}), "r")
        async for o in agen:
            if stop_at_finished and o.finished:
                break
        await agen.aclose()

    asyncio.run(consume(True))
    asyncio.run(consume(False))
    assert metrics.requests["length"] == 2 and metrics.requests["abort"] == metrics.aborted == 0

    # a caller that goes away while its request waits for a row (no output yet) is an abort too,
    # counted with its prompt and no generated tokens; and so is one that leaves mid-stream
    admitted = asyncio.Event()

    async def queued(*a, **kw):
        admitted.set()
        await asyncio.sleep(3600)
        yield outs[0]

    async def leave(stream_fn, after_first: bool) -> None:
        fake.aengine = types.SimpleNamespace(stream=stream_fn)
        admitted.clear()
        agen = gen_fn(fake, parse_completion({"prompt": "x"}), "r")
        task = asyncio.ensure_future(agen.__anext__())
        if after_first:
            await task
            task = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def one_then_wait(*a, **kw):
        yield outs[0]
        await asyncio.sleep(3600)

    prompt_before = metrics.prompt_len.sum
    asyncio.run(leave(queued, after_first=False))
    assert admitted.is_set() and metrics.requests["abort"] == metrics.aborted == 1
    assert metrics.prompt_len.sum - prompt_before == 2
    asyncio.run(leave(one_then_wait, after_first=True))
    assert metrics.requests["abort"] == metrics.aborted == 2


def test_a_replica_whose_tp_group_failed_answers_replica_lost_not_500():
    """Once a tensor-parallel worker is gone, a new request (before anything is tokenised) and an
    in-flight one the failed step ends both get a retryable 503 replica_lost, which the ingress
    resubmits to a live replica; with the group healthy, a failed step stays a 500."""
    import asyncio
    import types

    from dart_ray.engine.async_engine import EngineStepError
    from deployments.serving import DartRayServer

    cls = DartRayServer.func_or_class
    group = {"failed": False}

    def check_group():
        if group["failed"]:
            raise RuntimeError("a tensor-parallel worker exited")

    async def failing_step(*a, **kw):
        group["failed"] = group["step_fails_it"]
        raise EngineStepError("engine step failed: RuntimeError('gloo: connection reset')")
        yield

    async def prepare(req):
        prepared.append(req)
        return [5, 6]

    async def lane(speculative):
        return "main"

    fake = types.SimpleNamespace(
        _hooks=types.SimpleNamespace(check_health=check_group), _check_model=lambda m: None,
        _check_prompt_size=lambda r: None, _lane=lane, _prepare=prepare,
        _params=lambda req, n: SamplingParams(max_new_tokens=2),
        server_metrics=ServerMetrics("tiny"), aengine=types.SimpleNamespace(stream=failing_step),
        args=types.SimpleNamespace(retry_after_s=1.0))
    fake._group_failure = lambda: cls._group_failure(fake)

    async def first_item():
        agen = cls.generate(fake, parse_completion({"prompt": "x"}), "r")
        try:
            return await agen.__anext__()
        finally:
            await agen.aclose()

    prepared: list = []
    for fails_it, code, status in ((False, "engine_error", 500), (True, "replica_lost", 503)):
        group.update(failed=False, step_fails_it=fails_it)
        err = asyncio.run(first_item())
        assert (err.code, err.status) == (code, status)
    assert len(prepared) == 2
    err = asyncio.run(first_item())                 # the group is down: refused before any work
    assert (err.code, err.status) == ("replica_lost", 503) and len(prepared) == 2


def test_serve_checks_the_profile_before_starting_anything(tmp_path, caplog, capsys):
    """A missing or malformed --profile fails `dart-ray serve` at once (exit 2), not at replica
    start; on a cluster (--address) a profile not readable here is left to the replicas."""
    from deployments.cli import serve_cli
    from deployments.run import check_profile

    check_profile(None, local=True)
    check_profile("chat", local=True)                        # a shipped profile, by name
    with pytest.raises(FileNotFoundError):
        check_profile(str(tmp_path / "nope.yaml"), local=True)
    with caplog.at_level("WARNING"):
        check_profile(str(tmp_path / "nope.yaml"), local=False)
    assert "resolve it on their nodes" in caplog.text
    bad = tmp_path / "bad.yaml"
    bad.write_text("schedule:\n- {max_batch_size: 4, decoding: {draft_depth: 8.5}}\n")
    with pytest.raises(ValueError, match="draft_depth must be an integer"):
        check_profile(str(bad), local=False)
    assert serve_cli(["--method", "dart", "--profile", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "draft_depth must be an integer" in err and str(bad) in err     # names the file


def test_serve_checks_the_model_before_starting_anything(tmp_path, caplog, capsys):
    """A --model that names no model (missing, a non-GGUF file, a directory with neither
    config.json nor one GGUF) fails `dart-ray serve` at once (exit 2), not as a replica that never
    starts; on a cluster it is left to the replicas; flat or under `engine`."""
    import ray

    from deployments.cli import serve_cli
    from deployments.run import check_app_model as check_model

    check_model({}, local=True)                                   # the embedded default
    with pytest.raises(RuntimeError, match="does not exist"):
        check_model({"model": str(tmp_path / "nope")}, local=True)
    with pytest.raises(RuntimeError, match="not a .gguf"):
        (tmp_path / "w.bin").write_bytes(b"x")
        check_model({"engine": {"model": str(tmp_path / "w.bin")}}, local=True)
    (tmp_path / "fake.gguf").write_bytes(b"GGML0000")
    with pytest.raises(RuntimeError, match="bad magic"):
        check_model({"model": str(tmp_path)}, local=True)         # the directory's one GGUF
    with caplog.at_level("WARNING"):
        check_model({"model": str(tmp_path / "nope")}, local=False)
    assert "resolve it on their nodes" in caplog.text
    assert serve_cli(["--method", "dart", "--model", str(tmp_path / "nope")]) == 2
    assert "model path does not exist" in capsys.readouterr().err
    assert not ray.is_initialized()


# ---- draining on shutdown ------------------------------------------------------------------------
def test_drain_control_waits_for_every_replica_to_count_knowing_of_the_drain(monkeypatch):
    """Drained only once every replica still reporting has reported twice since the drain began
    (its second count admits no new request) with nothing open; a replica gone silent is not
    waited for."""
    import deployments.drain as dr

    clock = [100.0]
    monkeypatch.setattr(dr.time, "time", lambda: clock[0])
    c = dr.ServeControl()
    assert c.poll("a", 2) == dr.SERVING and c.poll("b", 0) == dr.SERVING
    assert c.drained() == (False, 2)
    c.start_drain()
    assert c.poll("a", 0) == dr.DRAINING and c.poll("b", 0) == dr.DRAINING
    assert c.drained() == (False, 0)              # counted before they knew: not yet
    c.poll("a", 1)
    c.poll("b", 0)
    assert c.drained() == (False, 1)              # a request admitted just before: waited for
    c.poll("a", 0)
    assert c.drained() == (True, 0)
    c.poll("c", 3)                                # a replica that never saw the drain ...
    assert c.drained() == (False, 3)
    clock[0] += dr.GONE_S + 1                     # ... and went silent: gone
    c.poll("a", 0)
    c.poll("b", 0)
    assert c.drained() == (True, 0)
    c.start_cut()
    assert c.poll("a", 0) == dr.CUTTING and c.draining


def test_the_cut_cancels_open_requests_and_their_engine_calls():
    """What is still open when the drain ends is cancelled (its engine stream too, so the engine
    aborts it) instead of running on after its client is gone."""
    from deployments.drain import cancel_open_requests

    engine = _FakeEngine([_out("Hel", 1)], hang=True)       # a generation that would not end
    ingress, app = _ingress(engine)
    status, _, body = _asgi(app, "POST", "/v1/completions", {"prompt": "x", "stream": True},
                            on_first_chunk=lambda: cancel_open_requests(ingress))
    events = _events(body)
    assert status == 200 and events[-1] == b"[DONE]"             # the client hears why it ended
    assert json.loads(events[-2])["error"]["code"] == "shutting_down"
    assert json.loads(events[0])["choices"][0]["text"] == "Hel"
    assert ingress.open_requests == 0 and engine.streams[0].cancelled
    # a client that leaves by itself (no cut) is cancelled as before: nothing is sent to it
    ingress.cutting = False
    engine = _FakeEngine([_out("Hel", 1)], hang=True)
    ingress, app = _ingress(engine)
    status, _, body = _asgi(app, "POST", "/v1/completions", {"prompt": "x", "stream": True},
                            disconnect_after_first_chunk=True)
    assert b"shutting_down" not in body and engine.streams[0].cancelled


def test_drain_gate_refuses_new_generation_and_counts_open_requests():
    """While draining: POSTs get 503 shutting_down + Retry-After, /health 503, reads still
    answer; every request is counted open until its whole response is sent."""
    seen_open = []

    class Counting(_FakeEngine):
        def generate(self, req, request_id):
            seen_open.append(ingress.open_requests)
            return super().generate(req, request_id)

    engine = Counting([_out("Hel", 1), _out("lo", 2, True)])
    ingress, app = _ingress(engine)
    status, _, body = _asgi(app, "POST", "/v1/completions", {"prompt": "x", "stream": True})
    assert status == 200 and _events(body)[-1] == b"[DONE]"
    assert seen_open == [1] and ingress.open_requests == 0
    ingress.draining = True
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for path, payload in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", chat)):
        status, headers, body = _asgi(app, "POST", path, payload)
        assert status == 503 and headers["retry-after"] == "1"
        assert json.loads(body)["error"]["code"] == "shutting_down"
    assert _asgi(app, "GET", "/health")[0] == 503
    assert _asgi(app, "GET", "/v1/models")[0] == 200
    assert len(engine.request_ids) == 1 and ingress.open_requests == 0
    # the two refused requests; a load balancer's /health probes are not request errors
    for _ in range(3):
        assert _asgi(app, "GET", "/health")[0] == 503
    assert ingress.metrics.errors == {"503": 2}
