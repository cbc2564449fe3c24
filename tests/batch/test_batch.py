"""Tests for batch/: DartGenerator, the atomic output store, and the resumable exactly-once job.

A tiny random Llama (hidden 64, 4 layers, SmolLM2's tokenizer) keeps generation cheap; Ray runs
either in a subprocess (the kill test drives ``python -m batch.cli``) or once in-process for the
tests at the end of the module.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from conftest import make_tiny_checkpoint

from batch import (
    OUTPUT_COLUMNS,
    BatchJobConfig,
    DartGenerator,
    DuplicateIdError,
    OutputStore,
    run_batch_job,
)
from batch.store import CorruptPartError, OutputBusyError
from dart_ray import (
    DecodingConfig,
    DecodingSchedule,
    Engine,
    EngineConfig,
    SamplingParams,
    save_profile,
)

REPO = Path(__file__).resolve().parents[2]
MAX_NEW = 8
ENGINE = {"method": "none", "dtype": "fp32", "max_seq_len": 256, "max_batch_size": 4,
          "num_threads": 1}
TOO_LONG = "word " * 400  # > max_seq_len 256
BAD_ROWS = {5: None, 17: "", 40: TOO_LONG}


def _prompts(n: int) -> list:
    out = [f"Prompt {i}: tell me about {'cats ' * (i % 5)}and {i * 7 % 13} dogs" for i in range(n)]
    for i, p in BAD_ROWS.items():
        if i < n:
            out[i] = p
    return out


def _ids(n: int) -> list[str]:
    return [f"row-{i:04d}" for i in range(n)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm_dir) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("batch") / "llama", "llama", smollm_dir)


@pytest.fixture(scope="module")
def engine_config(tiny_model) -> dict:
    return dict(model=str(tiny_model), **ENGINE)


@pytest.fixture(scope="module")
def ref_engine(engine_config) -> Engine:
    """What ``dart-ray generate`` runs: one prompt at a time."""
    return Engine.from_config(EngineConfig(**engine_config))


def _single(engine: Engine, prompt: str, **params):
    return engine.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW, **params))[0]


def _assert_matches_single(ref_engine: Engine, rows: list[dict],
                           prompt_key: str = "prompt") -> None:
    for r in rows:
        c = _single(ref_engine, r[prompt_key])
        assert r["error"] is None
        assert r["generated_text"] == c.text
        assert r["num_completion_tokens"] == len(c.token_ids)
        assert r["num_prompt_tokens"] == c.num_prompt_tokens
        assert r["finish_reason"] == c.finish_reason


# ---- DartGenerator (no Ray) ----------------------------------------------------------------------
def test_generator_error_rows_and_greedy_equals_single_request(engine_config, ref_engine):
    n = 45
    table = pa.table({"id": _ids(n), "prompt": _prompts(n), "extra": list(range(n))})
    gen = DartGenerator(engine_config, max_new_tokens=MAX_NEW)
    out = gen(table)
    assert out.column_names == ["id", "prompt", "extra", *OUTPUT_COLUMNS]
    rows = out.to_pylist()
    assert rows[5]["error"] == "ValueError: prompt is null"
    assert rows[17]["error"] == "ValueError: prompt is empty"
    assert rows[40]["error"].startswith("PromptTooLongError: prompt has")
    assert rows[40]["num_prompt_tokens"] > 256
    for i in BAD_ROWS:
        assert rows[i]["generated_text"] is None and rows[i]["finish_reason"] is None
    good = [r for i, r in enumerate(rows) if i not in BAD_ROWS]
    assert all(r["num_completion_tokens"] >= 1 and r["latency_s"] > 0 for r in good)
    _assert_matches_single(ref_engine, good[::6])


def test_generator_batch_formats(engine_config):
    gen = DartGenerator(engine_config, max_new_tokens=2, id_column=None)
    df = pd.DataFrame({"prompt": ["Hello there", 42, None], "keep": ["a", "b", "c"]})
    out = gen(df)
    assert list(out.columns) == ["prompt", "keep", *OUTPUT_COLUMNS]
    assert out["keep"].tolist() == ["a", "b", "c"]
    assert out["error"].tolist()[1] == "TypeError: prompt must be a string, got int"
    assert out["num_completion_tokens"].tolist()[0] == 2
    d = gen({"prompt": pa.array(["Hi", "Bye"]).to_numpy(zero_copy_only=False)})
    assert set(OUTPUT_COLUMNS) <= set(d) and list(d["num_completion_tokens"]) == [2, 2]


def test_dart_method_is_lossless_against_plain_single_requests(engine_config, ref_engine):
    cfg = dict(engine_config, method="dart", drafter="random")
    small = {"draft_depth": 4, "top_k": 4, "beam_width": 4}
    profile = {"workload": "t", "schedule": [  # DecodingSchedule.to_dict() form
        {"max_batch_size": 2, "decoding": dict(small, tree_budget=12)},
        {"max_batch_size": 64, "decoding": dict(small, tree_budget=6)}]}
    gen = DartGenerator(cfg, max_new_tokens=MAX_NEW, profile=profile)
    assert gen.engine.decoding_for(2).tree_budget == 12
    assert gen.engine.decoding_for(4).tree_budget == 6
    prompts = [p for p in _prompts(8) if p]
    out = gen(pa.table({"prompt": prompts})).to_pylist()
    _assert_matches_single(ref_engine, out)
    assert all(r["mean_accepted_len"] >= 1.0 for r in out)


def test_an_engine_failure_fails_the_batch_without_a_rebuild_per_row(engine_config, monkeypatch):
    """An exception from the engine is no row's fault: the batch fails (its rows are not recorded
    as error rows, which would be committed as done), with one engine rebuilt for the next batch,
    not one per row. Bad rows stay error rows."""
    from batch import EngineFailure

    gen = DartGenerator(engine_config, max_new_tokens=2)
    builds = []
    monkeypatch.setattr(gen, "_build_engine", lambda: builds.append(1) or gen.engine)

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(gen.engine, "generate", broken)
    table = pa.table({"id": _ids(4), "prompt": ["Hello", None, "there", ""]})
    with pytest.raises(EngineFailure, match="batch of 2 rows: RuntimeError: CUDA error"):
        gen.process(table)
    assert builds == [1]
    out, st = gen.process(table.take([1, 3]))      # only bad rows: the engine is not called
    assert st.errors == 2 and out.column("error").to_pylist() == [
        "ValueError: prompt is null", "ValueError: prompt is empty"]


def test_profile_by_path(tmp_path, engine_config):
    path = save_profile(DecodingSchedule.constant(DecodingConfig(draft_depth=4), "t"),
                        tmp_path / "p.yaml")
    gen = DartGenerator(engine_config, max_new_tokens=2, profile=str(path))
    assert gen.engine.decoding_for(3).draft_depth == 4


def test_sampling_seeds_follow_ids_not_batching(engine_config):
    gen = DartGenerator(engine_config, max_new_tokens=MAX_NEW, temperature=1.0, seed=7)
    table = pa.table({"id": _ids(6), "prompt": _prompts(6)})
    together = gen(table)["generated_text"].to_pylist()
    split = gen(table.slice(0, 2))["generated_text"].to_pylist() + \
        gen(table.slice(2, 4).take([3, 2, 1, 0]))["generated_text"].to_pylist()[::-1]
    assert split == together
    other = DartGenerator(engine_config, max_new_tokens=MAX_NEW, temperature=1.0, seed=8)
    assert other(table)["generated_text"].to_pylist() != together


# ---- the output store --------------------------------------------------------------------------
def _rows(ids: list[str]) -> pa.Table:
    return pa.table({"id": ids, "x": list(range(len(ids)))})


def test_parts_commit_atomically_and_idempotently(tmp_path):
    store = OutputStore(tmp_path / "out")
    store.create()
    assert store.committed_ids("id") is None
    a = store.write_part(_rows(["a", "b"]), "id")
    again = store.write_part(_rows(["b", "a"]), "id")  # a retried batch replaces its own part
    assert a == again and len(store.part_paths()) == 1
    store.write_part(_rows(["c"]), "id")
    (store.tmp / "part-x.parquet.123.tmp").write_bytes(b"PAR1 half-written")  # a killed writer
    assert sorted(store.committed_ids("id").to_pylist()) == ["a", "b", "c"]
    assert store.clear_tmp() == 1 and not list(store.tmp.iterdir())
    (store.root / "part-bogus.parquet").write_bytes(b"not parquet")
    with pytest.raises(CorruptPartError, match="part-bogus"):
        store.committed_ids("id")


def test_attempt_records_count_retried_rows(tmp_path):
    from batch.store import retry_report

    store = OutputStore(tmp_path / "out")
    store.create()
    assert store.attempted_ids("id") is None
    assert retry_report(None) == {"rows": 0, "in_run": 0, "from_interrupted_run": 0}
    store.record_attempt(pa.array(["a", "b"]), "id")
    store.record_attempt(pa.array(["c", "d"]), "id")
    store.record_attempt(pa.array(["b", "a"]), "id")    # the first batch, run again after a loss
    assert not list(store.tmp.iterdir())                 # records are renamed into place
    attempted = store.attempted_ids("id")
    assert sorted(attempted.to_pylist()) == ["a", "a", "b", "b", "c", "d"]
    # "x" was started by an interrupted earlier run and generated again now; "y" was not (yet)
    assert retry_report(attempted, pa.array(["x", "y"])) == {
        "rows": 2, "in_run": 2, "from_interrupted_run": 0}
    store.record_attempt(pa.array(["x"]), "id")
    assert retry_report(store.attempted_ids("id"), pa.array(["x", "y"])) == {
        "rows": 3, "in_run": 2, "from_interrupted_run": 1}
    assert store.clear_attempts() == 4 and store.attempted_ids("id") is None


def test_driver_lock_excludes_second_driver_and_waits_for_stale_workers(tmp_path):
    store = OutputStore(tmp_path / "out")
    with store.driver_session(), pytest.raises(OutputBusyError, match="another"), \
            store.driver_session():
        pass
    # A worker of a killed run still holds the worker lock and commits one more part.
    code = ("import sys, time, pyarrow as pa; from batch.store import OutputStore; "
            "s = OutputStore(sys.argv[1]); s.hold_worker_lock(); print('locked', flush=True); "
            "time.sleep(1.5); s.write_part(pa.table({'id': ['late']}), 'id')")
    worker = subprocess.Popen([sys.executable, "-c", code, str(store.root)], stdout=subprocess.PIPE,
                              text=True, cwd=REPO)
    try:
        assert worker.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        with store.driver_session():
            assert time.monotonic() - t0 > 1.0
            assert store.committed_ids("id").to_pylist() == ["late"]  # seen before resuming
        with pytest.raises(OutputBusyError, match="still running"):
            fd = store.hold_worker_lock()
            try:
                with store.driver_session(stale_worker_timeout_s=0.3):
                    pass
            finally:
                os.close(fd)
    finally:
        worker.wait(timeout=30)


def test_bad_input_is_refused_before_any_work(tmp_path, engine_config):
    dup = tmp_path / "dup.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "a"], "prompt": ["x", "y", "z"]}), dup)
    cfg = BatchJobConfig(input=str(dup), output=str(tmp_path / "o1"),
                         engine=EngineConfig(**engine_config))
    with pytest.raises(DuplicateIdError, match="more than once"):
        run_batch_job(cfg)
    noprompt = tmp_path / "noprompt.jsonl"
    noprompt.write_text('{"id": 1, "text": "x"}\n')
    with pytest.raises(ValueError, match="no prompt column"):
        run_batch_job(BatchJobConfig(input=str(noprompt), output=str(tmp_path / "o2")))
    # an output directory written with other settings is not resumed into
    store = OutputStore(tmp_path / "o3")
    store.create()
    store.check_manifest({"max_new_tokens": 64})
    store.write_part(pa.table({"id": ["z"]}), "id")  # committed rows (without, it is replaced)
    ok = tmp_path / "ok.parquet"
    pq.write_table(pa.table({"id": ["a"], "prompt": ["x"]}), ok)
    with pytest.raises(ValueError, match="other settings"):
        run_batch_job(BatchJobConfig(input=str(ok), output=str(store.root)))


def test_manifest_is_the_engine_fingerprint_and_the_generation_settings(tmp_path):
    """Issue 18: the job contains one EngineConfig (a dict is read with ``EngineConfig.from_dict``)
    and its manifest is that config's fingerprint, less the settings a resumed run may change."""
    import dataclasses

    from batch import engine_config_from_dict
    from batch.job import MANIFEST_EXCLUDES
    from dart_ray.config import RenamedWarning

    cfg = BatchJobConfig(input="in.parquet", output="out", engine=dict(ENGINE))
    with pytest.warns(RenamedWarning, match="EngineConfig.from_dict"):  # the deprecated alias
        assert cfg.engine == EngineConfig(**ENGINE) == engine_config_from_dict(ENGINE)
    m = cfg.manifest("column")
    fp = cfg.engine.fingerprint(exclude=MANIFEST_EXCLUDES)
    assert {k: m[f"engine.{k}"] for k in fp} == fp
    assert set(fp) == set(cfg.engine.fingerprint()) - {"num_threads", "max_batch_size"}
    assert not {k for k in m if k.endswith(("num_threads", "max_batch_size"))}
    assert m["max_new_tokens"] == cfg.sampling.max_new_tokens
    assert m["ids"] == "column" and m["seed"] == cfg.seed
    assert json.loads(json.dumps(m)) == m
    resumable = dataclasses.replace(cfg, engine=cfg.engine.replace(num_threads=8, max_batch_size=2))
    assert resumable.manifest("column") == m
    for change in ({"adaptive": False}, {"decoding": DecodingConfig(top_k=3)}, {"device": "cuda"},
                   {"seed": 1}, {"method": "ngram"}):
        changed = dataclasses.replace(cfg, engine=cfg.engine.replace(**change))
        assert changed.manifest("column") != m, change
    with pytest.raises(ValueError, match="unknown EngineConfig fields"):
        BatchJobConfig(input="in.parquet", output="out", engine={"threads": 2})
    # a resumed run with another engine setting is refused, naming the setting
    store = OutputStore(tmp_path / "o")
    store.create()
    store.check_manifest(m)
    store.write_part(pa.table({"id": ["z"]}), "id")
    with pytest.raises(ValueError, match=r"engine.adaptive: True -> False"):
        other = dataclasses.replace(cfg, engine=cfg.engine.replace(adaptive=False))
        store.check_manifest(other.manifest("column"))


