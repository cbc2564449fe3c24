"""Global engine counters (vLLM-compatible speculative-decoding names are derived from these)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    steps: int = 0
    """Decode (verify) steps run; each covers the whole running batch."""
    row_steps: int = 0
    """Sum over steps of running rows (= drafts proposed)."""
    draft_tokens: int = 0
    """Draft tree nodes verified, summed over rows and steps."""
    draft_depth_tokens: int = 0
    """Speculated positions: per row-step the depth of the verified tree (0 on a plain step). This
    is vLLM's "draft tokens" for a tree: accepted_tokens / draft_depth_tokens is the acceptance rate
    a vLLM dashboard computes, and stays in [0, 1]."""
    spec_row_steps: int = 0
    """Row-steps that verified at least one draft node (vLLM's "drafts")."""
    ar_steps: int = 0
    """Decode steps the adaptive controller ran as plain AR steps (no drafting)."""
    head_rows: int = 0
    """LM-head rows computed in decode steps (the lazy head skips leaves that cannot be used)."""
    accepted_tokens: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)
    generated_tokens: int = 0
    """Tokens committed to requests' outputs (only grows; where a consumer ends a request at a stop
    string it finds, :class:`~dart_ray.engine.async_engine.AsyncEngine`, the tokens a step committed
    past it count too: the client's count is the server's ``vllm:generation_tokens``)."""
    prompt_tokens: int = 0
    finished_requests: int = 0
    draft_s: float = 0.0
    """Seconds in drafter forwards (propose minus tree search)."""
    tree_s: float = 0.0
    verify_s: float = 0.0
    """Seconds in target forwards of decode steps (incl. mask building)."""
    accept_s: float = 0.0
    """Seconds in acceptance, commit and drafter bookkeeping."""
    prefill_s: float = 0.0
    other_s: float = 0.0
    """Emission, detokenisation, stop checks, row management."""

    @property
    def mean_accepted_len(self) -> float:
        return (self.accepted_tokens + self.row_steps) / self.row_steps if self.row_steps else 0.0

    def record_row(self, num_draft: int, num_accepted: int, depth: int = 0) -> None:
        """One row of one step: ``num_draft`` tree nodes of depth ``depth`` verified,
        ``num_accepted`` of them accepted."""
        self.row_steps += 1
        self.draft_tokens += num_draft
        self.draft_depth_tokens += depth
        self.spec_row_steps += num_draft > 0
        self.accepted_tokens += num_accepted
        if num_accepted > len(self.accepted_per_depth):
            self.accepted_per_depth.extend([0] * (num_accepted - len(self.accepted_per_depth)))
        for i in range(num_accepted):
            self.accepted_per_depth[i] += 1

    def time_split_ms(self) -> dict[str, float]:
        """Mean milliseconds per decode step of each phase."""
        n = max(self.steps, 1)
        return {k: 1000.0 * getattr(self, f"{k}_s") / n
                for k in ("draft", "tree", "verify", "accept", "other")}

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["mean_accepted_len"] = self.mean_accepted_len
        d["time_split_ms"] = self.time_split_ms()
        return d
