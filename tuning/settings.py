"""What ``dart-ray tune`` is asked to do: :class:`TuneSettings` (validated at construction) and
the bounds it is checked against. The phases (``tuning.start``, ``tuning.search``,
``tuning.choose``, ``tuning.write``) read it; :func:`tuning.runner.run_tune` runs them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dart_ray import METHODS, EngineConfig
from dart_ray.config import DTYPES
from tuning import study as studies
from tuning.objective import LOAD_THRESHOLD

MAX_BATCH_BOUND = 1024
TUNABLE_METHODS = tuple(m for m in METHODS if m != "none")
DEFAULT_TRIALS = 30
"""Trials per batch size of a cold tune."""
WARM_TRIALS = 12
"""Trials per batch size of a warm-started tune (``--for-this-machine``)."""


@dataclass
class TuneSettings:
    prompts: str
    """Prompt file (.jsonl/.parquet with a 'prompt' column) or a built-in set (humaneval, chat)."""
    workload: str
    """Workload name: the profile's name and the study prefix."""
    out: str
    """Profile YAML to write (plots, and by default the study database, go next to it)."""
    batch_sizes: Sequence[int] = (1, 4, 16)
    """Batch sizes to tune (each gets its own study and profile entry)."""
    trials: int | None = None
    """Target number of finished trials per batch size (resumed studies count earlier trials);
    default :data:`DEFAULT_TRIALS`, or :data:`WARM_TRIALS` with a warm start."""
    time_budget_s: float | None = None
    """Wall-clock budget of the whole run (setup, tuning, evaluation)."""
    storage: str | None = None
    """Optuna RDB URL; default ``sqlite:///<out dir>/tune.db``."""
    results_dir: str | None = None
    """Ray Tune storage path; default ``<out dir>/tune_results``."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The measuring engine (a mapping is read with ``EngineConfig.from_dict``): its ``method``'s
    knobs are tuned (not ``none``); ``max_batch_size`` is set to the largest tuned batch size and
    ``num_threads`` (None) to the CPUs of a trial."""
    max_new_tokens: int = 128
    """Cap on each answer's length (answers end at EOS before it, as served)."""
    ignore_eos: bool = False
    """True: fixed-length answers (the pre-issue-15 objective, for comparison only)."""
    chat: bool = False
    """Apply the chat template to prompts."""
    num_prompts: int = 64
    """Prompts sampled from the file (then split into tune / eval)."""
    eval_fraction: float = 0.25
    """Share of the sampled prompts held out for the default-vs-tuned evaluation."""
    prompts_per_trial: int | None = None
    """Prompts measured per trial; default max(8, 2 * batch size), capped by the tune split."""
    reports_per_trial: int = 8
    """Incremental throughput reports per trial; ASHA's rungs sit at 1, 2, 4, ... reports. With
    the default 8 prompts per trial that is a report per finished answer, so a poor trial stops
    after one answer (every trial answers the same prompts in the same order, so the rungs compare
    like with like)."""
    check_prompts: int = 2
    """Prompts per trial checked token-for-token against AR (exactness gate)."""
    check_tokens: int | None = None
    """Tokens generated per exactness-check prompt; default min(max_new_tokens, 32)."""
    check_dtype: str | None = "fp32"
    """dtype of the exactness check (None = the measuring engine's)."""
    objective: str = "throughput"
    """``throughput`` (maximise tokens/s) or ``throughput+p95`` (also minimise p95 request
    latency)."""
    p95_max_ratio: float = 1.0
    """``throughput+p95``: the chosen point's p95 latency may be at most this multiple of the
    default knobs' p95 at the same batch size (on the tune split, then on the eval split)."""
    p95_max_s: float | None = None
    """``throughput+p95``: an absolute p95 latency bound in seconds (combined with the ratio: both
    hold)."""
    warm_start: str | None = None
    """Profile (name or path) whose knobs are enqueued as the first trials; '' = the shipped
    profile named like the workload; None = cold start."""
    load_probe_tokens: int = 16
    """Tokens of the AR load probe around each trial (0 disables load detection)."""
    load_threshold: float = LOAD_THRESHOLD
    """A probe this much slower than the fastest one marks the machine as loaded (re-run, then
    flag); ``tuning.objective.LOAD_THRESHOLD`` says why 0.3."""
    cpus_per_trial: float | None = None
    """Default: all CPUs of the Ray cluster (trials run one at a time so they do not disturb each
    other)."""
    gpus_per_trial: float | None = None
    """Default: 1 with a CUDA device, else 0."""
    max_concurrent_trials: int = 1
    """Trials run at once (1: measurements do not disturb each other)."""
    eval_repeats: int = 3
    """Held-out runs per config (median)."""
    seed: int = 0
    """Seed of the prompt split and the sampler."""
    plots: bool = True
    """Write PNG plots next to the profile."""
    ray_address: str | None = None
    """Join a running Ray cluster (default: ``RAY_ADDRESS`` if set, else a new local Ray)."""
    ray_temp_dir: str | None = None
    """Ray session dir when starting Ray."""
    ray_num_cpus: int | None = None
    """CPUs of a Ray started here (default: all)."""

    def __post_init__(self) -> None:
        self.engine = EngineConfig.from_dict(self.engine)
        self.batch_sizes = sorted({int(b) for b in self.batch_sizes})
        bs = self.batch_sizes
        if not bs or bs[0] < 1 or bs[-1] > MAX_BATCH_BOUND:
            raise ValueError(f"batch sizes must be in [1, {MAX_BATCH_BOUND}], got "
                             f"{self.batch_sizes}")
        if self.trials is None:
            self.trials = WARM_TRIALS if self.warm_start is not None else DEFAULT_TRIALS
        if self.trials < 1:
            raise ValueError("trials must be >= 1")
        if self.engine.method not in TUNABLE_METHODS:
            raise ValueError(f"method must be one of {TUNABLE_METHODS} (AR has no knobs), "
                             f"got {self.engine.method!r}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError("time budget must be > 0 seconds")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError("eval fraction must be in [0, 1)")
        if self.max_new_tokens < 1 or self.num_prompts < 1 or self.reports_per_trial < 1:
            raise ValueError("max-new-tokens, num-prompts and reports-per-trial must be >= 1")
        if not self.workload or any(c in self.workload for c in "/\\ "):
            raise ValueError(f"workload must be a plain name, got {self.workload!r}")
        if self.objective not in studies.OBJECTIVES:
            raise ValueError(f"objective must be one of {studies.OBJECTIVES}, got "
                             f"{self.objective!r}")
        if self.p95_max_ratio <= 0 or (self.p95_max_s is not None and self.p95_max_s <= 0):
            raise ValueError("p95 bounds must be > 0")
        if self.load_probe_tokens < 0 or not 0.0 < self.load_threshold < 1.0:
            raise ValueError("load probe tokens must be >= 0 and the load threshold in (0, 1)")
        concrete = [d for d in DTYPES if d != "auto"]      # the check's dtype is not measured
        if self.check_dtype is not None and self.check_dtype not in concrete:
            raise ValueError(f"check dtype must be one of {concrete} or 'same', got "
                             f"{self.check_dtype!r}")
        if self.prompts_per_trial is not None and self.prompts_per_trial < 1:
            raise ValueError(f"prompts per trial must be >= 1, got {self.prompts_per_trial}")
        if self.check_prompts < 0 or (self.check_tokens is not None and self.check_tokens < 1):
            raise ValueError("check prompts must be >= 0 (0 turns the exactness check off) and "
                             "check tokens >= 1")
        if self.eval_repeats < 1 or self.max_concurrent_trials < 1:
            raise ValueError("eval repeats and max concurrent trials must be >= 1")
        if self.cpus_per_trial is not None and self.cpus_per_trial <= 0:
            raise ValueError(f"cpus per trial must be > 0, got {self.cpus_per_trial}")
        if self.gpus_per_trial is not None and self.gpus_per_trial < 0:
            raise ValueError(f"gpus per trial must be >= 0, got {self.gpus_per_trial}")
        out = self.out_path
        if out.is_dir():
            raise ValueError(f"--out {self.out} is a directory; name the profile YAML to write")
        if self.storage is not None:
            from sqlalchemy.engine import make_url
            from sqlalchemy.exc import ArgumentError

            try:
                make_url(self.storage)
            except ArgumentError as e:
                raise ValueError(f"--storage is not a database URL: {e}") from None

    @property
    def out_path(self) -> Path:
        return Path(self.out).expanduser().resolve()

    @property
    def storage_url(self) -> str:
        return self.storage or studies.default_storage_url(self.out_path.parent)

    @property
    def storage_display(self) -> str:
        """The storage URL with any password hidden (logs, profile meta)."""
        try:
            from sqlalchemy.engine import make_url

            return make_url(self.storage_url).render_as_string(hide_password=True)
        except Exception:
            return self.storage_url

    @property
    def results_path(self) -> Path:
        return Path(self.results_dir).expanduser().resolve() if self.results_dir else \
            self.out_path.parent / "tune_results"

    @property
    def multi_objective(self) -> bool:
        return self.objective != "throughput"

    def p95_bound(self, default_p95: float | None) -> float | None:
        """The p95 latency bound given the default knobs' p95 (None: unbounded / unknown)."""
        bounds = [b for b in (None if default_p95 is None else self.p95_max_ratio * default_p95,
                              self.p95_max_s)
                  if b is not None]
        return min(bounds) if bounds else None
