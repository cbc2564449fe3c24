"""The batch job: prompts in parquet/JSONL -> a pool of engine actors -> committed parquet parts.

Pipeline (Ray Data, streaming)::

    read_parquet / read_json(lines)      input files (without an id column: numbered by the driver)
      -> _prepare                        keep id + prompt, normalise id types, drop ids already done
      -> repartition(batch_size rows)    so every actor of the pool gets work
      -> map_batches(_PartWriter)        actor pool: DartGenerator, then one atomic part per batch
      -> iter_batches                    the driver sums per-batch totals (progress bar, summary)

Rows are written by the actors, not by ``write_parquet``: Ray's file writes are not atomic, so a
killed job could leave a truncated committed file. Each batch becomes one part committed with a
rename (see :mod:`batch.store`), so the output directory only ever holds complete rows.

Exactly once, across kills and reruns:

1. Input ids must be unique and non-null (checked up front; a duplicate is an error, not silently
   dropped, since the rows may differ). Without an id column, ids are 0-based row numbers over the
   input files in sorted path order (the driver reads the input to number it); the manifest then
   records the files and their row counts, and a rerun with other files is refused (a file added
   or removed renumbers the rows).
2. The driver locks the output directory, waits until no worker of an earlier run is alive, deletes
   half-written temp files, and reads the ids in the committed parts. A resumed run checks that the
   committed rows' prompts are the input's prompts for those ids (another input with the same ids
   is refused, unless forced).
3. Only the remaining ids are processed; each batch is committed atomically under a name derived
   from its ids, so a retried batch replaces its own part. A bad row (null, empty, non-string or
   too long prompt) is committed as an error row; a failure of the engine itself fails its batch
   (nothing is committed for it) and the job reruns the pipeline from the committed parts, at most
   ``max_resumes`` times, then fails.
4. At the end the committed ids are checked against the input: every id exactly once, or the job
   reports what is missing/duplicated and fails.

Losing a worker or a whole node mid-run (multi-node clusters): Ray Data restarts the pool's actor
(``max_restarts=-1``) wherever a CPU is free and runs its unfinished batches again
(``max_task_retries=-1``); blocks lost with the node are recomputed from their lineage. A batch run
twice commits the same part name (same ids), so the output still holds every id once. The summary
counts these rows as ``retried_rows`` (from per-attempt records, see :mod:`batch.store`), together
with rows an earlier, interrupted run had started but not committed. The output directory must be
one filesystem every node sees (NFS, a mounted bucket with atomic rename) for this to hold across
nodes; on one machine any local path does.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
import pyarrow.parquet as pq

from batch.generator import OUTPUT_COLUMNS, OUTPUT_SCHEMA, BatchStats, DartGenerator, EngineFailure
from batch.store import OutputStore, id_report, retry_report
from batch.watchdog import PipelineStalled, consume
from dart_ray import (
    EngineConfig,
    SamplingParams,
    actor_allocator_env,
    init_ray,
    joins_cluster,
    load_profile,
)
from dart_ray.profiles import refuse_profile_over_decoding

log = logging.getLogger(__name__)

ROW_NUMBER = "row_number"
"""Manifest value of ``ids`` when the input has no id column."""

READ_CPUS = 0.25
"""CPUs declared by the read/prepare tasks (Ray's file listing still takes one whole CPU)."""

MANIFEST_EXCLUDES = ("num_threads", "max_batch_size")
"""Engine settings a resumed run may change: threads follow the actors' CPUs, and the rows decoded
together follow scheduling anyway (fp32 outputs do not depend on them; see
:mod:`batch.generator`)."""


class DuplicateIdError(ValueError):
    """The input holds an id more than once (or a null id)."""


class InputChangedError(ValueError):
    """The output directory's committed rows were generated from other prompts than the input's
    (the same ids, another input)."""


@dataclass
class BatchJobConfig:
    """One batch job (what ``dart-ray batch`` builds from its flags)."""

    input: str
    """A .parquet file, a .jsonl/.json (JSON Lines) file, or a directory of either."""
    output: str
    """Output directory of committed parts; rerunning with the same one resumes."""
    prompt_column: str = "prompt"
    id_column: str = "id"
    """Unique row id. Absent from the input: ids are row numbers (see the module docstring)."""
    chat: bool = False
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The engine of every actor (a mapping of its fields is read with
    ``EngineConfig.from_dict``)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = 0
    """Base of per-row sampling seeds (seed + hash(id)); None = unseeded."""
    profile: str | None = None
    """Decoding profile name or YAML path (:func:`dart_ray.load_profile`), read on the driver."""
    concurrency: int = 1
    """Engine actors (each loads the weights once)."""
    batch_size: int = 32
    """Rows per actor call, and so per committed part (the work lost to a kill is < one batch per
    actor). The engine decodes up to ``engine.max_batch_size`` of them at a time."""
    num_cpus_per_actor: float | None = None
    """CPUs each actor declares; None = (cluster CPUs - 1) / concurrency, one CPU left for reads.
    The engine uses max(1, floor(this)) threads unless ``engine.num_threads`` is set."""
    stale_worker_timeout_s: float = 120.0
    stall_timeout_s: float | None = 900.0
    """No batch committed for this long (actor start-up included): the run is stalled (a lost
    actor can leave Ray Data's pool waiting forever, see :mod:`batch.watchdog`); it is stopped and
    the job resumes from its committed parts. Set it above the slowest batch; None = never."""
    max_resumes: int = 2
    """Automatic resumes after a stall within one call; beyond them the job fails (rerun
    resumes)."""
    force: bool = False
    """Resume into a directory written by a different job: other generation settings, other input
    files (row-number ids) or other prompts for committed ids. The committed rows are kept as they
    are and only ids not yet committed are generated."""
    progress: bool = True

    def __post_init__(self) -> None:
        self.engine = EngineConfig.from_dict(self.engine)
        refuse_profile_over_decoding(self.profile, self.engine.decoding)
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.num_cpus_per_actor is not None and self.num_cpus_per_actor <= 0:
            raise ValueError(f"num_cpus_per_actor must be > 0, got {self.num_cpus_per_actor}")
        if self.stall_timeout_s is not None and self.stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0 or None, got {self.stall_timeout_s}")
        if self.max_resumes < 0:
            raise ValueError(f"max_resumes must be >= 0, got {self.max_resumes}")
        for what, name in (("prompt_column", self.prompt_column), ("id_column", self.id_column)):
            if name in OUTPUT_COLUMNS:
                raise ValueError(f"{what} {name!r} is the name of an output column (the output has "
                                 f"{', '.join(OUTPUT_COLUMNS)}); use an input column of another "
                                 f"name")
        if self.prompt_column == self.id_column:
            raise ValueError(f"prompt_column and id_column are both {self.prompt_column!r}")

    def manifest(self, ids: str, profile: dict | None = None,
                 input_files: list | None = None) -> dict:
        """Settings that determine the outputs (a resumed run must match them): the engine's
        fingerprint (``EngineConfig.fingerprint``, keys ``engine.<field>``) less
        :data:`MANIFEST_EXCLUDES`, the generation settings, the decoding knobs of the profile
        (``profile``: its ``DecodingSchedule.to_dict()``; its ``schedule`` is recorded) and, with
        row-number ids, the input files with their row counts (``input_files``)."""
        s = self.sampling
        engine = {f"engine.{k}": v
                  for k, v in self.engine.fingerprint(exclude=MANIFEST_EXCLUDES).items()}
        m = {**engine, "chat": self.chat,
             "prompt_column": self.prompt_column, "id_column": self.id_column, "ids": ids,
             "max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
             "top_k": s.top_k, "stop": list(s.stop), "stop_token_ids": list(s.stop_token_ids),
             "ignore_eos": s.ignore_eos, "seed": self.seed}
        if profile is not None:     # absent (not null) without one: older manifests still match
            m["profile"] = json.loads(json.dumps(profile["schedule"]))
        if input_files is not None:
            m["input_files"] = [list(x) for x in input_files]
        return m


@dataclass
class JobSummary:
    input_rows: int
    already_done: int
    rows: int = 0
    """Rows processed by this run."""
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0
    accepted_tokens: int = 0
    wall_s: float = 0.0
    """Seconds from the pipeline's start (actors loading included) to its end."""
    first_result_s: float = 0.0
    """Seconds until the first batch was committed (mostly actor start-up and weight loading)."""
    engine_s: float = 0.0
    """Seconds the engines spent generating, summed over actors."""
    output: dict = field(default_factory=dict)
    """id_report of the output directory after the run."""
    retried_rows: int = 0
    """Rows generated more than once by this run (a worker or node was lost mid-batch and Ray ran
    the batch again) plus rows an earlier, interrupted run had started but not committed."""
    retries: dict = field(default_factory=dict)
    """retried_rows split: ``in_run`` and ``from_interrupted_run`` (see
    :func:`batch.store.retry_report`)."""
    resumes: int = 0
    """Times this run stopped a stalled pipeline and resumed from the committed parts."""
    unreported_rows: int = 0
    """Rows this run committed whose batch totals never reached the driver (a pipeline stopped by
    a stall or an engine failure after committing them): in the output, not in ``rows`` and the
    token totals."""

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.wall_s if self.wall_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def mean_accepted_len(self) -> float:
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    @property
    def ok(self) -> bool:
        o = self.output
        return o.get("missing") == 0 and o.get("duplicated") == 0

    engine_failures: int = 0
    """Times this run's pipeline failed on an engine error and was rerun from the committed
    parts."""

    def add(self, st: dict) -> None:
        for k in ("rows", "errors", "prompt_tokens", "completion_tokens", "steps",
                  "accepted_tokens"):
            setattr(self, k, getattr(self, k) + int(st[k]))
        self.engine_s += float(st["generate_s"])

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(rows_per_s=self.rows_per_s, tokens_per_s=self.tokens_per_s,
                 mean_accepted_len=self.mean_accepted_len, ok=self.ok)
        return d

    def format(self) -> str:
        o = self.output
        lines = [
            (f"dart-ray batch: {self.input_rows} input rows, {self.already_done} already done, "
             f"{self.rows} processed this run ({self.errors} errors) in {self.wall_s:.1f} s"
             + (f"; {self.unreported_rows} more committed by a stopped pipeline (not in the "
                f"totals)" if self.unreported_rows else "")),
            (f"  {self.rows_per_s:.2f} rows/s, {self.tokens_per_s:.1f} tokens/s "
             f"({self.completion_tokens} completion tokens), mean accepted length "
             f"{self.mean_accepted_len:.2f}"),
            (f"  first batch after {self.first_result_s:.1f} s; engines busy {self.engine_s:.1f} s "
             f"in all"),
            (f"  retried: {self.retried_rows} rows ({self.retries.get('in_run', 0)} after a lost "
             f"worker/node, {self.retries.get('from_interrupted_run', 0)} left unfinished by an "
             f"interrupted run); resumed after a stall: {self.resumes}x"
             + (f", after an engine failure: {self.engine_failures}x"
                if self.engine_failures else "")),
        ]
        if self.ok:
            lines.append(f"  output: {o['expected']} ids, each exactly once")
        else:
            lines.append(f"  output INCOMPLETE: {o.get('missing')} missing, {o.get('duplicated')} "
                         f"duplicated of {o.get('expected')} ids")
        if o.get("unexpected"):
            lines.append(f"  warning: {o['unexpected']} ids in the output are not in the input")
        return "\n".join(lines)


# ---- input --------------------------------------------------------------------------------------
def resolve_input(path: str) -> tuple[list[str], str]:
    """Input files (sorted) and their format, ``parquet`` or ``json`` (JSON Lines)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and not any(
            part.startswith((".", "_")) for part in f.relative_to(p).parts))
        parquet = [str(f) for f in files if f.suffix == ".parquet"]
        jsonl = [str(f) for f in files if f.suffix in (".jsonl", ".json")]
        if parquet and jsonl:
            raise ValueError(f"{path} mixes parquet and JSON files")
        if not parquet and not jsonl:
            raise FileNotFoundError(f"no .parquet, .jsonl or .json files under {path}")
        return (parquet, "parquet") if parquet else (jsonl, "json")
    if p.is_file():
        if p.suffix == ".parquet":
            return [str(p)], "parquet"
        if p.suffix in (".jsonl", ".json"):
            return [str(p)], "json"
        raise ValueError(f"{path}: expected a .parquet, .jsonl or .json file")
    raise FileNotFoundError(path)


def check_layout(cfg: BatchJobConfig) -> None:
    """Refuse an output directory equal to or inside the input directory: a rerun would read the
    job's own parts as input."""
    inp, out = Path(cfg.input).resolve(), Path(cfg.output).resolve()
    if inp.is_dir() and (out == inp or inp in out.parents):
        raise ValueError(f"output {cfg.output} is inside the input directory {cfg.input}: a rerun "
                         f"would read the job's own parts as input. Choose an output directory "
                         f"outside the input")


def decode_dictionaries(table: pa.Table) -> pa.Table:
    """Dictionary-encoded columns (pandas categoricals) as plain columns of their value type."""
    for i, f in enumerate(table.schema):
        if pa.types.is_dictionary(f.type):
            col = table.column(i)
            plain = pa.chunked_array([c.dictionary_decode() for c in col.chunks],
                                     type=f.type.value_type)
            table = table.set_column(i, f.name, plain)
    return table


def prompt_strings(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Prompts as the output stores them: strings, null for null, ``str(value)`` for other
    values."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return col.cast(pa.string())
    return pa.array([p if p is None or isinstance(p, str) else str(p) for p in col.to_pylist()],
                    pa.string())


def _read_file(path: str, fmt: str, columns: list[str] | None = None) -> pa.Table:
    """One input file, dictionary columns decoded; an unreadable file is a ValueError naming it."""
    try:
        if fmt == "parquet":
            t = pq.read_table(path, columns=columns)
        else:
            t = pajson.read_json(path)
            if columns is not None:
                t = t.select(columns)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"cannot read input file {path}: {e}") from e
    return decode_dictionaries(t)


def _concat(tables: list[pa.Table], files: list[str]) -> pa.Table:
    """Concatenate per-file tables; files that disagree on a column's type are a ValueError
    naming them."""
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid) as e:
        seen: dict[str, dict[str, str]] = {}
        for f, t in zip(files, tables, strict=True):
            for field_ in t.schema:
                seen.setdefault(field_.name, {}).setdefault(str(field_.type), f)
        bad = [f"column {name!r} is " + " but ".join(f"{ty} in {f}" for ty, f in types.items())
               for name, types in seen.items() if len(types) > 1]
        raise ValueError(f"input files disagree on column types ({'; '.join(bad) or e}); give "
                         f"each column one type in every file") from e


