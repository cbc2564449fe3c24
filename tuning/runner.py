"""Orchestration of ``dart-ray tune``: per batch size, an Optuna study driven through Ray Tune,
then a held-out evaluation of default vs best and a per-batch-size decoding profile.

    run_tune(TuneSettings(...)) ->
        prompts  = sample of the workload, split into tune / eval parts (seeded)
        engine   = loaded once in the driver (drafter depth -> search space; held-out evaluation)
        for B in batch sizes:
            study   = <workload>.bs<B> in the RDB storage (resumed if it exists; see tuning.study)
            Tuner(with_resources(trainable), OptunaSearch(study) + ASHA, reuse_actors=True,
                  num_samples = target - finished, time_budget_s = share of what is left)
        for B: default vs best on the eval split, interleaved repeats, median tokens/s
        profile  = workload -> batch-size ranges -> DecodingConfig  (+ meta), summary, plots
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
from tuning.objective import TrialJob, stream_batched
from tuning.space import SearchSpace

MAX_BATCH_BOUND = 1024
TUNABLE_METHODS = tuple(m for m in METHODS if m != "none")
EVAL_RESERVE = 0.2
"""Share of the time budget kept for the held-out evaluation."""


@dataclass
class TuneSettings:
    prompts: str
    workload: str
    out: str
    batch_sizes: Sequence[int] = (1, 4, 16)
    trials: int = 30
    """Target number of finished trials per batch size (resumed studies count earlier trials)."""
    time_budget_s: float | None = None
    """Wall-clock budget of the whole run (setup, tuning, evaluation)."""
    storage: str | None = None
    """Optuna RDB URL; default ``sqlite:///<out dir>/tune.db``."""
    results_dir: str | None = None
    """Ray Tune storage path; default ``<out dir>/tune_results``."""
    model: str | None = None
    method: str = "dart"
    drafter: str | None = None
    ngram: str | None = None
    dtype: str = "bf16"
    device: str = "cpu"
    max_seq_len: int = 2048
    max_new_tokens: int = 64
    chat: bool = False
    num_prompts: int = 64
    eval_fraction: float = 0.25
    prompts_per_trial: int | None = None
    """Prompts measured per trial; default max(8, 2 * batch size), capped by the tune split."""
    reports_per_trial: int = 4
    check_prompts: int = 2
    check_tokens: int | None = None
    """Tokens generated per exactness-check prompt; default min(max_new_tokens, 32)."""
    check_dtype: str | None = "fp32"
    cpus_per_trial: float | None = None
    """Default: all CPUs of the Ray cluster (trials run one at a time so they do not disturb each other)."""
    gpus_per_trial: float | None = None
    max_concurrent_trials: int = 1
    eval_repeats: int = 3
    seed: int = 0
    plots: bool = True
    ray_address: str | None = None
    ray_temp_dir: str | None = None
    ray_num_cpus: int | None = None

    def __post_init__(self) -> None:
        self.batch_sizes = sorted({int(b) for b in self.batch_sizes})
        if not self.batch_sizes or self.batch_sizes[0] < 1 or self.batch_sizes[-1] > MAX_BATCH_BOUND:
            raise ValueError(f"batch sizes must be in [1, {MAX_BATCH_BOUND}], got {self.batch_sizes}")
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
    chosen: str = "default"
    note: str = ""
    eval_runs: int = 0
    outputs_equal: bool | None = None
    """Tuned and default greedy outputs identical on the eval split (fp32: required; half: informative)."""

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


def _run_batch_size(s: TuneSettings, b: int, job: TrialJob, cpus: float, space: SearchSpace,
                    status: studies.StudyStatus, budget_s: float | None, n_reports: int, callbacks: Sequence,
                    log) -> int:
    """One Tune experiment for one batch size; returns the number of trials it started."""
    from ray import tune

    from tuning.callbacks import Progress
    from tuning.objective import trainable

    stopped: set = set()
    searcher = studies.make_searcher(space, status.study, studies.make_sampler(s.seed, status.study), stopped)
    scheduler = studies.make_scheduler(n_reports, stopped)
    resources = {"cpu": cpus, "gpu": s.gpus_per_trial or 0}
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


def evaluate_on(engine: Engine, configs: dict[str, DecodingConfig], prompts: Sequence[str], batch_size: int,
                params: SamplingParams, chat: bool, repeats: int, deadline: Deadline) -> dict:
    """Interleaved repeats of each config on ``prompts`` (order alternates); median tokens/s."""
    runs: dict[str, list[float]] = {k: [] for k in configs}
    taus: dict[str, list[float]] = {k: [] for k in configs}
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
            outs, toks, secs = stream_batched(engine, prompts, batch_size, params, chat)
            runs[name].append(toks / max(secs, 1e-9))
            taus[name].append(engine.stats().mean_accepted_len)
            outputs.setdefault(name, outs)
        per_round = time.monotonic() - t0
    return {name: {"tokens_per_s": statistics.median(runs[name]), "runs": runs[name],
                   "tau": statistics.median(taus[name]), "outputs": outputs[name]} for name in names}


