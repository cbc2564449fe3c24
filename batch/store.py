"""The output directory of a batch job: atomically committed parts, the ids they hold, and locks.

Layout of ``DIR``::

    DIR/part-<digest>.parquet     committed parts: complete rows only, every id at most once overall
    DIR/_dart_ray/job.json        what produced the parts (a rerun with other settings is refused)
    DIR/_dart_ray/tmp/*.tmp       parts being written (left by a crash; the next run deletes them)
    DIR/_dart_ray/attempts/*      one small file per batch attempt (its ids): counts retried rows
    DIR/_dart_ray/driver.lock     held (flock, exclusive) by the one driver writing to DIR
    DIR/_dart_ray/workers.lock    held (flock, shared) by every worker that may commit parts

Exactly once rests on three facts:

* **Atomic commit.** A part is written under ``_dart_ray/tmp/``, fsynced, then renamed into
  ``DIR`` with :func:`os.replace` (atomic on POSIX within one filesystem). A reader sees either
  no file or the whole file; a killed writer leaves only a ``.tmp`` file, which no reader lists.
* **Content-addressed names.** A part's name is a digest of the sorted ids it holds, so a batch
  that is retried (a worker died after the rename but before reporting) overwrites its own part
  instead of adding a second copy of its rows.
* **No stale writers.** A rerun resumes from the ids in the committed parts. A worker of a killed
  run could still commit after that read, so the new driver first takes ``workers.lock``
  exclusively, which succeeds only once every worker of earlier runs (each holds it shared) has
  exited. ``driver.lock`` keeps two live jobs off one directory.

Retried rows are counted from attempt records: a worker records a batch's ids before generating
it, so ids recorded more than once in one run were retried (a worker or its node was lost and Ray
ran the batch again), and ids recorded by an earlier run but never committed were left unfinished
by that run and are generated again by this one. The records only count; they never decide what
is written.

Nothing here imports Ray; the job (``batch.job``) and the workers use these functions.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dart_ray.config import PATH_FIELDS

PART_GLOB = "part-*.parquet"
META_DIR = "_dart_ray"


class OutputBusyError(RuntimeError):
    """Another live job is writing to the output directory (or its workers did not exit)."""


class CorruptPartError(RuntimeError):
    """A committed part cannot be read (it was not written by this module's atomic commit)."""


log = logging.getLogger(__name__)

UNRECORDED_BEFORE = ("input_files", "profile")
"""Manifest keys older versions did not write: absent from a manifest, they are unknown (taken
from this run), not a change of settings."""


class OutputStore:
    """One output directory (see the module docstring for the layout)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.meta = self.root / META_DIR
        self.tmp = self.meta / "tmp"
        self.attempts = self.meta / "attempts"
        self.manifest_path = self.meta / "job.json"
        self.driver_lock_path = self.meta / "driver.lock"
        self.workers_lock_path = self.meta / "workers.lock"

    def create(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"output {self.root} is a file, not a directory")
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.attempts.mkdir(parents=True, exist_ok=True)

    # ---- parts ---------------------------------------------------------------------------------
    def part_paths(self) -> list[Path]:
        """Committed parts, sorted by name (temporary files never match)."""
        return sorted(self.root.glob(PART_GLOB))

    def committed_ids(self, id_column: str,
                      required: Sequence[str] = ()) -> pa.ChunkedArray | None:
        """Every id in the committed parts (duplicates kept), or None when there is no part yet.

        Raises :class:`CorruptPartError` for a part that cannot be read or lacks ``id_column`` or
        one of the ``required`` columns (the job passes its output columns: a file named like a
        part but written by something else is not counted as done)."""
        paths = self.part_paths()
        if not paths:
            return None
        chunks = []
        for p in paths:
            try:
                names = pq.read_schema(p).names
            except Exception as e:
                raise CorruptPartError(
                    f"cannot read committed part {p}: {e}. It was not written by dart-ray "
                    f"batch's atomic commit; remove it and rerun") from e
            lacking = [c for c in (id_column, *required) if c not in names]
            if lacking:
                raise CorruptPartError(
                    f"committed part {p} lacks the job's column(s) {lacking} (it has {names}): it "
                    f"was not written by this dart-ray batch job; remove it and rerun")
            try:
                chunks.append(pq.read_table(p, columns=[id_column]).column(0))
            except Exception as e:
                raise CorruptPartError(
                    f"cannot read id column {id_column!r} of committed part {p}: {e}. It was not "
                    f"written by dart-ray batch's atomic commit; remove it and rerun") from e
        types = {c.type for c in chunks}
        if len(types) > 1:
            raise CorruptPartError(f"committed parts in {self.root} disagree on the id type: "
                                   f"{types}")
        return pa.chunked_array([ch for c in chunks for ch in c.chunks], type=chunks[0].type)

    def read(self, columns: list[str] | None = None) -> pa.Table:
        """All committed rows (for tests and small outputs)."""
        paths = self.part_paths()
        if not paths:
            raise FileNotFoundError(f"no committed parts in {self.root}")
        return pa.concat_tables([pq.read_table(p, columns=columns) for p in paths])

    def write_part(self, table: pa.Table, id_column: str) -> Path:
        """Commit ``table`` as one part: temp file, fsync, atomic rename. Returns the part's path.

        The name depends only on the set of ids, so writing the same rows again replaces the
        earlier part rather than duplicating it.
        """
        final = self.root / f"part-{_digest(table.column(id_column))}.parquet"
        tmp = self.tmp / f"{final.name}.{uuid.uuid4().hex}.tmp"
        pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(self.root)
        return final

    # ---- attempts (retry accounting) -------------------------------------------------------
    def record_attempt(self, ids: pa.Array | pa.ChunkedArray, id_column: str) -> Path:
        """Record that a worker starts generating the batch holding ``ids`` (before it does)."""
        self.attempts.mkdir(parents=True, exist_ok=True)
        name = f"{_digest(ids)}.{uuid.uuid4().hex}.parquet"
        tmp = self.tmp / f"{name}.tmp"
        pq.write_table(pa.table({id_column: ids}), tmp)
        path = self.attempts / name
        os.replace(tmp, path)
        return path

    def attempted_ids(self, id_column: str) -> pa.ChunkedArray | None:
        """Every id of every recorded attempt (repeats kept), or None when there is none."""
        chunks = []
        for p in sorted(self.attempts.glob("*.parquet")):   # renamed into place: always whole
            chunks.extend(pq.read_table(p, columns=[id_column]).column(0).chunks)
        if not chunks:
            return None
        types = {c.type for c in chunks}
        if len(types) > 1:
            chunks = [c.cast(chunks[0].type) for c in chunks]
        return pa.chunked_array(chunks, type=chunks[0].type)

    def clear_attempts(self) -> int:
        """Forget the attempt records (call only while holding the locks)."""
        n = 0
        for p in self.attempts.glob("*.parquet"):
            p.unlink(missing_ok=True)
            n += 1
        return n

    def clear_tmp(self) -> int:
        """Delete parts left half-written by a killed run (call only while holding the locks)."""
        n = 0
        for p in self.tmp.glob("*.tmp"):
            p.unlink(missing_ok=True)
            n += 1
        return n

    # ---- manifest ------------------------------------------------------------------------------
    def refuse_foreign_parts(self) -> None:
        """Part files but no manifest: another writer's output (a Spark job, say), whose files
        would count as committed rows; refused even when forced."""
        parts = self.part_paths() if self.root.is_dir() else []
        if parts and not self.manifest_path.exists():
            names = ", ".join(p.name for p in parts[:3])
            raise ValueError(
                f"{self.root} holds {len(parts)} part-*.parquet file(s) ({names}"
                f"{', ...' if len(parts) > 3 else ''}) but no dart-ray batch manifest "
                f"({META_DIR}/job.json): it is not the output of a dart-ray batch job. Use a "
                f"new or empty output directory")

    def check_manifest(self, manifest: dict, force: bool = False) -> None:
        """Record ``manifest`` on the first run; on a rerun refuse a different one (unless
        forced).

        * No manifest yet: the directory must hold no part file (``part-*.parquet`` files of
          another writer, a Spark job say, would otherwise count as committed rows); refused even
          when forced.
        * A manifest but no committed part (an earlier run failed before committing anything):
          nothing can be mixed, so ``manifest`` replaces it.
        * A manifest and committed parts: a different ``manifest`` is refused (naming the
          differences) unless ``force``; forced, ``manifest`` replaces it. A changed
          ``input_files`` (row-number ids, see ``batch.job``) gets its own message.
        """
        parts = self.part_paths()
        if not self.manifest_path.exists():
            self.refuse_foreign_parts()
        elif parts and not force:
            old = json.loads(self.manifest_path.read_text())
            unknown = [k for k in UNRECORDED_BEFORE if k not in old and k in manifest]
            if unknown:
                # written by a version that did not record these: unknown, not different (the
                # committed prompts are still compared with the input's)
                log.warning("%s: its manifest does not record %s (an older dart-ray wrote it); "
                            "taking this run's and recording them", self.root, unknown)
                old = {**old, **{k: manifest[k] for k in unknown}}
            for k in (f"engine.{name}" for name in PATH_FIELDS):
                v = old.get(k)
                if isinstance(v, str) and not os.path.isabs(os.path.expanduser(v)) \
                        and os.path.abspath(os.path.expanduser(v)) == manifest.get(k):
                    old[k] = manifest[k]    # a relative path an older dart-ray recorded as given
            diff = {k: (old.get(k), manifest.get(k)) for k in sorted(set(old) | set(manifest))
                    if old.get(k) != manifest.get(k)}
            if not diff and unknown:
                self._write_manifest(manifest)
            files = diff.pop("input_files", None)
            if files is not None and "ids" not in diff:
                raise ValueError(
                    f"{self.root} was written from other input files (ids are row numbers over "
                    f"the sorted input files, so adding, removing or changing a file renumbers "
                    f"the rows): (file, rows) was {files[0]!r}, now {files[1]!r}. Use another "
                    f"output directory or give the input an id column. (force would keep the "
                    f"committed rows under their old numbers: input rows whose number was "
                    f"committed before would never be generated)")
            if files is not None:
                diff["input_files"] = files
            if diff:
                lines = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
                raise ValueError(
                    f"{self.root} holds output of a job with other settings ({lines}). Use another "
                    f"output directory, or pass force to mix them")
            return
        self._write_manifest(manifest)

    def _write_manifest(self, manifest: dict) -> None:
        tmp = self.meta / f"job.json.{uuid.uuid4().hex}.tmp"
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
        os.replace(tmp, self.manifest_path)

    # ---- locks ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def driver_session(self, stale_worker_timeout_s: float = 120.0) -> Iterator[None]:
        """Hold the directory for one job: exclusive driver lock, then wait out stale workers.

        Raises :class:`OutputBusyError` when another driver holds the directory, or when workers of
        an earlier run are still alive after ``stale_worker_timeout_s``.
        """
        self.create()
        fd = os.open(self.driver_lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise OutputBusyError("another dart-ray batch job is writing to "
                                      f"{self.root}") from None
            self.wait_for_workers(stale_worker_timeout_s)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def wait_for_workers(self, timeout_s: float) -> None:
        """Wait until no worker process holds the worker lock (raises OutputBusyError after
        ``timeout_s``)."""
        fd = os.open(self.workers_lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return  # no worker of an earlier run is left; released by close below
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise OutputBusyError(
                            f"workers of an earlier job on {self.root} are still running after "
                            f"{timeout_s:.0f} s; stop them (or that Ray cluster) and "
                            "rerun") from None
                    time.sleep(0.2)
        finally:
            os.close(fd)

    def hold_worker_lock(self) -> int:
        """Take the shared worker lock for this process's lifetime; returns the fd to keep open."""
        fd = os.open(self.workers_lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd


def id_report(expected: pa.Array | pa.ChunkedArray, committed: pa.ChunkedArray | None) -> dict:
    """How ``committed`` ids cover ``expected``: counts of missing, duplicated and unexpected
    ids."""
    expected = _combine(expected)
    if committed is None or len(committed) == 0:
        return {"expected": len(expected), "committed": 0, "missing": len(expected),
                "duplicated": 0, "unexpected": 0}
    committed = _combine(committed).cast(expected.type)
    counts = pc.value_counts(committed)
    dup = int(pc.sum(pc.greater(counts.field("counts"), 1)).as_py() or 0)
    uniq = counts.field("values")
    missing = len(expected) - int(pc.sum(pc.is_in(expected, value_set=uniq)).as_py() or 0)
    unexpected = len(uniq) - int(pc.sum(pc.is_in(uniq, value_set=expected)).as_py() or 0)
    return {"expected": len(expected), "committed": len(committed), "missing": missing,
            "duplicated": dup, "unexpected": unexpected}


def retry_report(attempted: pa.ChunkedArray | None, earlier: pa.Array | None = None) -> dict:
    """Retried rows of one run from its attempt records.

    ``attempted``: ids recorded by this run's batch attempts (repeats kept). ``earlier``: ids an
    earlier, interrupted run had started but not committed (unique). Returns ``in_run`` (attempts
    beyond the first of an id: batches Ray ran again after losing a worker or node),
    ``from_interrupted_run`` (ids of ``earlier`` generated again now) and their sum ``rows``.
    """
    in_run = 0
    again = 0
    if attempted is not None and len(attempted):
        a = _combine(attempted)
        uniq = pc.unique(a)
        in_run = len(a) - len(uniq)
        if earlier is not None and len(earlier):
            again = int(pc.sum(pc.is_in(_combine(earlier).cast(a.type),
                                        value_set=uniq)).as_py() or 0)
    return {"rows": in_run + again, "in_run": in_run, "from_interrupted_run": again}


def _digest(ids: pa.Array | pa.ChunkedArray) -> str:
    """Name of a batch: a digest of its sorted ids (the same rows always get the same name)."""
    keys = sorted(str(v) for v in ids.to_pylist())
    return hashlib.sha256("\x00".join(keys).encode()).hexdigest()[:24]


def _combine(a: pa.Array | pa.ChunkedArray) -> pa.Array:
    return a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
