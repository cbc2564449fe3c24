"""dart-ray: lossless DART speculative decoding for Llama-family models.

Public API (``deployments/``, ``tuning/`` and batch jobs use only these names)::

    from dart_ray import Engine, EngineConfig, DecodingConfig, SamplingParams
    engine = Engine.from_config(EngineConfig(method="dart"))
    for out in engine.stream("Hello", SamplingParams(max_new_tokens=32)):
        print(out.new_text, end="")

Importing this package has no side effects and imports no torch: the configs, profiles and the
allocator helpers are plain Python, and the engine names (``Engine``, ``RequestOutput``, ...) load
``dart_ray.engine`` on first use. So the ``dart-ray`` launcher and Ray's placement code can read
a config or an allocator setting without paying for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from dart_ray.allocator import actor_allocator_env, allocator_in_use, fast_allocator_env
from dart_ray.config import METHODS, DecodingConfig, EngineConfig, SamplingParams
from dart_ray.model_ref import ModelLoadError, locate_model
from dart_ray.profiles import DecodingSchedule, load_profile, save_profile
from dart_ray.ray_local import init_ray, joins_cluster, local_ray_config

if TYPE_CHECKING:
    from dart_ray.engine import (
        Completion,
        Engine,
        EngineStats,
        InvalidPromptError,
        PromptTooLongError,
        RequestOutput,
        RequestStats,
        encode_prompt,
    )
    from dart_ray.models.loading import check_model

__version__ = "0.1.0"

_LAZY = {**{name: "dart_ray.engine" for name in (
    "Completion", "Engine", "EngineStats", "InvalidPromptError", "PromptTooLongError",
    "RequestOutput", "RequestStats", "encode_prompt")},
    "check_model": "dart_ray.models.loading"}
"""Names imported (with torch) from their module on first use."""

__all__ = [
    "METHODS", "DecodingConfig", "EngineConfig", "SamplingParams", "Engine", "EngineStats",
    "Completion", "RequestOutput", "RequestStats", "InvalidPromptError", "PromptTooLongError",
    "DecodingSchedule", "ModelLoadError", "locate_model", "check_model",
    "load_profile", "save_profile", "encode_prompt", "fast_allocator_env", "actor_allocator_env",
    "allocator_in_use", "init_ray", "joins_cluster", "local_ray_config",
    "__version__",
]


def __getattr__(name: str):
    """The engine names (and ``check_model``), imported with torch on first use."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dart_ray' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