def build_schedule(workload: str, configs: dict[int, DecodingConfig], meta: dict) -> DecodingSchedule:
    """Batch-size ranges: tuned size b_i covers up to floor(sqrt(b_i * b_{i+1})); the last covers the rest."""
    sizes = sorted(configs)
    entries = []
    for i, b in enumerate(sizes):
        upper = math.isqrt(b * sizes[i + 1]) if i + 1 < len(sizes) else max(MAX_BATCH_BOUND, b)
        entries.append((upper, configs[b]))
    return DecodingSchedule(workload, tuple(entries), meta)


def run_tune(s: TuneSettings, callbacks: Sequence = (), log: Callable[[str], None] = print) -> TuneOutcome:
    from dart_ray.bench.prompts import load_prompts
    from tuning.report import format_summary, write_plots

    deadline = Deadline(s.time_budget_s)
    prompts = load_prompts(s.prompts)
    tune_p, eval_p = split_prompts(prompts, s.num_prompts, s.eval_fraction, s.seed)
    if not eval_p:
        log("note: too few prompts for a held-out split; evaluating on the tune prompts")
        eval_p = tune_p
    log(f"workload {s.workload!r}: {len(tune_p)} tune + {len(eval_p)} eval prompts from {s.prompts}; "
        f"batch sizes {list(s.batch_sizes)}; {s.trials} trials each; storage {_safe_url(s.storage_url)}")

    started_ray = _init_ray(s)
    try:
        import ray

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
        log("loading the engine in the driver (drafter depth, held-out evaluation)...")
        engine = Engine.from_config(ecfg)
        base = DecodingConfig()
        space = SearchSpace.for_engine(engine, base)
        params = SamplingParams(max_new_tokens=s.max_new_tokens, ignore_eos=True)
        log(f"search space ({engine.drafter.name}, trained depth {engine.drafter.max_depth}): "
            + ", ".join(f"{p.name}[{_fmt(p.low)}..{_fmt(p.high)}{' log' if p.log else ''}]" for p in space.params))

        storage = studies.open_storage(s.storage_url)
        results: list[BatchResult] = []
        study_objs: dict[int, object] = {}
        for i, b in enumerate(s.batch_sizes):
            n_trial = min(len(tune_p), s.prompts_per_trial or max(8, 2 * b))
            report_every = max(1, math.ceil(n_trial / s.reports_per_trial))
            n_reports = math.ceil(n_trial / report_every)
            check = tuple(tune_p[:max(0, s.check_prompts)])
            check_tokens = s.check_tokens or min(s.max_new_tokens, 32)
            fingerprint = {
                "model": str(s.model), "method": s.method, "drafter": str(s.drafter), "ngram": str(s.ngram),
                "dtype": s.dtype, "device": s.device, "max_seq_len": s.max_seq_len,
                "max_new_tokens": s.max_new_tokens, "chat": s.chat, "threads": threads,
                "prompts": _digest(tune_p[:n_trial]), "check": _digest(check),
                "check_dtype": str(s.check_dtype), "check_tokens": check_tokens,
                "space": json.dumps(space.to_dict(), sort_keys=True)}
            name = studies.study_name(s.workload, b)
            status = studies.prepare_study(storage, name, fingerprint, space, s.trials)
            study_objs[b] = status.study
            msg = f"[bs={b}] study {name}: {status.finished} finished, {status.remaining} to run"
            if status.requeued:
                msg += f", {status.requeued} interrupted trial(s) re-enqueued"
            log(msg)
            ran = 0
            if status.remaining > 0:
                left_for_tune = deadline.left() - (s.time_budget_s or 0) * EVAL_RESERVE
                budget = None if s.time_budget_s is None else left_for_tune / (len(s.batch_sizes) - i)
                if budget is not None and budget < 5:
                    log(f"[bs={b}] skipped: time budget exhausted")
                else:
                    job = TrialJob(engine=_engine_fields(ecfg), batch_size=b, prompts=tuple(tune_p[:n_trial]),
                                   check_prompts=check, max_new_tokens=s.max_new_tokens,
                                   base_decoding=base.to_dict(), chat=s.chat, report_every=report_every,
                                   check_dtype=s.check_dtype, num_threads=threads,
                                   check_max_new_tokens=check_tokens)
                    ran = _run_batch_size(s, b, job, cpus, space, status, budget, n_reports, callbacks, log)
            counts = _counts(status.study)
            best = studies.best_complete(status.study)
            results.append(BatchResult(
                batch_size=b, study_name=name, counts=counts, ran_trials=ran, default_params=space.default_point(),
                best_params=dict(best.params) if best is not None else None,
                best_trial=best.number if best is not None else None))

        # ---- held-out evaluation: default vs best, per batch size ---------------------------
        configs: dict[int, DecodingConfig] = {}
        engine.generate("Hello", SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
        for r in results:
            default_cfg = space.to_config(r.default_params)
            configs[r.batch_size] = default_cfg
            if r.best_params is None:
                r.note = "no completed trial"
                continue
            best_cfg = space.to_config(r.best_params)
            if best_cfg == default_cfg:
                r.note = "best trial is the default"
            st = study_objs[r.batch_size]
            dt, bt = studies.default_trial(st), studies.best_complete(st)
            slowest = min(t.value for t in (dt, bt) if t is not None)
            n_cfg = 1 if best_cfg == default_cfg else 2
            estimate = n_cfg * len(eval_p) * s.max_new_tokens / max(slowest, 1e-9)   # one eval round
            if estimate > deadline.left():
                r.note = "evaluation skipped (time budget): decided on tune-split trial values"
                r.default_tps = dt.value if dt is not None else None
                r.best_tps = bt.value if bt is not None else None
                if best_cfg != default_cfg and (r.default_tps is None or (r.best_tps or 0) > r.default_tps):
                    configs[r.batch_size], r.chosen = best_cfg, "tuned"
                continue
            cands = {"default": default_cfg} if best_cfg == default_cfg else {"default": default_cfg,
                                                                              "tuned": best_cfg}
            ev = evaluate_on(engine, cands, eval_p, r.batch_size, params, s.chat, s.eval_repeats, deadline)
            r.eval_runs = len(ev["default"]["runs"])
            r.default_tps, r.tau_default = ev["default"]["tokens_per_s"], ev["default"]["tau"]
            if "tuned" not in ev:
                r.best_tps, r.tau_best = r.default_tps, r.tau_default
                continue
            r.best_tps, r.tau_best = ev["tuned"]["tokens_per_s"], ev["tuned"]["tau"]
            same = r.outputs_equal = ev["tuned"]["outputs"] == ev["default"]["outputs"]
            if not same and s.dtype == "fp32":
                r.note = "tuned config changed fp32 greedy outputs on the eval split: rejected"
            elif r.best_tps > r.default_tps:
                configs[r.batch_size], r.chosen = best_cfg, "tuned"
            else:
                r.note = "tuned config did not beat the default on the eval split"

        elapsed = deadline.elapsed()
        meta = _meta(s, results, tune_p, eval_p, threads, cpus, elapsed)
        schedule = build_schedule(s.workload, configs, meta)
        path = save_profile(schedule, s.out_path)
        summary = format_summary(results, space)
        log(summary)
        log(f"wrote profile {path}")
        plots: list[Path] = []
        if s.plots:
            try:
                plots = write_plots(study_objs, s.out_path)
                for p in plots:
                    log(f"wrote {p}")
            except Exception as e:  # plots are a convenience: never lose a finished tune to them
                log(f"warning: plots failed: {e}")
        return TuneOutcome(path, schedule, results, study_objs, plots, deadline.elapsed(), summary)
    finally:
        if started_ray:
            import ray

            ray.shutdown()


def _counts(study) -> dict:
    from optuna.trial import TrialState

    c = {"complete": 0, "pruned": 0, "failed": 0, "interrupted": 0}
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.COMPLETE:
            c["complete"] += 1
        elif t.state == TrialState.PRUNED:
            c["pruned"] += 1
        elif studies.is_interrupted(t):
            c["interrupted"] += 1
        elif t.state == TrialState.FAIL:
            c["failed"] += 1
    return c


def _meta(s: TuneSettings, results: list[BatchResult], tune_p, eval_p, threads, cpus, elapsed) -> dict:
    sizes = [r.batch_size for r in results]
    per = []
    for i, r in enumerate(results):
        lo = 1 if i == 0 else math.isqrt(sizes[i - 1] * sizes[i]) + 1
        hi = math.isqrt(r.batch_size * sizes[i + 1]) if i + 1 < len(sizes) else None
        per.append({
            "tuned_batch_size": r.batch_size, "covers": f"{lo}-{hi}" if hi else f"{lo}+",
            "chosen": r.chosen, "note": r.note, "study": r.study_name, "trials": dict(r.counts),
            "trials_this_run": r.ran_trials, "best_trial": r.best_trial,
            "default_tokens_per_s": _round(r.default_tps), "tuned_tokens_per_s": _round(r.best_tps),
            "gain": _round(r.gain, 4), "tau_default": _round(r.tau_default), "tau_tuned": _round(r.tau_best),
            "eval_repeats": r.eval_runs, "eval_outputs_equal": r.outputs_equal})
    return {
        "tool": "dart-ray tune", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "prompts": str(s.prompts), "num_tune_prompts": len(tune_p), "num_eval_prompts": len(eval_p),
        "model": s.model or "default", "method": s.method, "drafter": s.drafter or "default",
        "ngram": s.ngram or "default", "dtype": s.dtype, "device": s.device,
        "max_new_tokens": s.max_new_tokens, "chat": s.chat, "threads": threads, "cpus_per_trial": cpus,
        "trials_per_batch_size": s.trials, "time_budget_s": s.time_budget_s, "elapsed_s": round(elapsed, 1),
        "storage": _safe_url(s.storage_url), "results_dir": str(s.results_path), "seed": s.seed,
        "objective": "generated tokens/s (greedy, ignore_eos), continuous batching at the batch size",
        "batch_sizes": per}


def _round(v, nd: int = 2):
    return None if v is None else round(float(v), nd)
