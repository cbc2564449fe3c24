"""Phase 1, start: the prompts (seeded tune / eval split), Ray (started here or joined), the
warm-start profile (``--for-this-machine``) and the engine loaded once in the driver (its drafter's
depth sizes the search space; its hardware fingerprint keys the studies; it runs the held-out
evaluation). Everything the later phases share is one :class:`TuneRun`."""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dart_ray import (
    DecodingSchedule,
    Engine,
    EngineConfig,
    SamplingParams,
    actor_allocator_env,
    init_ray,
    load_profile,
)
from tuning.report import short_number
from tuning.settings import TuneSettings
from tuning.space import SearchSpace


class Deadline:
    """The run's wall-clock budget (``TuneSettings.time_budget_s``; None = unbounded), from its
    start."""

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


def split_prompts(prompts: list[str], n: int, eval_fraction: float,
                  seed: int) -> tuple[list[str], list[str]]:
    """Seeded sample of ``n`` prompts, split into (tune, eval)."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    chosen = [prompts[i] for i in order[:n]]
    n_eval = int(round(len(chosen) * eval_fraction)) if len(chosen) >= 2 else 0
    n_eval = min(n_eval, len(chosen) - 1)
    return chosen[n_eval:], chosen[:n_eval]


def check_prompts_fit(engine: Engine, tune_p: list[str], eval_p: list[str], chat: bool) -> None:
    """Every sampled prompt tokenises to something the engine accepts (fits the context), checked
    before any trial: a prompt that does not would fail every trial (tune split) or the run after
    all of them (eval split)."""
    for split, prompts in (("tune", tune_p), ("eval", eval_p)):
        for i, p in enumerate(prompts):
            try:
                engine.check_prompt(engine.encode_prompt(p, chat))
            except ValueError as e:
                raise ValueError(f"{split} prompt {i} ({p[:40]!r}...): {e}; drop it from the "
                                 "prompt file or raise --max-seq-len") from None


def start_tune_ray(s: TuneSettings) -> bool:
    """Start or join Ray as ``s`` says (:func:`dart_ray.init_ray`); True if this call did (and
    should shut it down), False if Ray was up already."""
    kw: dict = {"include_dashboard": False, "logging_level": "WARNING"}
    if s.ray_address:
        kw["address"] = s.ray_address
    else:
        if s.ray_num_cpus:
            kw["num_cpus"] = s.ray_num_cpus
        if s.ray_temp_dir:
            kw["_temp_dir"] = s.ray_temp_dir
    # CPU trials measure throughput: run them under the allocator serving uses (~25 % apart)
    alloc = actor_allocator_env(device=s.engine.device)
    if alloc:
        kw["runtime_env"] = {"env_vars": alloc}
    # trials time decoding: a Ray started here runs them at this command's priority, not 15 lower
    return init_ray(**kw)


def load_warm_start(s: TuneSettings) -> DecodingSchedule | None:
    """The ``--for-this-machine`` profile (given, or the shipped one named like the workload)."""
    if s.warm_start is None:
        return None
    return load_profile(s.warm_start or s.workload)


def warm_points(warm: DecodingSchedule | None, batch_size: int) -> list[dict]:
    """Knobs to enqueue first at ``batch_size``: the profile's entry for it, then its other
    entries."""
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
    log(f"workload {s.workload!r}: {len(tune_p)} tune + {len(eval_p)} eval prompts from "
        f"{s.prompts}; batch sizes {list(s.batch_sizes)}; {s.trials} trials each; objective "
        f"{s.objective}; answers <= {s.max_new_tokens} "
        f"tokens{' (ignore_eos)' if s.ignore_eos else ', EOS honoured'}; storage "
        f"{s.storage_display}")

    cluster_cpus = float(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
    cpus = float(s.cpus_per_trial) if s.cpus_per_trial else cluster_cpus
    if cpus > cluster_cpus:
        raise ValueError(f"--cpus-per-trial {cpus} exceeds the cluster's {cluster_cpus} CPUs")
    threads = s.engine.num_threads or max(1, int(cpus))
    if s.gpus_per_trial is None:
        s.gpus_per_trial = 1.0 if s.engine.device.startswith("cuda") else 0.0

    ecfg = s.engine.replace(max_batch_size=max(s.batch_sizes), num_threads=threads)
    log("loading the engine in the driver (drafter depth, hardware, held-out evaluation)...")
    engine = Engine.from_config(ecfg)
    log(f"machine: {engine.fingerprint.summary()}")
    check_prompts_fit(engine, tune_p, eval_p, s.chat)
    small = [b for b in s.batch_sizes if b > min(len(tune_p), len(eval_p))]
    if small:
        log(f"warning: batch sizes {small} are measured with at most {len(tune_p)} (tune) / "
            f"{len(eval_p)} (eval) prompts in flight, fewer than their rows: raise --num-prompts "
            "for a profile entry measured at its batch size")
    # the engine's --decoding knobs are the base: the default point and every untuned knob
    space = SearchSpace.for_engine(engine, s.engine.decoding)
    ranges = [f"{p.name}[{short_number(p.low)}..{short_number(p.high)}{' log' if p.log else ''}]"
              for p in space.params]
    log(f"search space ({engine.drafter.name}, trained depth {engine.drafter.max_draft_depth}): "
        + ", ".join(ranges))
    run = TuneRun(s, deadline, tune_p, eval_p, engine, ecfg, space, threads, cpus, log, warm)
    if warm is not None:
        run.warm_differences = hardware_differences(warm, engine.fingerprint)
        where = "; ".join(run.warm_differences) or "this machine (same fingerprint)"
        log(f"warm start from {warm.source or warm.workload}: tuned on {where}")
    return run