# ---- the job, killed and resumed (subprocess CLI) ----------------------------------------------
def _cli(inp: Path, out: Path, model: Path, ray_tmp: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "batch.cli", "--input", str(inp), "--output", str(out),
            "--model", str(model), "--method", "none", "--dtype", "fp32", "--max-seq-len", "256",
            "--max-new-tokens", str(MAX_NEW), "--batch-size", "4", "--max-batch-size", "2",
            "--num-cpus", "2", "--ray-temp-dir", ray_tmp, "--no-progress", *extra]


def test_killed_job_resumes_with_every_id_exactly_once(tmp_path, tiny_model, ref_engine):
    n = 300
    inp = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": _ids(n), "prompt": _prompts(n)}), inp)
    out = tmp_path / "out"
    store = OutputStore(out)
    ray_tmp = tempfile.mkdtemp(prefix="drb", dir="/tmp")  # short: Ray's socket paths are limited
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    cmd = _cli(inp, out, tiny_model, ray_tmp)
    first = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while len(store.part_paths()) < 5:
            assert first.poll() is None, f"job exited early: {first.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no parts written in time"
            time.sleep(0.02)
        os.kill(first.pid, signal.SIGKILL)  # the driver dies mid-run; its actors linger briefly
        first.wait(timeout=30)
        killed_at = len(store.part_paths())
        assert 5 <= killed_at < n // 4, "the job was not interrupted mid-run"

        second = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=400)
        assert second.returncode == 0, second.stderr[-3000:]
        assert "each exactly once" in second.stdout

        table = store.read()
        ids = table.column("id").to_pylist()
        assert len(ids) == n and set(ids) == set(_ids(n))  # no loss, no duplicates
        rows = {r["id"]: r for r in table.to_pylist()}
        errors = {r["id"] for r in rows.values() if r["error"] is not None}
        assert errors == {_ids(n)[i] for i in BAD_ROWS}
        assert rows[_ids(n)[40]]["error"].startswith("PromptTooLongError")
        _assert_matches_single(ref_engine, [rows[i] for i in _ids(n)[::37] if i not in errors])
        last = json.loads((store.meta / "last_run.json").read_text())
        assert last["ok"] and last["already_done"] >= 4 * killed_at  # resumed, not restarted
        assert last["rows"] == n - last["already_done"]
        # rows the killed run had started but not committed are generated again, and counted
        assert last["retried_rows"] == last["retries"]["from_interrupted_run"] <= last["rows"]
        assert "retried:" in second.stdout

        third = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=120)
        assert third.returncode == 0 and "0 processed this run" in third.stdout
        assert len(store.read()) == n
    finally:
        try:  # Ray helpers of the killed run exit by themselves within a minute; do not wait
            os.killpg(first.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        shutil.rmtree(ray_tmp, ignore_errors=True)


# ---- in-process Ray: JSONL without ids, two actors; DartGenerator in a user's pipeline -----------
@pytest.fixture(scope="module")
def ray_local():
    import ray

    from dart_ray import init_ray

    tmp = tempfile.mkdtemp(prefix="drb", dir="/tmp")
    assert init_ray(num_cpus=2, include_dashboard=False, _temp_dir=tmp)  # as the job starts one
    yield ray
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


def test_the_jobs_own_ray_runs_workers_at_the_drivers_priority(ray_local):
    """Ray lowers its workers' priority by 15 unless told; the Ray a job starts does not."""
    @ray_local.remote(num_cpus=0)
    def nice() -> int:
        return os.nice(0)

    assert ray_local.get(nice.remote()) == os.nice(0)


def test_jsonl_without_id_column_two_actors(tmp_path, engine_config, ref_engine, ray_local):
    n = 42
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in _prompts(n)))
    cfg = BatchJobConfig(input=str(inp), output=str(tmp_path / "out"),
                         engine=EngineConfig(**engine_config),
                         sampling=SamplingParams(max_new_tokens=MAX_NEW), concurrency=2,
                         batch_size=5, progress=False)
    summary = run_batch_job(cfg)
    assert summary.ok and summary.rows == n and summary.errors == len(BAD_ROWS)
    assert summary.completion_tokens > 0 and summary.tokens_per_s > 0
    table = OutputStore(cfg.output).read().sort_by("id")
    assert table.column("id").to_pylist() == list(range(n))  # row numbers
    assert table.column("prompt").to_pylist() == _prompts(n)
    assert pc.sum(pc.is_valid(table.column("error"))).as_py() == len(BAD_ROWS)
    _assert_matches_single(ref_engine, [r for r in table.to_pylist()[::10] if r["error"] is None])
    assert summary.retried_rows == 0 and summary.retries["in_run"] == 0  # nothing was lost
    again = run_batch_job(cfg)
    assert again.rows == 0 and again.already_done == n and again.ok and again.retried_rows == 0


