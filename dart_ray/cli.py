"""``dart-ray`` command line: generate | bench | build-ngram | prompts | serve | batch | tune |
train-drafter.

Heavy imports happen inside each subcommand so ``dart-ray --help`` is instant.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import NoReturn

from dart_ray.allocator import allocator_in_use
from dart_ray.config import EngineConfig, RenamedWarning, add_engine_args, engine_args
from dart_ray.model_ref import ModelLoadError


def _add_profile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=None,
                   help="decoding profile (name or YAML path) from `dart-ray tune`")


def _apply_profile(engine, profile: str | None) -> None:
    """Apply ``--profile`` (warns once if it was tuned on other hardware than ``engine``'s)."""
    if profile:
        from dart_ray.profiles import apply_profile

        apply_profile(engine, profile)


def cmd_generate(a: argparse.Namespace) -> int:
    from dart_ray import Engine, PromptTooLongError, SamplingParams
    from dart_ray.profiles import refuse_profile_over_decoding

    cfg = EngineConfig.from_args(a)
    refuse_profile_over_decoding(a.profile, cfg.decoding)
    params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                            top_p=a.top_p, top_k=a.top_k, seed=a.seed, stop=tuple(a.stop or ()))
    engine = Engine.from_config(cfg)
    _apply_profile(engine, a.profile)
    try:
        engine.add_request(a.prompt, params, request_id="cli", chat=a.chat)
    except (PromptTooLongError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    n, last = 0, None
    while engine.has_unfinished():
        for o in engine.step():
            sys.stdout.write(o.new_text)
            sys.stdout.flush()
            n += len(o.new_token_ids)
            last = o
    dt = time.perf_counter() - t0
    st = last.stats
    es = engine.stats()
    print()
    spec = (f"{es.ar_steps}/{es.steps} steps plain AR" if engine.controller is not None
            else "adaptive off")
    print(f"[{cfg.method}] {n} tokens in {dt:.2f}s = {n / dt:.1f} tok/s | tau "
          f"{st.mean_accepted_len:.2f} | finish {last.finish_reason} | {engine.config.dtype} "
          f"({engine.dtype_choice.reason}) | {spec} | {engine.fingerprint.summary()} | "
          f"allocator {allocator_in_use()}",
          file=sys.stderr if a.stats_stderr else sys.stdout)
    return 0


def _method_map(items: list[str] | None, flag: str) -> dict[str, str]:
    """``["eagle=DIR", ...]`` -> ``{"eagle": "DIR"}`` (a clear error for a malformed entry)."""
    out = {}
    for it in items or []:
        m, sep, v = it.partition("=")
        if not sep or not m or not v:
            raise SystemExit(f"{flag} takes METHOD=VALUE, got {it!r}")
        out[m] = v
    return out


BENCH_FIXED = ("max_batch_size", "max_seq_len", "pack_weights", "seed")
"""Engine settings the bench harness fixes itself (a flag for one of them is an error, not
ignored)."""


def cmd_bench(a: argparse.Namespace) -> int:
    from dart_ray.bench.prompts import load_prompts
    from dart_ray.bench.runner import format_table, plot_report, run_bench, write_report

    if a.plot and missing_modules(["matplotlib"]):     # found after the run otherwise
        raise ValueError("--plot needs matplotlib: pip install 'dart-ray[bench]'")
    given = engine_args(a)
    fixed = sorted(k for k in BENCH_FIXED if k in given)
    if fixed:
        raise ValueError(f"bench sets {fixed} itself (rows = --batch-size, max_seq_len 2048, auto "
                         "packing, drafter seed 0); drop those flags")
    from dart_ray.profiles import refuse_profile_over_decoding

    cfg = EngineConfig.from_args(a)          # --method is not used: --methods lists what runs
    profile_for = _method_map(a.profile_for, "--profile-for")
    for prof in (a.profile, *profile_for.values()):
        refuse_profile_over_decoding(prof, cfg.decoding)
    prompts = load_prompts(a.prompts, limit=a.limit)
    decoding = cfg.decoding
    if a.profile:
        decoding = _bench_profile(a.profile, a.batch_size, cfg)
    drafters = _method_map(a.drafter_for, "--drafter-for")
    decodings = {m: _bench_profile(prof, a.batch_size, cfg) for m, prof in profile_for.items()}
    report = run_bench(prompts, a.methods.split(","), model=cfg.model, drafter=cfg.drafter,
                       ngram=cfg.ngram, chat=a.chat, max_new_tokens=a.max_new_tokens,
                       batch_size=a.batch_size, dtype=cfg.dtype, threads=cfg.num_threads,
                       decoding=decoding, device=cfg.device, drafters=drafters, decodings=decodings,
                       adaptive=cfg.adaptive, temperature=a.temperature, top_p=a.top_p,
                       top_k=a.top_k, seed=a.seed)
    print(format_table(report))
    if a.out:
        write_report(report, a.out)
        print(f"wrote {a.out}")
    if a.plot:
        plot_report(report, a.plot)
        print(f"wrote {a.plot}")
    return 0


def _bench_profile(ref: str, batch_size: int, cfg: EngineConfig):
    """A profile's knobs at ``batch_size``, with the warning every command gives when it was tuned
    on other hardware (this machine, dtype and threads as the bench runs them; no model: the bench
    has not loaded it yet)."""
    from dart_ray.hardware import Fingerprint, resolve_dtype
    from dart_ray.profiles import check_profile_hardware, load_profile

    sched = load_profile(ref)
    check_profile_hardware(sched, Fingerprint.current(
        cfg.device, dtype=resolve_dtype(cfg.dtype, cfg.device).dtype, threads=cfg.num_threads))
    return sched.for_batch_size(batch_size)


def cmd_prompts(a: argparse.Namespace) -> int:
    from dart_ray.bench.prompts import load_prompts, write_jsonl

    prompts = load_prompts(a.source)[a.skip:]
    if a.limit is not None:
        prompts = prompts[:a.limit]
    write_jsonl(prompts, a.out)
    print(f"wrote {len(prompts)} prompts to {a.out}")
    return 0


EXTRAS = {"serve": ("serve", ("ray.serve", "prometheus_client")),
          "tune": ("tune", ("ray.tune", "optuna")),
          "batch": ("batch", ("ray.data",))}
"""Command -> (the pyproject extra it needs, modules that extra provides): checked before the
command runs (they are imported lazily, deep inside it)."""


def missing_modules(modules) -> list[str]:
    import importlib.util

    out = []
    for m in modules:
        try:
            found = importlib.util.find_spec(m) is not None
        except ModuleNotFoundError:          # its parent package is missing
            found = False
        if not found:
            out.append(m)
    return out


def _delegate(cmd: str, module: str, func: str, argv: list[str]) -> int:
    import importlib

    extra, needs = EXTRAS.get(cmd, (None, ()))
    missing = missing_modules(needs)
    if missing:
        print(f"dart-ray {cmd}: error: {', '.join(missing)} not installed; install the extra: "
              f"pip install 'dart-ray[{extra}]'", file=sys.stderr)
        return 2
    mod = importlib.import_module(module)
    return getattr(mod, func)(argv)


DELEGATED = {
    "build-ngram": ("dart_ray.ngram.build", "build_ngram_cli"),
    "serve": ("deployments.cli", "serve_cli"),
    "batch": ("batch.cli", "batch_cli"),
    "tune": ("tuning.cli", "tune_cli"),
    "train-drafter": ("dart_ray.training.cli", "train_cli"),
    "gen-data": ("dart_ray.training.cli", "gen_data_cli"),
    "gen-prompts": ("dart_ray.training.cli", "gen_prompts_cli"),
    "ship": ("dart_ray.training.ship", "ship_cli"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dart-ray",
                                description="Lossless DART speculative decoding on Ray")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt (streams to stdout)")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="apply the chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--stats-stderr", action="store_true", help="print the stats line to stderr")
    add_engine_args(g, method="auto", max_batch_size=1)
    _add_profile_arg(g)
    g.set_defaults(func=cmd_generate)
    b = sub.add_parser("bench", help="benchmark methods on a prompt file (one process, "
                                     "interleaved, medians)")
    b.add_argument("--prompts", required=True,
                   help=".jsonl/.parquet with a 'prompt' column, or humaneval|chat|chat-probe")
    b.add_argument("--methods", default="ar,ngram,dart,hf,hf-pld",
                   help="comma list of ar, ngram, sps, medusa, eagle, dart, hf, hf-pld; an own "
                        "method twice as METHOD@NAME with its own --drafter-for/--profile-for "
                        "(e.g. dart,dart@new --drafter-for dart@new=DIR: an A/B in one process)")
    b.add_argument("--chat", action="store_true")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: benchmark sampling (own methods; every prompt seeded with --seed)")
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--seed", type=int, default=0, help="sampling seed of every prompt")
    b.add_argument("--batch-size", type=int, default=1)
    b.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    b.add_argument("--out", default=None, help="results JSON")
    b.add_argument("--plot", default=None, help="results PNG")
    b.add_argument("--drafter-for", action="append", metavar="METHOD=DIR",
                   help="drafter directory of one method (repeatable; default: shipped)")
    b.add_argument("--profile-for", action="append", metavar="METHOD=PROFILE",
                   help="decoding profile of one method (repeatable; default: --profile, else "
                        "--decoding, else defaults)")
    add_engine_args(b, help={"method": "not used (--methods lists what runs)"})
    _add_profile_arg(b)
    b.set_defaults(func=cmd_bench)
    pr = sub.add_parser("prompts", help="export a prompt set (humaneval|chat|FILE) to .jsonl")
    pr.add_argument("source")
    pr.add_argument("--out", required=True)
    pr.add_argument("--limit", type=int, default=None)
    pr.add_argument("--skip", type=int, default=0,
                    help="drop the first N prompts (e.g. the ones bench uses)")
    pr.set_defaults(func=cmd_prompts)
    for name in DELEGATED:
        sub.add_parser(name, help=f"see `dart-ray {name} --help`", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # old spellings (a profile's chunk_len, a renamed flag) still work; say so on every command
    warnings.simplefilter("default", RenamedWarning)
    try:
        return _run(argv)
    except ModelLoadError as e:       # a bad --model, from any command: an error, not a traceback
        print(f"dart-ray {argv[0]}: error: {e}", file=sys.stderr)
        return 2


def _run(argv: list[str]) -> int:
    if argv and argv[0] in DELEGATED:
        module, func = DELEGATED[argv[0]]
        return _delegate(argv[0], module, func, argv[1:])
    a = build_parser().parse_args(argv)
    if getattr(a, "num_threads", None):
        import torch

        torch.set_num_threads(a.num_threads)
    try:
        return a.func(a)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _device_arg(argv: list[str]) -> str:
    """The ``--device`` value on a command line ('' if none), read before parsing."""
    for i, x in enumerate(argv):
        flag, eq, value = x.partition("=")
        # argparse takes any unambiguous prefix: --dev, --devi, ... (--de is --decoding's too)
        if len(flag) >= 5 and "--device".startswith(flag):
            if eq:
                return value
            if i + 1 < len(argv):
                return argv[i + 1]
    return ""


def entry() -> NoReturn:
    """The ``dart-ray`` console script (and ``python -m dart_ray.cli``): a command that runs an
    engine or training in this process on CPU re-executes itself once, with the same command line,
    under a fast allocator (:mod:`dart_ray.allocator`; ``DART_RAY_ALLOCATOR=system`` opts out);
    then :func:`main`."""
    from dart_ray.allocator import reexec_argv

    argv = sys.argv[1:]
    command = next((x for x in argv if not x.startswith("-")), None)
    try:
        plan = reexec_argv(command, device=_device_arg(argv))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if plan is not None:
        args, env = plan
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execve(args[0], args, env)
        except OSError as e:        # the interpreter went away: run here, on this allocator
            print(f"warning: could not restart under a faster allocator ({e})", file=sys.stderr)
    sys.exit(main())


if __name__ == "__main__":
    entry()
