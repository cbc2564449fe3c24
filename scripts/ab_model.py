"""Same-process A/B of parts of the model's forward (``dart_ray/models/llama.py``): the installed
code against the one in ``OLD`` (a ``git archive`` of an earlier revision), alternated so both see
the same machine state. ``PARTS``: comma list of ``attention`` (``Attention.forward`` and
``Transformer.forward``) and ``rms_norm`` (``RMSNorm.forward``).

    git archive 440bd05 | tar -x -C /tmp/old
    python scripts/ab_model.py forward /tmp/old attention                  # verify forwards, ms
    python scripts/ab_model.py generate /tmp/old attention chat dart 24    # generations
    python scripts/ab_model.py generate /tmp/old rms_norm humaneval none 12

``forward``: median of 8 verify-shaped forwards (taps, half the LM head) per (context, tokens)
cell. ``generate``: each prompt generated with both, order alternating per prompt; tok/s over all
prompts, median verify ms per step, mean tau, and how many outputs are identical (bf16: near-ties
fall either way).
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

PARTS = {"attention": (("Attention", "forward"), ("Transformer", "forward")),
         "rms_norm": (("RMSNorm", "forward"),)}


def implementations(root: str, parts: list[str]) -> dict[str, list[tuple[type, str, object]]]:
    """{"old"/"new": [(class, attribute, function)]} for the chosen parts."""
    spec = importlib.util.spec_from_file_location("old_llama", f"{root}/dart_ray/models/llama.py")
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    out: dict[str, list] = {"old": [], "new": []}
    for part in parts:
        for cls, attr in PARTS[part]:
            target = getattr(new, cls)
            out["new"].append((target, attr, getattr(target, attr)))
            out["old"].append((target, attr, getattr(getattr(old, cls), attr)))
    return out


def main() -> None:
    mode, root, parts = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    impl = implementations(root, parts)

    def use(k: str) -> None:
        for target, attr, fn in impl[k]:
            setattr(target, attr, fn)

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
    which, method, n = sys.argv[4], sys.argv[5], int(sys.argv[6])
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
            toks = eng.generate([p], params)[0].token_ids
            s = eng.stats()
            res[k].append({"s": time.perf_counter() - t, "tokens": list(toks),
                           "verify_ms": s.time_split_ms()["verify"], "tau": s.mean_accepted_len})
    for k, r in res.items():
        secs = sum(x["s"] for x in r)
        print(f"{method} {which} {k}: {sum(len(x['tokens']) for x in r) / secs:.1f} tok/s, "
              f"total {secs:.2f} s, verify per step median "
              f"{statistics.median(x['verify_ms'] for x in r):.2f} ms, "
              f"tau {statistics.mean(x['tau'] for x in r):.2f}")
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(res["old"], res["new"], strict=True))
    print(f"identical outputs {same} / {len(ids)}")


if __name__ == "__main__":
    main()