def _check_prompt_types(files: list[str], types: list[pa.DataType], column: str) -> None:
    """Files whose prompt columns hold different kinds of values (strings in one, numbers in
    another) cannot be read as one dataset (Ray Data fails to unify them, with a traceback):
    refuse, naming them. string/large_string/dictionary-of-string are one kind; an all-null
    column goes with anything."""
    kinds: dict[str, str] = {}
    for f, t in zip(files, types, strict=True):
        if pa.types.is_dictionary(t):
            t = t.value_type
        if pa.types.is_null(t):
            continue
        kind = "string" if pa.types.is_string(t) or pa.types.is_large_string(t) else str(t)
        kinds.setdefault(kind, f)
    if len(kinds) > 1:
        raise ValueError(f"input files disagree on the prompt column {column!r}: "
                         + " but ".join(f"{k} in {f}" for k, f in kinds.items())
                         + "; give prompts one type (strings) in every file")


def _has_column(schemas: list[pa.Schema], column: str) -> bool:
    """Whether every input file has ``column`` (an error if only some do)."""
    present = [column in s.names for s in schemas]
    if any(present) and not all(present):
        raise ValueError(f"column {column!r} is in some input files but not in others")
    return all(present)


ID_KINDS = (pa.types.is_integer, pa.types.is_string, pa.types.is_large_string,
            pa.types.is_temporal, pa.types.is_boolean, pa.types.is_floating)
