"""Same-process A/B of one module-level constant of the engine (e.g. ``EAGER_HEAD_ROWS`` of
``dart_ray.verify.logits``): one engine, each prompt generated with value A and with value B, the
order alternating per prompt, so both see the same machine state and the same learned controller.

    python scripts/ab_const.py dart_ray.verify.logits EAGER_HEAD_ROWS 0 6 humaneval dart 24
    python scripts/ab_const.py dart_ray.verify.logits EAGER_HEAD_ROWS 0 6 chat dart 24

Per value: tok/s over all prompts (total tokens / total seconds), the engine's time split per step
(draft, tree, verify, accept; totals over all steps), LM-head rows per step, and tau (the mean of
the prompts' mean accepted lengths); then how many outputs are identical (bf16: near-ties may fall
either way when a row's logits come from a head call over other rows). Values are parsed as Python
literals. Fixed: bs 1, 2 threads, greedy, <= 128 new tokens, the default model, drafter and knobs;
the warm-up prompt runs with the module's own value. Only a constant read at call time through its
module works (one imported by value elsewhere would not change).
"""

from __future__ import annotations

import ast
import importlib
import statistics
import sys
import time

from dart_ray.bench.prompts import load_prompts
from dart_ray.config import EngineConfig, SamplingParams
from dart_ray.engine import Engine


def main() -> None:
    if len(sys.argv) != 8:
        raise SystemExit(__doc__)
    module, name, a, b, which, method, n = sys.argv[1:]
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        raise SystemExit(f"{module} has no attribute {name!r}")
    values = {"A": ast.literal_eval(a), "B": ast.literal_eval(b)}
    eng = Engine.from_config(EngineConfig(method=method, max_batch_size=1, max_seq_len=2048,
                                          num_threads=2))
    params = SamplingParams(max_new_tokens=128)
    ids = [eng.encode_prompt(p, chat=which == "chat") for p in load_prompts(which, limit=int(n))]
    eng.generate(ids[:1], params)                                   # warm-up (not counted)
    res: dict[str, list[dict]] = {"A": [], "B": []}
    for i, p in enumerate(ids):
        for k in (("A", "B") if i % 2 == 0 else ("B", "A")):
            setattr(mod, name, values[k])
            eng.reset_stats()
            t = time.perf_counter()
            toks = eng.generate([p], params)[0].token_ids
            secs = time.perf_counter() - t
            s = eng.stats()
            res[k].append({"s": secs, "tokens": list(toks), "steps": s.steps,
                           "split": {"draft": s.draft_s, "tree": s.tree_s, "verify": s.verify_s,
                                     "accept": s.accept_s},
                           "head_rows": s.head_rows, "tau": s.mean_accepted_len})
    for k, r in res.items():
        secs = sum(x["s"] for x in r)
        steps = sum(x["steps"] for x in r)
        split = ", ".join(f"{p} {1e3 * sum(x['split'][p] for x in r) / steps:.2f}"
                          for p in ("draft", "tree", "verify", "accept"))
        print(f"{method} {which} {name}={values[k]!r}: "
              f"{sum(len(x['tokens']) for x in r) / secs:.1f} tok/s, total {secs:.2f} s, "
              f"per step ms: {split}; head rows/step {sum(x['head_rows'] for x in r) / steps:.2f}, "
              f"tau {statistics.mean(x['tau'] for x in r):.2f}", flush=True)
    same = sum(x["tokens"] == y["tokens"] for x, y in zip(res["A"], res["B"], strict=True))
    print(f"identical outputs {same} / {len(ids)}")


if __name__ == "__main__":
    main()
