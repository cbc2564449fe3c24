"""OpenAI-compatible request parsing and response bodies (no Ray, no FastAPI).

Parsing is explicit (no pydantic models) so every rejection is an OpenAI-style error body::

    {"error": {"message": ..., "type": "invalid_request_error", "param": "max_tokens", "code": ...}}

Supported: ``/v1/completions`` (prompt: string, token ids, or a one-element list of either) and
``/v1/chat/completions`` (messages with string or text-part content), ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k`` (vLLM extra), ``seed``, ``stop``
(string or list), ``stop_token_ids`` / ``ignore_eos`` / ``add_special_tokens`` (vLLM extras; the
last defaults as vLLM's: true for completions, false for chat), ``stream`` with
``stream_options.include_usage``, ``n`` = 1 only, and the extra ``speculative`` field
(``true``/``false``/``{"method": <one of dart_ray.METHODS>}``). Parameters that would change the
output in ways the engine cannot honour (logprobs, echo, suffix, penalties, logit_bias, tools and
tool messages, json mode, n > 1, best_of > 1, vLLM's sampling, structured-output, rendering and
chat-template extras: ``_NEUTRAL``) are rejected with 400 unless they hold their default, and a
field the server does not know is refused as OpenAI refuses it ("Unrecognized request argument").
Bookkeeping fields (``user``, ``metadata``, ``store``, ...: ``_NO_EFFECT_KEYS``) are accepted.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from dart_ray import METHODS

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_KEYS = frozenset(("role", "content", "name", "tool_calls", "function_call",
                          "tool_call_id"))
"""Fields of a chat message this server reads (the tool ones only to refuse them)."""


class APIError(Exception):
    """An error that maps to an HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code
        self.headers = dict(headers or {})
        """Extra HTTP response headers (e.g. ``Retry-After`` on a 503)."""

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def __reduce__(self):   # pickles whole (the engine deployment sends it to the ingress)
        return (APIError,
                (self.status, self.message, self.type, self.param, self.code, self.headers))


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than {limit} bytes (max_body_bytes)",
                    "invalid_request_error", None, "request_too_large")


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist (this server serves `{served}`).",
                    "invalid_request_error", "model", "model_not_found")


@dataclass
class GenerationRequest:
    """A validated completion or chat request."""

    kind: str                       # "completion" | "chat"
    model: str | None
    prompt: Any                     # str | list[int] | list[dict] (chat messages)
    chat: bool
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    speculative: str | None = None  # None: the server's method; else one of dart_ray.METHODS
    user: str | None = None
    add_special_tokens: bool = True  # the tokenizer's BOS etc.; vLLM: completions yes, chat no
    extra: dict = field(default_factory=dict)

    @property
    def token_ids(self) -> list[int] | None:
        """The prompt when it was sent as token ids (nothing to tokenise), else None."""
        return None if self.chat or isinstance(self.prompt, str) else self.prompt

    @property
    def prompt_param(self) -> str:
        """The request field that holds the prompt (the ``param`` of errors about it)."""
        return "messages" if self.chat else "prompt"


def parse_json(raw: bytes) -> dict:
    if not raw:
        raise bad("request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad("request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {type(body).__name__}",
                  code="invalid_json")
    return body


# ---- typed getters ------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(body: dict, key: str, default, lo: float, hi: float, lo_open: bool = False):
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise bad(f"'{key}' must be a number, got {type(v).__name__}", key, "invalid_type")
    if math.isnan(v) or v < lo or v > hi or (lo_open and v == lo):
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise bad(f"'{key}' must be in {rng}, got {v}", key)
    return float(v)


