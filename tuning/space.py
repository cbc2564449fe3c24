"""The typed search space over :class:`~dart_ray.DecodingConfig` runtime knobs.

Every dimension is a typed :class:`Param` (int or float, optionally log-scaled) whose range lies
inside what ``DecodingConfig`` validates, so any point of the space — sampled by Optuna, by
:meth:`SearchSpace.sample`, or enqueued by hand — maps to a valid config. Dimensions are named like
the ``DecodingConfig`` fields; ``draft_depth`` is capped to the drafter's trained depth
(``engine.drafter.max_draft_depth``).

Knobs a method does not read are left out of its space (the N-gram-only drafter ignores the
draft-logit scoring knobs; without an N-gram model the N-gram weight and count threshold do
nothing), so trials are not spent on dimensions that cannot matter.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from dart_ray import DecodingConfig

MAX_DRAFT_DEPTH = 16
"""Upper end of the ``draft_depth`` range even when the drafter could go deeper (N-gram drafter:
32)."""


@dataclass(frozen=True)
class Param:
    """One dimension: ``kind`` is ``"int"`` or ``"float"``; bounds are inclusive."""

    name: str
    kind: str
    low: float
    high: float
    log: bool = False
    help: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("int", "float"):
            raise ValueError(f"{self.name}: kind must be 'int' or 'float', got {self.kind!r}")
        if not self.low <= self.high:
            raise ValueError(f"{self.name}: empty range [{self.low}, {self.high}]")
        if self.log and self.low <= 0:
            raise ValueError(f"{self.name}: a log-scaled range needs low > 0")
        if self.kind == "int" and (int(self.low) != self.low or int(self.high) != self.high):
            raise ValueError(f"{self.name}: int bounds must be integers")

    def clip(self, value):
        v = min(max(value, self.low), self.high)
        return int(round(v)) if self.kind == "int" else float(v)

    def sample(self, rng: random.Random):
        if self.kind == "int":
            if self.log:
                v = math.exp(rng.uniform(math.log(self.low), math.log(self.high + 1)))
                return self.clip(math.floor(v))
            return rng.randint(int(self.low), int(self.high))
        if self.log:
            return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return rng.uniform(self.low, self.high)

    def distribution(self):
        import optuna

        if self.kind == "int":
            return optuna.distributions.IntDistribution(int(self.low), int(self.high), log=self.log)
        return optuna.distributions.FloatDistribution(float(self.low), float(self.high),
                                                      log=self.log)

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "low": self.low, "high": self.high,
                "log": self.log}


@dataclass(frozen=True)
class SearchSpace:
    """Named, typed dimensions plus the base config that fills in untuned fields."""

    params: tuple[Param, ...]
    base: DecodingConfig = field(default_factory=DecodingConfig)

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate search-space dimensions: {names}")
        known = set(DecodingConfig.__dataclass_fields__)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"not DecodingConfig fields: {unknown}")

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def for_drafter(cls, method: str, max_draft_depth: int, has_ngram: bool = True,
                    base: DecodingConfig | None = None) -> SearchSpace:
        """The default space for ``method`` (dart, eagle, medusa, sps or ngram) and a drafter whose
        trained depth is ``max_draft_depth``."""
        base = base or DecodingConfig()
        if max_draft_depth < 1:
            raise ValueError(f"drafter max_draft_depth must be >= 1, got {max_draft_depth} "
                             "(method 'none' has nothing to tune)")
        d_hi = min(max_draft_depth, MAX_DRAFT_DEPTH)
        d_lo = min(2, d_hi)
        depth = Param("draft_depth", "int", d_lo, d_hi,
                      help="positions drafted per step (<= trained depth)")
        budget = Param("tree_budget", "int", 4, 128, log=True, help="draft nodes per tree")
        min_count = Param("ngram_min_count", "int", 1, 8, log=True, help="N-gram count threshold")
        if method in ("dart", "medusa", "eagle"):
            ps = [depth,
                  Param("top_k", "int", 2, 64, log=True, help="candidates per level"),
                  Param("beam_width", "int", 1, 48, log=True,
                        help="beams kept per level (tree width)"),
                  budget]
            if has_ngram:
                ps += [Param("ngram_weight", "float", 0.0, 1.5, help="weight of ln p_ngram"),
                       min_count]
            ps += [Param("level_weight_exp", "float", 0.0, 1.5, help="level weight (l+1)^-a"),
                   Param("logit_weight_base", "float", 0.5, 1.0, help="draft-logit weight b^l")]
            if method == "dart":
                ps += [Param("lookup_paths", "int", 0, 8,
                             help="prompt-lookup paths merged into the tree"),
                       Param("lookup_len", "int", 2, 16, log=True,
                             help="tokens per lookup path (any drafter depth)"),
                       Param("lookup_min_match", "int", 1, 3,
                             help="shortest suffix match for a lookup path")]
            # no N-gram term and no level weighting: cumulative draft confidence only
            if method == "eagle":
                ps = [depth,
                      Param("top_k", "int", 2, 16, log=True, help="children per expanded node"),
                      Param("beam_width", "int", 1, 16, log=True, help="nodes expanded per level"),
                      budget]
        elif method == "sps":
            ps = [Param("draft_depth", "int", 1, d_hi,
                        help="draft chain length (the papers' gamma)")]
        elif method == "ngram":
            ps = [depth, Param("beam_width", "int", 1, 32, log=True, help="continuations kept"),
                  budget]
            if has_ngram:
                ps.append(min_count)
        else:
            raise ValueError(f"nothing to tune for method {method!r} (use dart or ngram)")
        return cls(tuple(ps), base)

    @classmethod
    def for_engine(cls, engine, base: DecodingConfig | None = None) -> SearchSpace:
        """The default space for a loaded engine's drafter."""
        drafter = engine.drafter
        has_ngram = getattr(drafter, "ngram", None) is not None
        return cls.for_drafter(drafter.name, drafter.max_draft_depth, has_ngram, base)

    # ---- points ---------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    def default_point(self) -> dict:
        """The base (current default) config projected into the space."""
        return {p.name: p.clip(getattr(self.base, p.name)) for p in self.params}

    def contains(self, point: dict) -> bool:
        by = {p.name: p for p in self.params}
        return set(point) == set(by) and all(by[k].low <= v <= by[k].high for k, v in point.items())

    def sample(self, rng: random.Random) -> dict:
        return {p.name: p.sample(rng) for p in self.params}

    def to_config(self, point: dict) -> DecodingConfig:
        """A validated DecodingConfig: the base with ``point`` applied (values clipped to the
        space)."""
        by = {p.name: p for p in self.params}
        unknown = set(point) - set(by)
        if unknown:
            raise ValueError(f"point has dimensions outside the space: {sorted(unknown)}")
        return self.base.replace(**{k: by[k].clip(v) for k, v in point.items()})

    def distributions(self) -> dict:
        """name -> optuna distribution (for ``OptunaSearch(space=...)`` / ``study.ask``)."""
        return {p.name: p.distribution() for p in self.params}

    def to_dict(self) -> dict:
        return {"params": [p.to_dict() for p in self.params], "base": self.base.to_dict()}
