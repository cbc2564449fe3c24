"""The decode loop with continuous batching, streaming and metrics."""

from dart_ray.engine.engine import Engine, InvalidPromptError, PromptTooLongError, encode_prompt
from dart_ray.engine.metrics import EngineStats
from dart_ray.engine.request import Completion, RequestOutput, RequestStats

__all__ = ["Engine", "InvalidPromptError", "PromptTooLongError", "encode_prompt", "EngineStats",
           "Completion", "RequestOutput", "RequestStats"]
