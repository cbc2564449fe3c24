"""Held-out accuracy of several DART/EAGLE drafters on the SAME held-out prefixes (one teacher pass
per batch serves them all), per domain: per-level top-1/top-5 vs the target's argmax and chain_tau
(``--split train``: the same on training sequences, to see how much of it is memorisation); each
over every prefix and over the answers' prefixes only (what serving drafts after), and the answers'
level 1 by how sure the target is of each token and inside the draft vocabulary (see
:mod:`dart_ray.training.metrics`).

The numbers in a drafter's card come from its own run's held-out split; comparing two drafters
trained on different data needs one split for both. This uses ``--data``'s ``val`` rows (the split
is by prompt hash, so no drafter trained on them if it trained on a split of the same prompts).

``--data`` may also name directories of evaluation answers (``dart-ray gen-data --eval-prompts chat
--out runs/evalsets/chat``): their rows are scored as their own domain (``chat@chat``), the target's
answers to requests written apart from every training prompt.

    python scripts/eval_drafters.py --data runs/a,runs/b --out eval.json \\
        shipped=dart_ray/artifacts/SmolLM2-135M-Instruct/drafter new=runs/x/drafter
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    import torch

    from dart_ray.drafters.dart_model import DartModel
    from dart_ray.hardware import resolve_dtype
    from dart_ray.models import load_target
    from dart_ray.training.gen_data import load_rows
    from dart_ray.training.metrics import evaluate_domains
    from dart_ray.training.trainer import TrainConfig, _val_by_domain

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafters", nargs="+", help="NAME=DIR (a drafter directory)")
    p.add_argument("--data", required=True, help="gen-data directory (or comma list)")
    p.add_argument("--eval-seqs", type=int, default=128, help="held-out sequences per domain")
    p.add_argument("--max-len", type=int, default=320)
    p.add_argument("--seqs-per-step", type=int, default=8)
    p.add_argument("--model", default=None,
                   help="the target the drafters were trained for (default: the embedded one)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--split", choices=("val", "train"), default="val",
                   help="train: the last --eval-seqs TRAINING sequences per domain instead (how "
                        "far a drafter fits what it was trained on: the gap to val is "
                        "memorisation)")
    p.add_argument("--out", default=None, help="JSON of the results")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = resolve_dtype(a.dtype, "cpu")
    tgt = load_target(a.model, dtype.dtype, "cpu", max_seq_len=a.max_len + 8)
    students, names = [], []
    for spec in a.drafters:
        name, _, path = spec.partition("=")
        model = DartModel.load(path).float().eval()
        try:
            model.cfg.check_target(tgt.args, tgt.model_id)
        except ValueError as e:
            raise SystemExit(f"{name}={path}: {e} (pass its target with --model)") from None
        cfg = TrainConfig(data=a.data, out="-", arch=model.cfg.arch, depth=model.cfg.depth,
                          seqs_per_step=a.seqs_per_step, max_len=a.max_len,
                          draft_vocab=model.cfg.draft_vocab or 0)
        students.append((model, cfg))
        names.append(name)
    if a.split == "train":
        val, _ = _val_by_domain(load_rows(a.data, "train"), [], a.eval_seqs)
    else:
        val, held_out = _val_by_domain([], load_rows(a.data, "val"), a.eval_seqs)
        if not held_out:
            raise SystemExit(f"{a.data} has no held-out rows")
    cache = tgt.model.new_cache(a.seqs_per_step, a.max_len + 8)
    t2d = torch.zeros(1)  # non-None: each drafter maps its predictions through its own d2t
    evs = evaluate_domains(students, tgt.model, cache, val, t2d, dtype.dtype)
    out = {"data": a.data, "split": a.split, "dtype": dtype.to_dict(),
           ("held_out_seqs" if a.split == "val" else "train_seqs"):
               {k: len(v) for k, v in val.items()},
           "drafters": {n: {"path": s.split("=", 1)[1], **ev}
                        for n, s, ev in zip(names, a.drafters, evs, strict=True)}}
    for n, ev in zip(names, evs, strict=True):
        for dom in sorted(ev):
            for part, e in (("every", ev[dom]), ("answer", ev[dom]["answer"])):
                print(f"{n:>10} {dom:>5} {part:>6}: top1 {[round(x, 3) for x in e['top1'][:4]]} "
                      f"top5 {[round(x, 3) for x in e['top5'][:2]]} chain_tau "
                      f"{e['chain_tau']:.2f}")
            ans = ev[dom]["answer"]
            bins = " ".join(f">={b['p_min']:.1f}: {b['top1']:.3f} ({b['share']:.0%})"
                            for b in ans["level1_by_confidence"])
            print(f"{'':>10} {dom:>5} answer level 1 by the target's top-1 probability: {bins}; "
                  f"inside the draft vocabulary {ans['level1_in_vocab']:.1%}")
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
