"""Request state and the outputs the engine streams."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dart_ray.config import SamplingParams
from dart_ray.engine.detok import RequestText
from dart_ray.verify.randomness import RequestRandom

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class RequestStats:
    """Speculative-decoding statistics of one request."""

    steps: int = 0
    """Target verify steps (each commits accepted + 1 tokens)."""
    draft_tokens: int = 0
    """Draft nodes proposed (tree sizes summed)."""
    accepted_tokens: int = 0
    """Draft tokens accepted."""
    accepted_per_depth: list[int] = field(default_factory=list)
    """accepted_per_depth[i] = steps in which the depth-(i+1) draft was accepted."""

    @property
    def mean_accepted_len(self) -> float:
        """tau: mean tokens committed per verify step (accepted drafts + the bonus)."""
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.steps += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += num_accepted
        if num_accepted > len(self.accepted_per_depth):
            self.accepted_per_depth.extend([0] * (num_accepted - len(self.accepted_per_depth)))
        for i in range(num_accepted):
            self.accepted_per_depth[i] += 1

    def to_dict(self) -> dict:
        return {"steps": self.steps, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens,
                "accepted_per_depth": list(self.accepted_per_depth),
                "mean_accepted_len": self.mean_accepted_len}


@dataclass
class RequestOutput:
    """One streamed delta of one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_generated_tokens: int
    stats: RequestStats


@dataclass
class Completion:
    """A finished request (what ``Engine.generate`` returns)."""

    request_id: str
    num_prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: RequestStats
    latency_s: float
    first_token_s: float | None = None

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Request:
    """Engine-internal state of a request."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    random: RequestRandom | None
    """Its randomness (sampled requests; None when greedy): position-keyed race variates, and the
    generator a sampling drafter (SpS) draws its drafts with."""
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    row: int = -1
    root: int = -1
    """Next root token (generated, not yet in the target cache)."""
    finished: bool = False
    finish_reason: FinishReason | None = None
    text: RequestText | None = None
    """Its text, when the engine's own :meth:`~dart_ray.engine.Engine.step` makes it (the
    synchronous API); None while its consumer detokenises (:class:`AsyncEngine`)."""
