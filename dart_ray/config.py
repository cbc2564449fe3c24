"""Typed, validated configuration for the dart-ray engine.

Two kinds of knobs:

* **Structural** (:class:`EngineConfig`): model, drafter, dtype, device, batch/sequence limits.
  Changing one of these means building a new :class:`~dart_ray.Engine` (weights reload).
* **Runtime** (:class:`DecodingConfig`): tree shape and scoring. These can be swapped on a live
  engine with ``engine.set_decoding(...)`` — Tune trials and batch-size profiles rely on that.

Per-request knobs live in :class:`SamplingParams`.

Every dataclass is frozen and validates itself in ``__post_init__``; bad values raise
``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Sequence

Method = Literal["dart", "eagle", "medusa", "sps", "ngram", "none"]
DType = Literal["auto", "fp32", "bf16", "fp16"]

METHODS: tuple[str, ...] = ("dart", "eagle", "medusa", "sps", "ngram", "none")
"""Drafting methods: ``dart`` (the product), the trained baselines ``eagle`` (autoregressive
tapped-feature drafter), ``medusa`` (heads) and ``sps`` (draft model), ``ngram`` (no model) and
``none`` (plain autoregressive decoding through the same engine)."""
DTYPES: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")
"""``auto`` = bf16 where the device runs it natively and it measures at least as fast as fp32, else
fp32 (:func:`dart_ray.hardware.resolve_dtype`)."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True)
class DecodingConfig:
    """Runtime knobs of draft-tree construction (changeable without reloading weights).

    Scoring of a child node at level ``l`` (0-based) follows DART::

        score(child) = score(parent)
                       + (l + 1) ** -level_weight_exp
                         * (logit_weight_base ** l * ln(p_draft + eps)
                            + ngram_weight * ln(p_ngram + eps))

    The N-gram term is skipped at level 0 (the drafter's level-1 prediction is reliable).
    """

    chunk_len: int = 8
    """Draft depth d used per step (number of levels); must be <= the drafter's trained depth."""

    top_k: int = 25
    """Candidates taken from each level's draft distribution (probabilities renormalised over them)."""

    beam_width: int = 20
    """Beams kept after each level of the beam search (tree width)."""

    tree_budget: int = 60
    """Maximum number of draft nodes in the tree (the root is extra). Verify runs on 1 + budget tokens."""

    ngram_weight: float = 0.5
    """Weight of ln p_ngram in the node score; 0 disables N-gram pruning."""

    ngram_min_count: int = 1
    """N-gram counts below this are treated as unseen at lookup time (backoff applies)."""

    level_weight_exp: float = 0.7
    """Exponent a in the level weight (l+1)^-a; larger favours shallow, confident nodes."""

    logit_weight_base: float = 0.9
    """Base b of the per-level draft-logit weight b^l."""

    eps: float = 1e-6
    """Floor added to probabilities before the log."""

    lookup_paths: int = 2
    """DART only: prompt-lookup continuations merged into the tree (0 = off, the tree is DART's alone).
    They lead the tree's priority order (copied text is accepted in long runs where it matches).
    Default 2: measured on an AVX2 EPYC (fp32, adaptive), HumanEval bs 1 went 0.97x -> 1.6x AR and
    the chat set 0.97x -> 1.04x (docs/BENCHMARKS.md).
    The longest suffix (``lookup_min_match``..3 tokens) of the committed text + root that occurred
    earlier in the same sequence proposes what followed it, up to ``lookup_len`` tokens per path, most
    recent occurrence first; shared prefixes reuse DART's nodes. Adds at most
    ``lookup_paths * lookup_len`` nodes on top of ``tree_budget``."""

    lookup_len: int = 10
    """Tokens per lookup path. Independent of the drafter's depth on purpose:
    copied text is accepted in long runs, while drafter levels past a few are mostly wrong."""

    lookup_min_match: int = 2
    """Shortest suffix match (tokens) that may propose a lookup path; 1 proposes after any repeated token."""

    def __post_init__(self) -> None:
        _check(1 <= self.chunk_len <= 32, f"chunk_len must be in [1, 32], got {self.chunk_len}")
        _check(1 <= self.top_k <= 256, f"top_k must be in [1, 256], got {self.top_k}")
        _check(1 <= self.beam_width <= 256, f"beam_width must be in [1, 256], got {self.beam_width}")
        _check(1 <= self.tree_budget <= 512, f"tree_budget must be in [1, 512], got {self.tree_budget}")
        _check(self.ngram_weight >= 0.0, f"ngram_weight must be >= 0, got {self.ngram_weight}")
        _check(self.ngram_min_count >= 1, f"ngram_min_count must be >= 1, got {self.ngram_min_count}")
        _check(self.level_weight_exp >= 0.0, f"level_weight_exp must be >= 0, got {self.level_weight_exp}")
        _check(0.0 < self.logit_weight_base <= 1.0,
               f"logit_weight_base must be in (0, 1], got {self.logit_weight_base}")
        _check(0.0 < self.eps < 1.0, f"eps must be in (0, 1), got {self.eps}")
        _check(0 <= self.lookup_paths <= 16, f"lookup_paths must be in [0, 16], got {self.lookup_paths}")
        _check(1 <= self.lookup_len <= 32, f"lookup_len must be in [1, 32], got {self.lookup_len}")
        _check(1 <= self.lookup_min_match <= 3, f"lookup_min_match must be in [1, 3], got {self.lookup_min_match}")

    def replace(self, **changes) -> "DecodingConfig":
        """A copy with ``changes`` applied (validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DecodingConfig":
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        _check(not unknown, f"unknown DecodingConfig fields: {sorted(unknown)}")
        return cls(**d)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation parameters (OpenAI-style semantics)."""

    max_new_tokens: int = 128
    """Upper bound on generated tokens (the stop token, if hit, counts)."""

    temperature: float = 0.0
    """0 = greedy (argmax); > 0 samples from softmax(logits / temperature)."""

    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with cumulative probability >= top_p."""

    top_k: int = 0
    """Keep only the k most likely tokens before sampling; 0 disables."""

    seed: int | None = None
    """Seed of this request's private RNG. Sampling is reproducible per request when set and the tree
    schedule is fixed (``EngineConfig.adaptive=False``): with adaptive speculation the tree sizes follow
    this machine's timings, and the output, still an exact sample of the target, can differ between runs."""

    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the request (the tokenizer's EOS always does unless ignore_eos)."""

    stop: tuple[str, ...] = ()
    """Strings that end the request; the text is cut before the stop string."""

    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks use this for fixed-length runs)."""

    def __post_init__(self) -> None:
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(0.0 <= self.temperature <= 100.0,
               f"temperature must be in [0, 100], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty str")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class EngineConfig:
    """Structural engine configuration (changing it means a new Engine)."""

    model: str | None = None
    """HF model directory, ``.gguf`` file, or None for the embedded SmolLM2-135M-Instruct."""

    method: Method = "dart"
    """Drafting method, one of METHODS: ``dart`` (trained drafter + N-gram tree), ``eagle``, ``medusa``,
    ``sps`` (trained baselines), ``ngram`` (no model), ``none`` (AR)."""

    drafter: str | None = None
    """Drafter directory for the method (safetensors + JSON). None = the shipped default for the
    default model; ``"random"`` = an untrained dart/eagle drafter (tests and time splits only)."""

    ngram: str | None = None
    """N-gram model directory. None = the shipped default for the default model (if any)."""

    dtype: DType = "auto"
    """Weights/activations dtype. ``auto`` (default) measures the machine: bf16 where it is native and
    fast (CUDA with bf16, CPUs with oneDNN bf16), else fp32. Exactness tests use fp32."""

    device: str = "cpu"
    """torch device string (``cpu``, ``cuda``, ``cuda:1``)."""

    max_batch_size: int = 8
    """Rows of the static KV cache = most requests decoded together."""

    max_seq_len: int = 2048
    """Tokens one request can use, prompt + generated (``max_model_len``). The draft-tree scratch is
    allocated beyond it, so a request never loses tokens to speculation."""

    num_threads: int | None = None
    """torch intra-op threads on CPU; None leaves torch's default."""

    pack_weights: bool | None = None
    """Prepack the target's linear weights for oneDNN (``dart_ray.models.packing``). None = auto:
    on where it helps on this machine (CPU bf16 with oneDNN bf16 support; CPU fp32 where a short
    measurement shows packed linears faster, e.g. AVX2-only CPUs). Packing is applied to the
    loaded target in place and is idempotent; packed linears are inference-only."""

    adaptive: bool = True
    """Adaptive speculation: every step the engine sizes the draft tree for the current batch -- from
    the node budget down to none (a plain AR step) -- to maximise expected committed tokens per
    second, from the measured cost model of this machine and the acceptance it has observed
    (``dart_ray.engine.controller``). Off = always draft the configured tree."""

    seed: int = 0
    """Seed for randomly initialised drafters (``drafter="random"``)."""

    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    """Initial runtime decoding knobs."""

    def __post_init__(self) -> None:
        _check(self.method in METHODS, f"method must be one of {METHODS}, got {self.method!r}")
        _check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(1 <= self.max_batch_size <= 1024,
               f"max_batch_size must be in [1, 1024], got {self.max_batch_size}")
        _check(64 <= self.max_seq_len <= 1 << 20,
               f"max_seq_len must be in [64, 1048576], got {self.max_seq_len}")
        _check(self.num_threads is None or self.num_threads >= 1,
               f"num_threads must be >= 1, got {self.num_threads}")
        _check(isinstance(self.decoding, DecodingConfig), "decoding must be a DecodingConfig")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def parse_int_list(text: str | Sequence[int]) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (lists pass through)."""
    if isinstance(text, str):
        return [int(t) for t in text.split(",") if t.strip()]
    return [int(t) for t in text]
