"""The batch job's guards around its input and output directory, without an engine or Ray: input
identity across reruns, foreign part files, categorical ids, layouts and column names, the
manifest of a failed first run, bad input through the CLI, engine failures of the pipeline."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batch import BatchJobConfig, EngineFailure, InputChangedError, OutputStore, run_batch_job
from batch.generator import OUTPUT_SCHEMA
from batch.job import (
    ROW_NUMBER,
    _load_input,
    _prepare,
    check_actor_cpus,
    check_committed_prompts,
    check_room_for_reads,
    engine_failure,
)
from batch.store import CorruptPartError
from dart_ray import DecodingConfig, DecodingSchedule, SamplingParams, save_profile


def _commit(store: OutputStore, ids: list, prompts: list, id_type: pa.DataType | None = None):
    """A part as the job's actors commit it (id, prompt, the output columns)."""
    n = len(ids)
    out = {f.name: pa.nulls(n, f.type) for f in OUTPUT_SCHEMA}
    out["generated_text"] = pa.array([f"gen {p}" for p in prompts], pa.string())
    table = pa.table({"id": pa.array(ids, id_type), "prompt": pa.array(prompts, pa.string()),
                      **out})
    return store.write_part(table, "id")


def _first_run(cfg: BatchJobConfig, ids: list, prompts: list, profile: dict | None = None):
    """The state a completed first run leaves: its manifest and its parts."""
    inp = _load_input(cfg)
    store = OutputStore(cfg.output)
    store.create()
    store.check_manifest(cfg.manifest(ROW_NUMBER if inp.numbered is not None else "column",
                                      profile=profile, input_files=inp.file_rows))
    _commit(store, ids, prompts, inp.ids.type)
    return store


# ---- 1. input identity --------------------------------------------------------------------------
def test_row_number_ids_refuse_another_set_of_input_files(tmp_path):
    """No id column: a file added that sorts first renumbers every row; the rerun is refused
    instead of generating b1, b2 again under the ids 3, 4 (and never a0, a1)."""
    d = tmp_path / "in"
    d.mkdir()
    pq.write_table(pa.table({"prompt": ["b0", "b1", "b2"]}), d / "b.parquet")
    cfg = BatchJobConfig(input=str(d), output=str(tmp_path / "out"), progress=False)
    assert _load_input(cfg).file_rows == [("b.parquet", 3)]
    assert cfg.manifest(ROW_NUMBER, input_files=[("b.parquet", 3)])["input_files"] == [
        ["b.parquet", 3]]
    _first_run(cfg, [0, 1, 2], ["b0", "b1", "b2"])
    again = run_batch_job(cfg)                       # the same input: complete, nothing to do
    assert again.ok and again.already_done == 3 and again.rows == 0

    pq.write_table(pa.table({"prompt": ["a0", "a1"]}), d / "a.parquet")
    with pytest.raises(ValueError, match=r"other input files.*'a.parquet', 2"):
        run_batch_job(cfg)
    # the prompts of the committed ids tell the same, whatever the manifest says
    with pytest.raises(InputChangedError, match=r"3 committed row\(s\).*ids \[0, 1, 2\]"):
        check_committed_prompts(OutputStore(cfg.output), cfg, _load_input(cfg))


def test_another_input_with_the_same_ids_is_refused_unless_forced(tmp_path, caplog):
    in1, in2 = tmp_path / "in1.parquet", tmp_path / "in2.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3], "prompt": ["a", "b", "c"]}), in1)
    pq.write_table(pa.table({"id": [1, 2, 3], "prompt": ["a", "other", "prompts"]}), in2)
    out = str(tmp_path / "out")
    _first_run(BatchJobConfig(input=str(in1), output=out), [1, 2, 3], ["a", "b", "c"])
    assert run_batch_job(BatchJobConfig(input=str(in1), output=out, progress=False)).ok
    with pytest.raises(InputChangedError, match=r"2 committed row\(s\).*ids \[2, 3\].*force"):
        run_batch_job(BatchJobConfig(input=str(in2), output=out, progress=False))
    forced = run_batch_job(BatchJobConfig(input=str(in2), output=out, progress=False, force=True))
    assert forced.ok and forced.rows == 0                      # kept as they are, as asked
    assert "forced" in caplog.text


