"""Verification of draft trees against one target forward: greedy and lossless sampling."""

from dart_ray.verify.acceptance import (
    Acceptance,
    accept,
    greedy_accept,
    processed_probs,
    sample_accept,
)
from dart_ray.verify.randomness import RequestRandom

__all__ = ["Acceptance", "RequestRandom", "accept", "greedy_accept", "processed_probs",
           "sample_accept"]
