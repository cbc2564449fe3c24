"""Self-distillation data: the target answers the corpus prompts (resumable parquet shards).

Each shard ``shard-NNNNN.parquet`` holds complete rows and is written atomically (temp file +
rename), so an interrupted run resumes at the first missing shard. Generation uses the project's
own engine; speculative methods are lossless, so ``method="ngram"`` yields exactly the target's
greedy answers, only faster.

Columns: prompt (str), source (code|chat|text), chat (bool), prompt_ids (list<int32>),
response_ids (list<int32>), split (train|val; by a hash of the prompt), category (str; the
self-instruct seed category, "" otherwise), followup (str; the second user turn of a multi-turn row,
"" otherwise). Shards written before the last two columns existed read the same.

Multi-turn rows (self-instruct prompts marked ``multi_turn``): the target answers turn 1, then
writes a follow-up user turn that refers to its own answer
(:func:`~dart_ray.training.selfinstruct.followup_meta_prompt`, cleaned like every generated
request, must refer back (:func:`~dart_ray.training.selfinstruct.refers_back`) and must not be
near an evaluation prompt), then answers it; ``prompt_ids`` is the chat template over
[user, assistant, user] and ``response_ids`` the second answer, so one row teaches both turns. A
follow-up that fails these checks leaves the row single-turn.

**Evaluation answers** (``eval_prompts``, ``gen-data --eval-prompts chat``): the target's greedy
answers to an evaluation prompt set (the chat set, HumanEval, a file), every row in the ``val``
split and the directory marked (:data:`EVAL_MARKER`), so ``scripts/eval_drafters.py --data DIR``
and ``train-drafter --eval-data DIR`` score drafters on requests written apart from any training
prompt, and ``train-drafter --data DIR`` is refused. A held-out split of self-instruct rows shares
their generator's distribution (same categories, near-duplicate answers); these do not.

``corpus.json`` in the output directory records the prompt list's hash: resuming with another
corpus (other counts, seed or prompt directory) is refused instead of mixing two corpora.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

SCHEMA_COLUMNS = ("prompt", "source", "chat", "prompt_ids", "response_ids", "split", "category",
                  "followup")
DOMAINS = {"chat": "chat", "code": "code", "text": "text"}
"""Evaluation domain of each row source. Teacher-only stdlib text is its own domain: it is source
code people wrote, where the target's argmax is far harder to predict than on the code the target
writes itself (what the drafter meets when serving), so pooling it with ``code`` would measure the
text, not the drafter's serving accuracy on code."""


SPLITS = ("train", "val")
"""The splits a row can be in (:func:`split_of`)."""

EVAL_MARKER = "eval_set.json"
"""Written into a directory of evaluation answers: what it answers; no training run reads it."""


def eval_corpus(prompts: str) -> list[dict]:
    """Rows of the evaluation prompt set ``prompts`` (``chat``, ``humaneval`` or a file; see
    :func:`dart_ray.bench.prompts.load_prompts`): HumanEval's prompts are code continued without
    the chat template (as ``dart-ray bench`` runs them), every other set is chat."""
    from dart_ray.bench.prompts import load_prompts

    code = str(prompts) == "humaneval"
    return [{"prompt": p, "source": "code" if code else "chat", "chat": not code, "split": "val"}
            for p in load_prompts(prompts)]


def split_of(prompt: str, val_frac: float) -> str:
    h = int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "val" if h < val_frac else "train"


