"""Orchestration of ``dart-ray tune``: per batch size, an Optuna study driven through Ray Tune,
then a held-out evaluation of default vs best and a per-batch-size decoding profile.

:func:`run_tune` reads as its four phases, one module each; :class:`TuneSettings`
(``tuning.settings``) is what it is asked to do.

    run_tune(TuneSettings(...)) ->
        start    prompts (seeded tune / eval split), Ray, the engine loaded once in the driver
                 (drafter depth -> search space; hardware fingerprint; held-out evaluation), and the
                 warm-start profile (``--for-this-machine``)                     -> tuning.start
        search   for B in batch sizes:                                           -> tuning.search
                   study = <workload>.bs<B>[.p95] in the RDB storage (resumed if it exists; see
                           tuning.study); a fresh study gets the warm-start knobs, then the default,
                           as its first trials
                   Tuner(with_resources(trainable), OptunaSearch(study) + ASHA, reuse_actors=True,
                         num_samples = target - finished, time_budget_s = share of what is left)
        choose   for B: best trial (single objective) or the highest-throughput Pareto point within
                 the p95 bound (``throughput+p95``); default vs that on the eval split, interleaved
                 repeats, median tokens/s (and p95 latency)                      -> tuning.choose
        write    profile = workload -> batch-size ranges -> DecodingConfig, with meta (how it was
                 tuned, gains, ``meta.fingerprint`` / ``meta.cpu`` of the measuring machine); plots
                                                                                 -> tuning.write

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

from collections.abc import Callable, Sequence

from tuning.choose import choose
from tuning.search import BatchResult, search
from tuning.settings import (
    DEFAULT_TRIALS,
    MAX_BATCH_BOUND,
    TUNABLE_METHODS,
    WARM_TRIALS,
    TuneSettings,
)
from tuning.start import (
    Deadline,
    TuneRun,
    load_warm_start,
    start_tune,
    start_tune_ray,
    warm_points,
)
from tuning.write import TuneOutcome, write_outcome


class NoTrialCompletedError(RuntimeError):
    """Trials ran, and every one of them failed: nothing was measured, so no profile is written
    (a profile of the defaults would overwrite ``--out`` as if it had been tuned)."""


def check_some_trial_completed(results: Sequence[BatchResult], s: TuneSettings) -> None:
    """Raise :class:`NoTrialCompletedError` when trials failed and none completed at any batch size
    (a budget too small to start any keeps the defaults, as the profile's meta says)."""
    failed = sum(r.counts.get("failed", 0) for r in results)
    if failed and not any(r.counts.get("complete", 0) for r in results):
        raise NoTrialCompletedError(
            f"all {failed} trial(s) failed at every batch size, none completed: no profile "
            f"written to {s.out}. The trials' errors are in Ray Tune's trial logs under "
            f"{s.results_path} (and in the log above for trials this run started). Failed trials "
            f"count as finished, so rerunning does not run them again: to start over after fixing "
            f"the cause, remove the study's storage ({s.storage_display}) or pass another "
            f"--storage")


__all__ = ["DEFAULT_TRIALS", "MAX_BATCH_BOUND", "TUNABLE_METHODS", "WARM_TRIALS", "BatchResult",
           "Deadline", "NoTrialCompletedError", "TuneOutcome", "TuneRun", "TuneSettings",
           "run_tune", "warm_points"]


def run_tune(s: TuneSettings, callbacks: Sequence = (),
             log: Callable[[str], None] = print) -> TuneOutcome:
    """Start, search, choose, write the profile: see the module docstring. Ray is shut down at the
    end if this call started it."""
    from dart_ray.bench.prompts import load_prompts

    deadline = Deadline(s.time_budget_s)
    prompts = load_prompts(s.prompts)  # a missing prompt file or profile fails before Ray starts
    warm = load_warm_start(s)
    started_ray = start_tune_ray(s)
    try:
        run = start_tune(s, deadline, log, prompts, warm)
        results = search(run, callbacks)
        check_some_trial_completed(results, s)
        configs = choose(run, results)
        return write_outcome(run, results, configs)
    finally:
        if started_ray:
            import ray

            ray.shutdown()