def test_non_string_prompts_and_older_manifests_are_not_a_changed_input(tmp_path, caplog):
    """JSONL numbers reach the workers as Ray Data reads them (7 -> "7.0"): prompts that are not
    strings (error rows anyway) are not compared. A manifest written before input files and
    profiles were recorded takes this run's, with a warning, instead of refusing a rerun of the
    same job; a real change is still refused."""
    numbers = tmp_path / "n.jsonl"
    numbers.write_text('{"id": 1, "prompt": 7}\n{"id": 2, "prompt": 9}\n')
    cfg = BatchJobConfig(input=str(numbers), output=str(tmp_path / "o1"), progress=False)
    _first_run(cfg, [1, 2], ["7.0", "9.0"])
    check_committed_prompts(OutputStore(cfg.output), cfg, _load_input(cfg))   # no error

    d = tmp_path / "in"
    d.mkdir()
    pq.write_table(pa.table({"prompt": ["b0", "b1"]}), d / "b.parquet")
    cfg = BatchJobConfig(input=str(d), output=str(tmp_path / "o2"), progress=False)
    store = _first_run(cfg, [0, 1], ["b0", "b1"])
    old = json.loads(store.manifest_path.read_text())
    del old["input_files"]                                   # as the previous version wrote it
    store.manifest_path.write_text(json.dumps(old))
    assert run_batch_job(cfg).ok and "does not record ['input_files']" in caplog.text
    assert json.loads(store.manifest_path.read_text())["input_files"] == [["b.parquet", 2]]
    with pytest.raises(ValueError, match="other settings"):
        run_batch_job(dataclasses.replace(cfg, sampling=SamplingParams(max_new_tokens=99)))


def test_the_profile_is_part_of_the_manifest(tmp_path):
    def profile(depth: int) -> str:
        path = tmp_path / f"p{depth}.yaml"
        save_profile(DecodingSchedule.constant(DecodingConfig(draft_depth=depth), "t"), path)
        return str(path)

    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["x"], "prompt": ["p"]}), inp)
    out = str(tmp_path / "out")
    cfg = BatchJobConfig(input=str(inp), output=out, profile=profile(4), progress=False)
    from dart_ray import load_profile

    p4 = load_profile(cfg.profile).to_dict()
    assert cfg.manifest("column", profile=p4)["profile"] == p4["schedule"]
    assert "profile" not in cfg.manifest("column")     # manifests of profile-less jobs unchanged
    _first_run(cfg, ["x"], ["p"], profile=p4)
    assert run_batch_job(cfg).ok
    with pytest.raises(ValueError, match="other settings.*profile"):
        run_batch_job(BatchJobConfig(input=str(inp), output=out, profile=profile(6),
                                     progress=False))
    with pytest.raises(ValueError, match="other settings.*profile"):
        run_batch_job(BatchJobConfig(input=str(inp), output=out, progress=False))


# ---- 2. foreign part files ---------------------------------------------------------------------
def test_foreign_part_files_are_not_committed_rows(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(pa.table({"id": [1, 2], "prompt": ["a", "b"], "score": [0.1, 0.2]}),
                   out / "part-00000-abc-c000.snappy.parquet")     # a Spark job's output
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3], "prompt": ["a", "b", "c"]}), inp)
    with pytest.raises(ValueError, match=r"part-00000-abc-c000.*not the output of a dart-ray"):
        run_batch_job(BatchJobConfig(input=str(inp), output=str(out), force=True))
    assert sorted(p.name for p in out.iterdir()) == ["part-00000-abc-c000.snappy.parquet"]
    # a part without the job's columns (copied in after a first run) is not counted either
    store = OutputStore(out)
    assert len(store.committed_ids("id")) == 2          # without required columns: any id column
    with pytest.raises(CorruptPartError, match=r"part-00000-abc-c000.*lacks.*generated_text"):
        store.committed_ids("id", ("prompt", "generated_text", "error"))


