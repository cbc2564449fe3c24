"""Phase 4, write: the profile (workload -> batch-size ranges -> DecodingConfig) with its meta (how
it was tuned, the gains, ``meta.fingerprint`` / ``meta.cpu`` of the measuring machine), the
summary table and the plots."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from dart_ray import DecodingConfig, DecodingSchedule, save_profile
from tuning.search import BatchResult
from tuning.settings import MAX_BATCH_BOUND, TuneSettings
from tuning.start import TuneRun


@dataclass
class TuneOutcome:
    """What :func:`tuning.runner.run_tune` returns: the written profile and how it was reached."""

    profile_path: Path
    schedule: DecodingSchedule
    results: list[BatchResult]
    studies: dict = field(default_factory=dict)
    plots: list[Path] = field(default_factory=list)
    elapsed_s: float = 0.0
    summary: str = ""


def build_schedule(workload: str, configs: dict[int, DecodingConfig],
                   meta: dict) -> DecodingSchedule:
    """Batch-size ranges: tuned size b_i covers up to floor(sqrt(b_i * b_{i+1})); the last covers
    the rest."""
    sizes = sorted(configs)
    entries = []
    for i, b in enumerate(sizes):
        upper = math.isqrt(b * sizes[i + 1]) if i + 1 < len(sizes) else max(MAX_BATCH_BOUND, b)
        entries.append((upper, configs[b]))
    return DecodingSchedule(workload, tuple(entries), meta)


def write_outcome(run: TuneRun, results: list[BatchResult],
                  configs: dict[int, DecodingConfig]) -> TuneOutcome:
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
    return TuneOutcome(path, schedule, results, dict(run.studies), plots, run.deadline.elapsed(),
                       summary)


def _objective_text(s: TuneSettings) -> str:
    answers = (f"fixed {s.max_new_tokens}-token answers (ignore_eos)" if s.ignore_eos
               else f"natural answers (EOS honoured, <= {s.max_new_tokens} tokens)")
    what = "generated tokens/s" if not s.multi_objective else \
        ("generated tokens/s and p95 request latency (Pareto; chosen: highest tokens/s with p95 <= "
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
            "trials_this_run": r.ran_trials, "warm_start_trials": r.warm_trials,
            "best_trial": r.best_trial, "default_tokens_per_s": _round(r.default_tps),
            "tuned_tokens_per_s": _round(r.best_tps), "gain": _round(r.gain, 4),
            "tau_default": _round(r.tau_default), "tau_tuned": _round(r.tau_best),
            "default_p95_latency_s": _round(r.default_p95, 3),
            "tuned_p95_latency_s": _round(r.best_p95, 3), "p95_bound_s": _round(r.p95_bound, 3),
            "eval_repeats": r.eval_runs, "eval_outputs_equal": r.outputs_equal})
    fp = run.engine.fingerprint
    warm = None
    if run.warm is not None:
        warm = {"profile": run.warm.source or run.warm.workload,
                "tuned_on": run.warm.meta.get("cpu"), "differences": list(run.warm_differences)}
    return {
        "tool": "dart-ray tune",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": fp.summary(),
        "fingerprint": fp.to_dict(), "prompts": str(s.prompts),
        "num_tune_prompts": len(run.tune_prompts), "num_eval_prompts": len(run.eval_prompts),
        "model": s.engine.model or "default", "method": s.engine.method,
        "drafter": s.engine.drafter or "default", "ngram": s.engine.ngram or "default",
        "dtype": run.engine.config.dtype, "dtype_requested": s.engine.dtype,
        "device": s.engine.device, "max_new_tokens": s.max_new_tokens, "ignore_eos": s.ignore_eos,
        "chat": s.chat, "threads": run.threads, "cpus_per_trial": run.cpus,
        "adaptive": run.engine.config.adaptive, "trials_per_batch_size": s.trials,
        "time_budget_s": s.time_budget_s, "elapsed_s": round(run.deadline.elapsed(), 1),
        "storage": s.storage_display, "results_dir": str(s.results_path), "seed": s.seed,
        "objective": _objective_text(s), "objective_mode": s.objective, "warm_start": warm,
        "batch_sizes": per}


def _round(v, nd: int = 2):
    return None if v is None else round(float(v), nd)