"""Id column types a job takes (scalars arrow can hash and compare)."""


def ids_as_committed(ids: pa.Array, committed: pa.DataType) -> pa.Array:
    """The input's ids in the committed parts' id type, so this run's parts match them: another
    integer width (a file re-saved by pandas turns int32 into int64) or string/large_string, when
    every id converts without loss. Any other change is a ValueError before anything runs (the
    new parts would disagree with the old ones and no later run could read the output)."""
    if ids.type == committed:
        return ids
    same_kind = ((pa.types.is_integer(ids.type) and pa.types.is_integer(committed))
                 or ({pa.types.is_string(t) or pa.types.is_large_string(t)
                      for t in (ids.type, committed)} == {True}))
    if same_kind:
        try:
            cast = ids.cast(committed)            # safe: an overflow raises
            if cast.cast(ids.type).equals(ids):
                return cast
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
    raise ValueError(f"the input's ids are {ids.type}, the committed parts' ids {committed}, and "
                     "they do not convert without loss: write the ids as before, or use a new "
                     "--output")


def check_unique_ids(ids: pa.Array) -> None:
    if not any(kind(ids.type) for kind in ID_KINDS):
        raise ValueError(f"the id column has type {ids.type}; ids must be integers, strings, "
                         "timestamps/dates, booleans or floats")
    nulls = ids.null_count
    if nulls:
        raise DuplicateIdError(f"{nulls} input rows have a null id")
    counts = pc.value_counts(ids)
    dup = pc.filter(counts.field("values"), pc.greater(counts.field("counts"), 1))
    if len(dup):
        raise DuplicateIdError(
            f"{len(dup)} ids occur more than once in the input (e.g. {dup.to_pylist()[:5]}); "
            f"make the id column unique")


