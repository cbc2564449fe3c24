"""``dart-ray gen-data`` and ``dart-ray train-drafter`` (see :mod:`dart_ray.training.trainer`)."""

from __future__ import annotations

import argparse
import json
import sys


def gen_data_cli(argv: list[str] | None = None) -> int:
    from dart_ray.training.gen_data import generate_data

    p = argparse.ArgumentParser(prog="dart-ray gen-data", description="self-distillation data (resumable)")
    p.add_argument("--out", required=True)
    p.add_argument("--n-code", type=int, default=1500)
    p.add_argument("--n-chat", type=int, default=500)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shards", type=int, default=None,
                   help="generate only the first N shards of 64 prompts (rerun without it to extend)")
    p.add_argument("--text-tokens", type=int, default=0,
                   help="also write this many tokens of raw stdlib source as teacher-only training text")
    a = p.parse_args(argv)
    if a.text_tokens:
        from dart_ray.training.gen_data import write_text_corpus

        print(f"text rows in {write_text_corpus(a.out, a.text_tokens, a.model, seed=a.seed)}")
    if a.n_code + a.n_chat == 0:
        return 0
    out = generate_data(a.out, a.n_code, a.n_chat, a.max_new_tokens, a.batch_size, a.temperature, a.model,
                        a.dtype, seed=a.seed, threads=a.threads, max_shards=a.max_shards)
    print(f"data in {out}")
    return 0


def train_cli(argv: list[str] | None = None) -> int:
    from dart_ray.training.trainer import TrainConfig, train

    p = argparse.ArgumentParser(prog="dart-ray train-drafter",
                                description="train a drafter: DART, EAGLE-style, Medusa heads or an SpS draft model (resumable)")
    p.add_argument("--data", required=True, help="directory of gen-data shards")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--arch", default="dart",
                   help="dart (default), eagle (autoregressive drafter), medusa (heads) or sps (draft model); "
                        "a comma list (arch or arch:depth) trains them together on the same batches (out/<arch>/)")
    p.add_argument("--depth", type=int, default=8,
                   help="levels (dart), unrolled steps (eagle), heads (medusa), max chain length (sps)")
    p.add_argument("--sps-layers", default="0,1", help="sps: target layers the draft blocks start from")
    p.add_argument("--gamma", type=float, default=0.6)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--seqs-per-step", type=int, default=4)
    p.add_argument("--max-len", type=int, default=320)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--time-budget", type=float, default=None, help="seconds")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from dart_ray.config import parse_int_list

    archs = [x.strip() for x in a.arch.split(",") if x.strip()]
    first, _, d0 = archs[0].partition(":")
    cfg = TrainConfig(data=a.data, out=a.out, model=a.model, arch=first, joint=tuple(archs[1:]), sps_layers=tuple(parse_int_list(a.sps_layers)),
                      depth=int(d0) if d0 else a.depth, gamma=a.gamma, lr=a.lr, epochs=a.epochs,
                      max_steps=a.max_steps, seqs_per_step=a.seqs_per_step, max_len=a.max_len,
                      draft_vocab=a.draft_vocab, eval_every=a.eval_every, time_budget_s=a.time_budget,
                      threads=a.threads, seed=a.seed)
    summary = train(cfg)
    print(json.dumps(summary["final_eval"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(train_cli())
