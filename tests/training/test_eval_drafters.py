"""scripts/eval_drafters.py on a directory of evaluation answers (gen-data --eval-prompts): scored
as its own domain, never read as training rows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("eval_drafters",
                                                  ROOT / "scripts" / "eval_drafters.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_eval_drafters_scores_evaluation_answers_as_their_own_domain(tmp_path):
    from dart_ray import Engine, EngineConfig
    from dart_ray.training.gen_data import generate_data

    f = tmp_path / "probe.jsonl"
    prompts = ["How do hot air balloons go up and come down?", "Write a haiku about a lake."]
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    eng = Engine.from_config(EngineConfig(method="none", dtype="fp32", max_batch_size=2))
    data = generate_data(tmp_path / "ev", max_new_tokens=24, engine=eng, progress=False,
                         eval_prompts=str(f))
    shipped = ROOT / "dart_ray/artifacts/SmolLM2-135M-Instruct/drafter"
    out = tmp_path / "eval.json"
    assert _script().main(["--data", str(data), "--dtype", "fp32", "--eval-seqs", "8",
                           "--out", str(out), f"v={shipped}"]) == 0
    res = json.loads(out.read_text())
    assert res["held_out_seqs"] == {"chat@probe": 2}
    ev = res["drafters"]["v"]["chat@probe"]
    # the shipped drafter predicts the target's own plain answers well above chance at level 1
    assert ev["answer"]["n_prefixes"] >= 20 and 0.2 < ev["answer"]["top1"][0] <= 1.0
    with pytest.raises(ValueError, match="evaluation answers"):
        _script().main(["--data", str(data), "--split", "train", f"v={shipped}"])


def test_eval_drafters_refuses_a_drafter_of_another_target(tmp_path, tiny_dirs):
    """--model names the drafters' target; a drafter trained for another one is refused by name
    before any data is read (it crashed inside a forward with a shape error)."""
    shipped = ROOT / "dart_ray/artifacts/SmolLM2-135M-Instruct/drafter"
    with pytest.raises(SystemExit, match="v=.*does not match the target.*pass its target"):
        _script().main(["--data", str(tmp_path / "none"), "--dtype", "fp32", "--model",
                        str(tiny_dirs["llama"]), f"v={shipped}"])