# ---- Ray Data stages -----------------------------------------------------------------------------
def _prepare(table: pa.Table, id_column: str, prompt_column: str, id_type: pa.DataType,
             done: pa.Array | None) -> pa.Table:
    """Keep id and prompt, give the id the input-wide type, drop ids already committed."""
    table = decode_dictionaries(table.select([id_column, prompt_column]))
    ids = table.column(id_column).cast(id_type)
    table = table.set_column(0, id_column, ids)
    if done is not None and len(done):
        table = table.filter(pc.invert(pc.is_in(ids, value_set=done)))
    return table


class _PartWriter:
    """Actor of the job's pool: generates a batch and commits it as one part of the output."""

    def __init__(self, output: str, id_column: str, prompt_column: str, id_type: pa.DataType,
                 generator_kwargs: dict) -> None:
        self.store = OutputStore(output)
        # Before anything can be written: a later run waits for this lock to be released.
        self._lock_fd = self.store.hold_worker_lock()
        self.id_column = id_column
        self.prompt_column = prompt_column
        self.schema = pa.schema([(id_column, id_type), (prompt_column, pa.string()),
                                 *OUTPUT_SCHEMA])
        self.generator = DartGenerator(id_column=id_column, prompt_column=prompt_column,
                                       **generator_kwargs)

    def __call__(self, table: pa.Table) -> pa.Table:
        st = BatchStats()
        if table.num_rows:
            ids = table.column(self.id_column).cast(self.schema.field(0).type)
            self.store.record_attempt(ids, self.id_column)    # counts retries; decides nothing
            out, st = self.generator.process(table)
            prompts = prompt_strings(table.column(self.prompt_column))
            part = pa.Table.from_arrays([ids, prompts, *out.columns], schema=self.schema)
            self.store.write_part(part, self.id_column)
        return pa.Table.from_pylist([dataclasses.asdict(st)])


