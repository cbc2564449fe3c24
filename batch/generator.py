"""DartGenerator: a callable class for ``Dataset.map_batches`` that runs the dart-ray engine.

Use it in your own Ray Data pipelines::

    import ray
    from batch import DartGenerator

    ds = ray.data.read_parquet("prompts.parquet")
    ds = ds.map_batches(
        DartGenerator,
        fn_constructor_kwargs={"engine_config": {"method": "dart", "dtype": "bf16"},
                               "prompt_column": "prompt", "max_new_tokens": 128},
        batch_size=32, concurrency=2, num_cpus=4)   # one engine (weights loaded once) per actor
    ds.write_parquet("out/")

Each call takes a batch (pyarrow Table, pandas DataFrame or dict of numpy arrays), keeps its
columns and adds :data:`OUTPUT_COLUMNS`. A bad row -- null, empty or non-string prompt, prompt
longer than the context -- gets its ``error`` set and null outputs; it never fails the batch. A
failure of the engine itself (an exception from ``Engine.generate``) is no row's fault: it fails
the whole batch with :class:`EngineFailure`, so no row is recorded as done and the batch can be
retried.

Valid prompts are tokenised once, checked with the engine's own ``check_prompt`` (``generate`` of a
list is all or nothing), then decoded together by ``Engine.generate`` (continuous batching, up to
``max_batch_size`` rows at a time). Greedy outputs equal a single-prompt ``Engine.generate``
(what ``dart-ray generate`` runs) exactly in fp32. In bf16 the logits depend on the verify
forward's shape: rows decoded together round differently, and the adaptive controller's tree
sizes depend on what it measured on the rows an actor decoded before, so a row can part ways at a
near-tie (also between a resumed and an uninterrupted job). bf16 outputs match single requests
bit for bit only with ``max_batch_size=1`` and ``adaptive=False`` on both sides.
With ``seed`` set, row r samples with seed ``row_seed(seed, id_r)``; sampling is position-keyed
(:mod:`dart_ray.verify.randomness`), so sampled outputs do not depend on how rows were batched,
on the tree sizes the adaptive controller chose or on a resume (in bf16 with the caveat above).

This module imports no Ray: the class is plain Python and can be tested without a cluster.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from dart_ray import (
    DecodingConfig,
    DecodingSchedule,
    Engine,
    EngineConfig,
    SamplingParams,
    load_profile,
)
from dart_ray.config import warn_renamed
from dart_ray.profiles import check_profile_hardware

log = logging.getLogger(__name__)

OUTPUT_SCHEMA = pa.schema([
    ("generated_text", pa.string()),
    ("num_prompt_tokens", pa.int64()),
    ("num_completion_tokens", pa.int64()),
    ("finish_reason", pa.string()),
    ("mean_accepted_len", pa.float64()),
    ("latency_s", pa.float64()),
    ("error", pa.string()),
])
OUTPUT_COLUMNS: tuple[str, ...] = tuple(OUTPUT_SCHEMA.names)
"""Columns DartGenerator adds. ``error`` is null for a generated row and a message for a bad row
(whose other outputs are null, except ``num_prompt_tokens`` when the prompt could be tokenised).
``latency_s`` is seconds from the batch's submission to the row's last token."""


def engine_config_from_dict(d: dict | EngineConfig) -> EngineConfig:
    """Deprecated alias of :meth:`EngineConfig.from_dict` (the one dict form of engine settings);
    warns (:class:`~dart_ray.config.RenamedWarning`) and goes away next release."""
    warn_renamed("batch.engine_config_from_dict", "dart_ray.EngineConfig.from_dict", "function")
    return EngineConfig.from_dict(d)


def row_seed(seed: int, row_id: Any) -> int:
    """The sampling seed of one row: ``seed`` plus a stable 63-bit hash of ``str(row_id)``."""
    h = int.from_bytes(hashlib.blake2b(str(row_id).encode(), digest_size=8).digest(), "little")
    return (seed + h) % (1 << 63)


class EngineFailure(RuntimeError):
    """The engine itself failed while generating a batch (not a bad row): the batch fails."""


@dataclass
class BatchStats:
    """Totals of one processed batch (the job sums them for its summary)."""

    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0
    accepted_tokens: int = 0
    generate_s: float = 0.0


class DartGenerator:
    """Generate a completion per row with one engine built in the constructor.

    Args:
        engine_config: an :class:`~dart_ray.EngineConfig` or its fields as a dict
            (:meth:`EngineConfig.from_dict <dart_ray.EngineConfig.from_dict>`).
        prompt_column: column holding the prompt text.
        id_column: column holding a row id; it seeds sampling (see :func:`row_seed`). ``None`` or a
            column absent from the batch: the prompt text seeds the row instead.
        chat: wrap each prompt in the tokenizer's chat template as a user message.
        sampling: a :class:`~dart_ray.SamplingParams` (or its fields as a dict) shared by all rows;
            the keyword arguments below override its fields.
        max_new_tokens, temperature, top_p, top_k: shortcuts for the matching SamplingParams fields.
        seed: base seed of per-row sampling seeds; ``None`` = unseeded sampling.
        profile: decoding profile applied with ``Engine.set_decoding``: a profile name or YAML path
            (:func:`dart_ray.load_profile`, resolved on the worker), a
            :class:`~dart_ray.DecodingSchedule` or its ``to_dict()``, or one DecodingConfig.
    """

    def __init__(self, engine_config: dict | EngineConfig | None = None, *,
                 prompt_column: str = "prompt", id_column: str | None = "id", chat: bool = False,
                 sampling: SamplingParams | dict | None = None, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None, seed: int | None = 0,
                 profile: str | dict | DecodingSchedule | DecodingConfig | None = None) -> None:
        self.engine_config = EngineConfig.from_dict(engine_config or {})
        self.prompt_column = prompt_column
        self.id_column = id_column
        self.chat = chat
        if isinstance(sampling, dict):
            sampling = SamplingParams(**sampling)
        given = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                 "top_k": top_k}
        overrides = {k: v for k, v in given.items() if v is not None}
        self.sampling = dataclasses.replace(sampling or SamplingParams(), **overrides)
        self.seed = seed
        self.profile = _schedule(profile)
        self.engine = self._build_engine()

    def _build_engine(self) -> Engine:
        engine = Engine.from_config(self.engine_config)
        if isinstance(self.profile, DecodingSchedule):
            check_profile_hardware(self.profile, engine.fingerprint)  # warns once on other hardware
        if self.profile is not None:
            engine.set_decoding(self.profile)
        return engine

    # ---- Ray Data entry point ------------------------------------------------------------------
    def __call__(self, batch):
        """Add :data:`OUTPUT_COLUMNS` to a pyarrow Table, pandas DataFrame or dict of arrays."""
        if isinstance(batch, pa.Table):
            out, _ = self.process(batch)
            for name in OUTPUT_COLUMNS:
                batch = _set_column(batch, name, out.column(name))
            return batch
        columns = list(batch.columns) if _is_pandas(batch) else list(batch)
        prompts = _py_values(batch[self.prompt_column]) if self.prompt_column in columns else None
        keys = _py_values(batch[self.id_column]) if self.id_column in columns else None
        out, _ = self.generate_rows(prompts, keys)
        if _is_pandas(batch):
            batch = batch.copy()
            for name in OUTPUT_COLUMNS:
                batch[name] = out.column(name).to_pandas().to_numpy()
            return batch
        batch = dict(batch)
        for name in OUTPUT_COLUMNS:
            batch[name] = out.column(name).to_numpy(zero_copy_only=False)
        return batch

    # ---- the work ----------------------------------------------------------------------------
    def process(self, table: pa.Table) -> tuple[pa.Table, BatchStats]:
        """Outputs of every row of ``table``: a table of :data:`OUTPUT_COLUMNS` (same row order)
        and the batch's totals."""
        names = table.column_names
        prompts = (table.column(self.prompt_column).to_pylist() if self.prompt_column in names
                   else None)
        keys = table.column(self.id_column).to_pylist() if self.id_column in names else None
        return self.generate_rows(prompts, keys)

    def generate_rows(self, prompts: list | None,
                      keys: list | None = None) -> tuple[pa.Table, BatchStats]:
        """Outputs for ``prompts`` (row ``i`` seeded by ``keys[i]``, or by its prompt when no
        keys)."""
        if prompts is None:
            raise KeyError(f"batch has no prompt column {self.prompt_column!r}")
        n = len(prompts)
        keys = prompts if keys is None else keys
        rows: list[dict] = [{} for _ in range(n)]
        todo: list[int] = []
        ids: list[list[int]] = []
        for i, prompt in enumerate(prompts):
            try:
                toks = self._validate(prompt, rows[i])
            except (ValueError, TypeError) as e:
                rows[i]["error"] = f"{type(e).__name__}: {e}"
            else:
                todo.append(i)
                ids.append(toks)
        params = [self._params(keys[i]) for i in todo]
        stats = BatchStats(rows=n)
        t0 = time.perf_counter()
        for i, c in zip(todo, self._generate(ids, params), strict=True):
            rows[i].update(generated_text=c.text, num_prompt_tokens=c.num_prompt_tokens,
                           num_completion_tokens=len(c.token_ids), finish_reason=c.finish_reason,
                           mean_accepted_len=float(c.stats.mean_accepted_len),
                           latency_s=float(c.latency_s))
            stats.prompt_tokens += c.num_prompt_tokens
            stats.completion_tokens += len(c.token_ids)
            stats.steps += c.stats.steps
            stats.accepted_tokens += c.stats.accepted_tokens
        stats.generate_s = time.perf_counter() - t0
        stats.errors = sum(1 for r in rows if r.get("error") is not None)
        out = pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA)
        return out, stats

    def _validate(self, prompt, row: dict) -> list[int]:
        if prompt is None:
            raise ValueError("prompt is null")
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
        if prompt == "":
            raise ValueError("prompt is empty")
        toks = self.engine.encode_prompt(prompt, self.chat)
        row["num_prompt_tokens"] = len(toks)
        self.engine.check_prompt(toks)
        return toks

    def _params(self, key) -> SamplingParams:
        if self.sampling.greedy or self.seed is None:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=row_seed(self.seed, key))

    def _generate(self, ids: list[list[int]], params: list[SamplingParams]) -> list:
        """Completions for validated token ids. An engine failure is not a property of a row: it
        fails the whole batch (:class:`EngineFailure`), so that nothing is recorded for its rows
        and the batch is run again (by Ray, or by the batch job's resume)."""
        if not ids:
            return []
        try:
            return self.engine.generate(ids, params)
        except Exception as e:
            err = EngineFailure(f"the engine failed on a batch of {len(ids)} rows: "
                                f"{type(e).__name__}: {e}")
            log.exception("%s; rebuilding it for the next batch", err)
            self.engine = self._build_engine()   # its state may be broken: start the next clean
            raise err from e


def _schedule(profile) -> DecodingSchedule | DecodingConfig | None:
    if profile is None or isinstance(profile, (DecodingSchedule, DecodingConfig)):
        return profile
    if isinstance(profile, dict):
        return DecodingSchedule.from_dict(profile)
    return load_profile(profile)


# ---- batch formats ------------------------------------------------------------------------------
def _is_pandas(batch) -> bool:
    return type(batch).__name__ == "DataFrame" and hasattr(batch, "iloc")


def _py_values(col) -> list:
    """Column values as Python objects, pandas/numpy missing values (NaN, NA, NaT) as None."""
    values = col.tolist() if hasattr(col, "tolist") else col
    return [None if _is_missing(v) else v for v in values]


def _is_missing(v) -> bool:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return True
    return type(v).__name__ in ("NAType", "NaTType")


def _set_column(table: pa.Table, name: str, values: pa.ChunkedArray) -> pa.Table:
    if name in table.column_names:
        return table.set_column(table.column_names.index(name), name, values)
    return table.append_column(name, values)
