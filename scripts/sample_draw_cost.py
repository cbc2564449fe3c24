"""Time ``sample_accept`` (position-keyed sampling) on 3-node chains over SmolLM2's vocabulary.

    python scripts/sample_draw_cost.py

Prints the median ms per call and per drawn token (levels walked = accepted + 1) at batch 1 and 8,
top_p 1.0 and 0.9. Random logits, 2 threads; run it alone on the cores.
"""

from __future__ import annotations

import time

import torch

from dart_ray.tree.tree import chain_tree
from dart_ray.verify import RequestRandom
from dart_ray.verify.acceptance import sample_accept


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    V, D = 49152, 3
    for B in (1, 8):
        logits = torch.randn(B, 1 + D, V) * 4                                   # [B, 1+D, V]
        chains = torch.stack([logits[:, i].argmax(-1) for i in range(D)], 1)    # [B, D]
        tree = chain_tree(torch.zeros(B, dtype=torch.long), chains)
        randoms = [RequestRandom(i) for i in range(B)]
        for top_p in (1.0, 0.9):
            times, draws = [], 0
            for rep in range(60):
                t = time.perf_counter()
                acc = sample_accept(tree, logits, 0.7, 0, top_p, randoms, [rep * 4] * B)
                times.append(time.perf_counter() - t)
                draws += int(acc.num_accepted.sum()) + B
            times.sort()
            med = times[len(times) // 2]
            print(f"B={B} top_p={top_p}: {med * 1e3:.2f} ms per call, "
                  f"{med * 1e3 / (draws / 60):.3f} ms per drawn token")


if __name__ == "__main__":
    main()