# ---- the job -------------------------------------------------------------------------------------
@dataclass
class _Input:
    files: list[str]
    fmt: str
    """``parquet`` or ``json``."""
    ids: pa.Array
    numbered: pa.Table | None
    """Without an id column: the whole input (prompt + row-number id), read on the driver."""
    file_rows: list[tuple[str, int]] | None = None
    """Without an id column: (file relative to the input, rows) in numbering order (recorded in
    the manifest)."""
    json_tables: list[pa.Table] | None = None

    def tables(self, columns: list[str]) -> Iterator[pa.Table]:
        """The input's ``columns`` (the id column first), one table per file (one table in all
        with row-number ids), ids of the input-wide type."""
        if self.numbered is not None:
            parts: Iterator[pa.Table] = iter([self.numbered.select(columns)])
        elif self.json_tables is not None:
            parts = (decode_dictionaries(t.select(columns)) for t in self.json_tables)
        else:
            parts = (_read_file(f, self.fmt, columns) for f in self.files)
        for t in parts:
            yield t.set_column(0, columns[0], t.column(0).cast(self.ids.type))


def _load_input(cfg: BatchJobConfig) -> _Input:
    """Check the input's columns and read its ids on the driver (parquet: the id column only;
    JSON Lines: the whole files, so prefer parquet for very large inputs). Dictionary-encoded
    columns (pandas categoricals) are decoded; unreadable files and files whose columns disagree
    on type are a ValueError naming them."""
    files, fmt = resolve_input(cfg.input)
    json_tables = None
    if fmt == "parquet":
        schemas = []
        for f in files:
            try:
                schemas.append(pq.read_schema(f))
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"cannot read input file {f}: {e}") from e

        def read(cols: list[str]) -> list[pa.Table]:
            return [_read_file(f, fmt, cols) for f in files]
    else:
        json_tables = [_read_file(f, fmt) for f in files]
        schemas = [t.schema for t in json_tables]

        def read(cols: list[str]) -> list[pa.Table]:
            return [t.select(cols) for t in json_tables]
    if not _has_column(schemas, cfg.prompt_column):
        raise ValueError(f"input has no prompt column {cfg.prompt_column!r}")
    _check_prompt_types(files, [s.field(cfg.prompt_column).type for s in schemas],
                        cfg.prompt_column)
    file_rows = None
    if _has_column(schemas, cfg.id_column):
        ids = _concat(read([cfg.id_column]), files).column(0).combine_chunks()
        numbered = None
    else:
        log.warning("input has no %r column: ids are row numbers over %d file(s) in path order",
                    cfg.id_column, len(files))
        tables = read([cfg.prompt_column])
        root = Path(cfg.input) if Path(cfg.input).is_dir() else Path(cfg.input).parent
        file_rows = [(os.path.relpath(f, root), t.num_rows)
                     for f, t in zip(files, tables, strict=True)]
        numbered = _concat(tables, files)
        numbered = pa.table({cfg.id_column: pa.array(range(numbered.num_rows), pa.int64()),
                             cfg.prompt_column: numbered.column(0)})
        ids = numbered.column(cfg.id_column).combine_chunks()
    check_unique_ids(ids)
    return _Input(files, fmt, ids, numbered, file_rows, json_tables)


def _digest(prompt: str | None) -> bytes | None:
    return None if prompt is None else hashlib.blake2b(prompt.encode(), digest_size=8).digest()


