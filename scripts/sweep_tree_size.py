"""Fixed tree sizes vs the adaptive controller, DART, bs 1, the first prompts of a set.

    python scripts/sweep_tree_size.py SET [--prompts 12] [--rounds 2] [--sizes adaptive,8]

SET: humaneval | chat | a .jsonl/.parquet prompt file.

Each size overrides the controller's choice (the engine still cuts the tree to the first n nodes,
and DART still skips its drafter where lookup paths fill them); one engine, per round the median of
per-prompt tokens/s and the total (all tokens / all seconds: the median of a dozen prompts can
differ from it by 10 %), and how many speculative steps ran no drafter forward (lookup paths filled
the kept nodes). Checks that the controller picks near the best fixed size on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

SIZES = ("adaptive", 2, 4, 8, 12, 16, 24)


def _fixed(n: int):
    """A controller ``plan`` that always keeps ``n`` nodes (at most what the step allows)."""
    return lambda B, max_nodes, context=0: min(n, max_nodes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompts", help="humaneval | chat | a .jsonl/.parquet prompt file")
    ap.add_argument("--prompts", dest="n", type=int, default=12, help="prompts per size")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)),
                    help="comma list of 'adaptive' and fixed node counts")
    a = ap.parse_args()

    from dart_ray import Engine, EngineConfig, SamplingParams, encode_prompt
    from dart_ray.bench.prompts import load_prompts

    chat = a.prompts == "chat"
    eng = Engine.from_config(EngineConfig(method="dart", max_batch_size=1, max_seq_len=2048))
    ids = [encode_prompt(eng.target.tokenizer, p, chat) for p in load_prompts(a.prompts)[:a.n]]
    params = SamplingParams(max_new_tokens=128)
    adaptive = eng.controller.plan
    eng.generate([ids[0]], params)                                   # warm-up
    sizes = [s if s == "adaptive" else int(s) for s in a.sizes.split(",")]
    for r in range(a.rounds):
        for size in sizes:
            eng.controller.plan = adaptive if size == "adaptive" else _fixed(size)
            eng.reset_stats()
            skipped = eng.drafter.lookup_only_steps
            rates, tokens, secs = [], 0, 0.0
            for prompt in ids:
                t0 = time.perf_counter()
                n = len(eng.generate([prompt], params)[0].token_ids)
                dt = time.perf_counter() - t0
                rates.append(n / dt)
                tokens, secs = tokens + n, secs + dt
            label = size if size == "adaptive" else f"n={size}"
            med, st = statistics.median(rates), eng.stats()
            skipped = eng.drafter.lookup_only_steps - skipped
            print(f"round {r + 1} {a.prompts} {label}: median {med:.1f} tok/s, total "
                  f"{tokens / secs:.1f} tok/s, "
                  f"tau {st.mean_accepted_len:.2f}, drafter skipped on {skipped} of "
                  f"{st.steps - st.ar_steps} speculative steps", flush=True)


if __name__ == "__main__":
    main()
