"""How well N-gram models predict the target's own answers (no network, no timing): for every
answer token of each ``--data`` set, the model's top-1 / top-4 next token after the two tokens
before it (backoff as in serving), the share of tokens it gives any probability, and the mean
probability it gives the token the target wrote.

The DART tree search weighs and prunes the drafter's candidates with this model, so a model that
predicts the answers better is the one to try end to end; this is the cheap screen before that.

    python scripts/eval_ngram.py --data runs/evalsets/chat,runs/evalsets/humaneval \\
        shipped=dart_ray/artifacts/SmolLM2-135M-Instruct/ngram new=runs/x/ngram
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def answer_positions(rows, n: int) -> tuple:
    """Contexts [M, n] (the n tokens before, oldest first, -1 = none) and next tokens [M] of every
    answer token."""
    import numpy as np

    ctx, tok = [], []
    for ids, plen, _ in rows:
        for j in range(max(plen, 1), len(ids)):
            ctx.append([ids[i] if i >= 0 else -1 for i in range(j - n, j)])
            tok.append(ids[j])
    return np.array(ctx, dtype=np.int64).reshape(-1, n), np.array(tok, dtype=np.int64)


def score(model, rows) -> dict:
    """top-1 / top-4 hit rates, coverage (P > 0) and mean P of the written token."""
    ctx, tok = answer_positions(rows, model.context_len)
    top, _ = model.top_next(ctx, 4)
    p = model.prob(ctx, tok)
    return {"tokens": int(tok.size), "top1": round(float((top[:, 0] == tok).mean()), 4),
            "top4": round(float((top == tok[:, None]).any(1).mean()), 4),
            "covered": round(float((p > 0).mean()), 4), "mean_p": round(float(p.mean()), 4)}


def main(argv: list[str] | None = None) -> int:
    from dart_ray.ngram import NGramModel
    from dart_ray.training.gen_data import load_rows

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="NAME=DIR of each N-gram model")
    p.add_argument("--data", required=True,
                   help="comma list of data directories; each is scored on its own (evaluation "
                        "answers: all rows; self-distillation data: its val split)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    models = {}
    for spec in a.models:
        name, sep, path = spec.partition("=")
        if not sep or not name or not Path(path, "meta.json").is_file():
            p.error(f"{spec!r}: want NAME=DIR with an N-gram model (meta.json) in DIR")
        models[name] = NGramModel.load(path)
    results: dict = {}
    for d in [x for x in a.data.split(",") if x]:
        rows = [r for r in load_rows(d, "val") if len(r[0]) > r[1]]
        if not rows:
            p.error(f"{d}: no val rows with answer tokens")
        results[d] = {n: score(m, rows) for n, m in models.items()}
        print(d, json.dumps(results[d]))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
