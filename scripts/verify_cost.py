"""Verify cost of one DART tree on this machine: the dense LM head vs the lazy one (issue 14).

    .venv/bin/python scripts/verify_cost.py [--tree-budget 60] [--dtype auto] [--reps 7]

Builds the engine with the shipped DART drafter (adaptive off, so the tree has the full budget),
prefills a HumanEval prompt, drafts one tree and times the verify forward over it, with the LM head
on every node (dense) and on the root + internal nodes only (lazy, what the engine runs). Prints
the machine fingerprint with the numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch


def main() -> None:
    from dart_ray import DecodingConfig, Engine, EngineConfig, SamplingParams
    from dart_ray.bench.prompts import load_prompts
    from dart_ray.config import RenamedWarning, add_renamed_flag
    from dart_ray.drafters.base import BatchView
    from dart_ray.verify.logits import NodeLogits, internal_nodes

    warnings.simplefilter("default", RenamedWarning)
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree-budget", type=int, default=60,
                    help="draft nodes of the tree (DecodingConfig.tree_budget)")
    add_renamed_flag(ap, "--nodes", "--tree-budget", dest="tree_budget", type=int)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    decoding = DecodingConfig(tree_budget=a.tree_budget, lookup_paths=0)
    eng = Engine.from_config(EngineConfig(method="dart", dtype=a.dtype, max_batch_size=1,
                                          adaptive=False, decoding=decoding))
    prompt = load_prompts("humaneval", limit=1)[0]
    eng.add_request(prompt, SamplingParams(max_new_tokens=64))
    eng.step()                                                   # prefill + first decode step
    r = eng.running[0]
    view = BatchView(roots=torch.tensor([r.root]), lengths=eng.cache.lengths[:1], tokens=eng.tokens,
                     decoding=eng.decoding_for(1), params=[r.params], randoms=[r.random])
    tree = eng.drafter.propose(view)
    T = tree.num_nodes
    n_int = int(internal_nodes(tree).sum())

    from dart_ray.masks import attention_mask

    starts = eng.cache.lengths[:1]
    positions = torch.tensor(starts)[:, None] + tree.depths
    mask = attention_mask(starts, tree.ancestors(), max(starts) + T, eng.dtype)

    def dense():                                         # the previous verify: logits at every node
        return eng.model(tree.tokens, positions, mask, eng.cache, rows=slice(0, 1), starts=starts,
                         taps=eng.drafter.taps).logits

    def lazy():
        logits, _ = eng._verify(tree)
        return logits

    times: dict[str, list[float]] = {"dense": [], "lazy": []}
    dense(), lazy()
    for _ in range(a.reps):                                     # interleaved: drift hits both alike
        for name, f in (("dense", dense), ("lazy", lazy)):
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    out = {k: statistics.median(v) * 1000 for k, v in times.items()}
    assert isinstance(lazy(), NodeLogits)
    print(f"machine: {eng.fingerprint.summary()}; dtype {eng.config.dtype} "
          f"({eng.dtype_choice.reason})")
    print(f"tree: {T - 1} draft nodes + root, {n_int} with logits needed (root + internal)")
    print(f"verify, dense LM head on {T} rows: {out['dense']:.1f} ms; lazy on {n_int} rows: "
          f"{out['lazy']:.1f} ms")


if __name__ == "__main__":
    main()
