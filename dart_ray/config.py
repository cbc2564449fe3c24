"""Typed, validated configuration for the dart-ray engine.

Two kinds of knobs:

* **Structural** (:class:`EngineConfig`): model, drafter, dtype, device, batch/sequence limits.
  Changing one of these means building a new :class:`~dart_ray.Engine` (weights reload).
* **Runtime** (:class:`DecodingConfig`): tree shape and scoring. These can be swapped on a live
  engine with ``engine.set_decoding(...)`` — Tune trials and batch-size profiles rely on that.

Per-request knobs live in :class:`SamplingParams`.

Every dataclass is frozen and validates itself in ``__post_init__``; bad values raise
``ValueError`` naming the field.

**One name per concept** at every boundary (fields, profile YAML, the tuner's search space, CLI
flags, /metrics, docs): ``draft_depth`` is the number of positions drafted per step (the paper's
d; the SpS papers' gamma), capped by a drafter's ``max_draft_depth`` (its trained depth);
``tree_budget`` is the most draft nodes a tree keeps. Renamed spellings keep working for one release
with a :class:`RenamedWarning`: the ``chunk_len`` key (:data:`RENAMED_DECODING_KEYS`), old
attributes (:class:`RenamedAttribute`) and old flags (:func:`add_renamed_flag`).

**One path for engine settings** (like vLLM's ``EngineArgs``): every :class:`EngineConfig` field is
declared once, here. :meth:`EngineConfig.from_dict` / :meth:`EngineConfig.to_dict` are its dict
(YAML, JSON, Ray) form, :func:`add_engine_args` + :meth:`EngineConfig.from_args` its command-line
form (every ``dart-ray`` command takes the same engine flags), and :meth:`EngineConfig.fingerprint`
the settings a Tune study or a batch output was produced with. The Serve args, the Tune settings and
the batch job *contain* an EngineConfig (field ``engine``) instead of restating its fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import numbers
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dart_ray.methods import method_names

Method = str
"""A registered drafting method name (:func:`dart_ray.methods.method_names`)."""
DType = Literal["auto", "fp32", "bf16", "fp16"]

METHODS: tuple[str, ...] = method_names()
"""The built-in drafting methods, derived from the registry (:mod:`dart_ray.methods`): ``dart`` (the
product), the trained baselines ``eagle`` (autoregressive tapped-feature drafter), ``medusa``
(heads) and ``sps`` (draft model), ``ngram`` (no model) and ``none`` (plain autoregressive decoding
through the same engine). Validation reads the live registry, so a method registered later is
accepted too."""
DTYPES: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")
"""``auto`` = bf16 where the device runs it natively and it measures at least as fast as fp32, else
fp32 (:func:`dart_ray.hardware.resolve_dtype`)."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _is_integer(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _coerce_numbers(obj) -> None:
    """Check a frozen config dataclass's numeric fields by their annotation (``int``, ``float``,
    either ``| None``), so a typo (``8.5``, ``true``, ``"8"``) names its field; integral values
    become plain ints, real ones floats (a stable fingerprint)."""
    for f in dataclasses.fields(obj):
        kind, optional = f.type.removesuffix(" | None"), f.type.endswith(" | None")
        v = getattr(obj, f.name)
        if kind not in ("int", "float") or (optional and v is None):
            continue
        null = " or null" if optional else ""
        if kind == "int":
            _check(_is_integer(v), f"{f.name} must be an integer{null}, got {v!r}")
            object.__setattr__(obj, f.name, int(v))
        else:
            _check(isinstance(v, numbers.Real) and not isinstance(v, bool),
                   f"{f.name} must be a number{null}, got {v!r}")
            object.__setattr__(obj, f.name, float(v))


class RenamedWarning(DeprecationWarning):
    """An old spelling (a config key, a flag, an attribute) was used; it goes away next release.
    The ``dart-ray`` command line shows these (Python hides DeprecationWarnings by default)."""


def warn_renamed(old: str, new: str, what: str = "", stacklevel: int = 3) -> None:
    """Warn that ``old`` is the deprecated spelling of ``new`` (``what``: where, e.g. "profile
    key")."""
    where = f"{what} " if what else ""
    warnings.warn(f"{where}{old!r} is deprecated and will be removed in the next release; use "
                  f"{new!r}",
                  RenamedWarning, stacklevel=stacklevel)


