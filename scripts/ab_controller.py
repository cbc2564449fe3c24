"""Same-process A/B of the adaptive controller's contexts and hindsight, bs 1, greedy.

Every method runs twice in one process on one loaded target, interleaved per prompt (rotating
order), so machine drift hits both alike: as shipped, and with a suffix:

* ``0``: every step in one context, no hindsight (the controller before both),
* ``1``: contexts and hindsight, without the "running" half of the context,
* ``o``: probes that back off after every probe (``probe_until_seen=0``, the controller before
  probing episodes; 2026-12-07, twentieth sitting),
* ``L``: the context from every row's prompt lookups, as before the context stopped at the first
  row without a match (twenty-first sitting).

Prints and writes median tok/s over prompts, total tok/s, tau, the time split and each
controller's final estimates per context.

    python scripts/ab_controller.py humaneval 24 out.json      # ar,ngram,ngram0,dart,dart0
    python scripts/ab_controller.py chat 24 out.json ar,ngram,ngram1,dart,dart1
    python scripts/ab_controller.py chat 40 out.json ar,dart,darto,ngram,ngramo
    python scripts/ab_controller.py chat 48 out.json ar,dart,darto 16   # static batches of 16

With a batch size (5th argument) every method runs the same static batches of consecutive prompts,
interleaved per batch, and the medians are over batches (tok/s of the batch's tokens).
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time


def _every_row_context(drafter, view) -> int:
    """The shortest suffix match, from every row's lookups (variant ``L``)."""
    if not view.decoding.lookup_paths:
        return 0
    return min((k for _, k in drafter._lookups(view)), default=0)


def main() -> None:
    import torch

    from dart_ray.bench.prompts import load_prompts
    from dart_ray.config import EngineConfig, SamplingParams
    from dart_ray.drafters import make_drafter
    from dart_ray.engine import Engine
    from dart_ray.engine.controller import ControllerConfig
    from dart_ray.engine.engine import encode_prompt
    from dart_ray.hardware import resolve_dtype
    from dart_ray.models import load_target

    which, limit, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    methods = (sys.argv[4].split(",") if len(sys.argv) > 4
               else ["ar", "ngram", "ngram0", "dart", "dart0"])
    bs = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    torch.set_num_threads(2)
    dtype = resolve_dtype("auto", "cpu").dtype
    target = load_target(None, dtype, "cpu", max_seq_len=2048)
    engines = {}
    for m in methods:
        base = m.rstrip("01oL")
        cfg = EngineConfig(method={"ar": "none"}.get(base, base), dtype=dtype, max_batch_size=bs,
                           max_seq_len=2048)
        e = Engine(target, make_drafter(cfg, target), cfg)
        if m.endswith("o"):                     # before any context's controller exists
            e.controller.config = ControllerConfig(probe_until_seen=0)
        if m.endswith("L"):                     # the context before: every row's lookups
            e.drafter.context = functools.partial(_every_row_context, e.drafter)
        if m.endswith("1"):
            e.hindsight.running = lambda rid: False
        if m.endswith("0"):
            e.drafter.context = lambda view: 0
            e._known = lambda view, n, max_nodes: n
            e.hindsight.running = lambda rid: False
        engines[m] = e
    chat = which in ("chat", "chat-probe")              # the chat sets run under the template
    ids = [encode_prompt(target.tokenizer, p, chat) for p in load_prompts(which, limit=limit)]
    params = SamplingParams(max_new_tokens=128)
    for e in engines.values():                     # warm-up outside the measurement
        e.generate([ids[0]], params)
        e.reset_stats()
    rates = {m: [] for m in methods}
    toks = dict.fromkeys(methods, 0)
    secs = dict.fromkeys(methods, 0.0)
    outs = {m: [] for m in methods}
    for i, start in enumerate(range(0, len(ids), bs)):
        group = ids[start:start + bs]
        for m in methods[i % len(methods):] + methods[:i % len(methods)]:
            t0 = time.perf_counter()
            o = [c.token_ids for c in engines[m].generate(group, params)]
            dt = time.perf_counter() - t0
            n = sum(len(x) for x in o)
            rates[m].append(n / dt)
            toks[m] += n
            secs[m] += dt
            outs[m].extend(o)
    ar = statistics.median(rates["ar"]) if "ar" in rates else None
    rep = {"which": which, "n": len(ids), "batch_size": bs, "dtype": str(dtype), "methods": {}}
    for m in methods:
        st, med, ctl = engines[m].stats(), statistics.median(rates[m]), engines[m].controller
        rep["methods"][m] = {
            "tok_s": med, "total_tok_s": toks[m] / secs[m], "x_ar": med / ar if ar else None,
            "tau": st.mean_accepted_len, "steps": st.steps, "plain": st.ar_steps,
            "split": st.time_split_ms(),
            "mismatch_ar": sum(a != b for a, b in zip(outs[m], outs["ar"], strict=True))
            if ar else None,
            "controller": {str(k): v for k, v in ctl.snapshot().items()} if ctl else None}
        print(f"{m:7s} {med:6.1f} tok/s {med / ar if ar else 0:5.2f}x total "
              f"{toks[m] / secs[m]:5.1f} tau {st.mean_accepted_len:4.2f} steps {st.steps} "
              f"plain {st.ar_steps} "
              + " ".join(f"{k} {v:.2f}" for k, v in st.time_split_ms().items()), flush=True)
    with open(out, "w") as f:
        json.dump(rep, f, indent=1, default=str)


if __name__ == "__main__":
    main()
