"""``dart-ray tune``: tune decoding knobs per batch size on a workload and write a profile.

    dart-ray tune --prompts FILE --workload NAME [--batch-sizes 1,4,16] [--trials N]
                  [--time-budget S] [--storage URL] [--objective throughput|throughput+p95]
                  [--for-this-machine [PROFILE]] --out PROFILE.yaml

Resumable: rerun the same command (same --storage) after an interruption; see ``tuning.study``.
``--for-this-machine`` re-tunes a profile (default: the shipped one named like ``--workload``) on
this machine, starting from its knobs; the written profile records this machine's fingerprint.
"""

from __future__ import annotations

import argparse
import sys

from dart_ray.config import add_engine_args


def build_parser() -> argparse.ArgumentParser:
    from tuning.settings import TuneSettings

    p = argparse.ArgumentParser(
        prog="dart-ray tune",
        description="Tune DART decoding knobs for throughput per batch size (Ray Tune + Optuna + "
                    "ASHA) and write a decoding profile. Resumes from --storage.")
    p.add_argument("--prompts", required=True,
                   help=".jsonl/.parquet with a 'prompt' column, or humaneval|chat")
    p.add_argument("--workload", required=True,
                   help="workload name (profile name and study prefix)")
    p.add_argument("--out", required=True, help="profile YAML to write (plots go next to it)")
    p.add_argument("--batch-sizes", default="1,4,16",
                   help="comma-separated batch sizes to tune (default 1,4,16)")
    p.add_argument("--trials", type=int, default=None,
                   help="target finished trials per batch size (default 30; 12 with "
                        "--for-this-machine)")
    p.add_argument("--for-this-machine", nargs="?", const="", default=None, metavar="PROFILE",
                   dest="warm_start", help="warm start: the profile's knobs (default: the shipped "
                                           "profile named like --workload) are the first trials of "
                                           "each batch size; the new profile records this machine")
    p.add_argument("--objective", default="throughput", choices=["throughput", "throughput+p95"],
                   help="throughput (default): max tokens/s; throughput+p95: Pareto of tokens/s "
                        "and p95 request latency, the profile takes the fastest point within the "
                        "p95 bound")
    p.add_argument("--p95-max-ratio", type=float, default=1.0,
                   help="throughput+p95: chosen p95 <= this x the default knobs' p95 (default 1.0)")
    p.add_argument("--p95-max-s", type=float, default=None,
                   help="throughput+p95: absolute p95 latency bound in seconds (default none)")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="wall-clock budget in seconds for the whole run (tuning + evaluation)")
    p.add_argument("--storage", default=None,
                   help="Optuna RDB URL (default sqlite:///<out dir>/tune.db); any SQLAlchemy URL")
    p.add_argument("--results-dir", default=None,
                   help="Ray Tune storage path (default <out dir>/tune_results)")
    add_engine_args(p, help={
        "method": "method whose knobs are tuned (default: dart; not none/ar: plain decoding has no "
                  "knobs)",
        "max_batch_size": "not for tune: the engine holds the largest of --batch-sizes",
        "num_threads": "torch threads of the measuring engines (default: --cpus-per-trial)"})
    w = p.add_argument_group("measurement")
    w.add_argument("--max-new-tokens", type=int, default=128,
                   help="cap on each answer (answers end at EOS before it, as served; default 128)")
    w.add_argument("--ignore-eos", action="store_true",
                   help="fixed-length answers (the old objective; for comparison only)")
    w.add_argument("--chat", action="store_true", help="apply the chat template to prompts")
    w.add_argument("--num-prompts", type=int, default=64,
                   help="prompts sampled from the file (default 64)")
    w.add_argument("--eval-fraction", type=float, default=0.25,
                   help="share held out for evaluation (default 0.25)")
    w.add_argument("--prompts-per-trial", type=int, default=None,
                   help="prompts measured per trial (default max(8, 2 x batch size))")
    w.add_argument("--reports-per-trial", type=int, default=TuneSettings.reports_per_trial,
                   help="incremental reports per trial (ASHA rungs at 1, 2, 4, ... reports)")
    w.add_argument("--check-prompts", type=int, default=2,
                   help="prompts checked against AR per trial")
    w.add_argument("--check-tokens", type=int, default=None,
                   help="tokens generated per check prompt (default min(max-new-tokens, 32))")
    w.add_argument("--check-dtype", default="fp32",
                   help="dtype of the exactness check ('same' = the measuring engine's dtype)")
    w.add_argument("--eval-repeats", type=int, default=3, help="held-out runs per config (median)")
    w.add_argument("--load-probe-tokens", type=int, default=TuneSettings.load_probe_tokens,
                   help="tokens of the AR load probe around each trial (0 disables load detection)")
    w.add_argument("--load-threshold", type=float, default=TuneSettings.load_threshold,
                   help="probe slowdown (share of the fastest) that marks a loaded machine: "
                        "re-run, then flag")
    r = p.add_argument_group("resources")
    r.add_argument("--cpus-per-trial", type=float, default=None,
                   help="default: all CPUs of the Ray cluster")
    r.add_argument("--gpus-per-trial", type=float, default=None,
                   help="default: 1 if --device cuda*, else 0")
    r.add_argument("--max-concurrent-trials", type=int, default=1)
    r.add_argument("--ray-address", default=None,
                   help="join a running Ray cluster (default: RAY_ADDRESS if set, else a new "
                        "local Ray)")
    r.add_argument("--ray-temp-dir", default=None, help="Ray session dir when starting Ray")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plots", action="store_true")
    return p


def settings_from_args(a: argparse.Namespace):
    from dart_ray import EngineConfig
    from dart_ray.config import parse_int_list
    from tuning.runner import TuneSettings

    if a.max_batch_size is not None:
        raise ValueError("tune sizes the engine from --batch-sizes; drop --max-batch-size")
    return TuneSettings(
        prompts=a.prompts, workload=a.workload, out=a.out,
        batch_sizes=parse_int_list(a.batch_sizes), trials=a.trials, time_budget_s=a.time_budget,
        storage=a.storage, results_dir=a.results_dir, engine=EngineConfig.from_args(a),
        max_new_tokens=a.max_new_tokens, ignore_eos=a.ignore_eos, chat=a.chat,
        num_prompts=a.num_prompts, objective=a.objective, p95_max_ratio=a.p95_max_ratio,
        p95_max_s=a.p95_max_s, warm_start=a.warm_start, load_probe_tokens=a.load_probe_tokens,
        load_threshold=a.load_threshold, eval_fraction=a.eval_fraction,
        prompts_per_trial=a.prompts_per_trial, reports_per_trial=a.reports_per_trial,
        check_prompts=a.check_prompts, check_tokens=a.check_tokens,
        check_dtype=None if a.check_dtype == "same" else a.check_dtype,
        cpus_per_trial=a.cpus_per_trial, gpus_per_trial=a.gpus_per_trial,
        max_concurrent_trials=a.max_concurrent_trials, eval_repeats=a.eval_repeats, seed=a.seed,
        plots=not a.no_plots, ray_address=a.ray_address, ray_temp_dir=a.ray_temp_dir)


def tune_cli(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from tuning.runner import NoTrialCompletedError, run_tune
    from tuning.study import StudyMismatchError

    try:
        s = settings_from_args(a)
        run_tune(s, log=lambda m: print(m, flush=True))
    except (StudyMismatchError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:              # e.g. --out not writable, found when the profile is written
        print(f"error: {e}", file=sys.stderr)
        return 1
    except NoTrialCompletedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume from the storage", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(tune_cli())
