"""Cost of one ``processed_probs`` call (temperature, top-k, top-p) on random logits over
SmolLM2's vocabulary: median of 30 calls per setting, 2 threads.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 python scripts/bench_processed_probs.py

Run it in two checkouts (``PYTHONPATH``) for an A/B of the filter.
"""

from __future__ import annotations

import time

import torch

from dart_ray.verify.acceptance import processed_probs


def main() -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    for batch in (1, 16):
        x = torch.randn(batch, 49152, generator=g) * 4
        # the first setting warms up; k 50 twice shows the warm-up is over
        for k, p in ((0, 1.0), (50, 1.0), (0, 0.9), (50, 0.9), (50, 1.0)):
            times = []
            for _ in range(30):
                t0 = time.perf_counter()
                processed_probs(x, 0.8, k, p)
                times.append(time.perf_counter() - t0)
            print(f"bs {batch} top_k {k} top_p {p}: {sorted(times)[15] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