def check_committed_prompts(store: OutputStore, cfg: BatchJobConfig, inp: _Input) -> None:
    """Refuse (:class:`InputChangedError`) committed rows whose prompt is not the input's prompt
    for the same id: the output was written from another input. Forced: a warning.

    String prompts only (any other type is an error row, and Ray Data may read a JSONL number
    differently from the driver); an 8-byte digest per input row, then one committed part at a
    time, so the driver holds ~100 bytes per row, not the prompts."""
    expected: dict = {}
    for t in inp.tables([cfg.id_column, cfg.prompt_column]):
        col = t.column(1)
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            return
        expected.update(zip(t.column(0).to_pylist(), map(_digest, col.to_pylist()),
                            strict=True))
    bad = 0
    examples: list = []
    for path in store.part_paths():
        part = pq.read_table(path, columns=[cfg.id_column, cfg.prompt_column])
        ids = part.column(0).cast(inp.ids.type).to_pylist()
        for i, prompt in zip(ids, part.column(1).to_pylist(), strict=True):   # strings (parts)
            if i in expected and expected[i] != _digest(prompt):
                bad += 1
                if len(examples) < 5:
                    examples.append(i)
    if not bad:
        return
    msg = (f"{bad} committed row(s) in {store.root} have another prompt than the input row with "
           f"the same id (e.g. ids {examples}): the output was written from another input")
    if cfg.force:
        log.warning("%s; forced: the committed rows are kept as they are", msg)
        return
    raise InputChangedError(f"{msg}. Use another output directory, or pass force to keep the "
                            f"committed rows as they are")


def run_batch_job(cfg: BatchJobConfig, ray_init: dict | None = None) -> JobSummary:
    """Run (or resume) the job; returns its summary. Starts Ray with ``ray_init`` if needed."""
    profile = load_profile(cfg.profile).to_dict() if cfg.profile else None  # workers get a dict
    check_layout(cfg)
    store = OutputStore(cfg.output)
    required = (cfg.prompt_column, *OUTPUT_COLUMNS)     # a part of this job has them all
    store.refuse_foreign_parts()                        # before anything is created in there
    with store.driver_session(cfg.stale_worker_timeout_s):
        inp = _load_input(cfg)
        store.check_manifest(cfg.manifest(ROW_NUMBER if inp.numbered is not None else "column",
                                          profile=profile, input_files=inp.file_rows),
                             force=cfg.force)
        stale = store.clear_tmp()
        if stale:
            log.info("deleted %d half-written part(s) of an earlier run", stale)
        committed = store.committed_ids(cfg.id_column, required)
        if committed is not None:
            inp.ids = ids_as_committed(inp.ids, committed.type)
            check_committed_prompts(store, cfg, inp)
        unfinished = _unfinished_attempts(store, cfg.id_column, committed)
        store.clear_attempts()
        before = id_report(inp.ids, committed)
        summary = JobSummary(input_rows=len(inp.ids),
                             already_done=before["expected"] - before["missing"])
        missing = before["missing"]
        while missing:
            done = None
            if committed is not None:
                done = pc.unique(committed.combine_chunks().cast(inp.ids.type))
            try:
                _run_pipeline(cfg, store, inp, done, missing, profile, summary, ray_init)
                break
            except PipelineStalled as e:
                if summary.resumes >= cfg.max_resumes:
                    raise PipelineStalled(f"{e}; gave up after {summary.resumes} resume(s). The "
                                          "committed parts are kept: rerun the job to "
                                          "resume") from e
                summary.resumes += 1
                log.warning("%s; resuming from the committed parts (%d/%d)", e, summary.resumes,
                            cfg.max_resumes)
            except Exception as e:
                failure = engine_failure(e)
                if failure is None:
                    raise
                if summary.engine_failures >= cfg.max_resumes:
                    raise EngineFailure(
                        f"{failure} (the pipeline was run {summary.engine_failures + 1} time(s), "
                        f"failing each time). The committed parts are kept: fix the cause and "
                        f"rerun the job to resume") from e
                summary.engine_failures += 1
                log.warning("%s; rerunning the pipeline from the committed parts (%d/%d)", failure,
                            summary.engine_failures, cfg.max_resumes)
            # a failed pipeline's actors live on while its exception's traceback (a reference
            # cycle) holds their handles, and so do their worker locks: collect it first
            gc.collect()
            store.wait_for_workers(cfg.stale_worker_timeout_s)  # the stopped actors' locks
            store.clear_tmp()
            committed = store.committed_ids(cfg.id_column, required)
            missing = id_report(inp.ids, committed)["missing"]
        summary.output = id_report(inp.ids, store.committed_ids(cfg.id_column, required))
        done_now = summary.output["expected"] - summary.output["missing"]
        summary.unreported_rows = max(0, done_now - summary.already_done - summary.rows)
        summary.retries = retry_report(store.attempted_ids(cfg.id_column), unfinished)
        summary.retried_rows = summary.retries["rows"]
        (store.meta / "last_run.json").write_text(json.dumps(summary.to_dict(), indent=2))
        return summary


