"""Fixed tree sizes vs the adaptive controller, DART, bs 1, the first 12 prompts of a set.

    python scripts/sweep_tree_size.py humaneval|chat

Each size overrides the controller's choice (the engine still cuts the tree to the first n nodes,
and DART still skips its drafter where lookup paths fill them); two rounds, one engine, medians of
per-prompt tokens/s. Checks that the controller picks near the best fixed size on this machine.
"""
import sys, time, statistics
from dart_ray import Engine, EngineConfig, SamplingParams
from dart_ray.bench.prompts import load_prompts
from dart_ray.engine.engine import encode_prompt
src = sys.argv[1]
eng = Engine.from_config(EngineConfig(method="dart", max_batch_size=1, max_seq_len=2048))
tok = eng.target.tokenizer
ids = [encode_prompt(tok, p, src == "chat") for p in load_prompts(src)[:12]]
P = SamplingParams(max_new_tokens=128)
ctl = eng.controller
orig = ctl.plan
eng.generate([ids[0]], P)
def run(label):
    eng.reset_stats(); rates = []
    for i in ids:
        t0 = time.perf_counter(); n = len(eng.generate([i], P)[0].token_ids); rates.append(n / (time.perf_counter() - t0))
    st = eng.stats()
    print(f"{src} {label}: median {statistics.median(rates):.1f} tok/s tau {st.mean_accepted_len:.2f}", flush=True)
for rep in range(2):
    for n in ("adaptive", 2, 4, 8, 12, 16, 24):
        if n == "adaptive":
            ctl.plan = orig
        else:
            ctl.plan = (lambda k: (lambda B, m: min(k, m)))(n)
        run(f"n={n}" if n != "adaptive" else "adaptive")
