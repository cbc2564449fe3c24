"""Same-process A/B of RMSNorm's CPU inference path (layer norm over [x, -x]) against
``F.rms_norm``: each prompt generated with both, order alternating per prompt.

    python scripts/ab_rms_norm.py humaneval none 12     # AR
    python scripts/ab_rms_norm.py humaneval dart 12
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

import dart_ray.models.llama as L
from dart_ray.bench.prompts import load_prompts
from dart_ray.config import EngineConfig, SamplingParams
from dart_ray.engine import Engine


def main() -> None:
    torch.set_num_threads(2)
    which, method, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    new = L.RMSNorm.forward

    def old(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    impl = {"old": old, "new": new}
    eng = Engine.from_config(EngineConfig(method=method, max_batch_size=1, max_seq_len=2048))
    params = SamplingParams(max_new_tokens=128)
    ids = [eng.encode_prompt(p, chat=which == "chat") for p in load_prompts(which, limit=n)]
    eng.generate(ids[:1], params)
    res = {"old": [0.0, 0], "new": [0.0, 0]}
    same = 0
    for i, p in enumerate(ids):
        outs = {}
        for k in (("new", "old") if i % 2 == 0 else ("old", "new")):
            L.RMSNorm.forward = impl[k]
            t = time.perf_counter()
            o = eng.generate([p], params)
            res[k][0] += time.perf_counter() - t
            res[k][1] += len(o[0].token_ids)
            outs[k] = list(o[0].token_ids)
        same += outs["old"] == outs["new"]
    for k, (s, t) in res.items():
        print(f"{method} {which} {k}: {t / s:.1f} tok/s")
    print(f"identical outputs {same} / {len(ids)} (bf16: near-ties fall either way)")


if __name__ == "__main__":
    main()
