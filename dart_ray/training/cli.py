"""``dart-ray gen-prompts``, ``dart-ray gen-data`` and ``dart-ray train-drafter`` (see
:mod:`dart_ray.training.selfinstruct`, :mod:`dart_ray.training.gen_data`,
:mod:`dart_ray.training.trainer`)."""

from __future__ import annotations

import argparse
import json
import sys


def gen_prompts_cli(argv: list[str] | None = None) -> int:
    from dart_ray.training.selfinstruct import STYLES, generate_prompts

    p = argparse.ArgumentParser(prog="dart-ray gen-prompts",
                                description="self-instruct chat prompts written by the target "
                                            "(resumable)")
    p.add_argument("--out", required=True, help="directory of prompts-*.jsonl shards")
    p.add_argument("--n", type=int, default=4000, help="stop once this many prompts are kept")
    p.add_argument("--model", default=None, help="target (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="auto",
                   help="auto = bf16 where this machine runs it natively and fast, else fp32")
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--shard-size", type=int, default=128, help="meta-prompts per shard")
    p.add_argument("--multi-turn-frac", type=float, default=0.2,
                   help="fraction marked for a follow-up turn (written by gen-data after the first "
                        "answer)")
    p.add_argument("--threshold", type=float, default=0.7,
                   help="near-duplicate threshold (word-bigram Jaccard; also the evaluation "
                        "filter's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-shards", type=int, default=None,
                   help="stop after N shards (rerun to extend)")
    p.add_argument("--device", default="cpu", help="torch device of the target (cpu, cuda)")
    p.add_argument("--style", choices=STYLES, default="list",
                   help="list: few-shot lists of one category's requests, the target writes the "
                        "next; pre-query: the target writes the user's turn of its own chat "
                        "template (Magpie), from its own prior over requests")
    a = p.parse_args(argv)
    from dart_ray.training.selfinstruct import GenerationStalledError

    try:
        out = generate_prompts(a.out, a.n, a.model, a.dtype, a.temperature, a.top_p,
                               a.max_new_tokens, a.batch_size, a.shard_size, a.seed,
                               a.multi_turn_frac, a.threshold, a.threads, a.max_shards,
                               device=a.device, style=a.style)
    except (ValueError, FileNotFoundError) as e:
        print(f"dart-ray gen-prompts: error: {e}", file=sys.stderr)
        return 2
    except GenerationStalledError as e:
        print(f"dart-ray gen-prompts: error: {e}", file=sys.stderr)
        return 1
    print(f"prompts in {out}: "
          f"{(out / 'stats.json').read_text() if (out / 'stats.json').is_file() else ''}")
    return 0


def gen_data_cli(argv: list[str] | None = None) -> int:
    from dart_ray.training.gen_data import SPLITS, generate_data

    p = argparse.ArgumentParser(prog="dart-ray gen-data",
                                description="self-distillation data (resumable)")
    p.add_argument("--out", required=True)
    p.add_argument("--n-code", type=int, default=1500)
    p.add_argument("--n-chat", type=int, default=500,
                   help="chat prompts (the first N of --prompts when given)")
    p.add_argument("--prompts", default=None,
                   help="gen-prompts directory: its prompts are the chat half (default: templates "
                        "x topics)")
    p.add_argument("--followup-temperature", type=float, default=0.7,
                   help="sampling temperature of the follow-up turns of multi-turn prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--shard-size", type=int, default=64,
                   help="prompts per parquet shard (the unit of resumption; at least the batch "
                        "size to keep the batch full)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto",
                   help="auto = bf16 where this machine runs it natively and fast, else fp32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shards", type=int, default=None,
                   help="generate only the first N shards of 64 prompts (rerun without it to "
                        "extend)")
    p.add_argument("--text-tokens", type=int, default=0,
                   help="also write this many tokens of raw stdlib source as teacher-only training "
                        "text")
    p.add_argument("--method", default="ngram",
                   help="engine method (exact under greedy decoding either way): ngram (default; "
                        "prompt lookup, fastest at small batches on a CPU) or none (plain steps, "
                        "for large batches on a GPU)")
    p.add_argument("--device", default="cpu", help="torch device of the target (cpu, cuda)")
    p.add_argument("--exclude-data", default="",
                   help="comma list of data directories whose prompts are answered already (e.g. "
                        "on another machine): left out here; train on both with --data A,B")
    p.add_argument("--only-split", choices=SPLITS, default=None,
                   help="answer only the prompts that hash to this split (val: a larger held-out "
                        "set for scripts/eval_drafters.py, never trained on)")
    p.add_argument("--eval-prompts", default=None,
                   help="answer this evaluation prompt set instead (chat, humaneval or a .jsonl/"
                        ".parquet file): every row held out, the directory marked so no training "
                        "run reads it; score drafters on it with scripts/eval_drafters.py --data "
                        "or train-drafter --eval-data")
    a = p.parse_args(argv)
    if a.eval_prompts is not None and (a.text_tokens or a.prompts or a.exclude_data
                                       or a.only_split):
        p.error("--eval-prompts answers an evaluation set alone (no --text-tokens, --prompts, "
                "--exclude-data or --only-split)")
    if a.text_tokens:
        from dart_ray.training.gen_data import write_text_corpus

        print(f"text rows in {write_text_corpus(a.out, a.text_tokens, a.model, seed=a.seed)}")
    if a.n_code + a.n_chat == 0 and a.eval_prompts is None:
        return 0
    try:
        out = generate_data(a.out, a.n_code, a.n_chat, a.max_new_tokens, a.batch_size,
                            a.temperature, a.model, a.dtype, method=a.method,
                            shard_size=a.shard_size, seed=a.seed, threads=a.threads,
                            max_shards=a.max_shards, prompts_dir=a.prompts,
                            followup_temperature=a.followup_temperature, device=a.device,
                            exclude_data=a.exclude_data or None, only_split=a.only_split,
                            eval_prompts=a.eval_prompts)
    except (ValueError, FileNotFoundError) as e:
        print(f"dart-ray gen-data: error: {e}", file=sys.stderr)
        return 2
    print(f"{'evaluation answers' if a.eval_prompts is not None else 'data'} in {out}")
    return 0


