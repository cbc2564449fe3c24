"""Orchestration of ``dart-ray tune``: per batch size, an Optuna study driven through Ray Tune,
then a held-out evaluation of default vs best and a per-batch-size decoding profile.

    run_tune(TuneSettings(...)) ->
        start   : prompts (seeded tune / eval split), Ray, the engine loaded once in the driver
                  (drafter depth -> search space; hardware fingerprint; held-out evaluation), and the
                  warm-start profile (``--for-this-machine``)
        search  : for B in batch sizes:
                    study = <workload>.bs<B>[.p95] in the RDB storage (resumed if it exists; see
                            tuning.study); a fresh study gets the warm-start knobs, then the default,
                            as its first trials
                    Tuner(with_resources(trainable), OptunaSearch(study) + ASHA, reuse_actors=True,
                          num_samples = target - finished, time_budget_s = share of what is left)
        choose  : for B: best trial (single objective) or the highest-throughput Pareto point within
                  the p95 bound (``throughput+p95``); default vs that on the eval split, interleaved
                  repeats, median tokens/s (and p95 latency)
        write   : profile = workload -> batch-size ranges -> DecodingConfig, with meta (how it was
                  tuned, gains, ``meta.fingerprint`` / ``meta.cpu`` of the measuring machine); plots

**What a trial measures** (``tuning.objective``): the workload as it is served. EOS is honoured,
answers keep their natural lengths up to ``max_new_tokens`` (a cap, default 128), prompts are
streamed with continuous batching at the trial's batch size, and throughput is generated tokens /
wall seconds of the engine steps (drafting, tree search and verification included). A short AR
probe around every trial detects a loaded machine: the trial is re-run once, then flagged
(``load_flag``) and not chosen (if every trial is flagged, the best of them still faces the held-out
evaluation, and the profile's meta says so).

**Adaptive engine.** Trials run the engine as served: ``EngineConfig.adaptive`` stays on (the
default), so the controller sizes each step's tree from the measured cost model. The tuned knobs
are therefore the controller's *starting point and cap* (``tree_budget`` bounds the nodes it may
verify; the tree shape knobs decide which nodes come first), and the measured throughput is what a
server applying the profile gets on this machine.

**Objectives.** ``throughput`` (default): maximise tokens/s. ``throughput+p95``: a two-objective
study (maximise tokens/s, minimise p95 per-request latency, Optuna's multi-objective TPE); the
profile takes the highest-throughput Pareto point whose p95 is within the bound
``min(p95_max_ratio x the default knobs' p95, p95_max_s)`` at that batch size (default: no worse
than the defaults), and the Pareto front is plotted (``<out>.pareto.png``).

**Warm start** (``--for-this-machine [PROFILE]``): the given (default: the shipped profile named
like ``--workload``) profile's knobs for each batch size are Optuna's first trials, followed by
its other entries and the defaults; fewer trials by default (:data:`WARM_TRIALS`). The profile
written carries this machine's fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from dart_ray import (
    METHODS,
    DecodingConfig,
    DecodingSchedule,
    Engine,
    EngineConfig,
    SamplingParams,
    save_profile,
)
from tuning import study as studies
from tuning.objective import TrialJob, stream_workload
from tuning.space import SearchSpace

MAX_BATCH_BOUND = 1024
TUNABLE_METHODS = tuple(m for m in METHODS if m != "none")
EVAL_RESERVE = 0.2
"""Share of the time budget kept for the held-out evaluation."""
DEFAULT_TRIALS = 30
"""Trials per batch size of a cold tune."""
WARM_TRIALS = 12
"""Trials per batch size of a warm-started tune (``--for-this-machine``)."""
WARM_STARTUP_TRIALS = 4
"""TPE start-up (random) trials of a warm-started study (a cold one uses 8)."""


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
    model: str | None = None
    """Target model (HF dir or .gguf; None = the embedded default)."""
    method: str = "dart"
    """Speculative method whose knobs are tuned (not ``none``)."""
    drafter: str | None = None
    """Drafter dir for the method (None = shipped; 'random' = untrained)."""
    ngram: str | None = None
    """N-gram model dir (None = shipped; 'none' disables)."""
    dtype: str = "auto"
    """Engine dtype (``auto`` = what is fast here; see ``dart_ray.hardware``)."""
    device: str = "cpu"
    """Torch device of the engine."""
    max_seq_len: int = 2048
    """Engine context length."""
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
    reports_per_trial: int = 4
    """Incremental throughput reports per trial (ASHA rungs)."""
    check_prompts: int = 2
    """Prompts per trial checked token-for-token against AR (exactness gate)."""
    check_tokens: int | None = None
    """Tokens generated per exactness-check prompt; default min(max_new_tokens, 32)."""
    check_dtype: str | None = "fp32"
    """dtype of the exactness check (None = the measuring engine's)."""
    objective: str = "throughput"
    """``throughput`` (maximise tokens/s) or ``throughput+p95`` (also minimise p95 request latency)."""
    p95_max_ratio: float = 1.0
    """``throughput+p95``: the chosen point's p95 latency may be at most this multiple of the
    default knobs' p95 at the same batch size (on the tune split, then on the eval split)."""
    p95_max_s: float | None = None
    """``throughput+p95``: an absolute p95 latency bound in seconds (combined with the ratio: both hold)."""
    warm_start: str | None = None
    """Profile (name or path) whose knobs are enqueued as the first trials; '' = the shipped
    profile named like the workload; None = cold start."""
    load_probe_tokens: int = 16
    """Tokens of the AR load probe around each trial (0 disables load detection)."""
    load_threshold: float = 0.15
    """A probe this much slower than the fastest one marks the machine as loaded (re-run, then flag)."""
    cpus_per_trial: float | None = None
    """Default: all CPUs of the Ray cluster (trials run one at a time so they do not disturb each other)."""
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
    """Join a running Ray cluster (default: start one)."""
    ray_temp_dir: str | None = None
    """Ray session dir when starting Ray."""
    ray_num_cpus: int | None = None
    """CPUs of a Ray started here (default: all)."""

    def __post_init__(self) -> None:
        self.batch_sizes = sorted({int(b) for b in self.batch_sizes})
        if not self.batch_sizes or self.batch_sizes[0] < 1 or self.batch_sizes[-1] > MAX_BATCH_BOUND:
            raise ValueError(f"batch sizes must be in [1, {MAX_BATCH_BOUND}], got {self.batch_sizes}")
        if self.trials is None:
            self.trials = WARM_TRIALS if self.warm_start is not None else DEFAULT_TRIALS
        if self.trials < 1:
            raise ValueError("trials must be >= 1")
        if self.method not in TUNABLE_METHODS:
            raise ValueError(f"method must be one of {TUNABLE_METHODS} (AR has no knobs), got {self.method!r}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError("time budget must be > 0 seconds")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError("eval fraction must be in [0, 1)")
        if self.max_new_tokens < 1 or self.num_prompts < 1 or self.reports_per_trial < 1:
            raise ValueError("max-new-tokens, num-prompts and reports-per-trial must be >= 1")
        if not self.workload or any(c in self.workload for c in "/\\ "):
            raise ValueError(f"workload must be a plain name, got {self.workload!r}")
        if self.objective not in studies.OBJECTIVES:
            raise ValueError(f"objective must be one of {studies.OBJECTIVES}, got {self.objective!r}")
        if self.p95_max_ratio <= 0 or (self.p95_max_s is not None and self.p95_max_s <= 0):
            raise ValueError("p95 bounds must be > 0")
        if self.load_probe_tokens < 0 or not 0.0 < self.load_threshold < 1.0:
            raise ValueError("load probe tokens must be >= 0 and the load threshold in (0, 1)")

    @property
    def out_path(self) -> Path:
        return Path(self.out).expanduser().resolve()

    @property
    def storage_url(self) -> str:
        return self.storage or studies.default_storage_url(self.out_path.parent)

    @property
    def results_path(self) -> Path:
        return Path(self.results_dir).expanduser().resolve() if self.results_dir else \
            self.out_path.parent / "tune_results"

    @property
    def multi_objective(self) -> bool:
        return self.objective != "throughput"

    def p95_bound(self, default_p95: float | None) -> float | None:
        """The p95 latency bound given the default knobs' p95 (None: unbounded / unknown)."""
        bounds = [b for b in (None if default_p95 is None else self.p95_max_ratio * default_p95, self.p95_max_s)
                  if b is not None]
        return min(bounds) if bounds else None


@dataclass
class BatchResult:
    batch_size: int
    study_name: str
    counts: dict
    ran_trials: int
    default_params: dict
    best_params: dict | None
    best_trial: int | None
    default_tps: float | None = None
    best_tps: float | None = None
    tau_default: float | None = None
    tau_best: float | None = None
    default_p95: float | None = None
    best_p95: float | None = None
    p95_bound: float | None = None
    """``throughput+p95``: the latency bound the choice honoured (tune split)."""
    chosen: str = "default"
    note: str = ""
    eval_runs: int = 0
    outputs_equal: bool | None = None
    """Tuned and default greedy outputs identical on the eval split (fp32: required; half: informative)."""
    warm_trials: int = 0
    """Warm-start points enqueued into this (fresh) study."""

    @property
    def gain(self) -> float | None:
        if self.default_tps and self.best_tps and self.chosen == "tuned":
            return self.best_tps / self.default_tps
        return 1.0 if self.default_tps else None


@dataclass
class TuneOutcome:
    profile_path: Path
    schedule: DecodingSchedule
    results: list[BatchResult]
    studies: dict = field(default_factory=dict)
    plots: list[Path] = field(default_factory=list)
    elapsed_s: float = 0.0
    summary: str = ""


class Deadline:
    def __init__(self, budget_s: float | None) -> None:
        self.t0 = time.monotonic()
        self.budget = budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return math.inf if self.budget is None else self.budget - self.elapsed()


@dataclass
class TuneRun:
    """What every phase of one ``run_tune`` shares."""

    settings: TuneSettings
    deadline: Deadline
    tune_prompts: list[str]
    eval_prompts: list[str]
    engine: Engine
    engine_config: EngineConfig
    space: SearchSpace
    threads: int
    cpus: float
    log: Callable[[str], None]
    warm: DecodingSchedule | None = None
    """The warm-start profile (``--for-this-machine``), if any."""
    warm_differences: list[str] = field(default_factory=list)
    """How the warm-start profile's recorded hardware differs from this machine's."""
    studies: dict = field(default_factory=dict)
    """batch size -> Optuna study."""

    @property
    def params(self) -> SamplingParams:
        """What the workload's requests ask for: EOS honoured, length capped."""
        s = self.settings
        return SamplingParams(max_new_tokens=s.max_new_tokens, ignore_eos=s.ignore_eos)


def split_prompts(prompts: list[str], n: int, eval_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Seeded sample of ``n`` prompts, split into (tune, eval)."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    chosen = [prompts[i] for i in order[:n]]
    n_eval = int(round(len(chosen) * eval_fraction)) if len(chosen) >= 2 else 0
    n_eval = min(n_eval, len(chosen) - 1)
    return chosen[n_eval:], chosen[:n_eval]


def _digest(items: Sequence[str]) -> str:
    h = hashlib.sha256()
    for p in items:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _engine_fields(cfg: EngineConfig) -> dict:
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "decoding"}
    return d


def _safe_url(url: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


def _init_ray(s: TuneSettings) -> bool:
    """Start (or join) Ray; True if this call started it (and should shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    kw: dict = {"include_dashboard": False, "logging_level": "WARNING"}
    if s.ray_address:
        kw["address"] = s.ray_address
    else:
        if s.ray_num_cpus:
            kw["num_cpus"] = s.ray_num_cpus
        if s.ray_temp_dir:
            kw["_temp_dir"] = s.ray_temp_dir
    ray.init(**kw)
    return True


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


# ---- start ----------------------------------------------------------------------------------------

def load_warm_start(s: TuneSettings) -> DecodingSchedule | None:
    """The ``--for-this-machine`` profile (given, or the shipped one named like the workload)."""
    if s.warm_start is None:
        return None
    from dart_ray.profiles import load_profile

    return load_profile(s.warm_start or s.workload)


def warm_points(warm: DecodingSchedule | None, batch_size: int) -> list[dict]:
    """Knobs to enqueue first at ``batch_size``: the profile's entry for it, then its other entries."""
    if warm is None:
        return []
    first = warm.for_batch_size(batch_size)
    rest = [cfg for _, cfg in warm.entries if cfg != first]
    return [cfg.to_dict() for cfg in [first, *rest]]


def start_tune(s: TuneSettings, deadline: Deadline, log: Callable[[str], None], prompts: list[str],
               warm: DecodingSchedule | None) -> TuneRun:
    """Prompt split, resources and the driver's engine (Ray must be initialised: the CPU count
    comes from it)."""
    import ray

    from dart_ray.profiles import hardware_differences

    tune_p, eval_p = split_prompts(prompts, s.num_prompts, s.eval_fraction, s.seed)
    if not eval_p:
        log("note: too few prompts for a held-out split; evaluating on the tune prompts")
        eval_p = tune_p
    log(f"workload {s.workload!r}: {len(tune_p)} tune + {len(eval_p)} eval prompts from {s.prompts}; "
        f"batch sizes {list(s.batch_sizes)}; {s.trials} trials each; objective {s.objective}; "
        f"answers <= {s.max_new_tokens} tokens{' (ignore_eos)' if s.ignore_eos else ', EOS honoured'}; "
        f"storage {_safe_url(s.storage_url)}")

    cluster_cpus = float(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
    cpus = float(s.cpus_per_trial) if s.cpus_per_trial else cluster_cpus
    if cpus > cluster_cpus:
        raise ValueError(f"--cpus-per-trial {cpus} exceeds the cluster's {cluster_cpus} CPUs")
    threads = max(1, int(cpus))
    if s.gpus_per_trial is None:
        s.gpus_per_trial = 1.0 if s.device.startswith("cuda") else 0.0

    ecfg = EngineConfig(model=s.model, method=s.method, drafter=s.drafter, ngram=s.ngram, dtype=s.dtype,
                        device=s.device, max_batch_size=max(s.batch_sizes), max_seq_len=s.max_seq_len,
                        num_threads=threads, seed=s.seed)
    log("loading the engine in the driver (drafter depth, hardware, held-out evaluation)...")
    engine = Engine.from_config(ecfg)
    log(f"machine: {engine.fingerprint.summary()}")
    space = SearchSpace.for_engine(engine, DecodingConfig())
    log(f"search space ({engine.drafter.name}, trained depth {engine.drafter.max_depth}): "
        + ", ".join(f"{p.name}[{_fmt(p.low)}..{_fmt(p.high)}{' log' if p.log else ''}]" for p in space.params))
    run = TuneRun(s, deadline, tune_p, eval_p, engine, ecfg, space, threads, cpus, log, warm)
    if warm is not None:
        run.warm_differences = hardware_differences(warm, engine.fingerprint)
        where = "; ".join(run.warm_differences) or "this machine (same fingerprint)"
        log(f"warm start from {warm.source or warm.workload}: tuned on {where}")
    return run


# ---- search ---------------------------------------------------------------------------------------

def _study_fingerprint(run: TuneRun, n_trial: int, check: tuple, check_tokens: int) -> dict:
    """The setup a study's trials were measured under (resuming with another one is refused)."""
    s = run.settings
    return {
        "model": str(s.model), "method": s.method, "drafter": str(s.drafter), "ngram": str(s.ngram),
        "dtype": s.dtype, "device": s.device, "max_seq_len": s.max_seq_len,
        "max_new_tokens": s.max_new_tokens, "ignore_eos": s.ignore_eos, "objective": s.objective,
        "chat": s.chat, "threads": run.threads, "hardware": run.engine.fingerprint.to_dict(),
        "prompts": _digest(run.tune_prompts[:n_trial]), "check": _digest(check),
        "check_dtype": str(s.check_dtype), "check_tokens": check_tokens,
        "space": json.dumps(run.space.to_dict(), sort_keys=True)}


def _trial_job(run: TuneRun, b: int, n_trial: int, report_every: int, check: tuple, check_tokens: int) -> TrialJob:
    s = run.settings
    return TrialJob(engine=_engine_fields(run.engine_config), batch_size=b, prompts=tuple(run.tune_prompts[:n_trial]),
                    check_prompts=check, max_new_tokens=s.max_new_tokens, base_decoding=run.space.base.to_dict(),
                    chat=s.chat, report_every=report_every, check_dtype=s.check_dtype, num_threads=run.threads,
                    check_max_new_tokens=check_tokens, ignore_eos=s.ignore_eos,
                    load_probe_tokens=s.load_probe_tokens, load_threshold=s.load_threshold)


def search_batch_size(run: TuneRun, storage, index: int, b: int, callbacks: Sequence) -> BatchResult:
    """Prepare (or resume) the study of batch size ``b`` and run its missing trials."""
    s, log = run.settings, run.log
    n_trial = min(len(run.tune_prompts), s.prompts_per_trial or max(8, 2 * b))
    report_every = max(1, math.ceil(n_trial / s.reports_per_trial))
    n_reports = math.ceil(n_trial / report_every)
    check = tuple(run.tune_prompts[:max(0, s.check_prompts)])
    check_tokens = s.check_tokens or min(s.max_new_tokens, 32)
    name = studies.study_name(s.workload, b, s.objective)
    status = studies.prepare_study(storage, name, _study_fingerprint(run, n_trial, check, check_tokens), run.space,
                                   s.trials, warm_start=warm_points(run.warm, b), objective=s.objective)
    run.studies[b] = status.study
    warm_n = sum(1 for t in status.study.get_trials(deepcopy=False) if t.user_attrs.get("warm_start")) \
        if status.fresh and run.warm is not None else 0
    msg = f"[bs={b}] study {name}: {status.finished} finished, {status.remaining} to run"
    if warm_n:
        msg += f", {warm_n} warm-start point(s) first"
    elif run.warm is not None and not status.fresh:
        msg += " (resumed: no warm-start points enqueued)"
    if status.requeued:
        msg += f", {status.requeued} interrupted trial(s) re-enqueued"
    log(msg)
    ran = 0
    if status.remaining > 0:
        left_for_tune = run.deadline.left() - (s.time_budget_s or 0) * EVAL_RESERVE
        budget = None if s.time_budget_s is None else left_for_tune / (len(s.batch_sizes) - index)
        if budget is not None and budget < 5:
            log(f"[bs={b}] skipped: time budget exhausted")
        else:
            job = _trial_job(run, b, n_trial, report_every, check, check_tokens)
            ran = _run_batch_size(run, b, job, status, budget, n_reports, callbacks)
    return BatchResult(batch_size=b, study_name=name, counts=_counts(status.study), ran_trials=ran,
                       default_params=run.space.default_point(), best_params=None, best_trial=None,
                       warm_trials=warm_n)


def _run_batch_size(run: TuneRun, b: int, job: TrialJob, status: studies.StudyStatus, budget_s: float | None,
                    n_reports: int, callbacks: Sequence) -> int:
    """One Tune experiment for one batch size; returns the number of trials it started."""
    from ray import tune

    from tuning.callbacks import Progress
    from tuning.objective import trainable

    s, log = run.settings, run.log
    stopped: set = set()
    startup = WARM_STARTUP_TRIALS if run.warm is not None else studies.STARTUP_TRIALS
    sampler = studies.make_sampler(s.seed, status.study, n_startup_trials=startup)
    searcher = studies.make_searcher(run.space, status.study, sampler, stopped)
    scheduler = studies.make_scheduler(n_reports, stopped)
    resources = {"cpu": run.cpus, "gpu": s.gpus_per_trial or 0}
    fn = tune.with_resources(tune.with_parameters(trainable, job=job), resources)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_config = tune.RunConfig(
        name=f"{s.workload}-bs{b}-{stamp}", storage_path=str(s.results_path), verbose=0,
        callbacks=[Progress(b, s.trials, status.finished, searcher, log), *callbacks],
        failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
        checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=False))
    tune_config = tune.TuneConfig(search_alg=searcher, scheduler=scheduler, num_samples=status.remaining,
                                  max_concurrent_trials=s.max_concurrent_trials, reuse_actors=True,
                                  time_budget_s=budget_s)
    tuner = tune.Tuner(fn, tune_config=tune_config, run_config=run_config)
    t0 = time.monotonic()
    try:
        grid = tuner.fit()
    finally:
        searcher.finalize()
    # Tune turns Ctrl+C into a quiet early stop; surface it (unless the time budget ended the run)
    # so the remaining batch sizes do not start. The study keeps everything finished so far.
    out_of_time = budget_s is not None and time.monotonic() - t0 >= budget_s - 1.0
    if (len(grid) < status.remaining or searcher.interrupted) and not out_of_time:
        raise KeyboardInterrupt(f"tune of batch size {b} was interrupted")
    if searcher.interrupted:
        log(f"[bs={b}] time budget reached: {len(searcher.interrupted)} unfinished trial(s) stopped; "
            "their points are re-enqueued for the next run")
    return len(grid)


def search(run: TuneRun, callbacks: Sequence = ()) -> list[BatchResult]:
    """Every batch size's study, in order (each resumes from the storage)."""
    storage = studies.open_storage(run.settings.storage_url)
    return [search_batch_size(run, storage, i, b, callbacks) for i, b in enumerate(run.settings.batch_sizes)]


# ---- choose ---------------------------------------------------------------------------------------

def evaluate_on(engine: Engine, configs: dict[str, DecodingConfig], prompts: Sequence[str], batch_size: int,
                params: SamplingParams, chat: bool, repeats: int, deadline: Deadline) -> dict:
    """Interleaved repeats of each config on ``prompts`` (order alternates); median tokens/s, tau
    and p95 request latency."""
    runs: dict[str, list[float]] = {k: [] for k in configs}
    taus: dict[str, list[float]] = {k: [] for k in configs}
    p95s: dict[str, list[float]] = {k: [] for k in configs}
    outputs: dict[str, list[list[int]]] = {}
    names = list(configs)
    per_round = None
    for r in range(max(1, repeats)):
        if r > 0 and per_round is not None and deadline.left() < per_round:
            break
        t0 = time.monotonic()
        for name in (names if r % 2 == 0 else names[::-1]):
            engine.set_decoding(configs[name])
            engine.reset_stats()
            res = stream_workload(engine, prompts, batch_size, params, chat)
            runs[name].append(res.tokens_per_s)
            taus[name].append(engine.stats().mean_accepted_len)
            p95s[name].append(res.p95_latency_s or 0.0)
            outputs.setdefault(name, res.outputs)
        per_round = time.monotonic() - t0
    return {name: {"tokens_per_s": statistics.median(runs[name]), "runs": runs[name],
                   "tau": statistics.median(taus[name]), "p95_latency_s": statistics.median(p95s[name]),
                   "outputs": outputs[name]} for name in names}


def pick_candidate(s: TuneSettings, study, r: BatchResult, include_flagged: bool = False):
    """The trial to challenge the defaults with: the best unflagged trial (single objective), or
    the highest-throughput Pareto point within the p95 bound (``throughput+p95``)."""
    if not s.multi_objective:
        return studies.best_complete(study, include_flagged)
    dt = studies.default_trial(study)
    r.default_p95 = None if dt is None else studies.p95_latency(dt)
    r.p95_bound = s.p95_bound(r.default_p95)
    return studies.choose_within_p95(study, r.p95_bound, include_flagged)


def choose_batch_size(run: TuneRun, r: BatchResult) -> DecodingConfig:
    """Default or tuned config for ``r``'s batch size (held-out evaluation where time allows)."""
    s, space, study = run.settings, run.space, run.studies[r.batch_size]
    default_cfg = space.to_config(r.default_params)
    flagged = sum(1 for t in studies.complete_trials(study, include_flagged=True) if t.user_attrs.get("load_flag"))
    best = pick_candidate(s, study, r)
    if flagged:
        r.note = f"{flagged} trial(s) measured under load were not considered"
    if best is None and flagged and not studies.complete_trials(study):
        # every trial ran under load: their ranking is still the best evidence, but say so loudly
        best = pick_candidate(s, study, r, include_flagged=True)
        r.note = (f"all {flagged} complete trial(s) were measured under load: the best of them goes to the "
                  "held-out evaluation; re-tune on an idle machine")
    if best is None:
        r.note = _join(r.note, "no completed trial" if not studies.complete_trials(study, True) else
                       f"no Pareto point within the p95 bound ({_fmt(r.p95_bound)} s)")
        return default_cfg
    r.best_params, r.best_trial = dict(best.params), best.number
    r.best_p95 = studies.p95_latency(best)
    best_cfg = space.to_config(r.best_params)
    if best_cfg == default_cfg:
        r.note = _join(r.note, "best trial is the default")
    dt = studies.default_trial(study)
    if _eval_estimate(run, dt, best, 1 if best_cfg == default_cfg else 2) > run.deadline.left():
        return _choose_on_trials(r, dt, best, best_cfg, default_cfg)
    cands = {"default": default_cfg} if best_cfg == default_cfg else {"default": default_cfg, "tuned": best_cfg}
    ev = evaluate_on(run.engine, cands, run.eval_prompts, r.batch_size, run.params, s.chat, s.eval_repeats,
                     run.deadline)
    return _choose_on_eval(s, r, ev, best_cfg, default_cfg)


def _eval_estimate(run: TuneRun, dt, bt, n_cfg: int) -> float:
    """Seconds of one evaluation round (natural answer lengths as the trials measured them)."""
    trials = [t for t in (dt, bt) if t is not None]
    slowest = min(studies.throughput(t) for t in trials)
    lengths = [float(t.user_attrs.get("mean_new_tokens", run.settings.max_new_tokens)) for t in trials]
    return n_cfg * len(run.eval_prompts) * max(lengths) / max(slowest, 1e-9)


def _choose_on_trials(r: BatchResult, dt, bt, best_cfg: DecodingConfig, default_cfg: DecodingConfig) -> DecodingConfig:
    r.note = _join(r.note, "evaluation skipped (time budget): decided on tune-split trial values")
    r.default_tps = studies.throughput(dt) if dt is not None else None
    r.best_tps = studies.throughput(bt)
    if best_cfg != default_cfg and (r.default_tps is None or (r.best_tps or 0) > r.default_tps):
        r.chosen = "tuned"
        return best_cfg
    return default_cfg


def _choose_on_eval(s: TuneSettings, r: BatchResult, ev: dict, best_cfg: DecodingConfig,
                    default_cfg: DecodingConfig) -> DecodingConfig:
    r.eval_runs = len(ev["default"]["runs"])
    r.default_tps, r.tau_default = ev["default"]["tokens_per_s"], ev["default"]["tau"]
    r.default_p95 = ev["default"]["p95_latency_s"]
    if "tuned" not in ev:
        r.best_tps, r.tau_best, r.best_p95 = r.default_tps, r.tau_default, r.default_p95
        return default_cfg
    r.best_tps, r.tau_best, r.best_p95 = ev["tuned"]["tokens_per_s"], ev["tuned"]["tau"], ev["tuned"]["p95_latency_s"]
    same = r.outputs_equal = ev["tuned"]["outputs"] == ev["default"]["outputs"]
    bound = s.p95_bound(r.default_p95) if s.multi_objective else None
    if not same and s.dtype == "fp32":
        r.note = _join(r.note, "tuned config changed fp32 greedy outputs on the eval split: rejected")
    elif bound is not None and r.best_p95 > bound:
        r.note = _join(r.note, f"tuned p95 {r.best_p95:.2f} s exceeds the bound {bound:.2f} s on the eval split")
    elif r.best_tps > r.default_tps:
        r.chosen = "tuned"
        return best_cfg
    else:
        r.note = _join(r.note, "tuned config did not beat the default on the eval split")
    return default_cfg


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def choose(run: TuneRun, results: list[BatchResult]) -> dict[int, DecodingConfig]:
    """Batch size -> the config its profile entry gets."""
    run.engine.generate("Hello", SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    return {r.batch_size: choose_batch_size(run, r) for r in results}


# ---- write ----------------------------------------------------------------------------------------

def build_schedule(workload: str, configs: dict[int, DecodingConfig], meta: dict) -> DecodingSchedule:
    """Batch-size ranges: tuned size b_i covers up to floor(sqrt(b_i * b_{i+1})); the last covers the rest."""
    sizes = sorted(configs)
    entries = []
    for i, b in enumerate(sizes):
        upper = math.isqrt(b * sizes[i + 1]) if i + 1 < len(sizes) else max(MAX_BATCH_BOUND, b)
        entries.append((upper, configs[b]))
    return DecodingSchedule(workload, tuple(entries), meta)


def write_outcome(run: TuneRun, results: list[BatchResult], configs: dict[int, DecodingConfig]) -> TuneOutcome:
    """Save the profile (with the machine's fingerprint), log the summary, write plots."""
    from tuning.report import format_summary, write_plots

    s, log = run.settings, run.log
    meta = _meta(run, results)
    schedule = build_schedule(s.workload, configs, meta)
    path = save_profile(schedule, s.out_path)
    summary = format_summary(results, run.space)
    log(summary)
    log(f"wrote profile {path}")
    plots: list[Path] = []
    if s.plots:
        try:
            chosen = {r.batch_size: r.best_trial for r in results}
            bounds = {r.batch_size: r.p95_bound for r in results}
            plots = write_plots(run.studies, s.out_path, chosen=chosen, p95_bounds=bounds)
            for p in plots:
                log(f"wrote {p}")
        except Exception as e:  # plots are a convenience: never lose a finished tune to them
            log(f"warning: plots failed: {e}")
    return TuneOutcome(path, schedule, results, dict(run.studies), plots, run.deadline.elapsed(), summary)


def run_tune(s: TuneSettings, callbacks: Sequence = (), log: Callable[[str], None] = print) -> TuneOutcome:
    """Tune, choose, write the profile: see the module docstring."""
    from dart_ray.bench.prompts import load_prompts

    deadline = Deadline(s.time_budget_s)
    prompts = load_prompts(s.prompts)  # a missing prompt file or profile fails before Ray starts
    warm = load_warm_start(s)
    started_ray = _init_ray(s)
    try:
        run = start_tune(s, deadline, log, prompts, warm)
        results = search(run, callbacks)
        configs = choose(run, results)
        return write_outcome(run, results, configs)
    finally:
        if started_ray:
            import ray

            ray.shutdown()


def _counts(study) -> dict:
    from optuna.trial import TrialState

    c = {"complete": 0, "pruned": 0, "failed": 0, "interrupted": 0, "load_flagged": 0}
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.COMPLETE:
            c["complete"] += 1
            c["load_flagged"] += bool(t.user_attrs.get("load_flag"))
        elif t.state == TrialState.PRUNED:
            c["pruned"] += 1
        elif studies.is_interrupted(t):
            c["interrupted"] += 1
        elif t.state == TrialState.FAIL:
            c["failed"] += 1
    return c


def _objective_text(s: TuneSettings) -> str:
    answers = (f"fixed {s.max_new_tokens}-token answers (ignore_eos)" if s.ignore_eos
               else f"natural answers (EOS honoured, <= {s.max_new_tokens} tokens)")
    what = "generated tokens/s" if not s.multi_objective else \
        (f"generated tokens/s and p95 request latency (Pareto; chosen: highest tokens/s with p95 <= "
         f"min({s.p95_max_ratio}x default p95, {s.p95_max_s or 'inf'} s))")
    return (f"{what}, greedy, {answers}, continuous batching at the batch size, adaptive engine "
            f"(knobs = controller start + cap), AR load probe {s.load_probe_tokens} tokens / "
            f"{s.load_threshold:.0%} threshold")


def _meta(run: TuneRun, results: list[BatchResult]) -> dict:
    s = run.settings
    sizes = [r.batch_size for r in results]
    per = []
    for i, r in enumerate(results):
        lo = 1 if i == 0 else math.isqrt(sizes[i - 1] * sizes[i]) + 1
        hi = math.isqrt(r.batch_size * sizes[i + 1]) if i + 1 < len(sizes) else None
        per.append({
            "tuned_batch_size": r.batch_size, "covers": f"{lo}-{hi}" if hi else f"{lo}+",
            "chosen": r.chosen, "note": r.note, "study": r.study_name, "trials": dict(r.counts),
            "trials_this_run": r.ran_trials, "warm_start_trials": r.warm_trials, "best_trial": r.best_trial,
            "default_tokens_per_s": _round(r.default_tps), "tuned_tokens_per_s": _round(r.best_tps),
            "gain": _round(r.gain, 4), "tau_default": _round(r.tau_default), "tau_tuned": _round(r.tau_best),
            "default_p95_latency_s": _round(r.default_p95, 3), "tuned_p95_latency_s": _round(r.best_p95, 3),
            "p95_bound_s": _round(r.p95_bound, 3),
            "eval_repeats": r.eval_runs, "eval_outputs_equal": r.outputs_equal})
    fp = run.engine.fingerprint
    warm = None
    if run.warm is not None:
        warm = {"profile": run.warm.source or run.warm.workload,
                "tuned_on": run.warm.meta.get("cpu"), "differences": list(run.warm_differences)}
    return {
        "tool": "dart-ray tune", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": fp.summary(), "fingerprint": fp.to_dict(),
        "prompts": str(s.prompts), "num_tune_prompts": len(run.tune_prompts),
        "num_eval_prompts": len(run.eval_prompts),
        "model": s.model or "default", "method": s.method, "drafter": s.drafter or "default",
        "ngram": s.ngram or "default", "dtype": run.engine.config.dtype, "dtype_requested": s.dtype,
        "device": s.device, "max_new_tokens": s.max_new_tokens, "ignore_eos": s.ignore_eos, "chat": s.chat,
        "threads": run.threads, "cpus_per_trial": run.cpus, "adaptive": run.engine.config.adaptive,
        "trials_per_batch_size": s.trials, "time_budget_s": s.time_budget_s,
        "elapsed_s": round(run.deadline.elapsed(), 1), "storage": _safe_url(s.storage_url),
        "results_dir": str(s.results_path), "seed": s.seed, "objective": _objective_text(s),
        "objective_mode": s.objective, "warm_start": warm, "batch_sizes": per}


def _round(v, nd: int = 2):
    return None if v is None else round(float(v), nd)
