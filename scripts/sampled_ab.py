"""Sampled decoding, DART (defaults) vs AR, through the public API only, so the same script runs
on an older checkout for an A/B across versions. Prints one JSON line: tok/s, tau, per-step times
and how many outputs equal AR's.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \\
      MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1 \\
      PYTHONPATH=CHECKOUT python scripts/sampled_ab.py N_PROMPTS TEMPERATURE [DTYPE]

(run from CHECKOUT, the checkout under test). Prompt i is sampled with seed i, 128 new tokens.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from dart_ray import Engine, EngineConfig, SamplingParams
from dart_ray.bench.prompts import load_prompts


def run(method: str, prompts: list[str], temperature: float, dtype: str) -> dict:
    eng = Engine.from_config(EngineConfig(method=method, dtype=dtype))
    params = [SamplingParams(max_new_tokens=128, temperature=temperature, seed=i)
              for i in range(len(prompts))]
    eng.generate(prompts[:1], params[:1], chat=True)            # warm-up
    eng.reset_stats()
    t0 = time.perf_counter()
    outs = [eng.generate([p], [sp], chat=True)[0].token_ids
            for p, sp in zip(prompts, params, strict=True)]
    dt = time.perf_counter() - t0
    st = eng.stats()
    split = st.time_split_ms()
    return {"tok_s": sum(map(len, outs)) / dt, "tokens": sum(map(len, outs)),
            "tau": st.mean_accepted_len, "accept_ms": split["accept"],
            "draft_ms": split["draft"], "verify_ms": split["verify"], "outputs": outs}


def main() -> None:
    torch.set_num_threads(2)
    n, temperature = int(sys.argv[1]), float(sys.argv[2])
    dtype = sys.argv[3] if len(sys.argv) > 3 else "auto"
    prompts = load_prompts("chat", limit=n)
    res = {m: run(m, prompts, temperature, dtype) for m in ("none", "dart")}
    same = sum(a == b for a, b in zip(res["none"].pop("outputs"), res["dart"].pop("outputs"),
                                      strict=True))
    print(json.dumps({"temperature": temperature, "n": n, "dtype": dtype, "same_as_ar": same,
                      **res}))


if __name__ == "__main__":
    main()