def _int(body: dict, key: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise bad(f"'{key}' must be an integer, got {type(v).__name__}", key, "invalid_type")
    if lo is not None and v < lo:
        raise bad(f"'{key}' must be >= {lo}, got {v}", key)
    if hi is not None and v > hi:
        raise bad(f"'{key}' must be <= {hi}, got {v}", key)
    return v


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean, got {type(v).__name__}", key, "invalid_type")
    return v


MAX_STOP_STRINGS = 16
"""Stop strings one request may give (OpenAI allows 4): each is searched in the new text of every
step, on the replica's event loop shared by all its streams."""
MAX_STOP_CHARS = 512
"""Characters of one stop string (the stream holds back that many less one)."""


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if any(s == "" for s in v):
        raise bad("'stop' strings must be non-empty", "stop")
    if len(v) > MAX_STOP_STRINGS:
        raise bad(f"'stop' has {len(v)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    longest = max((len(s) for s in v), default=0)
    if longest > MAX_STOP_CHARS:
        raise bad(f"a 'stop' string has {longest} characters; at most {MAX_STOP_CHARS} are "
                  "allowed", "stop")
    return tuple(v)


def _token_ids(v, key: str) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise bad(f"'{key}' must be a list of integers", key, "invalid_type")
    return list(v)


def _speculative(body: dict) -> str | None:
    v = body.get("speculative")
    if v is None or v is True:
        return None
    if v is False:
        return "none"
    if isinstance(v, str):
        v = {"method": v}
    if isinstance(v, dict):
        unknown = set(v) - {"method"}
        if unknown:
            raise bad(f"'speculative' supports only the key 'method', got {sorted(unknown)}",
                      "speculative")
        m = v.get("method")
        if m not in METHODS:
            raise bad(f"'speculative.method' must be one of {list(METHODS)}, got {m!r}",
                      "speculative")
        return m
    raise bad("'speculative' must be a boolean or an object {\"method\": ...}", "speculative",
              "invalid_type")


# The request fields each endpoint knows. Anything else is refused, as OpenAI does ("Unrecognized
# request argument"): a field this server does not know may change the output elsewhere.
_COMMON_KEYS = frozenset((
    "model", "max_tokens", "stream", "stream_options", "temperature", "top_p", "top_k", "seed",
    "stop", "stop_token_ids", "ignore_eos", "speculative", "add_special_tokens", "n",
    "logprobs", "top_logprobs", "response_format",
))
_KEYS = {
    "completion": _COMMON_KEYS | {"prompt", "max_completion_tokens", "best_of"},
    "chat": _COMMON_KEYS | {"messages", "max_completion_tokens", "parallel_tool_calls"},
}
_NO_EFFECT_KEYS = frozenset((
    "user", "metadata", "store", "service_tier", "request_id", "cache_salt", "safety_identifier",
    "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
))
"""Accepted and not used: bookkeeping that does not change the output."""
_NEUTRAL = {
    # OpenAI's: lossless speculative decoding of the plain model has no penalties or biases
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "logit_bias": ({},), "echo": (False,), "suffix": ("",),
    # vLLM sampling extras
    "min_tokens": (0,), "min_p": (0,), "include_stop_str_in_output": (False,),
    "prompt_logprobs": (), "use_beam_search": (False,), "length_penalty": (1,),
    "allowed_token_ids": (), "bad_words": ([],), "logits_processors": ([],),
    "truncate_prompt_tokens": (), "priority": (0,), "vllm_xargs": ({},),
    "kv_transfer_params": (),
    # structured output (vLLM's old and new spellings)
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "guided_decoding_backend": (), "guided_whitespace_pattern": (), "structured_outputs": (),
    # how the output is rendered
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,), "return_token_ids": (False,),
    # OpenAI features this server does not have
    "prediction": (), "audio": (), "modalities": (["text"],), "reasoning_effort": (),
    "web_search_options": (), "verbosity": (),
}
"""Known fields this server does not implement: accepted only absent, null or at these values
(which are what the field's absence means), else refused with 400."""
_CHAT_NEUTRAL = {
    # tool calling is not supported
    "tools": ([],), "functions": ([],), "tool_choice": ("none",), "function_call": ("none",),
    # vLLM's chat-template fields: the template is always applied with the generation prompt
    "add_generation_prompt": (True,), "continue_final_message": (False,), "chat_template": (),
    "chat_template_kwargs": ({},), "documents": (),
}
"""Chat-only fields this server does not implement, as :data:`_NEUTRAL`."""


def _same_value(v, default) -> bool:
    """``v`` is ``default``: numbers by value (0.0 is 0), but a bool only equals a bool (1 is not
    True), and containers by type and content."""
    if not isinstance(v, bool) and not isinstance(default, bool) \
            and isinstance(v, (int, float)) and isinstance(default, (int, float)):
        return v == default
    return type(v) is type(default) and v == default


def _check_keys(body: dict, kind: str) -> None:
    neutral = _NEUTRAL if kind == "completion" else {**_NEUTRAL, **_CHAT_NEUTRAL}
    for key, v in body.items():
        if key in _KEYS[kind] or key in _NO_EFFECT_KEYS:
            continue
        if key not in neutral:
            raise bad(f"Unrecognized request argument supplied: {key}", key,
                      "unknown_parameter")
        if v is not None and not any(_same_value(v, n) for n in neutral[key]):
            raise bad(f"'{key}' is not supported (only its default is accepted)", key,
                      "unsupported_value")


def _unsupported(body: dict, kind: str) -> None:
    _check_keys(body, kind)
    n = _int(body, "n", 1)
    if n != 1:
        raise bad(f"only n=1 is supported, got n={n}", "n", "unsupported_value")
    best_of = _int(body, "best_of", 1)
    if best_of != 1:
        raise bad(f"only best_of=1 is supported, got {best_of}", "best_of", "unsupported_value")
    # completions: an integer (0 too asks for the sampled token's logprob); chat: a boolean
    lp = body.get("logprobs")
    logprobs_off = lp is None or (kind == "chat" and lp is False)
    if not logprobs_off or body.get("top_logprobs") not in (None, 0):
        raise bad("'logprobs' is not supported", "logprobs", "unsupported_value")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type", "text") == "text"):
        raise bad("only response_format {\"type\": \"text\"} is supported", "response_format",
                  "unsupported_value")


def _common(body: dict, kind: str, prompt, chat: bool, max_tokens: int | None) -> GenerationRequest:
    _unsupported(body, kind)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model", "invalid_type")
    stream = _bool(body, "stream", False)
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        # include_obfuscation only pads the chunks OpenAI sends (nothing to pad here)
        unknown = sorted(set(so) - {"include_usage", "continuous_usage_stats",
                                    "include_obfuscation"})
        if unknown:
            raise bad(f"'stream_options' has unknown keys {unknown}", "stream_options",
                      "unknown_parameter")
        include_usage = _bool(so, "include_usage", False)
        if _bool(so, "continuous_usage_stats", False):
            raise bad("'stream_options.continuous_usage_stats' is not supported (usage comes in "
                      "the final chunk)", "stream_options", "unsupported_value")
    stop_ids = body.get("stop_token_ids")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("'user' must be a string", "user", "invalid_type")
    return GenerationRequest(
        kind=kind, model=model, prompt=prompt, chat=chat, max_tokens=max_tokens,
        temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=max(0, _int(body, "top_k", 0, -1, (1 << 63) - 1)),   # vLLM: -1 = disabled
        seed=_int(body, "seed", None, -(1 << 63), (1 << 64) - 1),
        stop=_stop(body),
        stop_token_ids=(tuple(_token_ids(stop_ids, "stop_token_ids")) if stop_ids is not None
                        else ()),
        ignore_eos=_bool(body, "ignore_eos", False),
        stream=stream, include_usage=stream and include_usage,
        speculative=_speculative(body),
        user=user,
        add_special_tokens=_bool(body, "add_special_tokens", kind == "completion"),
    )


def parse_completion(body: dict) -> GenerationRequest:
    if "prompt" not in body or body["prompt"] is None:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]                                 # a batch of one
    if isinstance(p, str):
        prompt = p
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        prompt = list(p)
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise bad("batched prompts are not supported; send one prompt per request", "prompt",
                  "unsupported_value")
    elif isinstance(p, list) and not p:
        raise bad("'prompt' is empty", "prompt")
    else:
        raise bad("'prompt' must be a string or a list of token ids", "prompt", "invalid_type")
    return _common(body, "completion", prompt, False, _max_tokens(body, 16))