def test_actor_pool_starts_with_what_fits():
    from batch.job import actors_that_fit

    assert actors_that_fit(2, 0.5, 3.0) == 2            # room for both, one CPU kept for reads
    assert actors_that_fit(4, 0.5, 2.0) == 2            # 1.0 of 2.0 for actors
    assert actors_that_fit(2, 0.5, 1.5) == 1            # a node lost: the survivor's room
    assert actors_that_fit(3, 1.0, 0.0) == 1            # nothing free (autoscaling): start one
    assert actors_that_fit(3, 1 / 3, 2.0) == 3          # no rounding below a whole fit


def test_a_busy_cluster_runs_the_job_with_fewer_actors(tmp_path, engine_config, ray_local):
    """A quarter of the CPUs held by someone else (like a serve replica on the survivor of a node
    loss): the job starts the actors that fit, instead of waiting forever for a pool it cannot
    place."""
    n = 20
    ids = _ids(n)
    inp = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": ids, "prompt": [f"Prompt {i}: hi" for i in range(n)]}), inp)

    @ray_local.remote(num_cpus=0.5)
    class Squatter:
        def ready(self) -> bool:
            return True

    squatter = Squatter.remote()
    ray_local.get(squatter.ready.remote())
    try:
        cfg = BatchJobConfig(input=str(inp), output=str(tmp_path / "out"),
                             engine=EngineConfig(**engine_config),
                             sampling=SamplingParams(max_new_tokens=4, ignore_eos=True),
                             concurrency=2, batch_size=5, num_cpus_per_actor=0.5, progress=False,
                             stall_timeout_s=60.0, max_resumes=0)
        summary = run_batch_job(cfg)
    finally:
        ray_local.kill(squatter)
    assert summary.ok and summary.resumes == 0 and summary.rows == n
    assert sorted(OutputStore(cfg.output).read(columns=["id"]).column("id").to_pylist()) == ids