def engine_failure(e: BaseException) -> EngineFailure | None:
    """The :class:`EngineFailure` behind ``e``, or None. Ray Data raises a failed batch wrapped
    in its own exceptions (``RayTaskError(UserCodeException)`` in Ray 2.60, whose chain no longer
    holds the actor's exception but whose text ends with its traceback): the chain is searched
    for the exception, then its text for the traceback's last line."""
    stack: list = [e]
    seen: set[int] = set()
    found = None
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if type(x) is EngineFailure:
            return x
        if isinstance(x, EngineFailure) and found is None:
            found = x           # Ray's RayTaskError subclassing the cause: prefer the plain one
        stack += [x.__cause__, x.__context__, getattr(x, "cause", None)]
    if found is not None:
        return found
    tag = f"{EngineFailure.__module__}.{EngineFailure.__qualname__}: "
    for line in reversed(str(e).splitlines()):
        if line.startswith(tag):
            return EngineFailure(line[len(tag):])
    return None


def _unfinished_attempts(store: OutputStore, id_column: str,
                         committed: pa.ChunkedArray | None) -> pa.Array | None:
    """Ids an earlier run started (recorded an attempt for) but did not commit."""
    attempted = store.attempted_ids(id_column)
    if attempted is None:
        return None
    started = pc.unique(attempted.combine_chunks())
    if committed is None or not len(committed):
        return started
    done = committed.combine_chunks().cast(started.type)
    return pc.filter(started, pc.invert(pc.is_in(started, value_set=done)))


def _run_pipeline(cfg: BatchJobConfig, store: OutputStore, inp: _Input, done: pa.Array | None,
                  remaining: int, profile: dict | None, summary: JobSummary,
                  ray_init: dict | None) -> None:
    """Generate the ``remaining`` rows (those not in ``done``), adding their totals to
    ``summary``."""
    import ray
    import ray.data

    init_ray(**(ray_init or {}))    # a Ray started here: workers not niced below others
    local = not joins_cluster((ray_init or {}).get("address"))   # no autoscaler to add CPUs
    total = ray.cluster_resources().get("CPU", 1.0)
    largest = max((n.get("Resources", {}).get("CPU", 0.0) for n in ray.nodes()
                   if n.get("Alive")), default=total)
    cpus = cfg.num_cpus_per_actor
    if cpus is None:    # no more than one node has (no CPU node yet: an autoscaler may add one)
        cpus = max(0.25, (total - 1.0) / cfg.concurrency)
        cpus = min(cpus, largest) if largest > 0 else cpus
    elif largest > 0:
        check_actor_cpus(cpus, largest)
    if cfg.num_cpus_per_actor is not None and cpus * cfg.concurrency > total - 1.0:
        log.warning("the actors declare %.2f of the cluster's %.0f CPUs; Ray Data's file listing "
                    "needs one free CPU, so the job may stall", cpus * cfg.concurrency, total)
    check_room_for_reads(total, cpus, local)
    actors = _actors_that_fit(cfg.concurrency, cpus)
    if actors < cfg.concurrency:
        log.warning("the cluster has room for %d of %d engine actors now (%.2f CPUs each, one CPU "
                    "kept for reads): starting with %d, more as CPUs free up or nodes join",
                    actors, cfg.concurrency, cpus, actors)
    engine = cfg.engine
    if engine.num_threads is None:
        engine = engine.replace(num_threads=max(1, math.floor(cpus)))
    gen_kwargs = {"engine_config": engine, "chat": cfg.chat, "sampling": cfg.sampling,
                  "seed": cfg.seed, "profile": profile}

    ctx = ray.data.DataContext.get_current()
    ray_bars, ctx.enable_progress_bars = ctx.enable_progress_bars, False  # ours is the one bar
    try:
        _execute(cfg, store, inp, done, remaining, summary, cpus, actors, gen_kwargs)
    finally:
        ctx.enable_progress_bars = ray_bars


def check_actor_cpus(cpus: float, largest_node_cpus: float) -> None:
    """An actor declaring more CPUs than the largest node has could never start (Ray Data would
    wait for it until the stall guard gives up): refuse at once."""
    if cpus > largest_node_cpus + 1e-9:
        raise ValueError(f"num_cpus_per_actor={cpus:g}, but the largest node of the Ray cluster "
                         f"has {largest_node_cpus:g} CPUs: no engine actor could start. Use at "
                         f"most {largest_node_cpus:g}")