# ---- 4. categorical ids ------------------------------------------------------------------------
def test_categorical_ids_are_read_as_their_values(tmp_path):
    inp = tmp_path / "in.parquet"
    pd.DataFrame({"id": pd.Categorical(["a", "b", "c"]), "prompt": ["x", "y", "z"]}).to_parquet(inp)
    assert pa.types.is_dictionary(pq.read_schema(inp).field("id").type)
    cfg = BatchJobConfig(input=str(inp), output=str(tmp_path / "out"), progress=False)
    loaded = _load_input(cfg)
    assert loaded.ids.type == pa.string() and loaded.ids.to_pylist() == ["a", "b", "c"]
    prepared = _prepare(pq.read_table(inp), "id", "prompt", loaded.ids.type,
                        pa.array(["b"]))                 # what the read tasks see: dictionary ids
    assert prepared.column("id").type == pa.string()
    assert prepared.column("id").to_pylist() == ["a", "c"]
    _first_run(cfg, ["a", "b", "c"], ["x", "y", "z"])
    summary = run_batch_job(cfg)                        # the end-of-job id report, every rerun
    assert summary.ok and summary.already_done == 3


# ---- 5. output inside the input ----------------------------------------------------------------
@pytest.mark.parametrize("sub", ["out", "out/deeper", "."])
def test_output_inside_the_input_directory_is_refused(tmp_path, sub):
    d = tmp_path / "in"
    d.mkdir()
    pq.write_table(pa.table({"id": [1], "prompt": ["a"]}), d / "a.parquet")
    with pytest.raises(ValueError, match="inside the input directory"):
        run_batch_job(BatchJobConfig(input=str(d), output=str(d / sub)))
    assert not (d / "_dart_ray").exists() and not (d / "out").exists()    # nothing created


# ---- 6. column names ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{"prompt_column": "error"}, {"id_column": "generated_text"},
                                {"prompt_column": "text", "id_column": "text"}])
def test_columns_named_like_output_columns_are_refused(kw):
    with pytest.raises(ValueError, match="output column|both"):
        BatchJobConfig(input="in.parquet", output="out", **kw)


# ---- 7. a first run that committed nothing -----------------------------------------------------
def test_a_manifest_without_committed_parts_is_replaced(tmp_path):
    store = OutputStore(tmp_path / "out")
    store.create()
    store.check_manifest({"engine.model": "/bad/path", "max_new_tokens": 4})   # failed first run
    store.check_manifest({"engine.model": "/good/path", "max_new_tokens": 4})  # the fixed rerun
    assert json.loads(store.manifest_path.read_text())["engine.model"] == "/good/path"
    store.write_part(pa.table({"id": ["a"]}), "id")
    with pytest.raises(ValueError, match="other settings"):
        store.check_manifest({"engine.model": "/other", "max_new_tokens": 4})