def test_an_actor_larger_than_every_node_fails_at_once(tmp_path, engine_config, ray_local):
    inp = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": _ids(2), "prompt": ["a", "b"]}), inp)
    cfg = BatchJobConfig(input=str(inp), output=str(tmp_path / "out"),
                         engine=EngineConfig(**engine_config), num_cpus_per_actor=3.0,
                         progress=False, stall_timeout_s=60.0, max_resumes=0)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="largest node of the Ray cluster has 2 CPUs"):
        run_batch_job(cfg)
    assert time.monotonic() - t0 < 30
    assert OutputStore(cfg.output).committed_ids("id") is None


def test_dart_generator_in_a_user_pipeline(engine_config, ref_engine, ray_local):
    prompts = [p for p in _prompts(12) if p and p != TOO_LONG]
    ds = ray_local.data.from_items([{"prompt": p, "tag": i} for i, p in enumerate(prompts)])
    ds = ds.map_batches(DartGenerator, batch_size=4, concurrency=1, num_cpus=0.5,
                        fn_constructor_kwargs={"engine_config": engine_config,
                                               "max_new_tokens": MAX_NEW})
    rows = sorted(ds.take_all(), key=lambda r: r["tag"])
    assert [r["prompt"] for r in rows] == prompts
    _assert_matches_single(ref_engine, rows)