def check_room_for_reads(total_cpus: float, actor_cpus: float, local: bool) -> None:
    """Ray Data's repartition and file listing take a whole CPU beside the engine actors: with less
    than that left after one actor the pipeline waits forever (a 1-CPU machine by default: the
    actor takes 0.25, 0.75 is left). A local Ray cannot grow: refuse; a cluster may add nodes:
    warn."""
    if total_cpus <= 0 or total_cpus - actor_cpus >= 1.0 - 1e-9:
        return
    msg = (f"the Ray cluster has {total_cpus:g} CPUs; an engine actor declares {actor_cpus:g} and "
           f"Ray Data's reads and repartition need one whole CPU beside it, so the job could not "
           f"run")
    if local:
        raise ValueError(f"{msg}: give the local Ray at least {math.ceil(actor_cpus + 1.0)} CPUs "
                         "(--num-cpus; a 1-CPU machine cannot run a batch job) or lower "
                         "--num-cpus-per-actor")
    log.warning("%s until the cluster grows (an autoscaler may add a node)", msg)


def engine_actor_options(engine: EngineConfig) -> dict:
    """Ray options of an engine actor beyond its CPUs: a CPU engine starts under a fast allocator
    (a process-start setting, ~25 % of its speed; see ``dart_ray.allocator``), a CUDA one as is."""
    env = actor_allocator_env(device=engine.device)
    return {"runtime_env": {"env_vars": env}} if env else {}


def actors_that_fit(wanted: int, cpus: float, free_cpus: float) -> int:
    """Engine actors of ``cpus`` each to start when ``free_cpus`` are free: up to ``wanted``, one
    CPU kept for Ray Data's reads, at least one. The pool starts with these and grows to
    ``wanted`` when room appears: a pool that must start larger than what the cluster can place
    waits forever (for instance, resumed after a node loss: the lost node's CPUs are gone)."""
    return max(1, min(wanted, math.floor((free_cpus - 1.0) / cpus + 1e-9)))


def _actors_that_fit(wanted: int, cpus: float, settle_s: float = 5.0) -> int:
    """:func:`actors_that_fit` for the CPUs the cluster has free now. A stopped pipeline's actors
    free theirs a moment after they die, so a short wait for room comes first."""
    import ray

    deadline = time.monotonic() + settle_s
    while True:
        n = actors_that_fit(wanted, cpus, ray.available_resources().get("CPU", 0.0))
        if n >= wanted or time.monotonic() >= deadline:
            return n
        time.sleep(0.25)


def _execute(cfg: BatchJobConfig, store: OutputStore, inp: _Input, done: pa.Array | None,
             remaining: int, summary: JobSummary, cpus: float, actors: int,
             gen_kwargs: dict) -> None:
    import ray.data
    from tqdm.auto import tqdm

    if inp.numbered is not None:
        step, t = cfg.batch_size, inp.numbered
        ds = ray.data.from_arrow([t.slice(i, step) for i in range(0, t.num_rows, step)])
    elif inp.fmt == "parquet":
        ds = ray.data.read_parquet(inp.files, columns=[cfg.id_column, cfg.prompt_column],
                                   num_cpus=READ_CPUS)
    else:
        ds = ray.data.read_json(inp.files, lines=True, num_cpus=READ_CPUS)
    ds = ds.map_batches(_prepare, batch_format="pyarrow", batch_size=None, num_cpus=READ_CPUS,
                        fn_kwargs={"id_column": cfg.id_column, "prompt_column": cfg.prompt_column,
                                   "id_type": inp.ids.type, "done": done})
    ds = ds.repartition(target_num_rows_per_block=cfg.batch_size)
    ds = ds.map_batches(
        _PartWriter, batch_format="pyarrow", batch_size=cfg.batch_size,
        compute=ray.data.ActorPoolStrategy(min_size=actors, max_size=cfg.concurrency),
        num_cpus=cpus, **engine_actor_options(gen_kwargs["engine_config"]),
        fn_constructor_kwargs={"output": str(store.root), "id_column": cfg.id_column,
                               "prompt_column": cfg.prompt_column, "id_type": inp.ids.type,
                               "generator_kwargs": gen_kwargs})

    t0 = time.perf_counter() - summary.wall_s        # a resumed pipeline adds to the run's time
    with tqdm(total=remaining, unit="row", desc="dart-ray batch", disable=not cfg.progress) as bar:
        for b in consume(lambda: ds.iter_batches(batch_size=None, batch_format="pyarrow"),
                         cfg.stall_timeout_s):
            for st in b.to_pylist():
                summary.add(st)
                bar.update(st["rows"])
            summary.wall_s = time.perf_counter() - t0
            summary.first_result_s = summary.first_result_s or summary.wall_s
            bar.set_postfix(errors=summary.errors, tok_s=f"{summary.tokens_per_s:.1f}",
                            tau=f"{summary.mean_accepted_len:.2f}", refresh=False)
    summary.wall_s = time.perf_counter() - t0
