"""``dart-ray tune`` (tuning/): search space validity, study persistence and resume, the exactness
gate, and a small end-to-end tune on a tiny random model through Ray Tune — interrupted, resumed,
extended, with a crashing trial — whose profile loads into the engine."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from conftest import local_ray, make_tiny_checkpoint

from dart_ray import (
    DecodingConfig,
    DecodingSchedule,
    Engine,
    EngineConfig,
    SamplingParams,
    load_profile,
)

ray = pytest.importorskip("ray")
pytest.importorskip("optuna")
tune = pytest.importorskip("ray.tune")

pytestmark = pytest.mark.tune

PROMPTS = ["def add(a, b):", "The quick brown fox", "Hello there, how", "1, 2, 3, 4, 5,",
           "import numpy as np", "Once upon a time", "SELECT * FROM users", "The capital of France"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm_dir):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_tune") / "llama", "llama", smollm_dir)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    from dart_ray.bench.prompts import write_jsonl

    return write_jsonl(PROMPTS, tmp_path_factory.mktemp("tune_prompts") / "prompts.jsonl")


# ---- search space ---------------------------------------------------------------------------
@pytest.mark.parametrize("method,depth,has_ngram",
                         [("dart", 8, True), ("dart", 8, False), ("dart", 3, True),
                                                    ("dart", 1, False), ("ngram", 32, True),
                          ("ngram", 32, False),
                                                    ("medusa", 4, True), ("eagle", 6, False),
                          ("sps", 6, False)])
def test_space_points_are_valid_configs(method, depth, has_ngram):
    import optuna

    from tuning.space import SearchSpace

    space = SearchSpace.for_drafter(method, depth, has_ngram)
    default = space.default_point()
    assert space.contains(default)
    base = DecodingConfig().replace(draft_depth=min(8, depth))
    if method == "eagle":  # its caps (top_k, beam_width <= 16) clip the defaults
        base = base.replace(top_k=16, beam_width=16)
    assert space.to_config(default) == base  # defaults kept
    chunk = next(p for p in space.params if p.name == "draft_depth")
    assert chunk.high <= depth
    if not has_ngram:
        assert "ngram_weight" not in space.names and "ngram_min_count" not in space.names
    if method in ("ngram", "sps", "eagle"):
        assert "top_k" in space.names or method != "eagle"
        assert "logit_weight_base" not in space.names
    if method == "sps":
        assert space.names == ["draft_depth"]
    rng = random.Random(0)
    points = [space.sample(rng) for _ in range(300)]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    points += [study.ask(space.distributions()).params for _ in range(100)]
    points += [{p.name: v for p in space.params} for v in (-1e9, 1e9)]  # clipped into range
    for pt in points:
        cfg = space.to_config(pt)                                         # validates
        assert 1 <= cfg.draft_depth <= depth
        assert 0 < cfg.logit_weight_base <= 1
        assert cfg.level_weight_exp >= 0 and cfg.ngram_weight >= 0
    with pytest.raises(ValueError):
        space.to_config({"no_such_knob": 1})


def test_space_rejects_untunable_method():
    from tuning.space import SearchSpace

    with pytest.raises(ValueError):
        SearchSpace.for_drafter("none", 0)


# ---- study persistence (no Ray) -------------------------------------------------------------
def test_study_resume_bookkeeping(tmp_path):
    from optuna.trial import TrialState

    from tuning import study as st
    from tuning.space import SearchSpace

    space = SearchSpace.for_drafter("dart", 8, False)
    storage = st.open_storage(f"sqlite:///{tmp_path / 'sub' / 'tune.db'}")
    fp = {"model": "m", "space": "s"}
    status = st.prepare_study(storage, "w.bs1", fp, space, target_trials=3)
    assert (status.finished, status.remaining) == (0, 3)
    first = status.study.ask(space.distributions())          # the enqueued default comes first
    assert first.params == space.default_point() and first.user_attrs.get("is_default")
    status.study.tell(first, 10.0)
    status.study.ask(space.distributions())                  # left RUNNING: the driver "died"

    status = st.prepare_study(st.open_storage(f"sqlite:///{tmp_path / 'sub' / 'tune.db'}"), "w.bs1",
                              fp, space, 3)
    assert (status.finished, status.remaining, status.requeued) == (1, 2, 1)
    trials = status.study.get_trials()
    assert [t.state for t in trials[:2]] == [TrialState.COMPLETE, TrialState.FAIL]
    assert trials[1].user_attrs["interrupted"] and st.is_interrupted(trials[1])
    assert trials[2].state == TrialState.WAITING and st.queued_params(trials[2]) == trials[1].params
    assert st.default_trial(status.study).number == 0
    assert st.best_complete(status.study).value == 10.0
    with pytest.raises(st.StudyMismatchError):
        st.prepare_study(storage, "w.bs1", {**fp, "model": "other"}, space, 3)


# ---- exactness gate (no Ray) ----------------------------------------------------------------
def test_exactness_violation_raises(tiny_model, monkeypatch):
    from tuning.objective import ExactnessError, TrialJob, WorkerState, evaluate_config

    cfg = EngineConfig(model=str(tiny_model), method="dart", drafter="random", ngram="none",
                       dtype="fp32", max_batch_size=2, max_seq_len=256, num_threads=1)
    state = WorkerState(cfg, check_dtype="fp32", check_batch=2)
    assert state.check_engine is state.engine                # fp32: the measuring engine is checked
    job = TrialJob(engine={}, batch_size=2, prompts=tuple(PROMPTS[:2]),
                   check_prompts=tuple(PROMPTS[:2]), max_new_tokens=8,
                   base_decoding=DecodingConfig().to_dict())
    dec = DecodingConfig(tree_budget=12, top_k=4, beam_width=3)
    seen = []
    out = evaluate_config(state, dec, job, report=seen.append)   # exact: measured and reported
    assert out["complete"] and out["tokens_per_s"] > 0 and seen[-1] == out

    real_accept = state.check_engine._accept

    def broken_accept(tree, logits, reqs):                  # a lossy verifier: bonus token is wrong
        acc = real_accept(tree, logits, reqs)
        acc.bonus = (acc.bonus + 1) % logits.shape[-1]
        return acc

    n_reports = len(seen)
    monkeypatch.setattr(state.check_engine, "_accept", broken_accept)
    with pytest.raises(ExactnessError, match="breaks exactness"):
        evaluate_config(state, dec, job, report=seen.append)
    # the gate closes the trial: ASHA may have seen its rungs, but it never becomes a result
    assert len(seen) > n_reports and not any(r["complete"] for r in seen[n_reports:])


def test_half_precision_engine_is_checked_in_fp32(tiny_model):
    from tuning.objective import WorkerState

    cfg = EngineConfig(model=str(tiny_model), method="dart", drafter="random", ngram="none",
                       dtype="bf16", max_batch_size=2, max_seq_len=256, num_threads=1)
    state = WorkerState(cfg, check_dtype="fp32", check_batch=2)
    assert state.check_engine is not state.engine and state.check_engine.config.dtype == "fp32"
    assert state.check_engine.drafter.max_draft_depth == state.engine.drafter.max_draft_depth
    state.check_exact(DecodingConfig(tree_budget=12, top_k=4, beam_width=3), PROMPTS[:2],
                      SamplingParams(max_new_tokens=8, ignore_eos=True), batch_size=2)


# ---- end to end through Ray Tune -------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray("drt-"):
        yield


_DEFAULT_KNOBS: dict = {}


class Interrupt(tune.Callback):
    """Aborts the tune driver once the 2nd trial at batch size 1 reports (a crash mid-trial)."""

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if result.get("batch_size") == 1 and trial.config != _DEFAULT_KNOBS:
            raise RuntimeError("simulated interruption")


def _settings(tiny_model, prompts_file, out_dir, trials, plots=False):
    from tuning.runner import TuneSettings

    engine = EngineConfig(model=str(tiny_model), method="dart", drafter="random", ngram="none",
                          dtype="fp32", max_seq_len=256)
    return TuneSettings(prompts=str(prompts_file), workload="tiny", out=str(out_dir / "tiny.yaml"),
                        batch_sizes=[1, 2], trials=trials, engine=engine, max_new_tokens=8,
                        num_prompts=6, prompts_per_trial=2, reports_per_trial=2, check_prompts=1,
                        eval_repeats=1, plots=plots, seed=0)


def _study(out_dir, b):
    import optuna

    return optuna.load_study(study_name=f"tiny.bs{b}", storage=f"sqlite:///{out_dir / 'tune.db'}")


@pytest.mark.filterwarnings("ignore:Fixed parameter logit_weight_base:UserWarning")
def test_tune_interrupt_resume_extend_profile(tiny_model, prompts_file, tmp_path, ray_cluster):
    from optuna.trial import TrialState

    from tuning import study as st
    from tuning.runner import run_tune
    from tuning.space import SearchSpace

    _DEFAULT_KNOBS.update(SearchSpace.for_drafter("dart", 8, False).default_point())
    out_dir = tmp_path / "tune"
    lines: list[str] = []

    # 1) interrupted while the 2nd trial at batch size 1 runs. Batch size 2 went first: a trial
    #    there decodes its 2 prompts in one round, at bs 1 in two (cheapest trials first)
    with pytest.raises(Exception, match="simulated interruption"):  # Tune wraps it in a TuneError
        run_tune(_settings(tiny_model, prompts_file, out_dir, trials=3), callbacks=[Interrupt()],
                 log=lines.append)
    assert any(ln.startswith("search order, cheapest trials first: bs 2") for ln in lines)
    s1, s2 = _study(out_dir, 1), _study(out_dir, 2)
    assert len(st.finished_trials(s2)) == 3 and len(st.finished_trials(s1)) == 1
    for s in (s1, s2):                                                  # defaults evaluated first
        assert s.trials[0].user_attrs.get("is_default") and s.trials[0].state == TrialState.COMPLETE
        assert s.trials[0].params == _DEFAULT_KNOBS
    pids = {t.user_attrs["worker_pid"] for t in s2.trials}
    # engine reused
    assert len(pids) == 1 and {t.user_attrs["engine_builds"] for t in s2.trials} == {1}
    interrupted = [t for t in s1.trials if st.is_interrupted(t)]
    assert len(interrupted) == 1
    waiting = s1.get_trials(states=(TrialState.WAITING,))
    # its point is re-enqueued
    assert [st.queued_params(t) for t in waiting] == [interrupted[0].params]
    assert not (out_dir / "tiny.yaml").exists()

    # 2) same command resumes: batch size 2 is done, batch size 1 runs only its 2 missing trials
    #    (results in the settings' order)
    out = run_tune(_settings(tiny_model, prompts_file, out_dir, trials=3), log=lines.append)
    assert [r.batch_size for r in out.results] == [1, 2]
    assert [r.ran_trials for r in out.results] == [2, 0]
    s1 = _study(out_dir, 1)
    assert len(st.finished_trials(s1)) == 3
    assert s1.trials[-2].params == interrupted[0].params                 # the interrupted point ran
    assert any("1 finished, 2 to run" in ln for ln in lines)

    # the written profile loads (by path and by name) and drives an engine
    sched = load_profile(out.profile_path)
    assert sched == out.schedule and sched.workload == "tiny"
    assert DecodingSchedule.from_dict(sched.to_dict()) == sched
    assert [b for b, _ in sched.entries] == [1, 1024]
    assert sched.meta["batch_sizes"][0]["tuned_batch_size"] == 1
    assert sched.meta["trials_per_batch_size"] == 3
    eng = Engine.from_config(EngineConfig(model=str(tiny_model), method="dart", drafter="random",
                                          ngram="none", dtype="fp32", max_batch_size=2,
                                          max_seq_len=256, num_threads=1))
    ar = Engine.from_config(EngineConfig(model=str(tiny_model), method="none", dtype="fp32",
                                         max_batch_size=2, max_seq_len=256, num_threads=1))
    eng.set_decoding(sched)
    assert eng.decoding_for(1) == sched.entries[0][1] and eng.decoding_for(2) == sched.entries[1][1]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    assert [c.token_ids for c in eng.generate(PROMPTS[:2], params)] == \
        [c.token_ids for c in ar.generate(PROMPTS[:2], params)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DART_RAY_PROFILES", str(out_dir))
        assert load_profile("tiny") == sched                           # by name, as the server does

    # 3) raise the target to 4: exactly one more trial per batch size; at batch size 1 it is a
    #    crashing config (invalid knob), recorded as a failed trial without stopping the tune
    s1 = _study(out_dir, 1)
    s1.enqueue_trial({**_DEFAULT_KNOBS, "logit_weight_base": 1.5})
    out = run_tune(_settings(tiny_model, prompts_file, out_dir, trials=4, plots=True),
                   log=lines.append)
    assert [r.ran_trials for r in out.results] == [1, 1]
    s1, s2 = _study(out_dir, 1), _study(out_dir, 2)
    assert len(st.finished_trials(s1)) == 4 and len(st.finished_trials(s2)) == 4
    failed = [t for t in s1.trials if t.state == TrialState.FAIL and not st.is_interrupted(t)]
    assert len(failed) == 1 and "logit_weight_base" in failed[0].user_attrs.get("error", "")
    assert out.results[0].counts["failed"] == 1
    assert all(p.is_file() and p.stat().st_size > 0 for p in out.plots) and len(out.plots) == 2
    assert "| batch |" in out.summary and load_profile(out.profile_path).workload == "tiny"


def test_time_budget_is_honoured(tiny_model, prompts_file, tmp_path, ray_cluster):
    """A budget too small to tune anything: no trial starts, the profile keeps the defaults, and
    the run ends within the budget (plus the unavoidable engine load)."""
    import time

    from tuning.runner import run_tune

    s = _settings(tiny_model, prompts_file, tmp_path, trials=3)
    s.time_budget_s = 3.0
    t0 = time.monotonic()
    out = run_tune(s, log=lambda m: None)
    assert time.monotonic() - t0 < 15
    assert [r.ran_trials for r in out.results] == [0, 0]
    assert all(cfg == DecodingConfig() for _, cfg in out.schedule.entries)
    assert out.schedule.meta["time_budget_s"] == 3.0


def test_cli_args(tmp_path):
    from tuning.cli import build_parser, settings_from_args, tune_cli

    a = build_parser().parse_args(["--prompts", "p.jsonl", "--workload", "code", "--out",
                                   str(tmp_path / "x.yaml"), "--batch-sizes", "16,1,4", "--trials",
                                   "5", "--time-budget", "60"])
    s = settings_from_args(a)
    assert s.batch_sizes == [1, 4, 16] and s.trials == 5 and s.time_budget_s == 60
    assert s.storage_url == f"sqlite:///{tmp_path.resolve() / 'tune.db'}"
    assert s.results_path == tmp_path.resolve() / "tune_results"
    assert tune_cli(["--prompts", str(tmp_path / "missing.jsonl"), "--workload", "w",
                     "--out", str(tmp_path / "x.yaml")]) == 2
    assert tune_cli(["--prompts", "p", "--workload", "bad/name", "--out",
                     str(tmp_path / "x.yaml")]) == 2
    # issue 18: the engine flags are the shared ones and land in settings.engine (an EngineConfig)
    assert s.engine == EngineConfig()
    a = build_parser().parse_args(["--prompts", "p.jsonl", "--workload", "code", "--out",
                                   str(tmp_path / "x.yaml"), "--model", "/m", "--method", "eagle",
                                   "--drafter", "random", "--dtype", "fp32", "--max-seq-len", "512",
                                   "--threads", "2", "--no-adaptive", "--drafter-seed", "3"])
    assert settings_from_args(a).engine == EngineConfig(model="/m", method="eagle",
                                                        drafter="random", dtype="fp32",
                                                         max_seq_len=512, num_threads=2,
                                                        adaptive=False, seed=3)
    assert tune_cli(["--prompts", "p", "--workload", "w", "--out", str(tmp_path / "x.yaml"),
                     "--method", "ar"]) == 2
    assert tune_cli(["--prompts", "p", "--workload", "w", "--out", str(tmp_path / "x.yaml"),
                     "--max-batch-size", "4"]) == 2
    with pytest.raises(ValueError, match="AR has no knobs"):
        dataclasses.replace(s, engine=EngineConfig(method="none"))
    assert dataclasses.replace(s, engine={"method": "ngram"}).engine == EngineConfig(method="ngram")


def test_a_tune_whose_every_trial_failed_writes_no_profile(tmp_path, monkeypatch, capsys):
    """Trials ran and all failed: an error (exit 1) and --out untouched, not a profile of the
    defaults as if tuned; one completed trial anywhere, or none started (budget), goes on."""
    import tuning.runner as runner
    from tuning.cli import build_parser, settings_from_args, tune_cli
    from tuning.search import BatchResult

    def result(b, **counts):
        return BatchResult(batch_size=b, study_name=f"w.bs{b}", counts={
            "complete": 0, "pruned": 0, "failed": 0, "interrupted": 0, "load_flagged": 0,
            **counts}, ran_trials=sum(counts.values()), default_params={}, best_params=None,
            best_trial=None)

    out = tmp_path / "x.yaml"
    s = settings_from_args(build_parser().parse_args(["--prompts", "p", "--workload", "w",
                                                      "--out", str(out)]))
    with pytest.raises(runner.NoTrialCompletedError, match="all 3 trial"):
        runner.check_some_trial_completed([result(1, failed=2), result(4, failed=1)], s)
    runner.check_some_trial_completed([result(1, failed=2), result(4, complete=1)], s)
    runner.check_some_trial_completed([result(1), result(4)], s)        # budget: none started

    out.write_text("kept\n")

    def all_failed(settings, log=print, callbacks=()):
        runner.check_some_trial_completed([result(1, failed=2)], settings)

    monkeypatch.setattr(runner, "run_tune", all_failed)
    assert tune_cli(["--prompts", "p", "--workload", "w", "--out", str(out)]) == 1
    assert "no profile written" in capsys.readouterr().err and out.read_text() == "kept\n"


def test_study_fingerprint_is_the_engine_fingerprint_plus_the_workload(tmp_path):
    """Issue 18: a study records ``EngineConfig.fingerprint()`` (less max_batch_size, which follows
    the run's batch sizes) with the workload and the machine; any other engine setting refuses a
    resume."""
    from types import SimpleNamespace

    from tuning.runner import TuneSettings
    from tuning.search import study_fingerprint
    from tuning.space import SearchSpace

    s = TuneSettings(prompts="p.jsonl", workload="w", out=str(tmp_path / "w.yaml"),
                     engine=EngineConfig(drafter="random", dtype="fp32"))
    machine = SimpleNamespace(fingerprint=SimpleNamespace(to_dict=lambda: {"cpu": "Test CPU"}))

    def study_fp(cfg: EngineConfig) -> dict:
        run = SimpleNamespace(settings=s, engine_config=cfg, engine=machine,
                              tune_prompts=["a", "b"],
                              space=SearchSpace.for_drafter("dart", 8, False))
        return study_fingerprint(run, 2, ("a",), 8)

    cfg = s.engine.replace(max_batch_size=4, num_threads=2)
    fp = study_fp(cfg)
    shared = {k: v for k, v in fp.items() if k in cfg.fingerprint()}
    assert shared == cfg.fingerprint(exclude=["max_batch_size"])
    assert fp["hardware"] == {"cpu": "Test CPU"} and fp["max_new_tokens"] == s.max_new_tokens
    json.dumps(fp)                                                      # an Optuna user attr
    assert study_fp(cfg.replace(max_batch_size=16)) == fp               # another batch size resumes
    for change in ({"num_threads": 1}, {"adaptive": False}, {"seed": 1}, {"max_seq_len": 1024},
                   {"decoding": DecodingConfig(lookup_paths=0)}):
        other = study_fp(cfg.replace(**change))
        assert other != fp, change


def test_batch_sizes_are_searched_cheapest_trial_first(tmp_path):
    """Issue 15: an equal split of the budget left bs 1 (prompts decoded one at a time) with half
    the time it needs. The cheapest sizes go first and pass their unused time on; the results
    still come back in the settings' order."""
    from types import SimpleNamespace

    from tuning.runner import TuneSettings
    from tuning.search import search_order, trial_cost, trial_prompts

    s = TuneSettings(prompts="p.jsonl", workload="w", out=str(tmp_path / "w.yaml"),
                     batch_sizes=(1, 4, 16))
    steps = {1: 0.060, 4: 0.075, 16: 0.200}            # an AVX2 CPU's plain-step seconds
    engine = SimpleNamespace(step_cost_s=lambda b: steps[b])
    run = SimpleNamespace(settings=s, engine=engine, tune_prompts=[f"p{i}" for i in range(48)])
    assert [trial_prompts(run, b) for b in (1, 4, 16)] == [8, 8, 32]
    assert trial_cost(run, 1) == pytest.approx(8 * 0.060)     # 8 rounds of one answer
    assert trial_cost(run, 4) == pytest.approx(2 * 0.075)     # 2 rounds of four
    assert search_order(run) == [4, 16, 1]
    run.engine = SimpleNamespace(step_cost_s=lambda b: None)  # no cost model: rounds alone
    assert search_order(run) == [4, 16, 1]
    run.tune_prompts = run.tune_prompts[:1]      # one round at every size: the smaller first
    assert search_order(run) == [1, 4, 16]


def test_tune_ray_gives_cpu_trials_the_fast_allocator(tmp_path, monkeypatch):
    """CPU trials measure throughput under the allocator serving uses (a process-start setting
    passed as the job's runtime_env); a CUDA tuning run is left as it is."""
    import ray

    from dart_ray import actor_allocator_env
    from tuning.runner import TuneSettings
    from tuning.start import start_tune_ray

    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append(kw))
    for k in ("LD_PRELOAD", "MALLOC_CONF", "GLIBC_TUNABLES", "DART_RAY_ALLOCATOR", "RAY_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    s = TuneSettings(prompts="p.jsonl", workload="w", out=str(tmp_path / "w.yaml"))
    assert start_tune_ray(s) is True
    want = actor_allocator_env()
    assert seen[-1].get("runtime_env") == ({"env_vars": want} if want else None)
    assert seen[-1]["_system_config"] == {"worker_niceness": 0}   # trials not niced below others
    s.engine = EngineConfig(device="cuda")
    start_tune_ray(s)
    assert "runtime_env" not in seen[-1]
    s.ray_address = "ray://head:10001"              # someone else's cluster: its settings stand
    start_tune_ray(s)
    assert seen[-1]["address"] == s.ray_address and "_system_config" not in seen[-1]


def test_a_study_recorded_before_cpu_id_resumes_on_the_same_machine(tmp_path):
    """A study's recorded hardware predating a fingerprint field (``cpu_id``) is not a different
    setup; another CPU, or another setting, still is."""
    from dart_ray.hardware import Fingerprint
    from tuning import study as st
    from tuning.space import SearchSpace

    space = SearchSpace.for_drafter("dart", 8, False)
    storage = st.open_storage(f"sqlite:///{tmp_path / 'tune.db'}")
    hw = Fingerprint("AMD EPYC", "AMD EPYC", ("avx2",), 2, "2.13.0", "bf16", "m",
                     cpu_id="family 26 model 2").to_dict()
    old_hw = {k: v for k, v in hw.items() if k != "cpu_id"}
    st.prepare_study(storage, "w.bs1", {"model": "m", "hardware": old_hw}, space, 3)
    resumed = st.prepare_study(storage, "w.bs1", {"model": "m", "hardware": hw}, space, 3)
    assert resumed.remaining == 3
    assert st.setup_differences({"hardware": old_hw}, {"hardware": {**hw, "cpu": "Other"}}) == [
        "hardware"]
    with pytest.raises(st.StudyMismatchError, match="model"):
        st.prepare_study(storage, "w.bs1", {"model": "x", "hardware": hw}, space, 3)