def test_a_hung_actor_stalls_the_pipeline_which_resumes_exactly_once(
        tmp_path, engine_config, ray_local):
    """A frozen worker (SIGSTOP: alive to Ray, never finishing its batch) must not hang the job: the
    stall guard stops the pipeline and the job resumes from its committed parts."""
    import threading

    # long enough that work is still queued for both actors when one is frozen: with 64 rows a
    # fast CPU (Zen 5, bf16 era) finished on one actor before the freeze, and nothing stalled
    n = 256
    ids = _ids(n)
    inp = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": ids, "prompt": [f"Prompt {i}: hello" for i in range(n)]}), inp)
    out = tmp_path / "out"
    cfg = BatchJobConfig(input=str(inp), output=str(out), engine=EngineConfig(**engine_config),
                         sampling=SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True),
                         concurrency=2, batch_size=4, num_cpus_per_actor=0.5, progress=False,
                         stall_timeout_s=40.0, max_resumes=1)    # > actor start-up on 2 busy cores
    store = OutputStore(out)
    frozen: list[int] = []
    finished = threading.Event()

    def freeze_one_actor() -> None:
        while not finished.is_set() and not frozen:
            alive = [a["Pid"] for a in ray_local._private.state.actors().values()
                     if "_PartWriter" in (a.get("ActorClassName") or "") and a["State"] == "ALIVE"
                     and a.get("Pid")]
            if len(alive) == 2 and len(store.part_paths()) >= 2:
                os.kill(alive[0], signal.SIGSTOP)
                frozen.append(alive[0])
                return
            time.sleep(0.2)

    freezer = threading.Thread(target=freeze_one_actor, daemon=True)
    freezer.start()
    try:
        summary = run_batch_job(cfg)
    finally:
        finished.set()
    freezer.join(timeout=5)
    assert frozen, "the test never froze an actor"
    with pytest.raises(ProcessLookupError):     # the stall guard killed the frozen process
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            os.kill(frozen[0], 0)
            time.sleep(0.5)
    assert summary.ok and summary.resumes == 1
    table = store.read(columns=["id", "error", "num_completion_tokens"])
    assert sorted(table.column("id").to_pylist()) == ids          # every id exactly once
    assert table.column("error").null_count == n
    assert set(table.column("num_completion_tokens").to_pylist()) == {MAX_NEW}
    assert "resumed after a stall: 1x" in summary.format()


def test_cpu_engine_actors_start_under_the_fast_allocator(monkeypatch):
    """A CPU engine actor's Ray options carry the allocator variables (a process-start setting);
    a CUDA one's do not, nor any when the user opted out."""
    from batch.job import engine_actor_options
    from dart_ray import EngineConfig, actor_allocator_env

    for k in ("LD_PRELOAD", "MALLOC_CONF", "GLIBC_TUNABLES", "DART_RAY_ALLOCATOR"):
        monkeypatch.delenv(k, raising=False)
    want = actor_allocator_env()
    cpu = engine_actor_options(EngineConfig(method="ngram"))
    assert cpu == ({"runtime_env": {"env_vars": want}} if want else {})
    assert engine_actor_options(EngineConfig(method="ngram", device="cuda")) == {}
    monkeypatch.setenv("DART_RAY_ALLOCATOR", "system")
    assert engine_actor_options(EngineConfig(method="ngram")) == {}
