"""Simulate the adaptive speculation controller on a synthetic machine and workload (no model).

Each step the controller plans a budget n; the "drafter" fills it (a chain of n nodes), level i of
which is accepted with probability ``p`` given level i-1 was; the step costs
``verify(1, n + 1) + draft + overhead`` of a synthetic cost curve. Prints tokens/s relative to
plain decoding and the fraction of plain steps, per seed. Used to check controller changes against
the static optimum before spending benchmark time (docs/BENCHMARKS.md, tenth sitting)::

    python scripts/simulate_controller.py --node-cost 0.12 --p 0.35
"""

from __future__ import annotations

import argparse
import random

from dart_ray.engine.controller import ControllerConfig, SpeculationController
from dart_ray.engine.cost import CostModel

GRID_B, GRID_T = [1, 2, 4, 8, 16], [1, 2, 3, 5, 9, 17, 33, 65]
PLAIN_S, DRAFT_S, OVERHEAD_S = 0.020, 0.0003, 0.001


def verify_s(node_cost: float, tokens: float) -> float:
    """The synthetic machine: a verify forward over ``tokens`` tokens of one row."""
    return PLAIN_S * (1.0 + node_cost * (tokens - 1))


def step_s(node_cost: float, n: int) -> float:
    """One step verifying ``n`` draft nodes: drafting (none for a plain step), verify, overhead."""
    return (DRAFT_S if n else 0.0) + verify_s(node_cost, n + 1) + OVERHEAD_S


def simulate(node_cost: float, p: float, steps: int, seed: int,
             budget: int = 32) -> tuple[float, float]:
    """(rate / plain rate, fraction of plain steps) of one run."""
    rng = random.Random(seed)
    cost = CostModel.from_function(lambda b, t: verify_s(node_cost, t), GRID_B, GRID_T)
    ctrl = SpeculationController(cost, ControllerConfig())
    seconds = tokens = plain = 0
    for _ in range(steps):
        n = ctrl.plan(1, budget)
        k = 0
        while k < n and rng.random() < p:
            k += 1
        seconds += step_s(node_cost, n)
        tokens += 1 + k
        plain += n == 0
        ctrl.record(1, n, [list(range(1, k + 1))] if n else [], draft_s=DRAFT_S if n else 0.0,
                    verify_s=0.0, tokens_per_row=n + 1, overhead_s=OVERHEAD_S)
    return tokens / seconds * step_s(node_cost, 0), plain / steps


def best_static(node_cost: float, p: float, budget: int = 32) -> tuple[int, float]:
    """The fixed chain length with the highest expected rate, and that rate / plain rate."""
    def rel(n: int) -> float:
        accepted = sum(p ** i for i in range(1, n + 1))
        return (1.0 + accepted) / step_s(node_cost, n) * step_s(node_cost, 0)
    n = max(range(budget + 1), key=rel)
    return n, rel(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--node-cost", type=float, default=0.12,
                    help="one more verified token, as a fraction of a plain step")
    ap.add_argument("--p", type=float, default=0.35, help="per-level acceptance of the chain")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seeds", type=int, default=3)
    a = ap.parse_args()
    n, rel = best_static(a.node_cost, a.p)
    print(f"static optimum: {n} nodes, {rel:.3f}x plain")
    for seed in range(a.seeds):
        speed, plain = simulate(a.node_cost, a.p, a.steps, seed)
        print(f"seed {seed}: {speed:.3f}x plain, {100 * plain:.0f}% plain steps")


if __name__ == "__main__":
    main()
