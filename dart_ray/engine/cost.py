"""Measured cost model: what one target verify forward costs on this machine.

Speculation pays only when a step's extra committed tokens outweigh what the bigger forward costs,
and that cost is a property of the machine, not of the method: on an AMX Xeon a 61-token bf16
forward is ~2x a 1-token one; on an AVX2-only EPYC in bf16 it is ~25x. So the engine measures.

:class:`CostModel` holds seconds per verify forward on a grid of batch sizes ``B`` x new tokens per
row ``T`` (``T`` = tree nodes + root), interpolated piecewise-linearly in between and extrapolated
pessimistically beyond (proportional to tokens: past the grid a forward is compute-bound), and
monotone (measurement noise never makes a bigger forward look cheaper). It is

* **measured once** at engine start-up (:func:`measure_verify_costs`): two untimed warm-up
  forwards, then one forward per grid cell, best of two, cells above
  :data:`MAX_MEASURED_TOKENS` tokens left to extrapolation, bounded to a few seconds for SmolLM2
  on 2 cores;
* **cached** under ``$DART_RAY_CACHE/hardware/cost-v2-<fingerprint>.json``
  (:func:`load_or_measure`),
  keyed by :class:`~dart_ray.hardware.Fingerprint` (device, CPU model + family/model numbers + ISA,
  threads, torch, dtype, model), so a restart on the same machine costs nothing;
* **refined online** (:meth:`CostModel.observe`): every decode step's measured verify time pulls
  the nearest grid cell toward it (exponential moving average of the observed/predicted ratio).

Drafting and tree-search time are measured online by the controller (they depend on the method and
its knobs, and cost nothing to observe).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dart_ray.hardware import is_duration, read_cached, write_cached

log = logging.getLogger(__name__)

MAX_MEASURED_TOKENS = 160
"""Grid cells with ``B * T`` above this are extrapolated, not measured (bounds start-up time)."""

COST_CACHE_VERSION = "v3"
"""Bumped when a measurement fix makes older cached cost models wrong (v2: warm-up before the
first cell, whose cold timing had inflated plain steps by up to 35 %; v3: models cached before
``DNNL_MAX_CPU_ISA`` was part of the fingerprint may come from the other ISA setting)."""

TOKEN_GRID = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 513)
"""New tokens per row measured (tree sizes 0, 1, 2, 4, 8, 16, ... plus the root)."""


def batch_grid(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to and including ``max_batch``."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return out


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Monotone piecewise-linear through (xs, ys) (a running maximum: a bigger forward never costs
    less; measurement noise must not say otherwise); beyond the last point, linear through the
    origin (a forward that large is compute-bound), a deliberately pessimistic extrapolation."""
    return _interp_monotone(xs, list(itertools.accumulate(ys, max)), x)


