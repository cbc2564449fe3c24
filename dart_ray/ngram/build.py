"""Build an :class:`NGramModel` from a text corpus with the target's tokenizer.

Input formats (``iter_texts``):

* ``.txt``     -- one text per paragraph: paragraphs are separated by one or more blank
  (whitespace-only) lines; each paragraph is yielded with its inner newlines kept and
  surrounding whitespace stripped. N-grams therefore never span two paragraphs.
* ``.jsonl``   -- one JSON object per line; the string field ``text_column`` is the text. A record
  without that field raises ``ValueError`` naming the file, line and column; ``null`` values are
  skipped; any other non-string value raises.
* ``.parquet`` -- the string column ``text_column`` (read in record batches with pyarrow); a
  missing column raises ``ValueError``; nulls are skipped.
* directories  -- recursed (sorted, deterministic order) for the three extensions above; other
  files are ignored.

Command line: ``python -m dart_ray.ngram.build CORPUS... --out DIR [--model PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from dart_ray.ngram.model import NGramModel

TEXT_EXTENSIONS: tuple[str, ...] = (".txt", ".jsonl", ".parquet")


# ----------------------------------------------------------------------------------------------
# reading texts
# ----------------------------------------------------------------------------------------------


def _expand_paths(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Resolve inputs to a list of files (directories recursed, sorted)."""
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found: list[Path] = []
            for root, dirs, names in os.walk(p):
                dirs.sort()
                for name in sorted(names):
                    if name.startswith("."):
                        continue
                    f = Path(root) / name
                    if f.suffix.lower() in TEXT_EXTENSIONS:
                        found.append(f)
            if not found:
                raise ValueError(
                    f"directory {p} contains no {'/'.join(TEXT_EXTENSIONS)} files"
                )
            files.extend(found)
        elif p.is_file():
            if p.suffix.lower() not in TEXT_EXTENSIONS:
                raise ValueError(
                    f"unsupported corpus file {p}: expected one of {', '.join(TEXT_EXTENSIONS)}"
                )
            files.append(p)
        else:
            raise FileNotFoundError(f"corpus path not found: {p}")
    return files


def _iter_txt(path: Path) -> Iterator[str]:
    """Paragraphs of a text file (blank-line separated)."""
    para: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                para.append(line)
            elif para:
                text = "".join(para).strip()
                para = []
                if text:
                    yield text
    if para:
        text = "".join(para).strip()
        if text:
            yield text


def _iter_jsonl(path: Path, column: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from e
            if not isinstance(rec, dict):
                raise ValueError(  # noqa: TRY004 - bad file content, not a bad argument
                    f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}"
                )
            if column not in rec:
                raise ValueError(
                    f"{path}:{lineno}: text column {column!r} missing "
                    f"(fields: {sorted(rec)[:10]})"
                )
            val = rec[column]
            if val is None:
                continue
            if not isinstance(val, str):
                raise ValueError(  # noqa: TRY004 - bad file content
                    f"{path}:{lineno}: column {column!r} must be a string, got {type(val).__name__}"
                )
            if val:
                yield val


