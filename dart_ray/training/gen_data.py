"""Self-distillation data: the target answers the corpus prompts (resumable parquet shards).

Each shard ``shard-NNNNN.parquet`` holds complete rows and is written atomically (temp file +
rename), so an interrupted run resumes at the first missing shard. Generation uses the project's
own engine; speculative methods are lossless, so ``method="ngram"`` yields exactly the target's
greedy answers, only faster.

Columns: prompt (str), source (code|chat), chat (bool), prompt_ids (list<int32>),
response_ids (list<int32>), split (train|val; by a hash of the prompt).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SCHEMA_COLUMNS = ("prompt", "source", "chat", "prompt_ids", "response_ids", "split")


def split_of(prompt: str, val_frac: float) -> str:
    h = int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "val" if h < val_frac else "train"


def generate_data(out_dir: str | Path, n_code: int = 1500, n_chat: int = 500, max_new_tokens: int = 128,
                  batch_size: int = 16, temperature: float = 0.0, model: str | None = None, dtype: str = "bf16",
                  method: str = "ngram", shard_size: int = 64, seed: int = 0, val_frac: float = 0.05,
                  threads: int | None = None, progress: bool = True, corpus: list[dict] | None = None,
                  max_shards: int | None = None) -> Path:
    """Generate target answers for ``corpus`` (default: :func:`build_corpus`) into parquet shards
    (only the first ``max_shards`` shards when given: a budgeted run that a later call may extend)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dart_ray import Engine, EngineConfig, SamplingParams
    from dart_ray.training.corpus import build_corpus

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = corpus if corpus is not None else build_corpus(n_code, n_chat, seed)
    shards = [rows[i:i + shard_size] for i in range(0, len(rows), shard_size)][:max_shards]
    todo = [i for i in range(len(shards)) if not (out / f"shard-{i:05d}.parquet").is_file()]
    if not todo:
        return out
    engine = Engine.from_config(EngineConfig(model=model, method=method, ngram="none", dtype=dtype,
                                             max_batch_size=batch_size, num_threads=threads))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(len(shards[i]) for i in todo), desc="self-distill", unit="prompt")
    for i in todo:
        shard = shards[i]
        recs = []
        for chat in (False, True):
            part = [r for r in shard if r["chat"] == chat]
            if not part:
                continue
            texts = [r["prompt"] for r in part]
            comps = engine.generate(texts, params, chat=chat)
            for r, c in zip(part, comps):
                recs.append({"prompt": r["prompt"], "source": r["source"], "chat": chat,
                             "prompt_ids": engine.encode_prompt(r["prompt"], chat), "response_ids": c.token_ids,
                             "split": split_of(r["prompt"], val_frac)})
            if bar is not None:
                bar.update(len(part))
        table = pa.table({k: [r[k] for r in recs] for k in SCHEMA_COLUMNS})
        dst = out / f"shard-{i:05d}.parquet"
        tmp = out / f".shard-{i:05d}.parquet.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, dst)
    if bar is not None:
        bar.close()
    return out


def load_sequences(data_dir: str | Path, split: str) -> list[tuple[list[int], int]]:
    """(prompt + response ids, prompt length) for every row of ``split``."""
    import pyarrow.parquet as pq

    files = sorted(Path(data_dir).glob("shard-*.parquet")) + sorted(Path(data_dir).glob("text-*.parquet"))
    if not files:
        raise FileNotFoundError(f"no shard-*.parquet in {data_dir}; run `dart-ray gen-data` first")
    out = []
    for f in files:
        t = pq.read_table(f, columns=["prompt_ids", "response_ids", "split"]).to_pydict()
        for p, r, s in zip(t["prompt_ids"], t["response_ids"], t["split"]):
            if s == split and len(r) >= 2:
                out.append((list(p) + list(r), len(p)))
    return out


def write_text_corpus(out_dir: str | Path, n_tokens: int, model: str | None = None, chunk_len: int = 320,
                      seed: int = 0, val_frac: float = 0.02) -> Path:
    """Raw-text training rows (no generation): chunks of Python source from the standard library.

    The drafter is trained against the target's own distributions on every position, so text the
    target did not write still teaches it (the teacher pass is ~5x cheaper than generating). Chunks
    that contain the signature of any HumanEval function are dropped. Written as
    ``text-00000.parquet`` with the same columns as the self-distillation shards (``source=text``,
    the chunk in ``response_ids``), so ``load_sequences`` reads both.
    """
    import random
    import sysconfig

    import pyarrow as pa
    import pyarrow.parquet as pq

    from dart_ray.models import load_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dst = out / "text-00000.parquet"
    if dst.is_file():
        return dst
    banned: set[str] = set()
    try:
        import re

        from dart_ray.bench.prompts import humaneval_prompts

        for p in humaneval_prompts():
            banned |= set(re.findall(r"def (\w+)\(", p))
    except FileNotFoundError:
        pass
    tok = load_tokenizer(model)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "idlelib" not in p.parts)
    random.Random(seed).shuffle(files)
    recs, total = [], 0
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for i in range(0, len(ids) - 32, chunk_len):
            chunk = ids[i:i + chunk_len]
            body = tok.decode(chunk)
            if any(f"def {name}(" in body for name in banned):
                continue
            recs.append({"prompt": f"{f.name}:{i}", "source": "text", "chat": False, "prompt_ids": [],
                         "response_ids": chunk, "split": split_of(f"{f.name}:{i}", val_frac)})
            total += len(chunk)
        if total >= n_tokens:
            break
    table = pa.table({k: [r[k] for r in recs] for k in SCHEMA_COLUMNS})
    tmp = out / ".text-00000.parquet.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, dst)
    return dst