def train_cli(argv: list[str] | None = None) -> int:
    from dart_ray.training.trainer import DTYPES, LR_SCHEDULES, TrainConfig, train

    p = argparse.ArgumentParser(prog="dart-ray train-drafter",
                                description="train a drafter: DART, EAGLE-style, Medusa heads or "
                                            "an SpS draft model (resumable)")
    p.add_argument("--data", required=True,
                   help="directory of gen-data shards, or a comma list of them (data made in "
                        "parts, e.g. on two machines)")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--arch", default="dart",
                   help="dart (default), eagle (autoregressive drafter), medusa (heads) or sps "
                        "(draft model); a comma list (arch or arch:depth) trains them together on "
                        "the same batches (out/<arch>/)")
    p.add_argument("--depth", type=int, default=8,
                   help="levels (dart), unrolled steps (eagle), heads (medusa), max chain length "
                        "(sps)")
    p.add_argument("--sps-layers", default="0,1",
                   help="sps: target layers the draft blocks start from")
    p.add_argument("--gamma", type=float, default=0.6)
    p.add_argument("--prompt-weight", type=float, default=1.0,
                   help="loss weight of the prefixes inside each row's prompt, where serving "
                        "never drafts (answers weigh 1; 0 = answers only; default 1 = all alike)")
    p.add_argument("--lr", type=float, default=None, help="peak LR of a new plan (default 1e-3)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warmup steps of a new plan (default 30)")
    p.add_argument("--epochs", type=float, default=None,
                   help="length of this run's plan in passes over the data (default 1; with "
                        "--lr-schedule fresh counted from the resumed step)")
    p.add_argument("--max-steps", type=int, default=None, help="cap on this run's plan, in steps")
    p.add_argument("--resume", default=None,
                   help="start from a run dir, its checkpoint/ dir, or a drafter dir (e.g. "
                        "dart_ray/artifacts/SmolLM2-135M-Instruct/drafter); needs --lr-schedule. "
                        "(A run restarts from its own --out checkpoint without this.)")
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=None,
                   help="with --resume: continue = the source's LR plan, optimizer moments and "
                        "data position go on (--lr/--warmup/--epochs/--max-steps not allowed); "
                        "fresh = weights only, a new warmup + cosine plan at --lr over "
                        "--epochs/--max-steps")
    p.add_argument("--init-from-target", action="store_true",
                   help="dart/eagle: start the drafter layer from a target layer (default: random "
                        "init)")
    p.add_argument("--init-layer", type=int, default=None,
                   help="target layer for --init-from-target (default: the last tapped layer)")
    p.add_argument("--seqs-per-step", type=int, default=4)
    p.add_argument("--max-len", type=int, default=320)
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="size of the drafter's own vocabulary (the data answers' most frequent "
                        "tokens; 0 = the full tied head). Default: a resumed or restarted "
                        "drafter's own size, else 8192 (also with --revocab)")
    p.add_argument("--revocab", nargs="?", const="replace", default=None,
                   choices=("replace", "extend"),
                   help="with --resume ... --lr-schedule fresh: a new draft vocabulary of "
                        "--draft-vocab tokens: 'replace' (the default) = this data's most frequent "
                        "answer tokens, 'extend' = the resumed drafter's tokens plus this data's "
                        "most frequent others; shared tokens keep their trained head rows, new "
                        "ones start from the target's")
    p.add_argument("--mlp-width", type=int, default=None,
                   help="dart/eagle: units of the drafter layer's MLP (default: the target's); "
                        "with --resume ... --lr-schedule fresh a narrower drafter is grown to it, "
                        "its function kept (new units' down-projection starts at zero)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-seqs", type=int, default=48,
                   help="held-out sequences evaluated per domain (chat, code, text)")
    p.add_argument("--eval-data", default=None,
                   help="comma list of further data directories whose val rows join the held-out "
                        "set (e.g. make heldout-code's gen-data --only-split val)")
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of this invocation's training loop; then stop cleanly "
                        "(checkpoint, final evaluation, drafter); rerun the same command to "
                        "continue as if uninterrupted")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--teacher-cache-gb", type=float, default=4.0,
                   help="memory for the teacher's per-sequence outputs, so epochs after the first "
                        "skip the target forward (~3.7 KB per token for SmolLM2-135M in bf16); 0 = "
                        "recompute every step")
    p.add_argument("--teacher-cache", default=None,
                   help="directory keeping those outputs across runs (appended at each "
                        "checkpoint): restarts, later sittings and other runs on the same "
                        "sequences skip their teacher passes")
    p.add_argument("--device", default="cpu",
                   help="torch device of the teacher and students (cpu, cuda); a run may restart "
                        "on another device")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="teacher dtype and the students' autocast: auto = bf16 where this machine "
                        "runs it natively and fast, else fp32 (students keep fp32 weights either "
                        "way)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from dart_ray.config import parse_int_list

    if a.resume and a.lr_schedule is None:
        p.error("--resume needs an explicit --lr-schedule: 'continue' (the checkpoint's LR plan, "
                "optimizer state and data position go on) or 'fresh' (weights only; new warmup + "
                "cosine at --lr over --epochs)")
    if a.lr_schedule and not a.resume:
        p.error("--lr-schedule applies only with --resume")
    if a.lr_schedule == "continue":
        given = [f for f, v in (("--lr", a.lr), ("--warmup", a.warmup), ("--epochs", a.epochs),
                                ("--max-steps", a.max_steps)) if v is not None]
        if given:
            p.error(f"--lr-schedule continue keeps the checkpoint's plan; {', '.join(given)} would "
                    "change it (use --lr-schedule fresh)")
    archs = [x.strip() for x in a.arch.split(",") if x.strip()]
    first, _, d0 = archs[0].partition(":")
    try:
        cfg = TrainConfig(data=a.data, out=a.out, model=a.model, arch=first, joint=tuple(archs[1:]),
                          sps_layers=tuple(parse_int_list(a.sps_layers)),
                          depth=int(d0) if d0 else a.depth, gamma=a.gamma,
                          prompt_weight=a.prompt_weight,
                          lr=1e-3 if a.lr is None else a.lr,
                          warmup_steps=30 if a.warmup is None else a.warmup,
                          epochs=1.0 if a.epochs is None else a.epochs, max_steps=a.max_steps,
                          seqs_per_step=a.seqs_per_step, max_len=a.max_len,
                          draft_vocab=a.draft_vocab, eval_every=a.eval_every, eval_seqs=a.eval_seqs,
                          eval_data=a.eval_data,
                          ckpt_every=a.ckpt_every, time_budget_s=a.time_budget, threads=a.threads,
                          teacher_cache_gb=a.teacher_cache_gb, teacher_cache=a.teacher_cache,
                          device=a.device, dtype=a.dtype, seed=a.seed, resume=a.resume,
                          lr_schedule=a.lr_schedule,
                          init_from_target=a.init_from_target, init_layer=a.init_layer,
                          revocab=a.revocab, mlp_width=a.mlp_width)
    except ValueError as e:
        p.error(str(e))
    summary = train(cfg)
    print(json.dumps(summary["final_eval"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(train_cli())
