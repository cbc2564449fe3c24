"""Optuna studies in a real database, and the Ray Tune searcher that feeds them.

Resume semantics (the database is the source of truth; the Tune experiment directory is only a
record of each run):

* One study per (workload, batch size), named ``<workload>.bs<B>``, in an RDB storage
  (``sqlite:///path/tune.db`` by default; any SQLAlchemy URL Optuna accepts).
* ``--trials N`` is a *target*: a run executes ``N - finished`` new trials, where *finished*
  counts COMPLETE, PRUNED and FAILED (errored) trials. Re-running with the same storage after
  all N finished runs nothing new; raising N runs only the difference.
* A trial left RUNNING in the database was interrupted (driver killed, time budget hit,
  exception): on the next run it is marked FAIL with ``interrupted=True`` (not counted) and its
  parameters are enqueued again once, so the point it was evaluating is not lost.
* The default point is enqueued into a fresh study, so it is always evaluated (unless points were
  enqueued by hand before). A warm start (``dart-ray tune --for-this-machine``) enqueues a
  profile's knobs *before* it, so they are the first trials; a resumed study is never re-seeded.
* A study is single-objective (maximise tokens/s) or, for ``--objective throughput+p95``,
  two-objective (maximise tokens/s, minimise p95 request latency); the objective is part of the
  study name (``<workload>.bs<B>.p95``) so the two kinds never share a study.
* Trials measured on a loaded machine (``load_flag``, see ``tuning.objective``) stay in the study
  but are not chosen as the best or as a Pareto point (unless every complete trial is flagged:
  then the runner evaluates the best of them and says so in the profile's meta).
* The study records a fingerprint of the setup (model, method, drafter, dtype, prompts,
  lengths, objective, search space, and the machine's hardware fingerprint); resuming with a
  different setup is refused instead of silently mixing incomparable throughputs.
* The TPE sampler is seeded with ``seed + number of trials already in the study``: a resumed run
  does not replay the random start-up points of the interrupted one.

Only the driver touches the database (the searcher lives in the Tune driver); workers only
report metrics. One tune run per study at a time.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.trial import TrialState

from tuning.objective import METRIC, P95_METRIC
from tuning.space import SearchSpace

optuna.logging.set_verbosity(optuna.logging.WARNING)
log = logging.getLogger(__name__)


class StudyMismatchError(ValueError):
    """The storage already holds a study of this name tuned under a different setup."""


def default_storage_url(out_dir: str | Path) -> str:
    return f"sqlite:///{Path(out_dir).resolve() / 'tune.db'}"


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """An RDB storage for ``url`` (the SQLite file's folder is created)."""
    kwargs: dict = {}
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        path.parent.mkdir(parents=True, exist_ok=True)
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    return optuna.storages.RDBStorage(url, **kwargs)


OBJECTIVES = ("throughput", "throughput+p95")
"""``throughput``: maximise tokens/s. ``throughput+p95``: also minimise p95 request latency."""

RECORDED = ("tau", "prompts_done", "tokens", "seconds", "worker_pid", "engine_builds", P95_METRIC,
            "mean_new_tokens", "eos_finished", "load_drift", "load_flag", "reruns", "ar_probe_tps",
            "ar_reference_tps")
"""Result keys copied into each Optuna trial's user attributes."""


def study_name(workload: str, batch_size: int, objective: str = "throughput") -> str:
    return f"{workload}.bs{batch_size}" + ("" if objective == "throughput" else ".p95")


def directions(objective: str) -> list[str]:
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    return ["maximize"] if objective == "throughput" else ["maximize", "minimize"]


def throughput(t: optuna.trial.FrozenTrial) -> float | None:
    """A finished trial's tokens/s (its first objective value)."""
    return t.values[0] if t.values else None


def p95_latency(t: optuna.trial.FrozenTrial) -> float | None:
    """A trial's p95 request latency (second objective, else the recorded attribute)."""
    if t.values and len(t.values) > 1:
        return t.values[1]
    v = t.user_attrs.get(P95_METRIC)
    return None if v is None else float(v)


def is_interrupted(t: optuna.trial.FrozenTrial) -> bool:
    return t.state == TrialState.FAIL and bool(t.user_attrs.get("interrupted"))


def finished_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials that count toward the target: complete, pruned, or errored (not interrupted)."""
    return [t for t in study.get_trials(deepcopy=False)
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
            or (t.state == TrialState.FAIL and not is_interrupted(t))]


def complete_trials(study: optuna.Study,
                    include_flagged: bool = False) -> list[optuna.trial.FrozenTrial]:
    """COMPLETE trials with a value; without those measured under load unless
    ``include_flagged``."""
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if throughput(t) is not None and (include_flagged or not t.user_attrs.get("load_flag"))]


def best_complete(study: optuna.Study,
                  include_flagged: bool = False) -> optuna.trial.FrozenTrial | None:
    """The highest-throughput complete trial (load-flagged ones excluded unless
    ``include_flagged``)."""
    done = complete_trials(study, include_flagged)
    return max(done, key=throughput) if done else None


def pareto_front(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """Trials no other trial beats on both throughput (higher) and p95 latency (lower), by
    throughput."""
    pts = [t for t in trials if throughput(t) is not None and p95_latency(t) is not None]

    def dominated(a) -> bool:
        return any(throughput(b) >= throughput(a) and p95_latency(b) <= p95_latency(a)
                   and (throughput(b) > throughput(a) or p95_latency(b) < p95_latency(a))
                   for b in pts)

    return sorted((t for t in pts if not dominated(t)), key=throughput, reverse=True)


def choose_within_p95(study: optuna.Study, p95_bound_s: float | None,
                      include_flagged: bool = False) -> optuna.trial.FrozenTrial | None:
    """The highest-throughput Pareto point (unflagged unless ``include_flagged``) whose p95 latency
    is <= ``p95_bound_s`` (None: no bound, i.e. the highest-throughput point); None when none
    qualifies."""
    for t in pareto_front(complete_trials(study, include_flagged)):
        if p95_bound_s is None or p95_latency(t) <= p95_bound_s:
            return t
    return None


def default_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.user_attrs.get("is_default"):
            return t
    return None


@dataclass
class StudyStatus:
    study: optuna.Study
    finished: int
    remaining: int
    requeued: int
    fresh: bool = False
    """The study had no trials before this run (warm-start points, if any, were enqueued)."""


def setup_differences(old: dict, new: dict) -> list[str]:
    """Keys of two study fingerprints that differ. ``hardware`` is compared as a hardware
    fingerprint (:func:`dart_ray.profiles.fingerprint_differences`): a study recorded before a
    field was added to it (``cpu_id``) still resumes on the same machine."""
    from dart_ray.profiles import fingerprint_differences

    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if k == "hardware" and isinstance(a, dict) and isinstance(b, dict):
            try:
                if not fingerprint_differences(a, b):
                    continue
            except (TypeError, ValueError):
                pass                                   # malformed: compared as plain values
        if a != b:
            out.append(k)
    return out


def prepare_study(storage, name: str, fingerprint: dict, space: SearchSpace, target_trials: int,
                  max_requeue: int = 1, warm_start: Sequence[dict] = (),
                  objective: str = "throughput") -> StudyStatus:
    """Create or load ``name``; fail interrupted trials (re-enqueueing their points); into a fresh
    study enqueue the ``warm_start`` points (clipped into the space) first, then the default point;
    return how many trials remain to reach ``target_trials``."""
    study = optuna.create_study(storage=storage, study_name=name, directions=directions(objective),
                                load_if_exists=True)
    if len(study.directions) != len(directions(objective)):
        raise StudyMismatchError(f"study {name!r} in this storage has {len(study.directions)} "
                                 f"objective(s), not {len(directions(objective))} ({objective})")
    old = study.user_attrs.get("fingerprint")
    diff = [] if old is None else setup_differences(old, fingerprint)
    if diff:
        raise StudyMismatchError(
            f"study {name!r} in this storage was tuned with a different setup (differs in {diff}); "
            "use another --workload name or --storage, or the same settings as before")
    if old is None:
        study.set_user_attr("fingerprint", fingerprint)
    fresh = not study.get_trials(deepcopy=False)
    if fresh:
        enqueue_warm_start(study, space, warm_start)
    st = study._storage
    requeued = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        st.set_trial_user_attr(t._trial_id, "interrupted", True)
        st.set_trial_state_values(t._trial_id, TrialState.FAIL)
        requeued += requeue(study, t.params, t.user_attrs, space, max_requeue)
    if not any(t.user_attrs.get("is_default") for t in study.get_trials(deepcopy=False)):
        study.enqueue_trial(space.default_point(), user_attrs={"is_default": True})
    finished = len(finished_trials(study))
    return StudyStatus(study, finished, max(0, target_trials - finished), requeued, fresh)


def enqueue_warm_start(study: optuna.Study, space: SearchSpace, points: Sequence[dict]) -> int:
    """Enqueue ``points`` (knob dicts, e.g. a profile's configs; clipped into the space, knobs the
    space lacks dropped, duplicates skipped) as the next trials, marked ``warm_start``; the one
    equal to the default point is marked ``is_default`` too. Returns how many were enqueued."""
    default = space.default_point()
    seen: list[dict] = []
    for raw in points:
        point = warm_point(space, raw)
        if point in seen:
            continue
        seen.append(point)
        attrs = {"warm_start": True, **({"is_default": True} if point == default else {})}
        study.enqueue_trial(point, user_attrs=attrs)
    return len(seen)


def warm_point(space: SearchSpace, knobs: dict) -> dict:
    """``knobs`` projected into ``space``: its dimensions only (missing ones from the space's base),
    clipped."""
    base = space.default_point()
    return {p.name: p.clip(knobs.get(p.name, base[p.name])) for p in space.params}


def queued_params(t: optuna.trial.FrozenTrial) -> dict:
    """The point an enqueued (WAITING) trial will evaluate."""
    return dict(t.system_attrs.get("fixed_params") or t.params)


def requeue(study: optuna.Study, params: dict, user_attrs: dict, space: SearchSpace | None = None,
            max_requeue: int = 1) -> int:
    """Enqueue an interrupted trial's point again (at most ``max_requeue`` times); 1 if enqueued."""
    tries = int(user_attrs.get("requeued", 0))
    if not params or tries >= max_requeue or (space is not None and not space.contains(params)):
        return 0
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    if any(queued_params(t) == params for t in waiting):
        return 0
    attrs = {"requeued": tries + 1}
    for k in ("is_default", "warm_start"):
        if user_attrs.get(k):
            attrs[k] = True
    study.enqueue_trial(params, user_attrs=attrs)
    return 1


STARTUP_TRIALS = 8
"""TPE's random start-up trials of a cold study (enqueued points count toward them)."""


def make_sampler(seed: int | None, study: optuna.Study,
                 n_startup_trials: int = STARTUP_TRIALS) -> optuna.samplers.BaseSampler:
    """Multivariate TPE (multi-objective capable), seeded with ``seed + trials in the study``."""
    n = len(study.get_trials(deepcopy=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=None if seed is None else seed + n,
                                          multivariate=True, n_startup_trials=n_startup_trials)


def _searcher_class():
    from ray.tune.search.optuna import OptunaSearch

    class StudySearch(OptunaSearch):
        """``OptunaSearch`` over a persistent study, with honest trial states.

        OptunaSearch itself tells Optuna COMPLETE for any trial that has a last result. Here:
        COMPLETE only when the trial measured all its prompts (``complete`` metric), PRUNED when
        the scheduler stopped it early, FAIL (+ error text) when it raised, and FAIL with
        ``interrupted=True`` when the run ended under it (time budget, shutdown) — see module doc.
        """

        def __init__(self, *, space: SearchSpace, study: optuna.Study, sampler,
                     stopped: set) -> None:
            multi = len(study.directions) > 1
            super().__init__(space=space.distributions(),
                             metric=[METRIC, P95_METRIC] if multi else METRIC,
                             mode=["max", "min"] if multi else "max", sampler=sampler,
                             study_name=study.study_name, storage=study._storage)
            self._multi = multi
            self._search_space = space
            self._stopped = stopped            # trial ids the scheduler stopped (shared with it)
            self._pending_fail: dict[str, object] = {}
            self.interrupted: list[str] = []

        def suggest(self, trial_id: str):
            params = super().suggest(trial_id)
            ot = self._ot_trials.get(trial_id)
            if ot is not None:
                ot.set_user_attr("tune_trial_id", trial_id)
            return params

        def on_trial_result(self, trial_id: str, result: dict) -> None:
            if trial_id in self._completed_trials or trial_id not in self._ot_trials:
                return
            super().on_trial_result(trial_id, result)
            self._record(trial_id, result)

        def _record(self, trial_id: str, result: dict | None) -> None:
            ot = self._ot_trials[trial_id]
            for k in RECORDED:
                if result and result.get(k) is not None:
                    ot.set_user_attr(k, result[k])

        def on_trial_complete(self, trial_id: str, result: dict | None = None,
                              error: bool = False) -> None:
            if trial_id in self._completed_trials or trial_id not in self._ot_trials:
                return
            ot = self._ot_trials[trial_id]
            if error:
                self._pending_fail[trial_id] = ot  # told once the error text arrives (record_error)
                return
            value = (result or {}).get(METRIC)
            values = [value, (result or {}).get(P95_METRIC)] if self._multi else value
            self._record(trial_id, result)
            if result and result.get("complete") and value is not None and \
                    (not self._multi or values[1] is not None):
                self._tell(trial_id, values, TrialState.COMPLETE)
            elif value is not None and trial_id in self._stopped and self._multi:
                # no intermediate values in multi-objective
                self._tell(trial_id, None, TrialState.PRUNED)
            elif value is not None and trial_id in self._stopped:
                # the result ASHA stopped on may not have passed through on_trial_result
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    try:
                        ot.report(float(value), int(result.get("training_iteration", 1)))
                    except (ValueError, RuntimeError) as e:
                        log.debug("report on prune %s: %s", trial_id, e)
                self._tell(trial_id, None, TrialState.PRUNED)
            else:
                self._interrupt(trial_id)

        def _interrupt(self, trial_id: str) -> None:
            ot = self._ot_trials[trial_id]
            ot.set_user_attr("interrupted", True)
            params, attrs = dict(ot.params), dict(ot.user_attrs)
            self._tell(trial_id, None, TrialState.FAIL)
            self.interrupted.append(trial_id)
            requeue(self._ot_study, params, attrs, self._search_space)

        def record_error(self, trial_id: str, message: str) -> None:
            ot = self._pending_fail.pop(trial_id, None)
            if ot is None:
                return
            ot.set_user_attr("error", message[:2000])
            self._tell(trial_id, None, TrialState.FAIL)

        def finalize(self) -> None:
            """Close every trial Tune left open (called after the Tune run returns or raises)."""
            for tid in list(self._pending_fail):
                self.record_error(tid, "trial errored (no error text captured)")
            for tid in list(self._ot_trials):
                if tid not in self._completed_trials:
                    try:
                        self._interrupt(tid)
                    except Exception as e:  # already finished in storage
                        log.debug("finalize %s: %s", tid, e)

        def _tell(self, trial_id: str, value, state) -> None:
            try:
                self._ot_study.tell(self._ot_trials[trial_id], value, state=state)
            except Exception as e:  # e.g. no intermediate value for a PRUNED trial
                log.warning("optuna tell for %s failed: %s", trial_id, e)
            self._completed_trials.add(trial_id)

    return StudySearch


def make_searcher(space: SearchSpace, study: optuna.Study, sampler, stopped: set):
    return _searcher_class()(space=space, study=study, sampler=sampler, stopped=stopped)


def make_scheduler(max_t: int, stopped: set, grace_period: int = 1, reduction_factor: int = 2):
    """ASHA over training iterations (= incremental throughput reports) that records its stops."""
    from ray.tune.schedulers import ASHAScheduler, TrialScheduler

    class RecordingASHA(ASHAScheduler):
        def on_trial_result(self, tune_controller, trial, result):
            decision = super().on_trial_result(tune_controller, trial, result)
            if decision == TrialScheduler.STOP and not result.get("complete"):
                stopped.add(trial.trial_id)
            return decision

    return RecordingASHA(time_attr="training_iteration", metric=METRIC, mode="max",
                         max_t=max(1, max_t), grace_period=max(1, min(grace_period, max_t)),
                         reduction_factor=reduction_factor)