def _interp_monotone(xs: list[int], ys: list[float], x: float) -> float:
    """:func:`_interp` of ``ys`` that are already a running maximum."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    i = bisect.bisect_left(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class CostModel:
    """Seconds of one target verify forward for ``B`` rows x ``T`` new tokens per row."""

    batches: list[int]
    """Batch sizes of the grid (ascending)."""
    tokens: list[int]
    """New tokens per row of the grid (ascending)."""
    table: dict[tuple[int, int], float]
    """Measured (or refined) seconds per cell; missing cells are extrapolated from their row."""
    alpha: float = 0.1
    """Weight of one online observation in the moving average of a cell."""
    fingerprint: dict = field(default_factory=dict)
    """The hardware fingerprint it was measured under (``Fingerprint.to_dict()``)."""
    measured_s: float = 0.0
    """Wall seconds the start-up measurement took (0 when loaded from the cache)."""

    def __post_init__(self) -> None:
        if not self.table:
            raise ValueError("a cost model needs at least one measured cell")
        bad = [k for k, v in self.table.items() if not is_duration(v)]
        if bad:              # a 0 s cell would make verifying free to the controller
            raise ValueError(f"cost model cells must be positive seconds: {bad[:3]}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")

    # ---- prediction ------------------------------------------------------------------------------
    def verify_s(self, B: int, T: float) -> float:
        """Predicted seconds of a verify forward over ``B`` rows x ``T`` tokens (T >= 1; a
        fractional ``T`` is an expected width, priced on the piecewise-linear curve)."""
        return self.verify_many(B, (T,))[0]

    def verify_many(self, B: int, Ts: Sequence[float]) -> list[float]:
        """:meth:`verify_s` of ``B`` rows for each of ``Ts``, reading the grid once (the
        controller prices every ladder size each step)."""
        rows: list[int] = []                             # batch sizes with measured cells
        curves: list[tuple[list[int], list[float]]] = []  # their (tokens, running-max seconds)
        for b in self.batches:
            pts = [(t, s) for t in self.tokens if (s := self.table.get((b, t))) is not None]
            if pts:
                rows.append(b)
                curves.append(([t for t, _ in pts],
                               list(itertools.accumulate((s for _, s in pts), max))))
        return [max(_interp(rows, [_interp_monotone(ts, ss, T) for ts, ss in curves], B), 1e-9)
                for T in Ts]

    @classmethod
    def from_function(cls, fn, batches: list[int], tokens: list[int], **kw) -> CostModel:
        """A synthetic cost model (tests): ``fn(B, T) -> seconds`` sampled on the grid."""
        return cls(list(batches), list(tokens),
                   {(b, t): float(fn(b, t)) for b in batches for t in tokens}, **kw)

    # ---- online refinement -----------------------------------------------------------------------
    def observe(self, B: int, T: int, seconds: float) -> None:
        """Pull the grid cell nearest to ``(B, T)`` toward a measured step (ratio EMA).

        The cell moves from its *prediction* (the monotone curve's value there), not its raw value:
        a raw cell below a smaller cell's value is hidden by the running maximum, and pulling it
        by the ratio to the prediction would shrink it without end (a cold first measurement of a
        plain step once drove a 24 ms cell to 0.1 ms this way). Cells of smaller forwards in the
        same row that now lie above it come down to it: a smaller forward never costs more, in
        either direction of the evidence."""
        if seconds <= 0:
            return
        pred = self.verify_s(B, T)
        b = min(self.batches, key=lambda x: abs(x - B))
        t = min(self.tokens, key=lambda x: abs(x - T))
        ratio = min(max(seconds / pred, 0.25), 4.0)      # one outlier (GC, preemption) moves little
        cell_pred = pred if (b, t) == (B, T) else self.verify_s(b, t)
        new = cell_pred * (1.0 - self.alpha + self.alpha * ratio)
        self.table[(b, t)] = new
        for tt in self.tokens:
            if tt < t and self.table.get((b, tt), 0.0) > new:
                self.table[(b, tt)] = new

    # ---- persistence -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"batches": self.batches, "tokens": self.tokens,
                "table": [[b, t, s] for (b, t), s in sorted(self.table.items())],
                "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(list(d["batches"]), list(d["tokens"]),
                   {(int(b), int(t)): float(s) for b, t, s in d["table"]},
                   fingerprint=dict(d.get("fingerprint", {})))

    def describe(self) -> str:
        """``B=1: T=1 20.1ms, T=9 31.0ms, ...`` (logs)."""
        lines = []
        for b in self.batches:
            cells = [f"T={t} {1000 * self.table[(b, t)]:.1f}ms" for t in self.tokens
                     if (b, t) in self.table]
            if cells:
                lines.append(f"B={b}: " + ", ".join(cells))
        return "; ".join(lines)


def measure_verify_costs(forward, batches: list[int], tokens: list[int],
                         max_tokens: int = MAX_MEASURED_TOKENS,
                         budget_s: float = 20.0) -> dict[tuple[int, int], float]:
    """Time ``forward(B, T)`` (one verify-shaped target forward) on the grid, best of two runs.

    Cells with ``B * T > max_tokens`` are skipped (extrapolated later), except ``T = tokens[0]``
    (one plain decode step per batch size is always measured). Stops early past ``budget_s``.
    """
    table: dict[tuple[int, int], float] = {}
    for _ in range(2):          # warm caches and kernels: the first cell must not pay for them
        forward(batches[0], tokens[0])
    t_start = time.perf_counter()
    for b in batches:
        for t in tokens:
            if t != tokens[0] and b * t > max_tokens:
                break
            best = float("inf")
            for _ in range(2):
                t0 = time.perf_counter()
                forward(b, t)
                best = min(best, time.perf_counter() - t0)
            table[(b, t)] = best
            if time.perf_counter() - t_start > budget_s:
                log.warning("cost-model measurement stopped at its %.0f s budget (B=%d, T=%d)",
                            budget_s, b, t)
                return table
    return table


def load_or_measure(key: str, fingerprint: dict, forward, batches: list[int],
                    tokens: list[int]) -> CostModel:
    """The cached cost model for this fingerprint, or a fresh measurement (then cached)."""
    name = f"cost-{COST_CACHE_VERSION}-{key}.json"
    data = read_cached(name)
    if data is not None:
        try:
            cm = CostModel.from_dict(data)
            if cm.batches == list(batches) and cm.tokens == list(tokens):
                return cm
        except (KeyError, TypeError, ValueError, AttributeError):
            pass
    t0 = time.perf_counter()
    with torch.inference_mode():
        table = measure_verify_costs(forward, batches, tokens)
    cm = CostModel(list(batches), list(tokens), table, fingerprint=fingerprint,
                   measured_s=time.perf_counter() - t0)
    write_cached(name, cm.to_dict())
    log.info("measured the verify cost model in %.1f s: %s", cm.measured_s, cm.describe())
    return cm