def generate_data(out_dir: str | Path, n_code: int = 1500, n_chat: int = 500,
                  max_new_tokens: int = 128, batch_size: int = 16, temperature: float = 0.0,
                  model: str | None = None, dtype: str = "bf16", method: str = "ngram",
                  shard_size: int = 64, seed: int = 0, val_frac: float = 0.05, threads: int
                  | None = None, progress: bool = True, corpus: list[dict] | None = None,
                  max_shards: int | None = None, prompts_dir: str | Path | None = None,
                  followup_temperature: float = 0.7, engine=None, device: str = "cpu",
                  exclude_data: str | Path | None = None, only_split: str | None = None,
                  eval_prompts: str | None = None) -> Path:
    """Generate target answers for ``corpus`` (default: :func:`build_corpus`, its chat half from
    ``prompts_dir`` when given) into parquet shards (only the first ``max_shards`` shards when
    given: a budgeted run that a later call may extend). ``method``: the engine's method (any is
    exact under greedy decoding; ``none`` where speculation does not pay, e.g. large batches on a
    GPU); ``device``: where the target runs. ``exclude_data``: data directories (one, or a comma
    list) whose prompts are answered already (e.g. by a run on another machine): their rows are
    left out of this corpus, so ``train-drafter --data THIS,THAT`` trains on both without
    duplicates. ``only_split``: answer only the prompts whose hash puts them in that split (``val``:
    a bigger held-out set that no training run can have seen, at ``val_frac`` of the cost of
    answering everything; ``train``: rows that add nothing to the held-out set).
    ``eval_prompts``: answer that evaluation prompt set instead (:func:`eval_corpus`), every row
    ``val``, the directory marked as evaluation answers (see the module docstring)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dart_ray import Engine, EngineConfig, SamplingParams
    from dart_ray.training.corpus import build_corpus
    from dart_ray.training.neardup import EvalFilter

    out = Path(out_dir)
    if eval_prompts is not None and (corpus is not None or prompts_dir is not None
                                     or exclude_data or only_split):
        raise ValueError("eval_prompts answers an evaluation set alone: no corpus, prompts_dir, "
                         "exclude_data or only_split with it")
    _check_eval_marker(out, eval_prompts)
    out.mkdir(parents=True, exist_ok=True)
    evals = None  # the evaluation prompts (built once: the corpus and the follow-ups check them)
    marker = None
    if eval_prompts is not None:
        rows = eval_corpus(eval_prompts)
        marker = json.dumps({"prompts": str(eval_prompts), "rows": len(rows)})
    elif corpus is not None:
        rows = corpus
    else:
        chat_rows = None
        if prompts_dir is not None:
            from dart_ray.training.selfinstruct import load_prompt_rows

            chat_rows = load_prompt_rows(prompts_dir)
        evals = EvalFilter()
        rows = build_corpus(n_code, n_chat, seed, chat_rows=chat_rows, eval_filter=evals)
    if exclude_data:
        answered = answered_prompts(exclude_data)
        rows = [r for r in rows if r["prompt"] not in answered]
    if only_split is not None:
        if only_split not in SPLITS:
            raise ValueError(f"only_split must be one of {SPLITS}, not {only_split!r}")
        rows = [r for r in rows if split_of(r["prompt"], val_frac) == only_split]
    _check_corpus_manifest(out, rows, shard_size)
    if marker is not None and not (out / EVAL_MARKER).is_file():
        (out / EVAL_MARKER).write_text(marker)      # after the checks: a refused run marks nothing
    shards = [rows[i:i + shard_size] for i in range(0, len(rows), shard_size)][:max_shards]
    todo = [i for i in range(len(shards)) if not (out / f"shard-{i:05d}.parquet").is_file()]
    if not todo:
        return out
    if evals is None and any(r.get("multi_turn") for r in rows):
        evals = EvalFilter()
    if engine is None:
        engine = Engine.from_config(EngineConfig(model=model, method=method, ngram="none",
                                                 dtype=dtype, device=device,
                                                 max_batch_size=batch_size, num_threads=threads))
    from dart_ray.training.selfinstruct import check_generation, engine_generation

    check_generation(out, {**engine_generation(engine), "max_new_tokens": max_new_tokens,
                           "temperature": temperature, "followup_temperature": followup_temperature,
                           "seed": seed, "val_frac": val_frac},
                     has_rows=len(todo) < len(shards))
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
            ids = [engine.encode_prompt(r["prompt"], chat) for r in part]  # tokenised once
            comps = engine.generate(ids, params)
            follow = (_followups(engine, part, comps, params, seed * 1_000_003 + i,
                                 followup_temperature, evals)
                      if chat else {})
            for k, (r, p_ids, c) in enumerate(zip(part, ids, comps, strict=True)):
                rec = {"prompt": r["prompt"], "source": r["source"], "chat": chat,
                       "prompt_ids": p_ids,
                       "response_ids": c.token_ids,
                       "split": r.get("split") or split_of(r["prompt"], val_frac),
                       "category": r.get("category", ""), "followup": ""}
                if k in follow:
                    rec.update(follow[k])
                recs.append(rec)
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


def answered_prompts(data_dirs: str | Path) -> set[str]:
    """The prompts of every self-distillation shard in ``data_dirs`` (a directory or a comma list,
    as :func:`data_files` reads them; teacher-only text rows are not answers)."""
    import pyarrow.parquet as pq

    try:
        files = data_files(data_dirs)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e} (--exclude-data)") from e
    out: set[str] = set()
    for f in files:
        if f.name.startswith("shard-"):
            out.update(pq.read_table(f, columns=["prompt"]).column("prompt").to_pylist())
    return out


def _followups(engine, part: list[dict], comps, params, seed: int, temperature: float,
               evals) -> dict[int, dict]:
    """Second turns of the multi-turn rows of ``part`` (answered in ``comps``; the follow-up is
    sampled at ``temperature``, answered with ``params`` like turn 1; a follow-up is a new user
    prompt, so it too must not be in ``evals``, the :class:`~dart_ray.training.neardup.EvalFilter`):
    index in ``part`` -> the row fields that change (followup, prompt_ids of the conversation,
    response_ids)."""
    from dart_ray import SamplingParams
    from dart_ray.training.selfinstruct import clean_request, followup_meta_prompt, refers_back

    idx = [k for k, r in enumerate(part) if r.get("multi_turn") and comps[k].text.strip()]
    if not idx:
        return {}
    metas = [followup_meta_prompt(part[k]["prompt"], comps[k].text) for k in idx]
    sp = [SamplingParams(max_new_tokens=64, temperature=temperature, top_p=0.95, seed=seed + k,
                         stop=("\n",))
          for k in idx]
    convs = {}
    for k, c in zip(idx, engine.generate(metas, sp), strict=True):
        text = clean_request(c.text) if c.finish_reason == "stop" else None
        if text is not None and refers_back(text, part[k]["prompt"],
                                            comps[k].text) and text not in evals:
            convs[k] = [{"role": "user", "content": part[k]["prompt"]},
                        {"role": "assistant", "content": comps[k].text.strip()},
                        {"role": "user", "content": text}]
    if not convs:
        return {}
    keys = sorted(convs)
    ids = [engine.encode_prompt(convs[k], True) for k in keys]  # the chat template, once
    answers = engine.generate(ids, params)
    return {k: {"followup": convs[k][2]["content"], "prompt_ids": p_ids,
                "response_ids": a.token_ids}
            for k, p_ids, a in zip(keys, ids, answers, strict=True)}


def _check_corpus_manifest(out: Path, rows: list[dict], shard_size: int) -> None:
    """Refuse to resume ``out`` with another corpus than the one its shards were made from."""
    h = hashlib.sha256(json.dumps([[r["prompt"], r["chat"], bool(r.get("multi_turn"))]
                                   for r in rows]).encode())
    want = {"rows": len(rows), "shard_size": shard_size, "sha256": h.hexdigest()}
    f = out / "corpus.json"
    if f.is_file():
        have = json.loads(f.read_text())
        if have != want:
            raise ValueError(f"{out} holds shards of another corpus ({have['rows']} rows, shard "
                             f"size {have['shard_size']}; now {want['rows']}, {shard_size}): use a "
                             "new --out, or the same --n-code/--n-chat/--seed/--prompts as the run "
                             "that made it")
    else:
        if any(out.glob("shard-*.parquet")):
            print(f"warning: {out} has shards but no corpus.json (made before it existed); cannot "
                  "check that they come from this corpus")
        tmp = out / ".corpus.json.tmp"
        tmp.write_text(json.dumps(want))
        os.replace(tmp, f)


def data_files(data_dir: str | Path) -> list[Path]:
    """The shards of ``data_dir`` -- one directory, or a comma list of them (data made in parts,
    e.g. on two machines: ``gen-data --exclude-data`` keeps them disjoint) -- in a stable order:
    per directory, its ``shard-*`` then its ``text-*`` files."""
    files: list[Path] = []
    for d in [x for x in str(data_dir).split(",") if x]:
        data = Path(d)
        found = sorted(data.glob("shard-*.parquet")) + sorted(data.glob("text-*.parquet"))
        if not found:
            raise FileNotFoundError(f"no shard-*.parquet in {d}; run `dart-ray gen-data` first")
        files += found
    if not files:
        raise FileNotFoundError(f"no data directory in {data_dir!r}")
    return files


def load_sequences(data_dir: str | Path, split: str) -> list[tuple[list[int], int]]:
    """(prompt + response ids, prompt length) for every row of ``split``."""
    return [(ids, n) for ids, n, _ in load_rows(data_dir, split)]


def load_rows(data_dir: str | Path, split: str) -> list[tuple[list[int], int, str]]:
    """(prompt + response ids, prompt length, domain) for every row of ``split``; the domain is
    ``chat``, ``code`` (the target's answers to code prompts) or ``text`` (:data:`DOMAINS`), tagged
    with the set's name in a directory of evaluation answers (:func:`eval_set_tag`)."""
    import pyarrow.parquet as pq

    if split == "train":
        marked = [d for d in str(data_dir).split(",") if d and eval_set_of(d) is not None]
        if marked:
            raise ValueError(f"{', '.join(marked)}: evaluation answers (gen-data --eval-prompts), "
                             "never training data; pass them as --eval-data")
    files = data_files(data_dir)
    tags = {d: eval_set_tag(d) for d in {f.parent for f in files}}     # read each marker once
    out = []
    for f in files:
        tag = tags[f.parent]
        t = pq.read_table(f, columns=["prompt_ids", "response_ids", "split", "source"]).to_pydict()
        for p, r, s, src in zip(t["prompt_ids"], t["response_ids"], t["split"], t["source"],
                                strict=True):
            if s == split and len(r) >= 2:
                out.append((list(p) + list(r), len(p), DOMAINS.get(src, "chat") + tag))
    return out


def _check_eval_marker(out: Path, eval_prompts: str | None) -> None:
    """Refuse to write training rows into a directory of evaluation answers, evaluation answers
    into a directory of training data, or one evaluation set's answers into another's."""
    have = eval_set_of(out)
    if eval_prompts is None:
        if have is not None:
            raise ValueError(f"{out} holds evaluation answers; use a new --out for training data")
        return
    if have is not None:
        if have != str(eval_prompts):
            raise ValueError(f"{out} holds the evaluation answers of {have!r}, not "
                             f"{eval_prompts!r}; use a new --out")
    elif any(out.glob("shard-*.parquet")) or any(out.glob("text-*.parquet")):
        raise ValueError(f"{out} holds training data; evaluation answers need a new --out")


def eval_set_tag(data_dir: str | Path) -> str:
    """``"@NAME"`` for a directory of evaluation answers to the prompt set NAME (its rows are their
    own evaluation domain, e.g. ``chat@chat-probe``, apart from a training data's held-out split),
    ``""`` for training data."""
    name = eval_set_of(data_dir)
    return "" if name is None else "@" + Path(name).stem


def eval_set_of(data_dir: str | Path) -> str | None:
    """The evaluation prompt set a directory answers (its :data:`EVAL_MARKER`), None for training
    data."""
    marker = Path(data_dir) / EVAL_MARKER
    return json.loads(marker.read_text())["prompts"] if marker.is_file() else None


def describe_data(data_dir: str | Path) -> dict:
    """Row counts of a data directory: by source, self-instruct rows, two-turn rows (for the
    card)."""
    import pyarrow.parquet as pq

    out = {"rows_by_source": {}, "self_instruct_rows": 0, "multi_turn_rows": 0}
    for f in data_files(data_dir):
        names = pq.read_schema(f).names
        t = pq.read_table(f, columns=[c for c in ("source", "category", "followup")
                                      if c in names]).to_pydict()
        for src in t["source"]:
            out["rows_by_source"][src] = out["rows_by_source"].get(src, 0) + 1
        out["self_instruct_rows"] += sum(1 for c in t.get("category", []) if c)
        out["multi_turn_rows"] += sum(1 for c in t.get("followup", []) if c)
    return out


def write_text_corpus(out_dir: str | Path, n_tokens: int, model: str | None = None,
                      chunk_len: int = 320, seed: int = 0, val_frac: float = 0.02) -> Path:
    """Raw-text training rows (no generation): chunks of Python source from the standard library.

    The drafter is trained against the target's own distributions on every position, so text the
    target did not write still teaches it (the teacher pass is ~5x cheaper than generating). Chunks
    that contain the signature of any HumanEval function, or are near-duplicates of any evaluation
    prompt (:class:`~dart_ray.training.neardup.EvalFilter`), are dropped. Written as
    ``text-00000.parquet`` with the same columns as the self-distillation shards (``source=text``,
    the chunk in ``response_ids``), so ``load_sequences`` reads both.
    """
    import random
    import sysconfig

    _check_eval_marker(Path(out_dir), None)

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
    from dart_ray.training.neardup import EvalFilter

    evals = EvalFilter()
    tok = load_tokenizer(model)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts
                   and "idlelib" not in p.parts)
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
            if any(f"def {name}(" in body for name in banned) or body in evals:
                continue
            recs.append({"prompt": f"{f.name}:{i}", "source": "text", "chat": False,
                         "prompt_ids": [], "response_ids": chunk,
                         "split": split_of(f"{f.name}:{i}", val_frac), "category": "",
                         "followup": ""})
            total += len(chunk)
        if total >= n_tokens:
            break
    table = pa.table({k: [r[k] for r in recs] for k in SCHEMA_COLUMNS})
    tmp = out / ".text-00000.parquet.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, dst)
    return dst
