"""Issue 15: tuning that knows its machine and measures the workload as served.

Hardware fingerprints in profiles (round trip, mismatch warning once), warm start
(``--for-this-machine``: the profile's knobs are the first trials), the served objective (EOS
honoured: an answer that ends early yields fewer tokens than the cap), load detection (re-run,
then flag), the multi-objective choice (Pareto point within the p95 bound), and resume from the
SQLite storage (old trials kept, new ones added). One small end-to-end warm-started
``throughput+p95`` tune through Ray Tune on a tiny random model."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from conftest import local_ray, make_tiny_checkpoint

pytest.importorskip("optuna")

from dart_ray import (
    DecodingConfig,
    DecodingSchedule,
    EngineConfig,
    SamplingParams,
    load_profile,
    save_profile,
)
from dart_ray.hardware import Fingerprint
from dart_ray.profiles import (
    NO_FINGERPRINT,
    ProfileHardwareWarning,
    apply_profile,
    check_profile_hardware,
    profile_fingerprint,
)

pytestmark = pytest.mark.tune

PROMPTS = ["def add(a, b):", "The quick brown fox", "Hello there, how", "1, 2, 3, 4, 5,",
           "import numpy as np", "Once upon a time", "SELECT * FROM users", "The capital of France"]


def _fp(**over) -> Fingerprint:
    base = Fingerprint(device="Test CPU 9000", cpu="Test CPU 9000", isa=("avx2", "fma", "amx_bf16"),
                       threads=2, torch="2.9.0", dtype="bf16",
                       model="HuggingFaceTB/SmolLM2-135M-Instruct")
    return dataclasses.replace(base, **over)


def _schedule(fp: Fingerprint | None = None, workload: str = "code") -> DecodingSchedule:
    meta = {"tool": "dart-ray tune"}
    if fp is not None:
        meta.update(fingerprint=fp.to_dict(), cpu=fp.summary())
    entries = ((1, DecodingConfig(draft_depth=3, tree_budget=6, top_k=13, beam_width=5)),
               (8, DecodingConfig(draft_depth=4, tree_budget=10, lookup_len=12)),
               (1024, DecodingConfig(draft_depth=3, tree_budget=6, top_k=2)))
    return DecodingSchedule(workload, entries, meta)


# ---- fingerprints in profiles (no model, no Ray) ----------------------------------------------
def test_profile_fingerprint_round_trip(tmp_path):
    fp = Fingerprint.current("cpu", "fp32", "some/model", 2)
    path = save_profile(_schedule(fp), tmp_path / "code.yaml")
    sched = load_profile(path)
    assert sched.meta["fingerprint"] == fp.to_dict() and sched.meta["cpu"] == fp.summary()
    assert profile_fingerprint(sched) == fp
    # source is not part of equality
    assert sched == _schedule(fp) and sched.source == str(path.resolve())
    assert DecodingSchedule.from_dict(sched.to_dict()) == sched
    assert "source" not in sched.to_dict()
    assert check_profile_hardware(sched, fp) == []                          # same machine: silent
    assert profile_fingerprint(_schedule(None)) is None


def test_profile_from_other_hardware_warns_once_naming_the_difference(tmp_path):
    recorded = _fp()
    here = _fp(cpu="AMD EPYC 7B13", device="AMD EPYC 7B13", isa=("avx2", "fma"), dtype="fp32")
    sched = load_profile(save_profile(_schedule(recorded), tmp_path / "code.yaml"))
    with pytest.warns(ProfileHardwareWarning) as rec:
        diffs = check_profile_hardware(sched, here)
    assert len(rec) == 1
    msg = str(rec[0].message)
    for name in ("cpu:", "isa:", "dtype:", "device:"):
        assert name in msg and any(d.startswith(name) for d in diffs)
    assert "AMD EPYC 7B13" in msg and "Test CPU 9000" in msg and "threads" not in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                # once: no second warning
        assert check_profile_hardware(sched, here) == diffs
        assert check_profile_hardware(load_profile(sched.source), here.to_dict()) == diffs
    with pytest.warns(ProfileHardwareWarning, match="threads"):       # another machine: warns again
        check_profile_hardware(sched, dataclasses.replace(here, threads=16))


def test_old_profile_without_fingerprint_warns_and_still_applies(tmp_path):
    class FakeEngine:
        fingerprint = _fp()
        applied = None

        def set_decoding(self, d):
            self.applied = d

    path = save_profile(_schedule(None, workload="old"), tmp_path / "old.yaml")
    eng = FakeEngine()
    with pytest.warns(ProfileHardwareWarning, match="no hardware recorded"):
        sched = apply_profile(eng, str(path))
    assert eng.applied == sched and sched.workload == "old"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_profile(eng, str(path))                                   # once per profile + machine
    assert check_profile_hardware(sched, eng.fingerprint) == [NO_FINGERPRINT]


def test_shipped_profiles_load_and_are_checked():
    for name in ("code", "chat"):
        sched = load_profile(name)
        with pytest.warns(ProfileHardwareWarning):                    # shipped ones: other hardware
            diffs = check_profile_hardware(dataclasses.replace(sched, source=f"test-{name}"),
                                           _fp(cpu="nowhere"))
        assert diffs


def test_a_name_resolves_to_the_variant_tuned_on_this_cpu_class(tmp_path, monkeypatch):
    """``NAME@CLASS.yaml`` beside ``NAME.yaml``: the name picks the variant whose fingerprint names
    this CPU model and ISA, else the plain file (and a lone variant when there is no plain one)."""
    from dart_ray.profiles import resolve_profile

    here = Fingerprint.current("cpu", "bf16", "m", 2)
    monkeypatch.setenv("DART_RAY_PROFILES", str(tmp_path))
    save_profile(_schedule(_fp()), tmp_path / "code.yaml")
    save_profile(_schedule(_fp(cpu="Other CPU")), tmp_path / "code@other.yaml")
    assert resolve_profile("code") == tmp_path / "code.yaml"            # no variant for this CPU
    # this CPU class (other threads: the class is the CPU model and ISA)
    save_profile(_schedule(dataclasses.replace(here, threads=16)), tmp_path / "code@here.yaml")
    assert resolve_profile("code") == tmp_path / "code@here.yaml"
    assert load_profile("code").source == str((tmp_path / "code@here.yaml").resolve())
    isa_only = dataclasses.replace(here, isa=tuple(f for f in here.isa if f != "avx2") + ("x",))
    save_profile(_schedule(isa_only), tmp_path / "code@here.yaml")      # same model, other ISA
    assert resolve_profile("code") == tmp_path / "code.yaml"
    other_gen = dataclasses.replace(here, cpu_id="family 1 model 1")   # same string, other CPU
    save_profile(_schedule(other_gen), tmp_path / "code@here.yaml")
    assert resolve_profile("code") == tmp_path / "code.yaml"
    save_profile(_schedule(dataclasses.replace(here, cpu_id="")), tmp_path / "code@here.yaml")
    assert resolve_profile("code") == tmp_path / "code@here.yaml"      # recorded without one
    save_profile(_schedule(_fp()), tmp_path / "mine@x.yaml")             # only a variant
    assert resolve_profile("mine") == tmp_path / "mine@x.yaml"
    assert resolve_profile(tmp_path / "code@other.yaml") == tmp_path / "code@other.yaml"


# ---- warm start and resume (Optuna storage, no Ray) -----------------------------------------
def test_warm_start_enqueues_the_profiles_knobs_first(tmp_path):
    from tuning import study as st
    from tuning.runner import warm_points
    from tuning.space import SearchSpace

    space = SearchSpace.for_drafter("dart", 8, True)
    prof = _schedule(_fp())
    for b, expected in ((1, prof.entries[0][1]), (4, prof.entries[1][1]), (16, prof.entries[2][1])):
        pts = warm_points(prof, b)
        assert pts[0] == expected.to_dict() and len(pts) == 3
        storage = st.open_storage(f"sqlite:///{tmp_path / f'w{b}.db'}")
        status = st.prepare_study(storage, f"code.bs{b}", {"k": 1}, space, target_trials=12,
                                  warm_start=pts)
        assert status.fresh and status.remaining == 12
        first = status.study.ask(space.distributions())
        assert first.params == {k: v for k, v in expected.to_dict().items() if k in space.names}
        assert first.user_attrs.get("warm_start") and not first.user_attrs.get("is_default")
        asked = [status.study.ask(space.distributions()) for _ in range(3)]
        assert [t.user_attrs.get("warm_start", False) for t in asked] == [True, True, False]
        assert asked[-1].params == space.default_point() and asked[-1].user_attrs["is_default"]
    # a point equal to the defaults is not evaluated twice
    storage = st.open_storage(f"sqlite:///{tmp_path / 'd.db'}")
    status = st.prepare_study(storage, "x.bs1", {}, space, 5,
                              warm_start=[DecodingConfig().to_dict()])
    waiting = status.study.get_trials(states=(st.TrialState.WAITING,))
    assert len(waiting) == 1 and waiting[0].user_attrs == {"warm_start": True, "is_default": True}


def test_resumed_study_keeps_old_trials_and_adds_new_ones(tmp_path):
    from optuna.trial import TrialState

    from tuning import study as st
    from tuning.space import SearchSpace

    space = SearchSpace.for_drafter("dart", 8, False)
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    warm = [DecodingConfig(tree_budget=6, draft_depth=3).to_dict()]
    status = st.prepare_study(st.open_storage(url), "w.bs1", {"m": 1}, space, 3, warm_start=warm)
    for v in (5.0, 7.0):
        t = status.study.ask(space.distributions())
        status.study.tell(t, v)
    old = [(t.number, t.params, t.value) for t in status.study.get_trials()
           if t.state == TrialState.COMPLETE]

    # a later run with a raised target, from the same storage (a new process would do exactly this)
    status = st.prepare_study(st.open_storage(url), "w.bs1", {"m": 1}, space, 4, warm_start=warm)
    assert not status.fresh and (status.finished, status.remaining) == (2, 2)
    assert [(t.number, t.params, t.value) for t in status.study.get_trials()
            if t.state == TrialState.COMPLETE] == old                     # continued, not restarted
    # not re-seeded
    assert sum(1 for t in status.study.get_trials() if t.user_attrs.get("warm_start")) == 1
    sampler = st.make_sampler(0, status.study)
    import optuna

    study = optuna.load_study(study_name="w.bs1", storage=url, sampler=sampler)
    for v in (6.0, 8.0):
        t = study.ask(space.distributions())
        study.tell(t, v)
    done = [t for t in study.get_trials() if t.state == TrialState.COMPLETE]
    assert len(done) == 4 and [(t.number, t.params, t.value) for t in done[:2]] == old
    assert st.prepare_study(st.open_storage(url), "w.bs1", {"m": 1}, space, 4).remaining == 0
    assert st.best_complete(study).value == 8.0


def test_load_flagged_trials_and_the_p95_choice(tmp_path):
    import optuna

    from tuning import study as st
    from tuning.space import SearchSpace

    space = SearchSpace.for_drafter("ngram", 8, False)
    storage = st.open_storage(f"sqlite:///{tmp_path / 'mo.db'}")
    status = st.prepare_study(storage, st.study_name("w", 1, "throughput+p95"), {}, space, 6,
                              objective="throughput+p95")
    assert status.study.study_name == "w.bs1.p95" and len(status.study.directions) == 2
    # (tokens/s, p95 s, load_flag): default, a dominated one, two Pareto points, a flagged "best"
    rows = [(50.0, 2.0, False), (40.0, 3.0, False), (70.0, 1.8, False), (90.0, 2.6, False),
            (200.0, 0.5, True)]
    for tps, p95, flag in rows:
        t = status.study.ask(space.distributions())
        t.set_user_attr("load_flag", flag)
        status.study.tell(t, [tps, p95])
    front = st.pareto_front(st.complete_trials(status.study))
    assert [st.throughput(t) for t in front] == [90.0, 70.0]         # flagged one never counts
    default = st.default_trial(status.study)
    assert st.p95_latency(default) == 2.0
    assert st.throughput(st.choose_within_p95(status.study, 2.0 * 1.0)) == 70.0
    assert st.throughput(st.choose_within_p95(status.study, 3.0)) == 90.0
    assert st.choose_within_p95(status.study, 1.0) is None
    assert st.throughput(st.best_complete(status.study)) == 90.0
    assert st.throughput(st.best_complete(status.study, include_flagged=True)) == 200.0
    with pytest.raises(st.StudyMismatchError):                       # one study, one objective kind
        st.prepare_study(storage, "w.bs1.p95", {}, space, 6, objective="throughput")
    assert isinstance(status.study, optuna.Study)


# ---- the objective on a tiny model (no Ray) ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm_dir):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_tune_hw") / "llama", "llama",
                                smollm_dir)


@pytest.fixture(scope="module")
def worker(tiny_model):
    from tuning.objective import WorkerState

    cfg = EngineConfig(model=str(tiny_model), method="dart", drafter="random", ngram="none",
                       dtype="fp32", max_batch_size=2, max_seq_len=256, num_threads=1)
    return WorkerState(cfg, check_dtype="fp32", check_batch=2)


def _job(**over):
    from tuning.objective import TrialJob

    kw = {"engine": {}, "batch_size": 2, "prompts": tuple(PROMPTS[:3]),
          "check_prompts": tuple(PROMPTS[:1]), "max_new_tokens": 12,
          "base_decoding": DecodingConfig().to_dict(), "load_probe_tokens": 4}
    kw.update(over)
    return TrialJob(**kw)


def test_objective_honours_eos(worker, monkeypatch):
    """The tiny random model's own greedy output decides its "EOS": the token it emits 3rd ends the
    answer when EOS is honoured, so that prompt yields fewer tokens than the cap."""
    from tuning.objective import evaluate_config, stream_workload

    eng, cap = worker.engine, 12
    free = eng.generate(PROMPTS[0],
                        SamplingParams(max_new_tokens=cap, ignore_eos=True))[0].token_ids
    eos = free[2]
    ends_at = free.index(eos) + 1
    assert ends_at <= 3 < cap
    monkeypatch.setattr(eng, "eos_ids", frozenset({eos}))
    dec = DecodingConfig(tree_budget=8, top_k=4, beam_width=3)

    eng.set_decoding(dec)
    res = stream_workload(eng, PROMPTS[:3], 2, SamplingParams(max_new_tokens=cap), False)
    assert res.outputs[0] == free[:ends_at] and res.finish_reasons[0] == "stop"
    assert res.tokens < 3 * cap and all(0 < lat <= res.seconds for lat in res.latencies)
    assert res.p95_latency_s is not None and res.tokens_per_s > 0

    served = evaluate_config(worker, dec, _job())
    assert served["complete"] and served["eos_finished"] >= 1
    assert served["tokens"] == res.tokens < 3 * cap                # natural lengths, not forced
    fixed = evaluate_config(worker, dec, _job(ignore_eos=True))
    # the old objective, for contrast
    assert fixed["tokens"] == 3 * cap and fixed["eos_finished"] == 0
    assert served["p95_latency_s"] > 0 and "load_flag" in served and served["ar_probe_tps"] > 0


def test_loaded_machine_reruns_then_flags(worker):
    from tuning.objective import LoadProbe, evaluate_config

    class ScriptedProbe(LoadProbe):
        def __init__(self, speeds):
            super().__init__()
            self.speeds = list(speeds)

        def measure(self, ar_engine):
            self.last = self.speeds.pop(0)
            self.reference = self.last if self.reference is None else max(self.reference, self.last)
            return self.last

    dec = DecodingConfig(tree_budget=8, top_k=4, beam_width=3)
    cases = [([100, 98], 0, False),         # idle: kept as measured
             ([100, 80], 0, False),         # a guest's idle noise (up to 23 % measured): kept
             # load during the trial, gone on the re-run: kept, re-run once
             ([100, 60, 100, 99], 1, False),
             ([100, 60, 70, 65], 1, True)]  # still loaded on the re-run: flagged, not silently kept
    for speeds, reruns, flag in cases:
        worker.probe = ScriptedProbe(speeds)
        seen = []
        out = evaluate_config(worker, dec, _job(), report=seen.append)
        assert (out["reruns"], out["load_flag"]) == (reruns, flag), speeds
        assert not worker.probe.speeds and seen[-1] == out and out["complete"]
        assert sum(1 for r in seen if r["complete"]) == 1               # one final report per trial
        assert out["load_drift"] == pytest.approx(1 - min(speeds[-2:]) / max(speeds))
    worker.probe = LoadProbe()


# ---- CLI ---------------------------------------------------------------------------------------
def test_cli_for_this_machine_and_objective(tmp_path):
    from tuning.cli import build_parser, settings_from_args
    from tuning.runner import DEFAULT_TRIALS, WARM_TRIALS

    base = ["--prompts", "p.jsonl", "--workload", "code", "--out", str(tmp_path / "x.yaml")]
    s = settings_from_args(build_parser().parse_args(base))
    assert s.warm_start is None and s.trials == DEFAULT_TRIALS and s.objective == "throughput"
    assert s.max_new_tokens == 128 and not s.ignore_eos
    s = settings_from_args(build_parser().parse_args(base + ["--for-this-machine"]))
    assert s.warm_start == "" and s.trials == WARM_TRIALS
    s = settings_from_args(build_parser().parse_args(
        base + ["--for-this-machine", "my.yaml", "--trials", "20", "--objective", "throughput+p95",
                "--p95-max-ratio", "1.2", "--p95-max-s", "4"]))
    assert (s.warm_start, s.trials, s.objective) == ("my.yaml", 20, "throughput+p95")
    assert s.p95_bound(2.0) == 2.4 and s.p95_bound(5.0) == 4.0 and s.p95_bound(None) == 4.0
    with pytest.raises(ValueError):
        dataclasses.replace(s, objective="latency")


# ---- end to end: warm-started two-objective tune through Ray Tune -----------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    pytest.importorskip("ray")
    with local_ray("drh-"):
        yield


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_warm_started_p95_tune_writes_this_machines_fingerprint(tiny_model, tmp_path, ray_cluster):
    from dart_ray.bench.prompts import write_jsonl
    from tuning import study as st
    from tuning.runner import TuneSettings, run_tune

    warm_cfg = DecodingConfig(draft_depth=3, top_k=4, beam_width=3, tree_budget=6)
    old = DecodingSchedule("tiny", ((1024, warm_cfg),),
                           {"fingerprint": _fp().to_dict(), "cpu": _fp().summary()})
    warm_path = save_profile(old, tmp_path / "shipped" / "tiny.yaml")
    s = TuneSettings(prompts=str(write_jsonl(PROMPTS, tmp_path / "p.jsonl")), workload="tiny",
                     out=str(tmp_path / "out" / "tiny.yaml"), batch_sizes=[1], trials=3,
                     engine=EngineConfig(model=str(tiny_model), method="dart", drafter="random",
                                         ngram="none", dtype="fp32", max_seq_len=256),
                     max_new_tokens=8, num_prompts=6, prompts_per_trial=2, reports_per_trial=2,
                     check_prompts=1, eval_repeats=1, seed=0, objective="throughput+p95",
                     p95_max_ratio=10.0, warm_start=str(warm_path), load_probe_tokens=4)
    lines: list[str] = []
    out = run_tune(s, log=lines.append)
    study = out.studies[1]
    assert study.study_name == "tiny.bs1.p95" and len(study.directions) == 2
    first = study.trials[0]
    assert first.params == {k: v for k, v in warm_cfg.to_dict().items() if k in first.params}
    assert first.user_attrs["warm_start"] and study.trials[1].user_attrs.get("is_default")
    done = st.complete_trials(study, include_flagged=True)
    assert done and all(len(t.values) == 2 and t.values[1] > 0 for t in done)
    assert all("load_flag" in t.user_attrs and "mean_new_tokens" in t.user_attrs for t in done)
    assert any("warm start from" in ln and "Test CPU 9000" in ln for ln in lines)

    prof = load_profile(out.profile_path)
    from dart_ray import Engine

    fp = Fingerprint.from_dict(prof.meta["fingerprint"])
    assert fp.cpu != "Test CPU 9000" and fp.dtype == "fp32" and fp.threads == 2
    assert prof.meta["cpu"] == fp.summary() and prof.meta["warm_start"]["differences"]
    assert prof.meta["objective_mode"] == "throughput+p95"
    assert "EOS honoured" in prof.meta["objective"]
    assert prof.meta["batch_sizes"][0]["warm_start_trials"] == 1
    assert any(p.name == "tiny.pareto.png" and p.stat().st_size > 0 for p in out.plots)
    # applied to an engine of the same setup, the written profile does not warn
    eng = Engine.from_config(EngineConfig(model=str(tiny_model), method="dart", drafter="random",
                                          ngram="none", dtype="fp32", max_batch_size=1,
                                          max_seq_len=256, num_threads=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileHardwareWarning)
        apply_profile(eng, str(out.profile_path))


def test_a_fresh_closing_probe_opens_the_next_trial(worker, monkeypatch):
    """Issue 15: consecutive trials share the probe between them (the previous trial's closing
    probe opens the next one while it is fresh); a stale one, or a re-run, probes anew."""
    import tuning.objective as obj

    calls = []
    real = obj.LoadProbe.measure

    def counting(self, ar_engine):
        calls.append(1)
        return real(self, ar_engine)

    monkeypatch.setattr(obj.LoadProbe, "measure", counting)
    worker.probe = obj.LoadProbe()
    dec = DecodingConfig(tree_budget=8, top_k=4, beam_width=3)
    job = _job(load_threshold=0.99)                       # this test is about counts, not load
    obj.evaluate_config(worker, dec, job)
    assert len(calls) == 2                                # opening + closing probe
    obj.evaluate_config(worker, dec, job)
    assert len(calls) == 3                                # opened with the last trial's closing one
    monkeypatch.setattr(obj, "PROBE_REUSE_S", 0.0)
    obj.evaluate_config(worker, dec, job)
    assert len(calls) == 5                                # too old: probed anew
    worker.probe.at -= 60.0
    assert worker.measure_load(job.load_probe_tokens, reuse_within_s=10.0) is not None
    assert len(calls) == 6
    worker.probe = obj.LoadProbe()


# ---- a review's findings (twenty-fourth sitting) --------------------------------------------
def test_a_tuned_config_that_changed_fp32_outputs_is_rejected_when_auto_resolved_to_fp32(tmp_path):
    """The eval-split exactness rule read the *requested* dtype ("auto" by default), so on a
    machine where auto resolves to fp32 a config that changed greedy outputs could be chosen."""
    from tuning.choose import _choose_on_eval
    from tuning.search import BatchResult
    from tuning.settings import TuneSettings

    s = TuneSettings(prompts="p.jsonl", workload="w", out=str(tmp_path / "w.yaml"))
    assert s.engine.dtype == "auto"
    ev = {"default": {"runs": [1], "tokens_per_s": 10.0, "tau": 1.0, "p95_latency_s": 1.0,
                      "outputs": [[1, 2]]},
          "tuned": {"tokens_per_s": 20.0, "tau": 2.0, "p95_latency_s": 1.0, "outputs": [[1, 3]]}}
    best, default = DecodingConfig(tree_budget=30), DecodingConfig()

    def choose(dtype):
        r = BatchResult(batch_size=1, study_name="w.bs1", counts={}, ran_trials=1,
                        default_params={}, best_params={}, best_trial=1)
        return _choose_on_eval(s, r, ev, best, default, dtype), r

    cfg, r = choose("fp32")
    assert cfg == default and r.chosen == "default" and "changed fp32 greedy outputs" in r.note
    cfg, r = choose("bf16")              # half precision: outputs may differ at near-ties
    assert cfg == best and r.chosen == "tuned"


def test_tune_settings_refuse_what_would_fail_late_or_be_ignored(tmp_path):
    from tuning.settings import TuneSettings

    def settings(**kw):
        return TuneSettings(**{"prompts": "p.jsonl", "workload": "w",
                               "out": str(tmp_path / "w.yaml"), **kw})

    for kw, match in (({"check_dtype": "float32"}, "check dtype"),
                      ({"check_dtype": "auto"}, "check dtype"),
                      ({"prompts_per_trial": 0}, "prompts per trial"),
                      ({"check_prompts": -1}, "check prompts"),
                      ({"check_tokens": 0}, "check tokens"),
                      ({"eval_repeats": 0}, "eval repeats"),
                      ({"max_concurrent_trials": 0}, "max concurrent"),
                      ({"cpus_per_trial": 0}, "cpus per trial"),
                      ({"gpus_per_trial": -1}, "gpus per trial"),
                      ({"out": str(tmp_path)}, "is a directory"),
                      ({"storage": "sqlite:/relative.db"}, "storage")):
        with pytest.raises(ValueError, match=match):
            settings(**kw)
    assert settings(check_dtype=None, check_prompts=0, storage="sqlite:///x.db").check_prompts == 0


def test_profile_names_with_dots_and_a_matching_variant_in_a_later_directory(tmp_path,
                                                                             monkeypatch):
    from dart_ray.profiles import SHIPPED, resolve_profile

    monkeypatch.setenv("DART_RAY_PROFILES", str(tmp_path))
    save_profile(_schedule(_fp(), workload="chat.v2"), tmp_path / "chat.v2.yaml")
    assert resolve_profile("chat.v2") == tmp_path / "chat.v2.yaml"     # a name, not a path
    with pytest.raises(FileNotFoundError):
        resolve_profile("chat.yaml")                                    # a path that is not there
    # DART_RAY_PROFILES holds only another CPU class's variant; the shipped directory has a
    # plain profile: the plain one wins over a variant tuned elsewhere
    assert (SHIPPED / "code.yaml").is_file() or list(SHIPPED.glob("code@*.yaml"))
    save_profile(_schedule(_fp(cpu="Other CPU"), workload="code"), tmp_path / "code@other.yaml")
    assert resolve_profile("code") != tmp_path / "code@other.yaml"
    # a variant elsewhere is still found when nothing else is
    save_profile(_schedule(_fp(cpu="Other CPU"), workload="zz"), tmp_path / "zz@other.yaml")
    assert resolve_profile("zz") == tmp_path / "zz@other.yaml"


def test_a_malformed_schedule_and_a_failed_write_are_clear(tmp_path):
    for bad, match in (({"schedule": "abc"}, "must be a list"),
                       ({"schedule": {"a": 1}}, "must be a list"),
                       ({"schedule": ["x"]}, "must be a mapping")):
        with pytest.raises(ValueError, match=match):
            DecodingSchedule.from_dict(bad)
    (tmp_path / "p.yaml").mkdir()
    with pytest.raises(OSError):
        save_profile(_schedule(_fp()), tmp_path / "p.yaml")
    assert not (tmp_path / "p.yaml.tmp").exists()                      # no temporary left behind


def test_a_profile_and_decoding_knobs_together_are_refused(tmp_path):
    from batch.job import BatchJobConfig
    from dart_ray.cli import main
    from deployments.config import ServeArgs

    knobs = DecodingConfig(tree_budget=12)
    with pytest.raises(ValueError, match="give one of them"):
        ServeArgs(engine=EngineConfig(decoding=knobs), profile="code")
    with pytest.raises(ValueError, match="give one of them"):
        BatchJobConfig(input="i", output="o", engine=EngineConfig(decoding=knobs), profile="code")
    assert ServeArgs(engine=EngineConfig(), profile="code").profile == "code"
    for cmd in (["generate", "x"], ["bench", "--prompts", "chat"]):
        assert main([*cmd, "--profile", "code", "--decoding", '{"tree_budget": 12}']) == 2
    assert main(["bench", "--prompts", "chat", "--methods", "dart", "--profile-for", "dart=code",
                 "--decoding", '{"tree_budget": 12}']) == 2


def test_start_tune_checks_prompts_first_and_tunes_around_the_given_knobs(tiny_model, tmp_path,
                                                                          monkeypatch):
    """A prompt over the context failed every trial (tune split) or the run after all of them
    (eval split): it is named before any trial. ``--decoding`` was dropped (the space's base was
    DecodingConfig()): it is now the default point and the untuned knobs."""
    import ray

    from tuning.settings import TuneSettings
    from tuning.start import Deadline, start_tune

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 1.0})
    knobs = DecodingConfig(tree_budget=12, eps=1e-3)
    s = TuneSettings(prompts="p.jsonl", workload="w", out=str(tmp_path / "w.yaml"),
                     batch_sizes=[1, 4], num_prompts=8,
                     engine=EngineConfig(model=str(tiny_model), method="dart", drafter="random",
                                         ngram="none", dtype="fp32", max_seq_len=64,
                                         decoding=knobs))
    logs: list[str] = []
    prompts = PROMPTS[:7] + ["word " * 200]
    with pytest.raises(ValueError, match=r"prompt \d+ .*context allows at most 63"):
        start_tune(s, Deadline(None), logs.append, prompts, None)
    run = start_tune(s, Deadline(None), logs.append, PROMPTS, None)
    assert run.space.base == knobs and run.space.default_point()["tree_budget"] == 12
    assert run.space.to_config(run.space.default_point()).eps == 1e-3      # an untuned knob
    assert any("batch sizes [4]" in m for m in logs)   # 2 eval prompts: bs 4 never fills up
