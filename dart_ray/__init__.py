"""dart-ray: lossless DART speculative decoding for Llama-family models.

Public API (``deployments/``, ``tuning/`` and batch jobs use only these names)::

    from dart_ray import Engine, EngineConfig, DecodingConfig, SamplingParams
    engine = Engine.from_config(EngineConfig(method="dart"))
    for out in engine.stream("Hello", SamplingParams(max_new_tokens=32)):
        print(out.new_text, end="")

Importing this package has no side effects and does not import torch-heavy submodules eagerly
beyond what the names below need.
"""

from dart_ray.allocator import allocator_in_use, fast_allocator_env
from dart_ray.config import METHODS, DecodingConfig, EngineConfig, SamplingParams
from dart_ray.engine import (
    Completion,
    Engine,
    EngineStats,
    PromptTooLongError,
    RequestOutput,
    RequestStats,
    encode_prompt,
)
from dart_ray.profiles import DecodingSchedule, load_profile, save_profile

__version__ = "0.1.0"

__all__ = [
    "METHODS", "DecodingConfig", "EngineConfig", "SamplingParams", "Engine", "EngineStats",
    "Completion", "RequestOutput", "RequestStats", "PromptTooLongError", "DecodingSchedule",
    "load_profile", "save_profile", "encode_prompt", "fast_allocator_env", "allocator_in_use",
    "__version__",
]
