"""Typed, validated arguments of the Serve application (``build_app(args)``).

``args`` come from a Serve config file (``applications[].args``), the CLI or Python. They are
checked here, in the driver, so a typo fails at deploy time with a message naming the key instead
of crashing a replica later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dart_ray import DecodingConfig, EngineConfig


def _fail(msg: str) -> None:
    raise ValueError(f"invalid serve args: {msg}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class ServeArgs:
    """Arguments of ``deployments.openai_app:build_app``."""

    model: str | None = None
    """HF model directory, ``.gguf`` file, or None for the embedded SmolLM2-135M-Instruct."""
    method: str = "dart"
    """Drafting method of the main engine: one of ``dart_ray.METHODS`` (dart, eagle, medusa, sps, ngram, none)."""
    drafter: str | None = None
    """DART drafter directory; None = shipped default; ``"random"`` = untrained (tests)."""
    ngram: str | None = None
    """N-gram model directory; None = shipped default; ``"none"`` disables it."""
    dtype: str = "auto"
    device: str = "cpu"
    max_batch_size: int = 8
    max_seq_len: int = 2048
    num_threads: int | None = None
    """torch intra-op threads in the replica (None: torch's default, which Ray sets to num_cpus)."""
    decoding: dict = field(default_factory=dict)
    """DecodingConfig fields overriding the defaults (runtime knobs)."""
    profile: str | None = None
    """Decoding profile (name or YAML path from ``dart-ray tune``); applied after ``decoding``."""
    tensor_parallel_size: int = 1
    api_key: str | None = None
    """If set, /v1/* and /metrics need ``Authorization: Bearer <api_key>`` (/health stays open)."""
    served_model_name: str | None = None
    """Model name clients pass as ``model``; None = the target's id (e.g. SmolLM2-135M-Instruct)."""
    num_cpus: float = 1.0
    """CPUs reserved by each replica (fractional is fine)."""
    max_queue: int = 64
    """Requests allowed to wait for a batch row per replica (beyond the ``max_batch_size`` running
    ones); beyond that: HTTP 503 with ``Retry-After``."""
    retry_after_s: int = 1
    """Seconds a 503 (queue full) tells the client to wait (``Retry-After`` header)."""
    num_replicas: int = 1
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
    seed: int = 0
    """Seed of randomly initialised drafters (``drafter="random"``)."""
    adaptive: bool | None = None
    """``EngineConfig.adaptive`` (tree size chosen per step from measured costs); None = the engine's
    default. False keeps the configured trees every step (reproducible speculation, e.g. in tests)."""

    def __post_init__(self) -> None:
        for name in ("model", "drafter", "ngram", "profile", "api_key", "served_model_name"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                _fail(f"{name} must be a string or null, got {type(v).__name__}")
        for name in ("method", "dtype", "device"):
            if not isinstance(getattr(self, name), str):
                _fail(f"{name} must be a string")
        for name in ("max_batch_size", "max_seq_len", "tensor_parallel_size", "max_queue", "num_replicas",
                     "seed", "retry_after_s", "max_lanes", "max_body_bytes", "tokenizer_workers"):
            if not _is_int(getattr(self, name)):
                _fail(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.num_threads is not None and not _is_int(self.num_threads):
            _fail(f"num_threads must be an integer or null, got {self.num_threads!r}")
        if not _is_num(self.num_cpus) or self.num_cpus < 0:
            _fail(f"num_cpus must be a number >= 0, got {self.num_cpus!r}")
        if self.tensor_parallel_size < 1:
            _fail(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_queue < 1:
            _fail(f"max_queue must be >= 1, got {self.max_queue}")
        if self.num_replicas < 1:
            _fail(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.max_replicas_per_node is not None and (not _is_int(self.max_replicas_per_node)
                                                       or self.max_replicas_per_node < 1):
            _fail(f"max_replicas_per_node must be an int >= 1 or null, got {self.max_replicas_per_node!r}")
        if self.placement_strategy not in ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"):
            _fail(f"placement_strategy must be STRICT_PACK, PACK, SPREAD or STRICT_SPREAD, "
                  f"got {self.placement_strategy!r}")
        if not isinstance(self.allow_speculative_override, bool):
            _fail("allow_speculative_override must be a boolean")
        if self.adaptive is not None and not isinstance(self.adaptive, bool):
            _fail("adaptive must be a boolean or null")
        if self.retry_after_s < 0:
            _fail(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.max_lanes < 1:
            _fail(f"max_lanes must be >= 1 (the main engine), got {self.max_lanes}")
        if self.max_body_bytes < 1024:
            _fail(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_prompt_chars is not None and (not _is_int(self.max_prompt_chars) or self.max_prompt_chars < 1):
            _fail(f"max_prompt_chars must be an integer >= 1 or null, got {self.max_prompt_chars!r}")
        if self.tokenizer_workers < 1:
            _fail(f"tokenizer_workers must be >= 1, got {self.tokenizer_workers}")
        if self.replica_niceness is not None and (not _is_int(self.replica_niceness)
                                                  or not -20 <= self.replica_niceness <= 19):
            _fail(f"replica_niceness must be an integer in [-20, 19] or null, got {self.replica_niceness!r}")
        if self.api_key is not None and not self.api_key:
            _fail("api_key must be non-empty (or null to disable authentication)")
        if not isinstance(self.decoding, Mapping):
            _fail(f"decoding must be a mapping of DecodingConfig fields, got {type(self.decoding).__name__}")
        object.__setattr__(self, "decoding", dict(self.decoding))
        try:
            self.engine_config()                    # EngineConfig/DecodingConfig validate themselves
        except (ValueError, TypeError) as e:
            _fail(str(e))

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, args: Mapping[str, Any] | None) -> ServeArgs:
        """Validate a plain dict (unknown keys are an error naming the known ones)."""
        if args is None:
            return cls()
        if isinstance(args, ServeArgs):
            return args
        if not isinstance(args, Mapping):
            _fail(f"args must be a mapping, got {type(args).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            _fail(f"unknown keys {unknown}; known keys: {sorted(known)}")
        return cls(**dict(args))

    def replace(self, **changes) -> ServeArgs:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def decoding_config(self) -> DecodingConfig:
        return DecodingConfig.from_dict(self.decoding) if self.decoding else DecodingConfig()

    def engine_config(self) -> EngineConfig:
        extra = {} if self.adaptive is None else {"adaptive": self.adaptive}
        return EngineConfig(model=self.model, method=self.method, drafter=self.drafter, ngram=self.ngram,
                            dtype=self.dtype, device=self.device, max_batch_size=self.max_batch_size,
                            max_seq_len=self.max_seq_len, num_threads=self.num_threads, seed=self.seed,
                            decoding=self.decoding_config(), **extra)

    def redacted(self) -> dict:
        """to_dict() without the API key (for logs and /v1/models)."""
        d = self.to_dict()
        if d.get("api_key"):
            d["api_key"] = "***"
        return d
