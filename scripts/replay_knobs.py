"""Acceptance of DART's draft trees per budget under tree-knob variants, replayed offline
(:mod:`dart_ray.bench.replay`): one greedy pass per prompt records the drafter's candidates at every
position, then each variant costs only its tree searches.

    python scripts/replay_knobs.py --set chat-probe --chat --limit 40 --cache runs/replay/probe.npz
    python scripts/replay_knobs.py --set stdlib-val --limit 48 --cache runs/replay/stdlib.npz

Prints, per variant, the mean accepted draft tokens per position with the tree cut to each size
(the controller's ladder), i.e. tau - 1 at a fixed budget: machine-independent. The last column
walks the references step by step with the adaptive controller choosing each budget
(:func:`dart_ray.bench.replay.simulate`), priced by this machine's measured verify cost table plus
``--draft-ms`` / ``--overhead-ms`` per step: tokens per second relative to plain decoding.
``--flat-cost R`` prices a verify forward of T tokens at ``(1 + (T - 1) / R)`` plain forwards
instead (R ~ 60 is an AMX Xeon's shape in bf16; docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 60, 80)


def variants(base):
    """Name -> knobs of every variant compared (the base first)."""
    v = {"default": base}
    for w in (0.0, 0.25, 1.0):
        v[f"ngram_weight={w}"] = base.replace(ngram_weight=w)
    for a in (0.3, 1.2):
        v[f"level_weight_exp={a}"] = base.replace(level_weight_exp=a)
    for b in (0.7, 1.0):
        v[f"logit_weight_base={b}"] = base.replace(logit_weight_base=b)
    for k in (10, 16):
        v[f"top_k={k}"] = base.replace(top_k=k)
    v["lookup_paths=0"] = base.replace(lookup_paths=0)
    v["lookup_paths=1"] = base.replace(lookup_paths=1)
    v["lookup_min_match=3"] = base.replace(lookup_min_match=3)
    for n in (5, 16, 24):
        v[f"lookup_len={n}"] = base.replace(lookup_len=n)
    v["lookup_paths=3"] = base.replace(lookup_paths=3)
    return v


def load_set(name: str, limit: int) -> list[str]:
    from dart_ray.bench.prompts import load_prompts

    if name == "stdlib-val":      # stdlib code prompts in the val split: no drafter trained on them
        from dart_ray.training.corpus import code_prompts
        from dart_ray.training.gen_data import split_of

        held = [p for p in code_prompts(40 * limit, seed=2026) if split_of(p, 0.05) == "val"]
        return held[:limit]
    return load_prompts(name, limit=limit)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", required=True,
                    help="chat | chat-probe | humaneval | stdlib-val | FILE")
    ap.add_argument("--chat", action="store_true", help="apply the chat template")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--cache", help=".npz: the recorded replay (written if absent)")
    ap.add_argument("--draft-ms", type=float, default=2.3,
                    help="drafting + search per step (AMD EPYC Zen 5, bf16: ~2.3)")
    ap.add_argument("--overhead-ms", type=float, default=0.8,
                    help="acceptance + commit + emission per speculative step (Zen 5: ~0.7-0.8)")
    ap.add_argument("--flat-cost", type=float, default=None,
                    help="price verify forwards as 1 + (T-1)/R plain ones instead of this "
                         "machine's table")
    ap.add_argument("--only", help="comma-separated variant names (default: all)")
    ap.add_argument("--json", help="write the table here")
    a = ap.parse_args()

    import torch

    from dart_ray import DecodingConfig, EngineConfig
    from dart_ray.bench.replay import Replay, accepted_by_budget, collect, flat_prices, simulate
    from dart_ray.engine import Engine
    from dart_ray.engine.cost import CostModel

    torch.set_num_threads(2)
    eng = Engine.from_config(EngineConfig(method="dart", max_batch_size=1))
    # the measured table as loaded, before recording refines it with the recording's own steps
    cost = CostModel.from_dict(eng.controller.cost.to_dict())
    cache = Path(a.cache) if a.cache else None
    if cache is not None and cache.is_file():
        rep = Replay.load(cache)
    else:
        prompts = load_set(a.set, a.limit)
        ids = [eng.encode_prompt(p, a.chat) for p in prompts]
        t0 = time.perf_counter()
        rep = collect(eng, ids, a.max_new_tokens)
        print(f"recorded {rep.num_positions} positions of {len(ids)} prompts in "
              f"{time.perf_counter() - t0:.1f} s")
        if cache is not None:
            rep.save(cache)
    ngram = eng.drafter.ngram
    if a.flat_cost:
        cost = flat_prices(cost, a.flat_cost)
    base = DecodingConfig()
    todo = variants(base)
    if a.only:
        todo = {k: v for k, v in todo.items() if k in a.only.split(",")}
    table = {}
    print(f"{rep.num_positions} positions; mean accepted draft tokens at budget:")
    print(f"{'variant':24s} " + " ".join(f"{m:>5d}" for m in SIZES) + "  controller x plain")
    for name, dec in todo.items():
        t0 = time.perf_counter()
        acc = accepted_by_budget(rep, dec, ngram, SIZES)
        means = {m: float(acc[m].mean()) for m in SIZES}
        sim = simulate(rep, dec, ngram, cost, draft_s=a.draft_ms / 1000,
                       overhead_s=a.overhead_ms / 1000, plain_overhead_s=a.overhead_ms / 2000)
        print(f"{name:24s} " + " ".join(f"{means[m]:5.3f}" for m in SIZES)
              + f"  {sim.speedup:.3f} (tau {sim.tokens_per_step:.2f})"
              + f"   [{time.perf_counter() - t0:.1f} s]", flush=True)
        table[name] = {"accepted": means, "controller_speedup": sim.speedup,
                       "controller_tau": sim.tokens_per_step}
    if a.json:
        Path(a.json).write_text(json.dumps({"set": a.set, "positions": rep.num_positions,
                                            "sizes": SIZES, "draft_ms": a.draft_ms,
                                            "overhead_ms": a.overhead_ms,
                                            "flat_cost": a.flat_cost,
                                            "cost_table": cost.to_dict()["table"],
                                            "variants": table}, indent=1))


if __name__ == "__main__":
    main()
