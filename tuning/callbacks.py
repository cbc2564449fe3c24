"""Ray Tune callbacks of the tune driver (module-level so Tune can pickle its config)."""

from __future__ import annotations

import os

from ray import tune

from tuning.objective import METRIC
from tuning.report import short_number


def error_summary(trace: str) -> str:
    """The exception line of a Tune error trace (e.g. ``ExactnessError: ...``)."""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":")[0]
        if "Error" in head or "Exception" in head:
            return ln
    return lines[-1] if lines else "unknown error"


def _error_text(trial) -> str:
    """The trial's error trace: the local error file (written before any sync), else storage."""
    try:
        path = trial.error_file
        if path and os.path.isfile(path):
            with open(path) as f:
                return f.read()
        return trial.get_error() or ""
    except OSError as e:
        return f"(error text unavailable: {e})"


class Progress(tune.Callback):
    """One line per finished trial; forwards a failed trial's error text into its Optuna trial."""

    def __init__(self, batch_size: int, target: int, done_before: int, searcher=None,
                 log=print) -> None:
        self.batch_size = batch_size
        self.target = target
        self.n = done_before
        self.best: float | None = None
        self._log, self._searcher = log, searcher

    def __getstate__(self) -> dict:
        # Tune pickles its config for Tuner.restore (unused here: the Optuna study is the state);
        # the live searcher and logger stay out of that file.
        return {**self.__dict__, "_log": None, "_searcher": None}

    def _line(self, trial, status: str) -> None:
        self.n += 1
        r = trial.last_result or {}
        tps = r.get(METRIC)
        if status == "complete" and tps is not None:
            self.best = tps if self.best is None else max(self.best, tps)
        knobs = " ".join(f"{k}={short_number(v)}" for k, v in sorted(trial.config.items()))
        msg = f"[bs={self.batch_size}] trial {self.n}/{self.target} {status}"
        if tps is not None:
            msg += (f": {tps:.1f} tok/s, tau {r.get('tau', 0):.2f} ({r.get('prompts_done', 0)} "
                    "prompts")
            if r.get("mean_new_tokens") is not None:
                msg += f", {r['mean_new_tokens']:.0f} tokens each"
            if r.get("p95_latency_s") is not None:
                msg += f", p95 {r['p95_latency_s']:.2f} s"
            msg += ")"
            if r.get("load_flag"):
                msg += (f" [UNDER LOAD: AR probe {r.get('load_drift', 0):.0%} slow after a re-run; "
                        "not chosen]")
            elif r.get("reruns"):
                msg += " [re-run once: load during the first measurement]"
        if self.best is not None:
            msg += f" | best this run {self.best:.1f}"
        if self._log is not None:
            self._log(f"{msg}\n    {knobs}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        r = trial.last_result or {}
        self._line(trial, "complete" if r.get("complete") else "stopped early")

    def on_trial_error(self, iteration, trials, trial, **info):
        msg = error_summary(_error_text(trial))
        if self._searcher is not None:
            self._searcher.record_error(trial.trial_id, msg)
        self._line(trial, f"ERROR ({msg[:300]})")
