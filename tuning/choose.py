"""Phase 3, choose: per batch size, the candidate (the best trial, or with ``throughput+p95`` the
highest-throughput Pareto point within the p95 bound) against the default knobs on the held-out
split (interleaved repeats, median tokens/s and p95 latency) where time allows, else on the trial
values; the winner is that batch size's profile entry."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from dart_ray import DecodingConfig, Engine, SamplingParams
from tuning import study as studies
from tuning.objective import stream_workload
from tuning.report import short_number
from tuning.search import BatchResult
from tuning.settings import TuneSettings
from tuning.start import Deadline, TuneRun


def evaluate_on(engine: Engine, configs: dict[str, DecodingConfig], prompts: Sequence[str],
                batch_size: int, params: SamplingParams, chat: bool, repeats: int,
                deadline: Deadline) -> dict:
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
                   "tau": statistics.median(taus[name]),
                   "p95_latency_s": statistics.median(p95s[name]), "outputs": outputs[name]}
            for name in names}


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
    flagged = sum(1 for t in studies.complete_trials(study, include_flagged=True)
                  if t.user_attrs.get("load_flag"))
    best = pick_candidate(s, study, r)
    if flagged:
        r.note = f"{flagged} trial(s) measured under load were not considered"
    if best is None and flagged and not studies.complete_trials(study):
        # every trial ran under load: their ranking is still the best evidence, but say so loudly
        best = pick_candidate(s, study, r, include_flagged=True)
        r.note = (f"all {flagged} complete trial(s) were measured under load: the best of them "
                  "goes to the held-out evaluation; re-tune on an idle machine")
    if best is None:
        r.note = _join(r.note, "no completed trial" if not studies.complete_trials(study, True) else
                       f"no Pareto point within the p95 bound ({short_number(r.p95_bound)} s)")
        return default_cfg
    r.best_params, r.best_trial = dict(best.params), best.number
    r.best_p95 = studies.p95_latency(best)
    best_cfg = space.to_config(r.best_params)
    if best_cfg == default_cfg:
        r.note = _join(r.note, "best trial is the default")
    dt = studies.default_trial(study)
    if _eval_estimate(run, dt, best, 1 if best_cfg == default_cfg else 2) > run.deadline.left():
        return _choose_on_trials(r, dt, best, best_cfg, default_cfg)
    cands = {"default": default_cfg}
    if best_cfg != default_cfg:
        cands["tuned"] = best_cfg
    ev = evaluate_on(run.engine, cands, run.eval_prompts, r.batch_size, run.params, s.chat,
                     s.eval_repeats, run.deadline)
    return _choose_on_eval(s, r, ev, best_cfg, default_cfg, run.engine.config.dtype)


def _eval_estimate(run: TuneRun, dt, bt, n_cfg: int) -> float:
    """Seconds of one evaluation round (natural answer lengths as the trials measured them)."""
    trials = [t for t in (dt, bt) if t is not None]
    slowest = min(studies.throughput(t) for t in trials)
    lengths = [float(t.user_attrs.get("mean_new_tokens", run.settings.max_new_tokens))
               for t in trials]
    return n_cfg * len(run.eval_prompts) * max(lengths) / max(slowest, 1e-9)


def _choose_on_trials(r: BatchResult, dt, bt, best_cfg: DecodingConfig,
                      default_cfg: DecodingConfig) -> DecodingConfig:
    r.note = _join(r.note, "evaluation skipped (time budget): decided on tune-split trial values")
    r.default_tps = studies.throughput(dt) if dt is not None else None
    r.best_tps = studies.throughput(bt)
    if best_cfg != default_cfg and (r.default_tps is None or (r.best_tps or 0) > r.default_tps):
        r.chosen = "tuned"
        return best_cfg
    return default_cfg


def _choose_on_eval(s: TuneSettings, r: BatchResult, ev: dict, best_cfg: DecodingConfig,
                    default_cfg: DecodingConfig, run_dtype: str) -> DecodingConfig:
    r.eval_runs = len(ev["default"]["runs"])
    r.default_tps, r.tau_default = ev["default"]["tokens_per_s"], ev["default"]["tau"]
    r.default_p95 = ev["default"]["p95_latency_s"]
    if "tuned" not in ev:
        r.best_tps, r.tau_best, r.best_p95 = r.default_tps, r.tau_default, r.default_p95
        return default_cfg
    tuned = ev["tuned"]
    r.best_tps, r.tau_best, r.best_p95 = tuned["tokens_per_s"], tuned["tau"], tuned["p95_latency_s"]
    same = r.outputs_equal = ev["tuned"]["outputs"] == ev["default"]["outputs"]
    bound = s.p95_bound(r.default_p95) if s.multi_objective else None
    if not same and run_dtype == "fp32":      # the dtype it ran in, not the one asked for (auto)
        r.note = _join(r.note,
                       "tuned config changed fp32 greedy outputs on the eval split: rejected")
    elif bound is not None and r.best_p95 > bound:
        r.note = _join(r.note, f"tuned p95 {r.best_p95:.2f} s exceeds the bound {bound:.2f} s on "
                               "the eval split")
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