def _max_tokens(body: dict, default: int | None) -> int | None:
    """``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens``."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _int(body, key, default, 1)


def _message_content(m: dict, i: int) -> str:
    c = m.get("content")
    if c is None:
        if m["role"] != "assistant":     # OpenAI: only an assistant's content may be null
            raise bad(f"messages[{i}].content is required for role {m['role']!r}",
                      f"messages[{i}].content", "missing_required_parameter")
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for part in c:
            if isinstance(part, dict) and part.get("type") == "text" \
                    and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise bad(f"messages[{i}].content: only text parts are supported",
                          f"messages[{i}].content", "unsupported_value")
        return "\n".join(parts)          # as vLLM joins text parts
    raise bad(f"messages[{i}].content must be a string or a list of text parts",
              f"messages[{i}].content", "invalid_type")


def parse_chat(body: dict) -> GenerationRequest:
    if "messages" not in body or body["messages"] is None:
        raise bad("'messages' is required", "messages", "missing_required_parameter")
    msgs = body["messages"]
    if not isinstance(msgs, list):
        raise bad("'messages' must be a list", "messages", "invalid_type")
    if not msgs:
        raise bad("'messages' must not be empty", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {role!r}",
                      f"messages[{i}].role")
        if role == "tool" or m.get("tool_calls") or m.get("function_call"):
            # their ids and calls would be dropped by the chat template: refuse, not ignore
            raise bad(f"messages[{i}]: tool messages and tool calls are not supported (tool "
                      "calling is not supported)", f"messages[{i}]", "unsupported_value")
        # an assistant message echoed back from a response carries refusal/annotations/audio as
        # null or []: empty fields are what they would be absent; anything else is refused
        extra = sorted(k for k in set(m) - MESSAGE_KEYS if m[k] not in (None, [], {}, ""))
        if extra:
            raise bad(f"messages[{i}] has fields this server does not support: {extra} (it "
                      f"takes {sorted(MESSAGE_KEYS)})", f"messages[{i}]", "unknown_parameter")
        msg = {"role": "system" if role == "developer" else role,
               "content": _message_content(m, i)}
        if m.get("name") is not None:       # the chat template decides what a name shows
            if not isinstance(m["name"], str):
                raise bad(f"messages[{i}].name must be a string", f"messages[{i}].name",
                          "invalid_type")
            msg["name"] = m["name"]
        out.append(msg)
    return _common(body, "chat", out, True, _max_tokens(body, None))


def prompt_size(req: GenerationRequest) -> tuple[int, int | None]:
    """(characters of the prompt text, token count if the prompt is token ids else None); chat
    messages count their contents. Cheap: runs before any tokenisation."""
    if req.token_ids is not None:
        return 0, len(req.token_ids)
    if req.chat:
        return sum(len(m.get("content") or "") for m in req.prompt), None
    return len(req.prompt), None


# ---- responses -----------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(num_prompt: int, num_completion: int, stats: dict | None, method: str) -> dict:
    u = {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
         "total_tokens": num_prompt + num_completion}
    s = stats or {}
    u["speculative"] = {"method": method,
                        "mean_accepted_len": float(s.get("mean_accepted_len", 0.0)),
                        "steps": int(s.get("steps", 0)),
                        "draft_tokens": int(s.get("draft_tokens", 0)),
                        "accepted_tokens": int(s.get("accepted_tokens", 0)),
                        "accepted_per_depth": list(s.get("accepted_per_depth", []))}
    return u


def completion_response(req: GenerationRequest, rid: str, created: int, model: str, text: str,
                        finish_reason: str | None, use: dict) -> dict:
    if req.kind == "chat":
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": finish_reason}],
                "usage": use, "system_fingerprint": None}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": use, "system_fingerprint": None}


def chunk(req: GenerationRequest, rid: str, created: int, model: str, text: str | None,
          finish_reason: str | None = None, role: bool = False) -> dict:
    """One streamed event; with ``include_usage`` it carries ``"usage": null`` (as OpenAI's do)
    until the final usage chunk."""
    if req.kind == "chat":
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "logprobs": None,
                            "finish_reason": finish_reason}]}
    else:
        out = {"id": rid, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": 0, "text": text or "", "logprobs": None,
                            "finish_reason": finish_reason}]}
    if req.include_usage:
        out["usage"] = None
    return out


def usage_chunk(req: GenerationRequest, rid: str, created: int, model: str, use: dict) -> dict:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": use}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"

_TEXT_SLOT = "\x00text\x00"
_TEXT_SLOT_JSON = json.dumps(_TEXT_SLOT).encode()


class SSEChunks:
    """The SSE events of one streamed response. A text delta is the common case (one per engine
    step and request): its event is encoded once with a placeholder and split around it, so each
    delta costs one ``json.dumps`` of its text, not of the whole chunk. Every event is byte for byte
    ``sse(chunk(...))`` / ``sse(usage_chunk(...))``."""

    def __init__(self, req: GenerationRequest, rid: str, created: int, model: str) -> None:
        self.req, self.rid, self.created, self.model = req, rid, created, model
        # the text is the last string of a chunk: rpartition finds it whatever the model name
        self._head, _, self._tail = sse(chunk(req, rid, created, model, _TEXT_SLOT)) \
            .rpartition(_TEXT_SLOT_JSON)

    def role(self) -> bytes:
        """A chat stream's first event (``delta.role``)."""
        return sse(chunk(self.req, self.rid, self.created, self.model, "", role=True))

    def text(self, text: str) -> bytes:
        return self._head + json.dumps(text).encode() + self._tail

    def finish(self, finish_reason: str | None) -> bytes:
        text = None if self.req.kind == "chat" else ""
        return sse(chunk(self.req, self.rid, self.created, self.model, text,
                         finish_reason=finish_reason))

    def usage(self, use: dict) -> bytes:
        return sse(usage_chunk(self.req, self.rid, self.created, self.model, use))


def now() -> int:
    return int(time.time())