def _iter_parquet(path: Path, column: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if column not in names:
        raise ValueError(f"{path}: text column {column!r} missing (columns: {names[:20]})")
    for batch in pf.iter_batches(columns=[column], batch_size=4096):
        for val in batch.column(0).to_pylist():
            if val is None:
                continue
            if not isinstance(val, str):
                raise ValueError(  # noqa: TRY004 - bad file content
                    f"{path}: column {column!r} must hold strings, got {type(val).__name__}"
                )
            if val:
                yield val


def iter_texts(
    paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str], text_column: str = "text"
) -> Iterator[str]:
    """Yield texts from .txt / .jsonl / .parquet files and directories (see module docstring).

    All paths are checked when this is called (FileNotFoundError / ValueError), before anything
    is read; per-record errors (missing column, bad JSON) raise while iterating.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    return _iter_files(_expand_paths(paths), text_column)


def _iter_files(files: list[Path], text_column: str) -> Iterator[str]:
    for f in files:
        ext = f.suffix.lower()
        if ext == ".txt":
            yield from _iter_txt(f)
        elif ext == ".jsonl":
            yield from _iter_jsonl(f, text_column)
        elif ext == ".parquet":
            yield from _iter_parquet(f, text_column)
        else:  # unreachable: _expand_paths filters extensions
            raise ValueError(f"unsupported corpus file {f}")


# ----------------------------------------------------------------------------------------------
# building
# ----------------------------------------------------------------------------------------------


def _tokenizer_vocab_size(tokenizer: Any) -> int:
    """Vocabulary size of a HF tokenizer (including added tokens)."""
    if hasattr(tokenizer, "__len__"):
        return len(tokenizer)
    vs = getattr(tokenizer, "vocab_size", None)
    if vs is None:
        raise TypeError(
            f"cannot determine vocabulary size of tokenizer {type(tokenizer).__name__}: "
            "it has neither __len__ nor vocab_size"
        )
    return int(vs)


def _describe(paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str]) -> str:
    if isinstance(paths, (str, os.PathLike)):
        return str(paths)
    return ", ".join(str(p) for p in paths)


def _tokenizer_name(tokenizer: Any) -> str:
    name = getattr(tokenizer, "name_or_path", None)
    return str(name) if name else type(tokenizer).__name__


def build_ngram(
    paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
    tokenizer: Any,
    order: int = 3,
    min_count: int = 1,
    text_column: str = "text",
    progress: bool = True,
    batch_size: int = 256,
    meta: dict[str, Any] | None = None,
    keep: Callable[[str], bool] | None = None,
) -> NGramModel:
    """Tokenise the corpus at ``paths`` with ``tokenizer`` and count its n-grams (of the texts
    ``keep`` accepts, when given).

    ``tokenizer(texts, add_special_tokens=False)["input_ids"]`` is called on batches of
    ``batch_size`` texts; each text is one sequence (n-grams never span two texts). ``meta`` is
    merged into the model's metadata (``tokenizer`` defaults to the tokenizer's name_or_path).
    Raises ValueError if the corpus yields no tokens.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    vocab_size = _tokenizer_vocab_size(tokenizer)
    texts = iter_texts(paths, text_column=text_column)
    if keep is not None:
        texts = filter(keep, texts)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(desc="tokenising", unit="text")

    n_texts = 0
    n_tokens = 0

    def sequences() -> Iterator[list[int]]:
        nonlocal n_texts, n_tokens
        batch: list[str] = []

        def run(batch: list[str]) -> list[list[int]]:
            ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
            if len(ids) != len(batch):
                raise ValueError(
                    f"tokenizer returned {len(ids)} sequences for a batch of {len(batch)} texts"
                )
            return list(ids)

        for text in texts:
            batch.append(text)
            if len(batch) >= batch_size:
                for ids in run(batch):
                    n_tokens += len(ids)
                    yield ids
                n_texts += len(batch)
                if bar is not None:
                    bar.update(len(batch))
                    bar.set_postfix(tokens=n_tokens, refresh=False)
                batch = []
        if batch:
            for ids in run(batch):
                n_tokens += len(ids)
                yield ids
            n_texts += len(batch)
            if bar is not None:
                bar.update(len(batch))
                bar.set_postfix(tokens=n_tokens, refresh=False)

    full_meta: dict[str, Any] = {"tokenizer": _tokenizer_name(tokenizer)}
    full_meta.update(meta or {})
    try:
        model = NGramModel.from_sequences(
            sequences(),
            order=order,
            min_count=min_count,
            vocab_size=vocab_size,
            progress=False,
            meta=full_meta,
        )
    finally:
        if bar is not None:
            bar.close()
    if model.num_tokens_trained == 0:
        raise ValueError(f"corpus {_describe(paths)} produced no tokens")
    model.meta["num_texts"] = n_texts
    return model


def build_ngram_cli(argv: list[str] | None = None) -> int:
    """``dart-ray``-style command: build an n-gram model directory from a corpus."""
    ap = argparse.ArgumentParser(
        prog="dart_ray.ngram.build",
        description="Build a token-id N-gram model (.npy + meta.json) from a text corpus.",
    )
    ap.add_argument("inputs", nargs="+", help=".txt/.jsonl/.parquet files or directories")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--order", type=int, default=3, help="n-gram order (context = order-1)")
    ap.add_argument("--min-count", type=int, default=1, help="prune entries with count < this")
    ap.add_argument("--text-column", default="text", help="text field for .jsonl/.parquet")
    ap.add_argument(
        "--model", default=None, help="target model path/id whose tokenizer to use (default model)"
    )
    ap.add_argument("--batch-size", type=int, default=256, help="texts per tokenizer call")
    ap.add_argument("--no-progress", action="store_true", help="disable progress bars")
    ap.add_argument("--keep-eval-prompts", action="store_true",
                    help="keep texts holding an evaluation prompt the project ships (HumanEval, "
                         "the chat sets; dropped by default: a model built on them inflates every "
                         "benchmark on them)")
    args = ap.parse_args(argv)

    from dart_ray.models import load_tokenizer

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    meta: dict[str, Any] = {"target": args.model, "inputs": [str(p) for p in args.inputs]}
    dropped = [0]
    if not args.keep_eval_prompts:
        from dart_ray.training.neardup import EvalFilter

        evals = EvalFilter()

        def keep(text: str) -> bool:
            if text in evals:
                dropped[0] += 1
                return False
            return True
    try:
        model = build_ngram(
            args.inputs,
            tokenizer,
            order=args.order,
            min_count=args.min_count,
            text_column=args.text_column,
            progress=not args.no_progress,
            batch_size=args.batch_size,
            meta=meta,
            keep=None if args.keep_eval_prompts else keep,
        )
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"dart-ray build-ngram: error: {e}", file=sys.stderr)
        return 2
    model.meta["evaluation_texts_dropped"] = None if args.keep_eval_prompts else dropped[0]
    out = model.save(args.out)
    dt = time.perf_counter() - t0
    print(f"n-gram model written to {out}")
    print(f"  tokenizer : {model.meta.get('tokenizer')}")
    print(f"  texts     : {model.meta.get('num_texts')}"
          + (f" ({dropped[0]} holding an evaluation prompt dropped)" if dropped[0] else ""))
    print(f"  tokens    : {model.num_tokens_trained}")
    for n, e in enumerate(model.num_entries, start=1):
        print(f"  order {n}   : {e} entries")
    print(f"  size      : {model.size_bytes() / 2**20:.2f} MB")
    print(f"  time      : {dt:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(build_ngram_cli())