def test_a_relative_model_path_an_older_version_recorded_still_resumes(tmp_path, monkeypatch):
    """Commands now record an existing relative --model as absolute; an output whose manifest an
    older version wrote with the path as given resumes when it names the same directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    store = OutputStore(tmp_path / "out")
    store.create()
    store.check_manifest({"engine.model": "m", "max_new_tokens": 4})          # older version
    store.write_part(pa.table({"id": ["a"]}), "id")
    store.check_manifest({"engine.model": str(tmp_path / "m"), "max_new_tokens": 4})
    with pytest.raises(ValueError, match="other settings"):
        store.check_manifest({"engine.model": str(tmp_path / "elsewhere"), "max_new_tokens": 4})


# ---- 8. bad input through the CLI --------------------------------------------------------------
def _cli_error(capsys, inp: Path, out: Path) -> tuple[int, str]:
    from batch.cli import batch_cli

    rc = batch_cli(["--input", str(inp), "--output", str(out), "--no-progress"])
    return rc, capsys.readouterr().err


def test_bad_input_exits_2_with_a_message_naming_the_file(tmp_path, capsys):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    pq.write_table(pa.table({"id": [1, 2], "prompt": ["a", "b"]}), mixed / "a.parquet")
    pq.write_table(pa.table({"id": ["3", "4"], "prompt": ["c", "d"]}), mixed / "b.parquet")
    rc, err = _cli_error(capsys, mixed, tmp_path / "o1")
    assert rc == 2 and "column 'id' is int64 in" in err and "b.parquet" in err

    empty = tmp_path / "empty"
    empty.mkdir()
    pq.write_table(pa.table({"id": [1], "prompt": ["a"]}), empty / "a.parquet")
    (empty / "z.parquet").write_bytes(b"")
    rc, err = _cli_error(capsys, empty, tmp_path / "o2")
    assert rc == 2 and "z.parquet" in err and "Traceback" not in err

    afile = tmp_path / "afile"
    afile.write_text("x")
    rc, err = _cli_error(capsys, mixed / "a.parquet", afile)
    assert rc == 2 and "is a file, not a directory" in err


# ---- 3. an engine failure fails the batch; the job reruns it, then gives up ---------------------
def test_engine_failures_rerun_the_pipeline_then_fail_the_job(tmp_path, monkeypatch):
    import batch.job as job

    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["x", "y"]}), inp)
    cfg = BatchJobConfig(input=str(inp), output=str(tmp_path / "out"), progress=False,
                         max_resumes=2)
    calls = []

    def failing(cfg, store, *args):
        calls.append(1)
        try:    # as Ray Data raises it: the actor's exception wrapped in its own
            raise EngineFailure("the engine failed on a batch of 2 rows: RuntimeError: boom")
        except EngineFailure as e:
            raise RuntimeError("UserCodeException: map_batches(_PartWriter) failed") from e

    monkeypatch.setattr(job, "_run_pipeline", failing)
    with pytest.raises(EngineFailure, match=r"boom.*run 3 time\(s\).*rerun the job to resume"):
        run_batch_job(cfg)
    assert len(calls) == 3 and OutputStore(cfg.output).committed_ids("id") is None

    def once(cfg, store, inp, *args):
        if len(calls) == 3:
            failing(cfg, store)
        _commit(store, ["a", "b"], ["x", "y"])

    monkeypatch.setattr(job, "_run_pipeline", once)
    summary = run_batch_job(cfg)
    assert summary.ok and summary.engine_failures == 1
    assert "after an engine failure: 1x" in summary.format()

    # a pipeline that commits a batch, then fails before its totals reach the driver: the rerun
    # reports only its own batch, and the summary says one row is in the output but not counted
    cfg = BatchJobConfig(input=str(inp), output=str(tmp_path / "out2"), progress=False)
    calls.clear()

    def commits_then_fails(cfg, store, inp, done, missing, profile, summary, *args):
        calls.append(1)
        if len(calls) == 1:
            _commit(store, ["a"], ["x"])
            failing(cfg, store)
        _commit(store, ["b"], ["y"])
        summary.add({"rows": 1, "errors": 0, "prompt_tokens": 1, "completion_tokens": 4,
                     "steps": 2, "accepted_tokens": 2, "generate_s": 0.1})

    monkeypatch.setattr(job, "_run_pipeline", commits_then_fails)
    summary = run_batch_job(cfg)
    assert summary.ok and summary.rows == 1 and summary.unreported_rows == 1
    assert "1 processed this run (0 errors)" in summary.format()
    assert "1 more committed by a stopped pipeline (not in the totals)" in summary.format()
    assert engine_failure(ValueError("bad row")) is None      # other errors are not retried
    # Ray 2.60 keeps only the text of the actor's exception (RayTaskError(UserCodeException))
    wrapped = RuntimeError("Failed to process the following data block: ...\nTraceback ...\n"
                           "batch.generator.EngineFailure: the engine failed on a batch of 4 "
                           "rows: RuntimeError: boom\n\nYou can retry ...")
    assert str(engine_failure(wrapped)) == (
        "the engine failed on a batch of 4 rows: RuntimeError: boom")


# ---- 9. an actor larger than any node ----------------------------------------------------------
def test_an_actor_larger_than_every_node_is_refused():
    check_actor_cpus(2.0, 2.0)
    with pytest.raises(ValueError, match="largest node of the Ray cluster has 2 CPUs"):
        check_actor_cpus(3.0, 2.0)


# ---- 10. no CPU left for the reads -------------------------------------------------------------
def test_a_local_ray_without_a_cpu_for_the_reads_is_refused(caplog):
    """On one CPU the actor took 0.25 and Ray Data's repartition, which needs a whole CPU, waited
    forever with no word (about 45 min of stall guards by default)."""
    with pytest.raises(ValueError, match="at least 2 CPUs"):
        check_room_for_reads(1.0, 0.25, local=True)
    with pytest.raises(ValueError, match="--num-cpus-per-actor"):
        check_room_for_reads(2.0, 1.5, local=True)
    check_room_for_reads(2.0, 1.0, local=True)          # one CPU left: runs
    check_room_for_reads(0.0, 0.25, local=False)        # no CPU node yet: an autoscaler may add one
    with caplog.at_level("WARNING"):
        check_room_for_reads(1.0, 0.25, local=False)    # a cluster may grow: warned, not refused
    assert "until the cluster grows" in caplog.text


# ---- 11. the input's types ----------------------------------------------------------------------
def test_ids_of_another_width_resume_in_the_committed_type(tmp_path, monkeypatch):
    """A file re-saved by pandas (int32 -> int64): the new run committed int64 parts beside the
    int32 ones, then failed, and every later run refused the output ("disagree on the id type").
    Now the ids take the committed type when they convert without loss; otherwise nothing runs."""
    import batch.job as job

    v1, v2 = tmp_path / "v1.parquet", tmp_path / "v2.parquet"
    pq.write_table(pa.table({"id": pa.array([1, 2], pa.int32()), "prompt": ["a", "b"]}), v1)
    pq.write_table(pa.table({"id": pa.array([1, 2, 3], pa.int64()),
                             "prompt": ["a", "b", "c"]}), v2)
    out = str(tmp_path / "out")
    _first_run(BatchJobConfig(input=str(v1), output=out), [1, 2], ["a", "b"])
    seen = []

    def pipeline(cfg, store, inp, done, *args):
        seen.append((inp.ids.type, done.type))
        assert done.to_pylist() == [1, 2]
        _commit(store, [3], ["c"], inp.ids.type)

    monkeypatch.setattr(job, "_run_pipeline", pipeline)
    summary = run_batch_job(BatchJobConfig(input=str(v2), output=out, progress=False))
    assert seen == [(pa.int32(), pa.int32())] and summary.ok and summary.already_done == 2
    assert OutputStore(out).committed_ids("id").type == pa.int32()
    assert run_batch_job(BatchJobConfig(input=str(v2), output=out, progress=False)).ok
    # ids that do not fit the committed type, or another kind of id: refused before any work
    v3 = tmp_path / "v3.parquet"
    pq.write_table(pa.table({"id": pa.array([1, 2, 2**40], pa.int64()),
                             "prompt": ["a", "b", "c"]}), v3)
    with pytest.raises(ValueError, match="do not convert without loss"):
        run_batch_job(BatchJobConfig(input=str(v3), output=out, progress=False, force=True))
    v4 = tmp_path / "v4.parquet"
    pq.write_table(pa.table({"id": ["1", "2", "3"], "prompt": ["a", "b", "c"]}), v4)
    with pytest.raises(ValueError, match="int32"):
        run_batch_job(BatchJobConfig(input=str(v4), output=out, progress=False, force=True))
    assert len(seen) == 1


def test_prompt_columns_of_different_kinds_and_unhashable_ids_are_refused(tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    pq.write_table(pa.table({"id": [1], "prompt": [5]}), d / "a.parquet")
    pq.write_table(pa.table({"id": [2], "prompt": ["text"]}), d / "b.parquet")
    with pytest.raises(ValueError, match=r"prompt column 'prompt': int64 in .*a.parquet but "
                                         r"string in .*b.parquet"):
        _load_input(BatchJobConfig(input=str(d), output=str(tmp_path / "o")))
    j = tmp_path / "mixed_jsonl"
    j.mkdir()
    (j / "a.jsonl").write_text('{"id": 1, "prompt": 5}\n')
    (j / "b.jsonl").write_text('{"id": 2, "prompt": "text"}\n')
    with pytest.raises(ValueError, match="disagree on the prompt column"):
        _load_input(BatchJobConfig(input=str(j), output=str(tmp_path / "o")))
    ok = tmp_path / "ok"        # large_string, dictionary and all-null columns go with strings
    ok.mkdir()
    pq.write_table(pa.table({"id": [1], "prompt": pa.array(["x"], pa.large_string())}),
                   ok / "a.parquet")
    pq.write_table(pa.table({"id": [2], "prompt": pa.array(["y"]).dictionary_encode()}),
                   ok / "b.parquet")
    pq.write_table(pa.table({"id": [3], "prompt": pa.nulls(1)}), ok / "c.parquet")
    assert len(_load_input(BatchJobConfig(input=str(ok), output=str(tmp_path / "o"))).ids) == 3
    lst = tmp_path / "list.parquet"
    pq.write_table(pa.table({"id": [[1], [2]], "prompt": ["a", "b"]}), lst)
    with pytest.raises(ValueError, match="ids must be integers, strings"):
        _load_input(BatchJobConfig(input=str(lst), output=str(tmp_path / "o")))
