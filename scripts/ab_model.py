"""Same-process A/B of parts of the engine: two versions alternated in one process, so both see
the same machine state (and, for ``generate``/``const``, the same learned controller).

``forward``/``generate`` swap parts of the model's forward (``dart_ray/models/llama.py``): the
installed code against the one in ``OLD`` (a ``git archive`` of an earlier revision). ``PARTS``:
comma list of ``attention`` (``Attention.forward`` and ``Transformer.forward``) and ``rms_norm``
(``RMSNorm.forward``). ``const`` swaps one module-level constant read at call time through its
module (e.g. ``dart_ray.verify.logits.EAGER_HEAD_ROWS``; values parsed as Python literals; one
imported by value elsewhere would not change).

    git archive 440bd05 | tar -x -C /tmp/old
    python scripts/ab_model.py forward /tmp/old attention                  # verify forwards, ms
    python scripts/ab_model.py generate /tmp/old attention chat dart 24    # generations
    python scripts/ab_model.py generate /tmp/old rms_norm humaneval none 12
    python scripts/ab_model.py const dart_ray.verify.logits.EAGER_HEAD_ROWS 0 6 humaneval dart 24

``forward``: median of 8 verify-shaped forwards (taps, half the LM head) per (context, tokens)
cell. ``generate``/``const``: each prompt generated with both versions, order alternating per
prompt (bs 1, 2 threads, greedy, <= 128 new tokens, the default model, drafter and knobs; the
warm-up prompt runs as installed); per version tok/s over all prompts (total tokens / total
seconds), the engine's time split per step (totals over all steps), the median over prompts of the
verify ms per step, LM-head rows per step, tau (the mean of the prompts' mean accepted lengths),
then how many outputs are identical (bf16: near-ties fall either way).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable

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


def ab_generate(use: Callable[[str], None], labels: tuple[str, str], which: str, method: str,
                n: int) -> None:
    """Generate ``n`` prompts of ``which`` with both versions (``use(label)`` switches), alternating
    the order per prompt, and print the comparison described in the module docstring."""
    eng = Engine.from_config(EngineConfig(method=method, max_batch_size=1, max_seq_len=2048))
    params = SamplingParams(max_new_tokens=128)
    ids = [eng.encode_prompt(p, chat=which == "chat") for p in load_prompts(which, limit=n)]
    eng.generate(ids[:1], params)                                   # warm-up (not counted)
    res: dict[str, list[dict]] = {k: [] for k in labels}
    for i, p in enumerate(ids):
        for k in (labels if i % 2 == 0 else labels[::-1]):
            use(k)
            eng.reset_stats()
            t = time.perf_counter()
            toks = eng.generate([p], params)[0].token_ids
            secs = time.perf_counter() - t
            s = eng.stats()
            res[k].append({"s": secs, "tokens": list(toks), "steps": s.steps,
                           "split": {ph: getattr(s, f"{ph}_s")
                                     for ph in ("draft", "tree", "verify", "accept")},
                           "verify_ms": s.time_split_ms()["verify"], "head_rows": s.head_rows,
                           "tau": s.mean_accepted_len})
    for k, r in res.items():
        secs = sum(x["s"] for x in r)
        steps = max(sum(x["steps"] for x in r), 1)
        split = ", ".join(f"{ph} {1e3 * sum(x['split'][ph] for x in r) / steps:.2f}"
                          for ph in ("draft", "tree", "verify", "accept"))
        print(f"{method} {which} {k}: {sum(len(x['tokens']) for x in r) / secs:.1f} tok/s, "
              f"total {secs:.2f} s, per step ms: {split}; verify per step median "
              f"{statistics.median(x['verify_ms'] for x in r):.2f} ms, head rows/step "
              f"{sum(x['head_rows'] for x in r) / steps:.2f}, "
              f"tau {statistics.mean(x['tau'] for x in r):.2f}", flush=True)
    a, b = (res[k] for k in labels)
    same = sum(x["tokens"] == y["tokens"] for x, y in zip(a, b, strict=True))
    print(f"identical outputs {same} / {len(ids)}")


def main() -> None:
    mode = sys.argv[1]
    torch.set_num_threads(2)
    if mode == "const":
        path, va, vb = sys.argv[2:5]
        module, _, name = path.rpartition(".")
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            raise SystemExit(f"{module} has no attribute {name!r}")
        values = {f"{name}={v}": ast.literal_eval(v) for v in (va, vb)}
        which, method, n = sys.argv[5], sys.argv[6], int(sys.argv[7])
        ab_generate(lambda k: setattr(mod, name, values[k]), tuple(values), which, method, n)
        return
    root, parts = sys.argv[2], sys.argv[3].split(",")
    impl = implementations(root, parts)

    def use(k: str) -> None:
        for target, attr, fn in impl[k]:
            setattr(target, attr, fn)

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
    ab_generate(use, ("new", "old"), sys.argv[4], sys.argv[5], int(sys.argv[6]))


if __name__ == "__main__":
    main()