class RenamedAttribute:
    """A deprecated attribute name: ``old = RenamedAttribute("new")`` in a class body reads and
    writes ``new`` with a :class:`RenamedWarning` (one release). Writes to a frozen dataclass
    still raise."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.__doc__ = f"Deprecated: :attr:`{new}` (removed next release)."

    def __set_name__(self, owner: type, name: str) -> None:
        self.old, self.what = name, f"{owner.__name__} attribute"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        warn_renamed(self.old, self.new, self.what)
        return getattr(obj, self.new)

    def __set__(self, obj: Any, value: Any) -> None:
        warn_renamed(self.old, self.new, self.what)
        setattr(obj, self.new, value)


RENAMED_DECODING_KEYS: dict[str, str] = {"chunk_len": "draft_depth"}
"""Old :class:`DecodingConfig` keys -> their names now; accepted (with a :class:`RenamedWarning`) by
:meth:`DecodingConfig.from_dict` (profiles, ``--decoding`` JSON, engine/Serve/batch configs) and
:meth:`DecodingConfig.replace` for one release."""


def canonical_decoding_keys(d: Mapping[str, Any]) -> dict:
    """``d`` with renamed DecodingConfig keys under their current names (a warning per old key); an
    old and a new key for the same field together are an error."""
    out = dict(d)
    for old, new in RENAMED_DECODING_KEYS.items():
        if old in out:
            _check(new not in out,
                   f"DecodingConfig: {old!r} is the old name of {new!r}; give only {new!r}")
            warn_renamed(old, new, "DecodingConfig key", stacklevel=4)
            out[new] = out.pop(old)
    return out


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

    draft_depth: int = 8
    """Draft depth d: positions drafted per step (tree levels; DART's d, the SpS chain length,
    EAGLE's unrolled steps, Medusa's heads used). A drafter uses
    ``min(draft_depth, max_draft_depth)``, its trained depth. Formerly ``chunk_len`` (still read,
    with a warning, for one release)."""

    top_k: int = 25
    """Candidates taken from each level's draft distribution (probabilities renormalised over
    them)."""

    beam_width: int = 20
    """Beams kept after each level of the beam search (tree width)."""

    tree_budget: int = 60
    """Tree budget: the most draft nodes a tree keeps (the root is extra; lookup paths may add
    ``lookup_paths * lookup_len``). Verify runs on 1 + budget tokens."""

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
    """DART only: prompt-lookup continuations merged into the tree (0 = off, the tree is DART's
    alone). They lead the tree's priority order (copied text is accepted in long runs where it
    matches). Default 2: measured on an AVX2 EPYC (fp32, adaptive), HumanEval bs 1 went 0.97x ->
    1.6x AR and the chat set 0.97x -> 1.04x (docs/BENCHMARKS.md).
    The longest suffix (``lookup_min_match``..3 tokens) of the committed text + root that occurred
    earlier in the same sequence proposes what followed it, up to ``lookup_len`` tokens per path,
    most recent occurrence first; shared prefixes reuse DART's nodes. Adds at most
    ``lookup_paths * lookup_len`` nodes on top of ``tree_budget``."""

    lookup_len: int = 10
    """Tokens per lookup path. Independent of the drafter's depth on purpose:
    copied text is accepted in long runs, while drafter levels past a few are mostly wrong."""

    lookup_min_match: int = 2
    """Shortest suffix match (tokens) that may propose a lookup path; 1 proposes after any repeated
    token."""

    def __post_init__(self) -> None:
        _coerce_numbers(self)          # types first: a profile's typo names the knob
        _check(1 <= self.draft_depth <= 32,
               f"draft_depth must be in [1, 32], got {self.draft_depth}")
        _check(1 <= self.top_k <= 256, f"top_k must be in [1, 256], got {self.top_k}")
        _check(1 <= self.beam_width <= 256,
               f"beam_width must be in [1, 256], got {self.beam_width}")
        _check(1 <= self.tree_budget <= 512,
               f"tree_budget must be in [1, 512], got {self.tree_budget}")
        _check(self.ngram_weight >= 0.0, f"ngram_weight must be >= 0, got {self.ngram_weight}")
        _check(self.ngram_min_count >= 1,
               f"ngram_min_count must be >= 1, got {self.ngram_min_count}")
        _check(self.level_weight_exp >= 0.0,
               f"level_weight_exp must be >= 0, got {self.level_weight_exp}")
        _check(0.0 < self.logit_weight_base <= 1.0,
               f"logit_weight_base must be in (0, 1], got {self.logit_weight_base}")
        _check(0.0 < self.eps < 1.0, f"eps must be in (0, 1), got {self.eps}")
        _check(0 <= self.lookup_paths <= 16,
               f"lookup_paths must be in [0, 16], got {self.lookup_paths}")
        _check(1 <= self.lookup_len <= 32, f"lookup_len must be in [1, 32], got {self.lookup_len}")
        _check(1 <= self.lookup_min_match <= 3,
               f"lookup_min_match must be in [1, 3], got {self.lookup_min_match}")

    chunk_len = RenamedAttribute("draft_depth")

    def replace(self, **changes) -> DecodingConfig:
        """A copy with ``changes`` applied (validated; renamed keys accepted with a warning)."""
        return dataclasses.replace(self, **canonical_decoding_keys(changes))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DecodingConfig:
        """From its fields as a mapping (YAML/JSON form). Renamed keys
        (:data:`RENAMED_DECODING_KEYS`) are read under their new names with a
        :class:`RenamedWarning`; unknown keys are an error."""
        d = canonical_decoding_keys(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        _check(not unknown, f"unknown DecodingConfig fields: {sorted(unknown)}")
        return cls(**d)


GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (vLLM's threshold)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation parameters (OpenAI-style semantics)."""

    max_new_tokens: int = 128
    """Upper bound on generated tokens (the stop token, if hit, counts)."""

    temperature: float = 0.0
    """0 = greedy (argmax); > 0 samples from softmax(logits / temperature). Below
    :data:`GREEDY_BELOW` (1e-5) it is greedy too, as in vLLM: dividing float32 logits by a smaller
    one overflows, and the distribution it describes is the argmax anyway."""

    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with cumulative probability >= top_p."""

    top_k: int = 0
    """Keep only the k most likely tokens before sampling; 0 disables."""

    seed: int | None = None
    """Seed of this request's randomness. The token at each output position is drawn by an
    exponential race keyed by (seed, position) (:mod:`dart_ray.verify.randomness`), so a seeded
    request's
    output is the same in any batch, under any tree schedule (adaptive or not) and with any
    method -- the one plain sampling with this seed gives -- except SpS, whose draft model samples
    its drafts from a sequential stream (reproducible for a fixed schedule only). In fp32: in
    bf16 the logits depend on the verify forward's shape, so another batch or tree size can flip
    a token at a near-tie of the race."""

    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the request (the tokenizer's EOS always does unless ignore_eos)."""

    stop: tuple[str, ...] = ()
    """Strings that end the request; the text is cut before the stop string."""

    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks use this for fixed-length runs)."""

    def __post_init__(self) -> None:
        _coerce_numbers(self)        # types first: a 2.5 or "0.5" names its field
        _check(self.seed is None or -(1 << 63) <= self.seed < (1 << 64),
               f"seed must be None or an integer in [-2**63, 2**64), got {self.seed!r}")
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be a bool, got "
                                                  f"{self.ignore_eos!r}")
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(0.0 <= self.temperature <= 100.0,
               f"temperature must be in [0, 100], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0 <= self.top_k < (1 << 63), f"top_k must be in [0, 2**63), got {self.top_k}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop   # one string, as OpenAI's
        _check(isinstance(stop, (tuple, list)) and all(isinstance(s, str) and s for s in stop),
               f"stop must be a non-empty string or a sequence of them, got {self.stop!r}")
        ids = self.stop_token_ids
        _check(isinstance(ids, (tuple, list)) and all(_is_integer(t) for t in ids),
               f"stop_token_ids must be a sequence of integers, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        object.__setattr__(self, "stop", tuple(stop))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class EngineConfig:
    """Structural engine configuration (changing it means a new Engine)."""

    model: str | None = None
    """HF model directory, ``.gguf`` file, or None for the embedded SmolLM2-135M-Instruct."""

    method: Method = "dart"
    """Drafting method, one of METHODS: ``dart`` (trained drafter + N-gram tree), ``eagle``,
    ``medusa``, ``sps`` (trained baselines), ``ngram`` (no model), ``none`` (AR)."""

    drafter: str | None = None
    """Drafter directory for the method (safetensors + JSON). None = the shipped default for the
    default model; ``"random"`` = an untrained dart/eagle drafter (tests and time splits only)."""

    ngram: str | None = None
    """N-gram model directory. None = the shipped default for the default model (if any)."""

    dtype: DType = "auto"
    """Weights/activations dtype. ``auto`` (default) measures the machine: bf16 where it is native
    and fast (CUDA with bf16, CPUs with oneDNN bf16), else fp32. Exactness tests use fp32."""

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
    """Adaptive speculation: every step the engine sizes the draft tree for the current batch --
    from the node budget down to none (a plain AR step) -- to maximise expected committed tokens per
    second, from the measured cost model of this machine and the acceptance it has observed
    (``dart_ray.engine.controller``). Off = always draft the configured tree."""

    seed: int = 0
    """Seed for randomly initialised drafters (``drafter="random"``)."""

    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    """Initial runtime decoding knobs."""

    def __post_init__(self) -> None:
        self._check_types()
        _check(self.method in method_names(),
               f"method must be one of {method_names()}, got {self.method!r}")
        _check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(1 <= self.max_batch_size <= 1024,
               f"max_batch_size must be in [1, 1024], got {self.max_batch_size}")
        _check(64 <= self.max_seq_len <= 1 << 20,
               f"max_seq_len must be in [64, 1048576], got {self.max_seq_len}")
        _check(self.num_threads is None or self.num_threads >= 1,
               f"num_threads must be >= 1, got {self.num_threads}")
        _check(isinstance(self.decoding, DecodingConfig), "decoding must be a DecodingConfig")

    def _check_types(self) -> None:
        """Types first, so a YAML/JSON typo (``max_batch_size: "8"``) names the field; paths
        (``os.PathLike``) become strings and integral numbers plain ints (a stable fingerprint)."""
        for name in ("model", "drafter", "ngram"):
            v = getattr(self, name)
            if isinstance(v, os.PathLike):
                v = os.fspath(v)
                object.__setattr__(self, name, v)
            _check(v is None or isinstance(v, str), f"{name} must be a string or null, got {v!r}")
        for name in ("method", "dtype", "device"):
            v = getattr(self, name)
            _check(isinstance(v, str), f"{name} must be a string, got {v!r}")
        _coerce_numbers(self)
        _check(isinstance(self.adaptive, bool),
               f"adaptive must be a boolean, got {self.adaptive!r}")
        _check(self.pack_weights is None or isinstance(self.pack_weights, bool),
               f"pack_weights must be a boolean or null (auto), got {self.pack_weights!r}")

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    # ---- the one path: dict, command line, fingerprint -------------------------------------------
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The settings, in declaration order (the keys of :meth:`to_dict`)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | EngineConfig) -> EngineConfig:
        """An EngineConfig from its fields as a mapping (YAML/JSON form; ``decoding`` may be a
        mapping of :class:`DecodingConfig` fields, null = the defaults). Unknown keys are an error
        naming the known ones; an EngineConfig passes through."""
        if isinstance(d, EngineConfig):
            return d
        _check(isinstance(d, Mapping),
               f"engine config must be a mapping of EngineConfig fields, got {d!r}")
        names = cls.field_names()
        unknown = sorted(set(d) - set(names))
        _check(not unknown, f"unknown EngineConfig fields {unknown}; known: {list(names)}")
        kw = dict(d)
        dec = kw.get("decoding", DecodingConfig())
        if dec is None:
            dec = DecodingConfig()
        elif isinstance(dec, Mapping):
            dec = DecodingConfig.from_dict(dict(dec))
        kw["decoding"] = dec
        return cls(**kw)

    def to_dict(self) -> dict:
        """The fields as plain data (``decoding`` as a dict): ``from_dict(to_dict())`` is the same
        config."""
        return dataclasses.asdict(self)

    @classmethod
    def from_args(cls, namespace: argparse.Namespace,
                  base: EngineConfig | Mapping[str, Any] | None = None) -> EngineConfig:
        """The config of a command line parsed with :func:`add_engine_args`: ``base`` (default: the
        defaults) with every engine flag that was given (or defaulted by the command) on top.
        ``--decoding`` knobs go over ``base``'s knobs. ``--method ar`` means ``none``;
        ``--method auto`` is resolved now (:func:`resolve_method`)."""
        merged = cls.from_dict(base if base is not None else {}).to_dict()
        given = engine_args(namespace)
        if "decoding" in given:
            given["decoding"] = {**merged["decoding"], **canonical_decoding_keys(given["decoding"])}
        merged.update(given)
        merged["method"] = resolve_method(merged["method"], merged["model"], merged["drafter"])
        return cls.from_dict(merged)

    def fingerprint(self, exclude: Iterable[str] = ()) -> dict:
        """The settings that affect outputs or speed, as a flat JSON-able dict with sorted keys:
        every field, decoding knobs as ``decoding.<name>``. ``exclude`` drops fields (``"decoding"``
        drops every knob). Tune studies and batch outputs record it and refuse to resume under
        another one; :meth:`fingerprint_digest` is its short hash."""
        flat = self.to_dict()
        dec = flat.pop("decoding")
        flat.update({f"decoding.{k}": v for k, v in dec.items()})
        exclude = set(exclude)
        unknown = exclude - set(flat) - {"decoding"}
        _check(not unknown, f"fingerprint: unknown fields to exclude {sorted(unknown)}")
        return {k: flat[k] for k in sorted(flat)
                if k not in exclude and not ("decoding" in exclude and k.startswith("decoding."))}

    def fingerprint_digest(self, exclude: Iterable[str] = ()) -> str:
        """16 hex digits of SHA-256 over :meth:`fingerprint` (canonical JSON): equal iff the
        fingerprints are."""
        text = json.dumps(self.fingerprint(exclude), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- command line --------------------------------------------------------------------------------
METHOD_ALIASES = {"ar": "none"}
"""Command-line spellings of method names (``--method ar``)."""


def resolve_method(method: str, model: str | None, drafter: str | None) -> str:
    """``ar`` -> ``none``; ``auto`` -> ``dart`` when a drafter is given or a DART drafter is shipped
    for the target, else ``ngram``; any other name is returned as is (validated by EngineConfig)."""
    method = METHOD_ALIASES.get(method, method)
    if method != "auto":
        return method
    if drafter:
        return "dart"
    from dart_ray.drafters import default_artifact_dir
    from dart_ray.methods import get_method
    from dart_ray.models.loading import model_id_for, resolve_model_dir

    spec = get_method("dart")
    artifacts = default_artifact_dir(model_id_for(resolve_model_dir(model)))
    shipped = artifacts / spec.artifact_dir / spec.config_file
    return "dart" if shipped.is_file() else "ngram"


def _json_mapping(text: str) -> dict:
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("expected a JSON object of DecodingConfig fields")
    return v


def _engine_flags() -> list[tuple[str, tuple[str, ...], dict]]:
    """(field, option strings, add_argument kwargs) per EngineConfig field; dest = field name,
    except ``seed`` (``--drafter-seed``, dest ``drafter_seed``: ``--seed`` is every command's
    sampling seed)."""
    d = EngineConfig()
    return [
        ("model", ("--model",), {
            "help": "HF model dir or .gguf file (default or 'default': embedded "
                    "SmolLM2-135M-Instruct)"}),
        ("method", ("--method",), {
            "choices": ["auto", *method_names(), *METHOD_ALIASES],
            "help": f"drafting method (default: {d.method}); auto = dart if a trained DART drafter "
                    "is given or shipped for the model, else ngram; ar = none (plain decoding)"}),
        ("drafter", ("--drafter",), {
            "help": "drafter dir for the method ('random' = untrained dart/eagle; default: "
                    "shipped)"}),
        ("ngram", ("--ngram",), {"help": "N-gram model dir ('none' disables; default: shipped)"}),
        ("dtype", ("--dtype",), {
            "choices": list(DTYPES),
            "help": f"default {d.dtype}: bf16 where this machine runs it natively and fast, else "
                    "fp32 (measured)"}),
        ("device", ("--device",), {"help": f"torch device (default: {d.device})"}),
        ("max_batch_size", ("--max-batch-size",), {
            "type": int,
            "help": f"KV-cache rows = requests decoded together (default: {d.max_batch_size})"}),
        ("max_seq_len", ("--max-seq-len",), {
            "type": int,
            "help": f"tokens one request can use, prompt + generated (default: {d.max_seq_len})"}),
        ("num_threads", ("--num-threads", "--threads"), {
            "type": int, "help": "torch CPU threads (default: torch's)"}),
        ("pack_weights", ("--pack-weights",), {
            "action": argparse.BooleanOptionalAction,
            "help": "prepack the target's linears for oneDNN (default: where it measures faster "
                    "here)"}),
        ("adaptive", ("--adaptive",), {
            "action": argparse.BooleanOptionalAction,
            "help": "size the draft tree every step from measured costs, down to plain AR "
                    "(default: on); --no-adaptive always verifies the configured tree"}),
        ("seed", ("--drafter-seed",), {
            "type": int, "dest": "drafter_seed",
            "help": "seed of a randomly initialised drafter (--drafter random; default: "
                    f"{d.seed})"}),
        ("decoding", ("--decoding",), {
            "type": _json_mapping, "metavar": "JSON",
            "help": "DecodingConfig knobs over the defaults, e.g. '{\"tree_budget\": 40}'"}),
    ]


def add_engine_args(parser: argparse.ArgumentParser, *, title: str = "engine",
                    help: Mapping[str, str] | None = None,
                    **defaults: Any) -> argparse._ArgumentGroup:
    """Add one flag per :class:`EngineConfig` field to ``parser`` (an argument group ``title``);
    read them back with :meth:`EngineConfig.from_args` (or :func:`engine_args` for the given ones).

    Flags left out parse as None (= ``base``'s value in ``from_args``), so a command can tell "not
    given" from a value. ``defaults``: per-field command defaults (``method="auto"``,
    ``max_batch_size=1``); ``help``: per-field help text replacing the generic one.
    ``--threads`` is kept as an alias of ``--num-threads``; ``--no-adaptive`` is the old
    spelling."""
    names = set(EngineConfig.field_names())
    unknown = (set(defaults) | set(help or {})) - names
    if unknown:
        raise ValueError(f"add_engine_args: unknown EngineConfig fields {sorted(unknown)}")
    group = parser.add_argument_group(title)
    for name, flags, kwargs in _engine_flags():
        kw = dict(kwargs)
        kw.setdefault("dest", name)
        kw["default"] = defaults.get(name)
        if help and name in help:
            kw["help"] = help[name]
        elif name in defaults:
            kw["help"] += f"; this command's default: {defaults[name]}"
        group.add_argument(*flags, **kw)
    return group


class _RenamedFlag(argparse.Action):
    """An old flag spelling: hidden from ``--help``; warns (:class:`RenamedWarning`), then stores
    its value where the new flag does."""

    def __init__(self, option_strings, dest, new_flag: str, **kwargs) -> None:
        self.new_flag = new_flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        warn_renamed(option_string, self.new_flag, "flag")
        setattr(namespace, self.dest, values)


def add_renamed_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, old: str, new: str,
                     dest: str, **kwargs: Any) -> None:
    """Keep ``old`` working for one release as a hidden alias of the flag ``new`` (destination
    ``dest``; ``kwargs`` such as ``type`` as for the new flag), warning when it is used."""
    parser.add_argument(old, dest=dest, action=_RenamedFlag, new_flag=new, help=argparse.SUPPRESS,
                        default=argparse.SUPPRESS, **kwargs)


PATH_FIELDS = {"model": "default", "drafter": "random", "ngram": "none"}
"""EngineConfig fields naming files, and the one word each takes that is not a path."""


def engine_args(namespace: argparse.Namespace) -> dict:
    """The engine fields a command line set (flags of :func:`add_engine_args` that are not None).
    A relative ``--model``/``--drafter``/``--ngram`` that exists here is made absolute: the config
    travels to processes with another working directory (Tune trials run in their trial
    directories)."""
    out = {}
    for name, _, kwargs in _engine_flags():
        v = getattr(namespace, kwargs.get("dest", name), None)
        if v is not None:
            if name in PATH_FIELDS and v != PATH_FIELDS[name] \
                    and os.path.exists(os.path.expanduser(v)):
                v = os.path.abspath(os.path.expanduser(v))
            out[name] = v
    return out


def parse_int_list(text: str | Sequence[int]) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (lists pass through)."""
    if isinstance(text, str):
        return [int(t) for t in text.split(",") if t.strip()]
    return [int(t) for t in text]
