"""Same-process A/B of two versions of the model's attention (``Attention.forward`` and
``Transformer.forward`` of ``dart_ray/models/llama.py``): the installed one against the one in
``OLD`` (a ``git archive`` of an earlier revision), alternated so both see the same machine state.

    python scripts/ab_attention.py forward /tmp/old            # verify-shaped forwards, ms
    python scripts/ab_attention.py generate /tmp/old chat dart 24   # whole generations per prompt

``forward``: median of 8 verify-shaped forwards (taps, half the LM head) per (context, tokens)
cell, old and new alternating. ``generate``: each prompt generated with both, order alternating
per prompt; total seconds, median verify ms per step, mean tau.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time

import torch

import dart_ray.models.llama as new
from dart_ray.bench.prompts import load_prompts
from dart_ray.config import EngineConfig, SamplingParams
from dart_ray.engine import Engine


def load_old(root: str):
    spec = importlib.util.spec_from_file_location("old_llama", f"{root}/dart_ray/models/llama.py")
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    return old


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    old = load_old(root)
    impl = {"new": (new.Attention.forward, new.Transformer.forward),
            "old": (old.Attention.forward, old.Transformer.forward)}

    def use(k: str) -> None:
        new.Attention.forward, new.Transformer.forward = impl[k]

    torch.set_num_threads(2)
    if mode == "forward":
        eng = Engine.from_config(EngineConfig(method="dart", max_batch_size=1, max_seq_len=2048))
        for ctx in (150, 300, 600, 1200):
            row = []
            for T in (1, 2, 4, 8, 16, 24):
                ts: dict[str, list[float]] = {"new": [], "old": []}
                for k in ("new", "old"):
                    use(k)
                    eng._timing_forward(1, T, ctx)
                for _ in range(8):
                    for k in ("new", "old"):
                        use(k)
                        t = time.perf_counter()
                        eng._timing_forward(1, T, ctx)
                        ts[k].append(time.perf_counter() - t)
                row.append(f"T{T}: {statistics.median(ts['old']) * 1e3:.1f}->"
                           f"{statistics.median(ts['new']) * 1e3:.1f}")
            print(f"ctx {ctx} (old->new ms):", " | ".join(row), flush=True)
        return
    which, method, n = sys.argv[3], sys.argv[4], int(sys.argv[5])
    eng = Engine.from_config(EngineConfig(method=method, max_batch_size=1, max_seq_len=2048))
    params = SamplingParams(max_new_tokens=128)
    ids = [eng.encode_prompt(p, chat=which == "chat") for p in load_prompts(which, limit=n)]
    eng.generate(ids[:1], params)
    res: dict[str, list[dict]] = {"new": [], "old": []}
    for i, p in enumerate(ids):
        for k in (("new", "old") if i % 2 == 0 else ("old", "new")):
            use(k)
            eng.reset_stats()
            t = time.perf_counter()
            eng.generate([p], params)
            s = eng.stats()
            res[k].append({"s": time.perf_counter() - t, "verify_ms": s.time_split_ms()["verify"],
                           "tau": s.mean_accepted_len})
    for k, r in res.items():
        print(f"{k}: total {sum(x['s'] for x in r):.2f} s, verify per step median "
              f"{statistics.median(x['verify_ms'] for x in r):.2f} ms, "
              f"tau {statistics.mean(x['tau'] for x in r):.2f}")


if __name__ == "__main__":
    main()
