"""Package trained artifacts into ``dart_ray/artifacts/<model_id>/`` with a card.

``dart-ray ship`` copies a trained drafter (``train-drafter`` output) and an N-gram model into the
package, checks the size limit (25 MB each), and writes ``CARD.md`` (command, data, steps, wall
time, measured per-level accuracy and tau) from the run's ``train_summary.json`` plus, when given,
a bench JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from dart_ray.methods import MethodSpec, method_specs

MAX_MB = 25.0


def ngram_from_selfdistill(data_dir: str | Path, out: str | Path, order: int = 3,
                           min_count: int = 2, model_id: str = "") -> Path:
    """N-gram model over the TRAIN split of self-distillation data (prompts + target answers)."""
    from dart_ray.ngram import NGramModel
    from dart_ray.training.gen_data import load_sequences

    seqs = [s for s, _ in load_sequences(data_dir, "train")]
    vocab = max(max(s) for s in seqs) + 1
    model = NGramModel.from_sequences(seqs, order=order, min_count=min_count,
                                      vocab_size=max(vocab, 49152),
                                      meta={"source": "self-distillation train split of "
                                                      f"{data_dir}",
                                            "target": model_id})
    model.save(out)
    return Path(out)


def _dir_mb(p: Path) -> float:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 2**20


def trained_method(arch: str) -> MethodSpec:
    """The registered method whose network the ``train-drafter --arch`` objective ``arch``
    trains."""
    for spec in method_specs():
        if spec.objective == arch:
            return spec
    raise ValueError(f"unknown arch {arch!r}; one of "
                     f"{[s.objective for s in method_specs() if s.objective]}")


def ship(run_dir: str | Path, ngram_dir: str | Path | None, model_id: str, command: str,
         bench_json: list[str] | None = None, dest_root: Path | None = None,
         arch: str | None = None, notes: str = "") -> Path:
    """Copy a trained drafter (and for DART the N-gram model) into the package with a card.

    DART goes to ``<model_id>/drafter`` with ``<model_id>/CARD.md``; a baseline arch to
    ``<model_id>/<arch>/`` with its card inside. ``arch`` defaults to the run's own. ``notes``:
    markdown put in the card after the command (e.g. the compute of every sitting that led here,
    data generation included, which no single run's summary knows).
    """
    from dart_ray.drafters import default_artifact_dir
    from dart_ray.training.trainer import config_defaults

    run = Path(run_dir)
    summary = json.loads((run / "train_summary.json").read_text())
    arch = arch or summary.get("arch") or summary["config"].get("arch", "dart")
    spec = trained_method(arch)
    dest = (dest_root / model_id) if dest_root else default_artifact_dir(model_id)
    dest.mkdir(parents=True, exist_ok=True)
    sizes = {}
    src = run / "drafter"
    if not (src / spec.config_file).is_file():
        raise FileNotFoundError(f"no trained {arch} drafter in {src}")
    target_dir = dest / spec.artifact_dir
    _replace_dir(src, target_dir)
    sizes[spec.artifact_dir] = _dir_mb(target_dir)
    if ngram_dir and arch == "dart":
        _replace_dir(Path(ngram_dir), dest / "ngram")
        sizes["ngram"] = _dir_mb(dest / "ngram")
    too_big = {k: v for k, v in sizes.items() if v > MAX_MB}
    if too_big:
        raise ValueError(f"shipped artifacts over {MAX_MB} MB: {too_big}")
    cfg = summary["config"]
    defaults = config_defaults()  # a run from before a setting existed trained with its default
    keys = ("arch", "depth", "gamma", "lr", "warmup_steps", "epochs", "max_steps", "seqs_per_step",
            "max_len", "draft_vocab", "teacher_topk", "init_from_target", "prompt_weight")
    keys += ("sps_layers",) if arch == "sps" else ()
    joint = summary.get("joint_with") or []
    lines = [f"# {spec.card_title} for {model_id}", "",
             "Produced by this project's own commands (no third-party weights):", "", "```bash",
             command, "```", "", *([notes.strip(), ""] if notes.strip() else []),
             "## Data", _data_paragraph(summary.get("data") or {}), "",
             "![training curves](training.png)", "",
             f"- training sequences: {summary['train_seqs']}"
             + (f" ({_by(summary['train_rows_by_domain'])})" if summary.get("train_rows_by_domain")
                else "")
             + f", held-out (evaluated): {summary['val_seqs']}"
             + (f" ({_by(summary['val_seqs_by_domain'])})" if summary.get("val_seqs_by_domain")
                else ""),
             f"- optimizer steps: {summary['steps']}; this drafter's training compute (its updates "
             f"+ its share of the teacher pass): {summary['train_wall_s'] / 60:.1f} min"
             + (f"; trained jointly with {', '.join(joint)} on the same batches" if joint else ""),
             *_plan_lines(summary),
             *_dtype_lines(summary),
             f"- config: `{json.dumps({k: cfg.get(k, defaults.get(k)) for k in keys})}`",
             "- sizes: " + ", ".join(f"{k} {v:.1f} MB" for k, v in sizes.items()), "",
             *accuracy_section(summary, chain_note=f", chains of {cfg['depth']} draft-model tokens"
                               if arch == "sps"
                               else "")]
    for bj in bench_json or []:
        lines += measured_section(bj)
    card_dir = dest if arch == "dart" else target_dir
    if (run / "training.png").is_file():
        shutil.copy(run / "training.png", card_dir / "training.png")
    (card_dir / "CARD.md").write_text("\n".join(lines))
    return dest


def _replace_dir(src: Path, dst: Path) -> None:
    """``dst`` becomes a copy of ``src``, swapped in whole (copied before anything is removed, so
    ``src`` may be ``dst`` itself: shipping the N-gram model already shipped keeps it)."""
    from dart_ray.training.checkpoint import save_dir_atomic

    save_dir_atomic(lambda tmp: shutil.copytree(src, tmp), dst)


def _by(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _data_paragraph(data: dict) -> str:
    si = data.get("self_instruct_rows", 0)
    chat = ("requests the target wrote itself (`dart-ray gen-prompts`: few-shot list continuation "
            "over seed categories x sub-topics, or with `--style pre-query` the user's turn of its "
            "own chat template; cleaned, near-duplicates removed"
            + (f"; {data.get('multi_turn_rows', 0)} two-turn conversations whose follow-up the "
               "target wrote after its first answer" if data.get("multi_turn_rows") else "") + ")"
            if si else "instructions from templates x topics")
    return ("Self-distillation: the target answered an offline prompt corpus "
            "(`dart_ray/training/corpus.py`): function headers + docstrings cut from the Python "
            "standard library (code) and " + chat + " (chat)"
            + (f" — rows by source: {_by(data['rows_by_source'])}" if data.get("rows_by_source")
               else "")
            + ". Plus teacher-only text (`gen-data --text-tokens`) when listed: 320-token chunks "
              "of Python standard-library source, trained against the target's own distributions "
              "at every position. Every evaluation prompt the project ships (HumanEval, "
              "`dart_ray/bench/data/`) and its near-duplicates are excluded "
              "(`dart_ray/training/neardup.py`: exact normalised match, or word-bigram Jaccard / "
              "containment >= 0.7; text chunks containing any HumanEval function signature are "
              "dropped). Held-out split by prompt hash.")


def _plan_lines(summary: dict) -> list[str]:
    plan, res = summary.get("lr_plan"), summary.get("resumed")
    out = []
    if plan:
        stopped = summary.get("stopped") not in (None, "plan complete")
        out.append(f"- LR plan: warmup {plan['warmup']} + cosine to 0, peak {plan['lr']:g}, steps "
                   f"{plan['start']}..{plan['start'] + plan['steps']}"
                   + (f"; stopped at {summary['steps']} ({summary['stopped']})" if stopped else ""))
    if res:
        out.append(f"- resumed at step {res['step']} from `{res['from']}` (--lr-schedule "
                   f"{res['lr_schedule']})")
    return out


def _dtype_lines(summary: dict) -> list[str]:
    """The training dtype (``train_summary.json`` ``dtype``: what ``--dtype`` resolved to, and
    why)."""
    d = summary.get("dtype")
    if not d:
        return []
    students = "fp32 weights, bf16 autocast" if d["dtype"] == "bf16" else "fp32"
    why = f"; `--dtype auto`: {d['reason']}" if d.get("requested") == "auto" else ""
    return [f"- teacher dtype: {d['dtype']} (students: {students}){why}"]


def measured_section(bench_json: str | Path) -> list[str]:
    """A card's ``## Measured`` section (lines) for one ``dart-ray bench --out`` JSON."""
    from dart_ray.bench.runner import format_table

    rep = json.loads(Path(bench_json).read_text())
    c = rep["config"]
    return [f"## Measured: `{Path(bench_json).name}` ({c['n_prompts']} prompts, bs "
            f"{c['batch_size']}, {c['dtype']}, {c['max_new_tokens']} new tokens)", "",
            format_table(rep), ""]


def _level_table(ev: dict) -> list[str]:
    n = len(ev["top1"])
    return ["| level | " + " | ".join(str(i + 1) for i in range(n)) + " |", "|---|" + "---|" * n,
            "| top-1 | " + " | ".join(f"{a:.3f}" for a in ev["top1"]) + " |",
            "| top-5 | " + " | ".join(f"{a:.3f}" for a in ev["top5"]) + " |"]


def accuracy_section(summary: dict, chain_note: str = "") -> list[str]:
    """The card's held-out numbers: per-level top-1/top-5 and expected chain length, per domain
    (``final_eval_by_domain``) and pooled (``final_eval``); definitions in
    :mod:`dart_ray.training.metrics`."""
    ev = summary["final_eval"]
    by = summary.get("final_eval_by_domain") or {}
    lines = ["## Held-out accuracy (vs the target's argmax)", ""]
    for dom, e in [*sorted(by.items()), ("all", ev)] if by else [("all", ev)]:
        if by:
            lines += [f"**{dom}**"
                      + (f" ({e['n_prefixes']} prefixes)" if "n_prefixes" in e else ""), ""]
        lines += [*_level_table(e), ""]
    lines += ["| domain | chain_tau | 1 + sum prod top-1 | answers only: level-1 / level-2 top-1, "
              "chain_tau |", "|---|---|---|---|"]
    for dom, e in [*sorted(by.items()), ("all", ev)]:
        indep, a = e.get("chain_len_indep"), e.get("answer")
        ans = (" / ".join(f"{x:.3f}" for x in a["top1"][:2]) + f", {a['chain_tau']:.2f}"
               if a else "-")
        lines.append(f"| {dom} | **{e['chain_tau']:.2f}** | "
                     f"{'-' if indep is None else f'{indep:.2f}'} | {ans} |")
    lines += ["", ("Expected accepted length of a greedy chain: chain_tau = 1 + mean number of "
                   f"leading correct top-1 levels per prefix{chain_note}; the second column is the "
                   "same if levels were independent (1 + sum_k prod_{j<=k} top-1_j); the last over "
                   "the answers' prefixes only (what serving drafts after; the others count the "
                   "prompts' too). Trees accept more: see the measured tau below."), ""]
    if summary.get("held_out") is False:
        lines += ["(No held-out rows: measured on the last training sequences.)", ""]
    return lines


def ship_cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dart-ray ship",
                                description="package a trained drafter + N-gram model")
    p.add_argument("--run", required=True, help="train-drafter output directory")
    p.add_argument("--data", default=None,
                   help="self-distillation data (builds the N-gram model from its train split)")
    p.add_argument("--ngram", default=None,
                   help="an existing N-gram model directory instead of --data")
    p.add_argument("--model-id", default="SmolLM2-135M-Instruct")
    p.add_argument("--arch", default=None,
                   help="|".join(s.objective for s in method_specs() if s.objective)
                   + " (default: the run's)")
    p.add_argument("--command", default="make artifacts", help="the command recorded in the card")
    p.add_argument("--bench", action="append", help="bench JSON(s) to include in the card")
    p.add_argument("--notes", default=None,
                   help="markdown file put in the card after the command (e.g. the compute of "
                        "every sitting, data generation included)")
    a = p.parse_args(argv)
    ngram = a.ngram
    arch = a.arch
    if not arch:
        arch = json.loads((Path(a.run) / "train_summary.json").read_text()).get("arch", "dart")
    if ngram is None and a.data and arch == "dart":
        ngram = ngram_from_selfdistill(a.data, Path(a.run) / "ngram", model_id=a.model_id)
    notes = Path(a.notes).read_text() if a.notes else ""
    dest = ship(a.run, ngram, a.model_id, a.command, a.bench, arch=arch, notes=notes)
    print(f"shipped to {dest}")
    return 0
