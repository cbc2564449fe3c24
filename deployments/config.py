"""Typed, validated arguments of the Serve application (``build_app(args)``).

``args`` come from a Serve config file (``applications[].args``), the CLI or Python. They are
checked here, in the driver, so a typo fails at deploy time with a message naming the key instead
of crashing a replica later.

The engine's settings are one :class:`~dart_ray.EngineConfig` under ``engine`` (its fields, as in
``EngineConfig.from_dict``); the other keys are the server's own::

    args:
      engine:
        {model: null, method: dart, dtype: auto, max_batch_size: 8, decoding: {tree_budget: 40}}
      profile: code
      num_replicas: 2

**Flat engine keys** (``model: ...``, ``method: ...``, ``decoding: {...}`` next to the server's
keys, the form of older configs) are still accepted and routed into ``engine``; where a key is given
both ways the flat one wins (``dart-ray serve --model ...`` overrides a config file's
``engine.model`` that way). ``adaptive: null`` (old spelling of "the engine's default") is dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dart_ray import EngineConfig
from dart_ray.profiles import refuse_profile_over_decoding
from deployments.placement import STRATEGIES


def _fail(msg: str) -> None:
    raise ValueError(f"invalid serve args: {msg}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class ServeArgs:
    """Arguments of ``deployments.openai_app:build_app``."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    """The engine of every replica (and the base of its lanes); a mapping is read with
    ``EngineConfig.from_dict``."""
    profile: str | None = None
    """Decoding profile (name or YAML path from ``dart-ray tune``); replaces ``engine.decoding`` on
    the replica's engine (and so on its lanes)."""
    tensor_parallel_size: int = 1
    api_key: str | None = None
    """If set, /v1/* and /metrics need ``Authorization: Bearer <api_key>`` (/health stays open)."""
    served_model_name: str | None = None
    """Model name clients pass as ``model``; None = the target's id (e.g. SmolLM2-135M-Instruct)."""
    num_cpus: float = 1.0
    """CPUs reserved by each engine replica (fractional is fine)."""
    max_queue: int = 64
    """Requests allowed to wait for a batch row per replica (beyond the ``max_batch_size`` running
    ones); beyond that: HTTP 503 with ``Retry-After``."""
    retry_after_s: int = 1
    """Seconds a 503 (queue full) tells the client to wait (``Retry-After`` header)."""
    num_replicas: int = 1
    """Engine replicas (``DartRayServer``), each with its own copy of the model."""
    max_replicas_per_node: int | None = None
    """At most this many replicas on one node (TP = 1 only): 1 spreads replicas strictly across
    nodes, so losing a node costs one replica (``deployments.placement``). None = Serve's default
    (spread when it can)."""
    placement_strategy: str = "STRICT_PACK"
    """Placement of one TP replica's rank bundles: STRICT_PACK (default: all ranks on one node, so a
    node loss takes the group whole), PACK, SPREAD or STRICT_SPREAD."""
    allow_speculative_override: bool = False
    """Serve ``"speculative": false`` / ``{"method": ...}`` per request by building extra engines
    (lanes) on demand that share the target weights (each lane has its own KV cache:
    ``max_batch_size x max_seq_len`` more memory, and building one pauses the engine for seconds).
    Off by default; with ``api_key`` set only authenticated clients reach it."""
    max_lanes: int = 2
    """Engines per replica when overrides are on, the main one included; a request for another
    method beyond it gets HTTP 400 (memory stays bounded whatever clients send)."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Largest request body read (bytes); larger: HTTP 413 before any parsing or tokenisation."""
    max_prompt_chars: int | None = None
    """Longest prompt (characters, chat messages summed) tokenised; longer: HTTP 400
    ``context_length_exceeded`` without tokenising. None = ``max_model_len`` x the longest
    token of the vocabulary in characters, a bound no prompt that fits the context exceeds."""
    tokenizer_workers: int = 2
    """Threads that tokenise prompts (each with its own tokenizer copy), off the engine thread."""
    replica_niceness: int | None = 0
    """Nice value the replica process resets itself to at start (Ray starts workers at nice 15);
    None = leave it. Lowering it needs CAP_SYS_NICE or RLIMIT_NICE, else a warning is logged."""
    ingress_num_replicas: int = 1
    """Replicas of the HTTP ingress (``DartRayIngress``), independent of ``num_replicas`` (the
    engine's): it holds no model, only the routes and the open streams."""
    ingress_num_cpus: float = 0.0
    """CPUs reserved by each ingress replica. 0 fits a head node started with ``--num-cpus=0``."""
    ingress_on_head: bool = True
    """Run the ingress replicas on the head node (next to the HTTP proxy with ``proxy_location:
    HeadOnly``), so losing a worker node never takes the ingress, and so an open stream, with it.
    False: anywhere (e.g. with a proxy on every node)."""
    max_replica_retries: int = 3
    """Resubmissions of a request whose engine replica is lost before its first output (nothing was
    sent, so it is safe); after that, or once a request has output, the client gets a retryable
    503 / SSE error ``replica_lost``."""

    def __post_init__(self) -> None:
        try:
            # validates itself
            object.__setattr__(self, "engine", EngineConfig.from_dict(self.engine))
        except (ValueError, TypeError) as e:
            _fail(f"engine: {e}")
        for name in ("profile", "api_key", "served_model_name"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                _fail(f"{name} must be a string or null, got {type(v).__name__}")
        try:
            refuse_profile_over_decoding(self.profile, self.engine.decoding)
        except ValueError as e:
            _fail(str(e))
        for name in ("tensor_parallel_size", "max_queue", "num_replicas", "retry_after_s",
                     "max_lanes", "max_body_bytes", "tokenizer_workers", "ingress_num_replicas",
                     "max_replica_retries"):
            if not _is_int(getattr(self, name)):
                _fail(f"{name} must be an integer, got {getattr(self, name)!r}")
        if not _is_num(self.num_cpus) or self.num_cpus < 0:
            _fail(f"num_cpus must be a number >= 0, got {self.num_cpus!r}")
        if not _is_num(self.ingress_num_cpus) or self.ingress_num_cpus < 0:
            _fail(f"ingress_num_cpus must be a number >= 0, got {self.ingress_num_cpus!r}")
        if self.ingress_num_replicas < 1:
            _fail(f"ingress_num_replicas must be >= 1, got {self.ingress_num_replicas}")
        if self.max_replica_retries < 0:
            _fail(f"max_replica_retries must be >= 0, got {self.max_replica_retries}")
        if self.tensor_parallel_size < 1:
            _fail(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_queue < 1:
            _fail(f"max_queue must be >= 1, got {self.max_queue}")
        if self.num_replicas < 1:
            _fail(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.max_replicas_per_node is not None and (not _is_int(self.max_replicas_per_node)
                                                       or self.max_replicas_per_node < 1):
            _fail(f"max_replicas_per_node must be an int >= 1 or null, "
                  f"got {self.max_replicas_per_node!r}")
        if self.placement_strategy not in STRATEGIES:
            _fail(f"placement_strategy must be one of {list(STRATEGIES)}, "
                  f"got {self.placement_strategy!r}")
        for name in ("allow_speculative_override", "ingress_on_head"):
            if not isinstance(getattr(self, name), bool):
                _fail(f"{name} must be a boolean")
        if self.allow_speculative_override and self.tensor_parallel_size > 1:
            _fail("allow_speculative_override needs tensor_parallel_size 1: a tensor-parallel "
                  "replica runs its one method (per-request lanes are not built over a TP group)")
        if self.retry_after_s < 0:
            _fail(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.max_lanes < 1:
            _fail(f"max_lanes must be >= 1 (the main engine), got {self.max_lanes}")
        if self.max_body_bytes < 1024:
            _fail(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_prompt_chars is not None and (not _is_int(self.max_prompt_chars)
                                                  or self.max_prompt_chars < 1):
            _fail(f"max_prompt_chars must be an integer >= 1 or null, "
                  f"got {self.max_prompt_chars!r}")
        if self.tokenizer_workers < 1:
            _fail(f"tokenizer_workers must be >= 1, got {self.tokenizer_workers}")
        if self.replica_niceness is not None and (not _is_int(self.replica_niceness)
                                                  or not -20 <= self.replica_niceness <= 19):
            _fail(f"replica_niceness must be an integer in [-20, 19] or null, "
                  f"got {self.replica_niceness!r}")
        if self.api_key is not None and not self.api_key:
            _fail("api_key must be non-empty (or null to disable authentication)")

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, args: Mapping[str, Any] | None) -> ServeArgs:
        """Validate a plain dict (unknown keys are an error naming the known ones). Engine settings
        go under ``engine``; flat engine keys are routed there too (see the module docstring)."""
        if args is None:
            return cls()
        if isinstance(args, ServeArgs):
            return args
        if not isinstance(args, Mapping):
            _fail(f"args must be a mapping, got {type(args).__name__}")
        own = {f.name for f in dataclasses.fields(cls)}
        flat_engine = set(EngineConfig.field_names())
        unknown = sorted(set(args) - own - flat_engine)
        if unknown:
            _fail(f"unknown keys {unknown}; known keys: {sorted(own)} and the engine's "
                  f"{sorted(flat_engine)} (under 'engine', or flat)")
        kw = {k: v for k, v in args.items() if k in own}
        flat = {k: v for k, v in args.items()
                if k in flat_engine and not (k == "adaptive" and v is None)}
        if flat:
            base = kw.get("engine") or {}
            if isinstance(base, EngineConfig):
                base = base.to_dict()
            if not isinstance(base, Mapping):
                _fail(f"engine must be a mapping of EngineConfig fields, got {type(base).__name__}")
            kw["engine"] = {**base, **flat}
        elif kw.get("engine") is None:
            kw.pop("engine", None)
        return cls(**kw)

    def replace(self, **changes) -> ServeArgs:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain data, ``engine`` nested (``from_dict(to_dict())`` gives the same args)."""
        return dataclasses.asdict(self)

    def redacted(self) -> dict:
        """to_dict() without the API key (for logs and /v1/models)."""
        d = self.to_dict()
        if d.get("api_key"):
            d["api_key"] = "***"
        return d
