"""Phase 2, search: per batch size, an Optuna study (``<workload>.bs<B>[.p95]`` in the RDB
storage, resumed if it exists; see ``tuning.study``) driven through Ray Tune: a fresh study gets the
warm-start knobs, then the default, as its first trials; ``Tuner(with_resources(trainable),
OptunaSearch(study) + ASHA, reuse_actors=True, num_samples = target - finished, time_budget_s =
share of what is left)``. Each batch size yields a :class:`BatchResult` for ``tuning.choose``.

**Time.** Batch sizes are searched from the cheapest trial to the dearest (:func:`search_order`);
each gets an equal share of the time left when it starts, and what it does not use passes on. At
bs 1 a trial decodes its prompts one at a time, so it costs several times a bs 4 trial: searched
last, it inherits the time the cheaper sizes saved instead of stopping at half the budget."""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from tuning import study as studies
from tuning.objective import TrialJob
from tuning.start import TuneRun, warm_points

EVAL_RESERVE = 0.2
"""Share of the time budget kept for the held-out evaluation."""
WARM_STARTUP_TRIALS = 4
"""TPE start-up (random) trials of a warm-started study (a cold one uses 8)."""


@dataclass
class BatchResult:
    """One batch size: its study (set by search), then the measurements and the choice (set by
    ``tuning.choose``), as the profile's meta and the summary report them."""

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
    """Tuned and default greedy outputs identical on the eval split (fp32: required; half:
    informative)."""
    warm_trials: int = 0
    """Warm-start points enqueued into this (fresh) study."""

    @property
    def gain(self) -> float | None:
        if self.default_tps and self.best_tps and self.chosen == "tuned":
            return self.best_tps / self.default_tps
        return 1.0 if self.default_tps else None


def _digest(items: Sequence[str]) -> str:
    h = hashlib.sha256()
    for p in items:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def study_fingerprint(run: TuneRun, n_trial: int, check: tuple, check_tokens: int) -> dict:
    """The setup a study's trials were measured under (resuming with another one is refused): the
    engine's :meth:`~dart_ray.EngineConfig.fingerprint` (less ``max_batch_size``, which follows the
    batch sizes of a run, so adding one resumes the others), the workload and the machine."""
    s = run.settings
    return {
        **run.engine_config.fingerprint(exclude=("max_batch_size",)),
        "max_new_tokens": s.max_new_tokens, "ignore_eos": s.ignore_eos, "objective": s.objective,
        "chat": s.chat, "hardware": run.engine.fingerprint.to_dict(),
        "prompts": _digest(run.tune_prompts[:n_trial]), "check": _digest(check),
        "check_dtype": str(s.check_dtype), "check_tokens": check_tokens,
        "space": json.dumps(run.space.to_dict(), sort_keys=True)}


def _trial_job(run: TuneRun, b: int, n_trial: int, report_every: int, check: tuple,
               check_tokens: int) -> TrialJob:
    s = run.settings
    engine = {k: v for k, v in run.engine_config.to_dict().items() if k != "decoding"}
    return TrialJob(engine=engine, batch_size=b,
                    prompts=tuple(run.tune_prompts[:n_trial]), check_prompts=check,
                    max_new_tokens=s.max_new_tokens, base_decoding=run.space.base.to_dict(),
                    chat=s.chat, report_every=report_every, check_dtype=s.check_dtype,
                    num_threads=run.threads, check_max_new_tokens=check_tokens,
                    ignore_eos=s.ignore_eos, load_probe_tokens=s.load_probe_tokens,
                    load_threshold=s.load_threshold)


def trial_prompts(run: TuneRun, b: int) -> int:
    """Prompts one trial of batch size ``b`` measures."""
    return min(len(run.tune_prompts), run.settings.prompts_per_trial or max(8, 2 * b))


def trial_cost(run: TuneRun, b: int) -> float:
    """A trial's predicted cost at batch size ``b``, relative to the other sizes: its rounds of
    ``b`` answers (ceil(prompts / b)) x the engine's measured plain-step seconds at ``b``; the
    rounds alone when the engine has no cost model."""
    rounds = math.ceil(trial_prompts(run, b) / b)
    step = run.engine.step_cost_s(b)
    return rounds * (step if step is not None else 1.0)


def search_order(run: TuneRun) -> list[int]:
    """The batch sizes from the cheapest trial to the dearest (ties: the smaller batch first)."""
    return sorted(run.settings.batch_sizes, key=lambda b: (trial_cost(run, b), b))


def search_batch_size(run: TuneRun, storage, b: int, sizes_left: int,
                      callbacks: Sequence) -> BatchResult:
    """Prepare (or resume) the study of batch size ``b`` and run its missing trials in an equal
    share of the time left among ``sizes_left`` batch sizes (this one included)."""
    s, log = run.settings, run.log
    n_trial = trial_prompts(run, b)
    report_every = max(1, math.ceil(n_trial / s.reports_per_trial))
    n_reports = math.ceil(n_trial / report_every)
    check = tuple(run.tune_prompts[:max(0, s.check_prompts)])
    check_tokens = s.check_tokens or min(s.max_new_tokens, 32)
    name = studies.study_name(s.workload, b, s.objective)
    status = studies.prepare_study(storage, name,
                                   study_fingerprint(run, n_trial, check, check_tokens), run.space,
                                   s.trials, warm_start=warm_points(run.warm, b),
                                   objective=s.objective)
    run.studies[b] = status.study
    warm_n = sum(1 for t in status.study.get_trials(deepcopy=False)
                 if t.user_attrs.get("warm_start")) \
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
        budget = None if s.time_budget_s is None else left_for_tune / sizes_left
        if budget is not None and budget < 5:
            log(f"[bs={b}] skipped: time budget exhausted")
        else:
            job = _trial_job(run, b, n_trial, report_every, check, check_tokens)
            ran = _run_batch_size(run, b, job, status, budget, n_reports, callbacks)
    return BatchResult(batch_size=b, study_name=name, counts=_counts(status.study), ran_trials=ran,
                       default_params=run.space.default_point(), best_params=None, best_trial=None,
                       warm_trials=warm_n)


def _run_batch_size(run: TuneRun, b: int, job: TrialJob, status: studies.StudyStatus,
                    budget_s: float | None, n_reports: int, callbacks: Sequence) -> int:
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
    tune_config = tune.TuneConfig(search_alg=searcher, scheduler=scheduler,
                                  num_samples=status.remaining,
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
        log(f"[bs={b}] time budget reached: {len(searcher.interrupted)} unfinished trial(s) "
            "stopped; their points are re-enqueued for the next run")
    return len(grid)


def search(run: TuneRun, callbacks: Sequence = ()) -> list[BatchResult]:
    """Every batch size's study (each resumes from the storage), cheapest trials first; the
    results come back in the settings' order."""
    storage = studies.open_storage(run.settings.storage_url)
    order = search_order(run)
    if order != list(run.settings.batch_sizes):
        run.log("search order, cheapest trials first: "
                + ", ".join(f"bs {b} ({trial_cost(run, b):.2g})" for b in order))
    done = {b: search_batch_size(run, storage, b, len(order) - i, callbacks)
            for i, b in enumerate(order)}
    return [done[b] for b in run.settings.batch_sizes]


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
