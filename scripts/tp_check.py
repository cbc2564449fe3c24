#!/usr/bin/env python3
"""TP=N (NCCL on CUDA, gloo on CPU) greedy outputs must equal TP=1: `python scripts/tp_check.py N
[device]`."""

import sys

from dart_ray import EngineConfig, SamplingParams
from dart_ray.parallel.launch import start_local_tp


def main() -> int:
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    cfg = EngineConfig(method="dart", dtype="fp32", device=device, max_batch_size=2)
    prompts = ["def fibonacci(n):", "Write a short poem about rain."]
    sp = SamplingParams(max_new_tokens=32, ignore_eos=True)
    outs = {}
    for n in (1, world):
        group = start_local_tp(cfg, n)
        try:
            outs[n] = [c.token_ids for c in group.engine.generate(prompts, sp)]
        finally:
            group.shutdown()
    ok = outs[1] == outs[world]
    print(f"TP={world} on {device}: {'equal' if ok else 'DIFFERENT'} to TP=1")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
