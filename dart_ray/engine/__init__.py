"""The decode loop with continuous batching, streaming and metrics."""

from dart_ray.engine.engine import Engine, PromptTooLongError
from dart_ray.engine.metrics import EngineStats
from dart_ray.engine.request import Completion, RequestOutput, RequestStats

__all__ = ["Engine", "PromptTooLongError", "EngineStats", "Completion", "RequestOutput", "RequestStats"]
