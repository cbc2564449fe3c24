"""The adaptive controller replayed on recorded acceptance (:func:`dart_ray.bench.replay.simulate`):
as shipped vs probes that back off after every probe (``probe_until_seen=0``), over several orders
of the same prompts (one controller serves a run's requests, so each order is another run), next
to fixed budgets. Deterministic: the prices are a verify cost table plus DART's drafting time per
budget, not the machine's timing noise.

    python scripts/replay_knobs.py --set chat --chat --cache runs/replay/chat.npz --only default
    python scripts/replay_controller.py runs/replay/chat.npz              # this machine's table
    python scripts/replay_controller.py runs/replay/chat.npz --flat-cost 60   # an AMX Xeon's shape

Prints tokens per second relative to plain decoding (mean, min, max, sd over orders) and tau.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from pathlib import Path

import numpy as np

BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24)
DRAFT_MS = (2.2, 2.5, 2.8, 3.0, 3.3, 3.7, 3.3, 3.5, 4.0)
"""DART's drafting + search per step at each budget, as the engine learned them on the chat set
(AMD EPYC Zen 5, bf16; the budget-n search is smaller for small n); ``LOOKUP_ONLY_MS`` where the
lookup paths alone fill the budget (no drafter forward, no search)."""
LOOKUP_ONLY_MS = 0.4


def drafting_s(n: int, context: int, lookup_nodes: int) -> float:
    if lookup_nodes >= n:
        return LOOKUP_ONLY_MS / 1000
    return DRAFT_MS[min(bisect.bisect_left(BUDGETS, n), len(BUDGETS) - 1)] / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("replay", help=".npz written by scripts/replay_knobs.py --cache")
    ap.add_argument("--orders", type=int, default=12)
    ap.add_argument("--flat-cost", type=float, default=None,
                    help="price a verify forward of T tokens at 1 + (T-1)/R plain ones")
    ap.add_argument("--overhead-ms", type=float, default=0.7)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()

    import torch

    from dart_ray import DecodingConfig, EngineConfig
    from dart_ray.bench.replay import Replay, flat_prices, simulate
    from dart_ray.engine import Engine
    from dart_ray.engine.controller import ControllerConfig
    from dart_ray.engine.cost import CostModel

    torch.set_num_threads(2)
    eng = Engine.from_config(EngineConfig(method="dart", max_batch_size=1))
    cost = CostModel.from_dict(eng.controller.cost.to_dict())
    if a.flat_cost:
        cost = flat_prices(cost, a.flat_cost)
    rep = Replay.load(a.replay)
    dec = DecodingConfig()
    orders = [np.random.default_rng(s).permutation(len(rep.seqs)).tolist()
              for s in range(a.orders)]
    kw = dict(draft_s=drafting_s, overhead_s=a.overhead_ms / 1000,
              plain_overhead_s=a.overhead_ms / 1000 * 0.7)
    out = {"replay": a.replay, "flat_cost": a.flat_cost, "orders": a.orders, "controllers": {},
           "fixed": {}}
    for name, cfg in (("back off after every probe", ControllerConfig(probe_until_seen=0)),
                      ("probing episodes (shipped)", ControllerConfig())):
        runs = [simulate(rep, dec, eng.drafter.ngram, cost, controller_config=cfg, order=o, **kw)
                for o in orders]
        sp = [r.speedup for r in runs]
        tau = statistics.mean(r.tokens_per_step for r in runs)
        out["controllers"][name] = {"speedup": sp, "tau": tau}
        print(f"{name:28s} mean {statistics.mean(sp):.3f} min {min(sp):.3f} max {max(sp):.3f} "
              f"sd {statistics.stdev(sp):.3f} tau {tau:.2f}", flush=True)
    for m in (2, 4, 6, 8, 12, 16):
        r = simulate(rep, dec, eng.drafter.ngram, cost, fixed=m, **kw)
        out["fixed"][m] = {"speedup": r.speedup, "tau": r.tokens_per_step}
    print("fixed budgets:", ", ".join(f"{m}: {v['speedup']:.3f}" for m, v in out["fixed"].items()))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
