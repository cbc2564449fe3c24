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

MAX_MB = 25.0


def ngram_from_selfdistill(data_dir: str | Path, out: str | Path, order: int = 3, min_count: int = 2,
                           model_id: str = "") -> Path:
    """N-gram model over the TRAIN split of self-distillation data (prompts + target answers)."""
    from dart_ray.ngram import NGramModel
    from dart_ray.training.gen_data import load_sequences

    seqs = [s for s, _ in load_sequences(data_dir, "train")]
    vocab = max(max(s) for s in seqs) + 1
    model = NGramModel.from_sequences(seqs, order=order, min_count=min_count, vocab_size=max(vocab, 49152),
                                      meta={"source": f"self-distillation train split of {data_dir}",
                                            "target": model_id})
    model.save(out)
    return Path(out)


def _dir_mb(p: Path) -> float:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 2**20


TITLES = {"dart": "DART drafter and N-gram model", "eagle": "EAGLE-style drafter (baseline)",
          "medusa": "Medusa heads (baseline)", "sps": "SpS draft model (baseline)"}
CONFIG_FILES = {"dart": "dart_config.json", "eagle": "dart_config.json", "medusa": "medusa_config.json",
                "sps": "sps_config.json"}


def ship(run_dir: str | Path, ngram_dir: str | Path | None, model_id: str, command: str,
         bench_json: list[str] | None = None, dest_root: Path | None = None, arch: str | None = None) -> Path:
    """Copy a trained drafter (and for DART the N-gram model) into the package with a card.

    DART goes to ``<model_id>/drafter`` with ``<model_id>/CARD.md``; a baseline arch to
    ``<model_id>/<arch>/`` with its card inside. ``arch`` defaults to the run's own.
    """
    from dart_ray.drafters import ARTIFACT_NAMES, default_artifact_dir

    run = Path(run_dir)
    summary = json.loads((run / "train_summary.json").read_text())
    arch = arch or summary.get("arch") or summary["config"].get("arch", "dart")
    if arch not in ARTIFACT_NAMES:
        raise ValueError(f"unknown arch {arch!r}")
    dest = (dest_root / model_id) if dest_root else default_artifact_dir(model_id)
    dest.mkdir(parents=True, exist_ok=True)
    sizes = {}
    src = run / "drafter"
    if not (src / CONFIG_FILES[arch]).is_file():
        raise FileNotFoundError(f"no trained {arch} drafter in {src}")
    target_dir = dest / ARTIFACT_NAMES[arch]
    if target_dir.exists():
        shutil.rmtree(target_dir)
    shutil.copytree(src, target_dir)
    sizes[ARTIFACT_NAMES[arch]] = _dir_mb(target_dir)
    if ngram_dir and arch == "dart":
        if (dest / "ngram").exists():
            shutil.rmtree(dest / "ngram")
        shutil.copytree(ngram_dir, dest / "ngram")
        sizes["ngram"] = _dir_mb(dest / "ngram")
    too_big = {k: v for k, v in sizes.items() if v > MAX_MB}
    if too_big:
        raise ValueError(f"shipped artifacts over {MAX_MB} MB: {too_big}")
    ev = summary["final_eval"]
    cfg = summary["config"]
    keys = ("arch", "depth", "gamma", "lr", "epochs", "max_steps", "seqs_per_step", "max_len", "draft_vocab",
            "teacher_topk") + (("sps_layers",) if arch == "sps" else ())
    joint = summary.get("joint_with") or []
    lines = [f"# {TITLES[arch]} for {model_id}", "",
             "Produced by this project's own commands (no third-party weights):", "", "```bash", command, "```", "",
             "## Data",
             "Self-distillation: the target answered an offline prompt corpus (`dart_ray/training/corpus.py`): "
             "function headers + docstrings cut from the Python standard library (code) and instructions from "
             "templates x topics (chat). Plus teacher-only text (`gen-data --text-tokens`): 320-token chunks of "
             "Python standard-library source, trained against the target's own distributions at every position "
             "(no generation needed). HumanEval and the project's chat evaluation set are excluded (exact and "
             "normalised prompt match; text chunks containing any HumanEval function signature are dropped). "
             "Held-out split by prompt hash.", "",
             "![training curves](training.png)", "",
             f"- training sequences: {summary['train_seqs']}, held-out: {summary['val_seqs']}",
             f"- optimizer steps: {summary['steps']}; this drafter's training compute (its updates + its share of "
             f"the teacher pass): {summary['train_wall_s'] / 60:.1f} min"
             + (f"; trained jointly with {', '.join(joint)} on the same batches" if joint else ""),
             f"- config: `{json.dumps({k: cfg.get(k) for k in keys})}`",
             "- sizes: " + ", ".join(f"{k} {v:.1f} MB" for k, v in sizes.items()), "",
             "## Held-out accuracy (vs the target's argmax)", "",
             "| level | " + " | ".join(str(i + 1) for i in range(len(ev["top1"]))) + " |",
             "|---|" + "---|" * len(ev["top1"]),
             "| top-1 | " + " | ".join(f"{a:.3f}" for a in ev["top1"]) + " |",
             "| top-5 | " + " | ".join(f"{a:.3f}" for a in ev["top5"]) + " |", "",
             "Expected accepted length of a greedy chain (1 + leading correct levels"
             + (f", chains of {cfg['depth']} draft-model tokens" if arch == "sps" else "")
             + f"): **{ev['chain_tau']:.2f}** (trees accept more: see the measured tau below).", ""]
    for bj in bench_json or []:
        rep = json.loads(Path(bj).read_text())
        from dart_ray.bench.runner import format_table

        c = rep["config"]
        lines += [f"## Measured: `{Path(bj).name}` ({c['n_prompts']} prompts, bs {c['batch_size']}, {c['dtype']}, "
                  f"{c['max_new_tokens']} new tokens)", "", format_table(rep), ""]
    card_dir = dest if arch == "dart" else target_dir
    if (run / "training.png").is_file():
        shutil.copy(run / "training.png", card_dir / "training.png")
    (card_dir / "CARD.md").write_text("\n".join(lines))
    return dest


def ship_cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dart-ray ship", description="package a trained drafter + N-gram model")
    p.add_argument("--run", required=True, help="train-drafter output directory")
    p.add_argument("--data", default=None, help="self-distillation data (builds the N-gram model from its train split)")
    p.add_argument("--ngram", default=None, help="an existing N-gram model directory instead of --data")
    p.add_argument("--model-id", default="SmolLM2-135M-Instruct")
    p.add_argument("--arch", default=None, help="dart|eagle|medusa|sps (default: the run's)")
    p.add_argument("--command", default="make artifacts", help="the command recorded in the card")
    p.add_argument("--bench", action="append", help="bench JSON(s) to include in the card")
    a = p.parse_args(argv)
    ngram = a.ngram
    arch = a.arch or json.loads((Path(a.run) / "train_summary.json").read_text()).get("arch", "dart")
    if ngram is None and a.data and arch == "dart":
        ngram = ngram_from_selfdistill(a.data, Path(a.run) / "ngram", model_id=a.model_id)
    dest = ship(a.run, ngram, a.model_id, a.command, a.bench, arch=arch)
    print(f"shipped to {dest}")
    return 0
