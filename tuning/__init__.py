"""Throughput tuning of DART decoding knobs per workload and batch size (Ray Tune + Optuna).

``dart-ray tune`` -> :func:`tuning.cli.tune_cli`; programmatic use: :func:`tuning.runner.run_tune`.
Imports are lazy: ``import tuning`` pulls in neither Ray nor Optuna.
"""

from __future__ import annotations

__all__ = ["ExactnessError", "Param", "SearchSpace", "TuneSettings", "run_tune", "tune_cli"]


def __getattr__(name: str):
    if name in ("SearchSpace", "Param"):
        from tuning import space

        return getattr(space, name)
    if name in ("TuneSettings", "run_tune"):
        from tuning import runner

        return getattr(runner, name)
    if name == "tune_cli":
        from tuning.cli import tune_cli

        return tune_cli
    if name == "ExactnessError":
        from tuning.objective import ExactnessError

        return ExactnessError
    raise AttributeError(name)
