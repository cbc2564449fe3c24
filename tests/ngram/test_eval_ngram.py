"""scripts/eval_ngram.py: every answer token scored after the tokens before it (prompt tokens never
scored, contexts padded with -1 at the start)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from dart_ray.ngram import NGramModel

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("eval_ngram", ROOT / "scripts" / "eval_ngram.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_answer_positions_and_scores_by_hand():
    mod = _script()
    ctx, tok = mod.answer_positions([([7, 1, 2], 1, "chat"), ([5, 6], 0, "chat")], 2)
    assert ctx.tolist() == [[-1, 7], [7, 1], [-1, 5]] and tok.tolist() == [1, 2, 6]
    m = NGramModel.from_sequences([[1, 2, 3, 1, 2, 3]], order=3, min_count=1, vocab_size=10)
    # answers after the prompt [1, 2]: 3 (seen twice after 1 2), 1, 2 (each seen once after its
    # context), 4 (never seen: no probability at any order)
    got = mod.score(m, [([1, 2, 3, 1, 2, 4], 2, "chat")])
    assert got == {"tokens": 4, "top1": 0.75, "top4": 0.75, "covered": 0.75, "mean_p": 0.75}
    with pytest.raises(SystemExit):
        mod.main(["--data", "nowhere", "x=" + str(ROOT / "missing")])
