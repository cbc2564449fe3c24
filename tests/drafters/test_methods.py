"""Tests of dart_ray.methods: the method registry is the one list of methods, and a method added
by one registry entry is picked up by config validation, the CLI, make_drafter and the engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from dart_ray.config import METHODS, EngineConfig, SamplingParams
from dart_ray.drafters import default_artifact_dir, make_drafter
from dart_ray.drafters.ngram import NGramDrafter
from dart_ray.methods import (
    MethodSpec,
    get_method,
    method_names,
    method_specs,
    register,
    unregister,
)

SHIPPED = default_artifact_dir("SmolLM2-135M-Instruct")


@pytest.fixture
def registered():
    """Register specs for one test; removed afterwards."""
    names = []

    def add(spec: MethodSpec) -> MethodSpec:
        names.append(spec.name)
        return register(spec)

    yield add
    for n in names:
        unregister(n)


def test_every_method_name_resolves_to_its_spec():
    assert METHODS == method_names() == ("dart", "eagle", "medusa", "sps", "ngram", "none")
    for name in METHODS:
        spec = get_method(name)
        assert spec.name == name and callable(spec.build)
        EngineConfig(method=name)                                     # validates
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        get_method("nope")
    with pytest.raises(ValueError, match="method must be one of"):
        EngineConfig(method="nope")


def test_shipped_artifacts_match_the_registry():
    """Each network method's config file is in its shipped directory, loads with its class and is
    the method's own; every shipped drafter directory belongs to a registered method."""
    nets = [s for s in method_specs() if s.model]
    assert {s.name for s in nets} == {"dart", "eagle", "medusa", "sps"}
    shipped = {p.name for p in SHIPPED.iterdir() if p.is_dir()} - {"ngram"}
    assert shipped == {s.artifact_dir for s in nets}
    for spec in nets:
        d = SHIPPED / spec.artifact_dir
        assert (d / spec.config_file).is_file() and (d / "model.safetensors").is_file(), spec.name
        model = spec.model_class().load(d)
        assert getattr(model.cfg, "arch", spec.name) == spec.name
        assert model.cfg.target_id == "SmolLM2-135M-Instruct"
    for spec in method_specs():
        if not spec.model:
            unset = (spec.config_file, spec.artifact_dir, spec.objective, spec.random_model)
            assert all(x is None for x in unset)


def test_shipped_artifacts_are_small():
    """Every shipped artifact (each drafter, the N-gram model) stays within 25 MB."""
    for d in (p for p in SHIPPED.iterdir() if p.is_dir()):
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        assert 0 < size <= 25 * 10**6, (d.name, size)


def test_training_and_shipping_derive_from_the_registry():
    from dart_ray.training.ship import trained_method
    from dart_ray.training.trainer import ARCHS

    assert ARCHS == ("dart", "eagle", "medusa", "sps")
    for arch in ARCHS:
        spec = trained_method(arch)
        assert spec.objective == arch and spec.card_title and spec.artifact_dir
    with pytest.raises(ValueError, match="unknown arch 'ngram'"):
        trained_method("ngram")


def test_ship_places_a_run_where_the_registry_says(tmp_path):
    """``dart-ray ship`` copies a trained run to the method's artifact dir with its card title."""
    import json

    from dart_ray.training.ship import ship

    run = tmp_path / "run"
    (run / "drafter").mkdir(parents=True)
    (run / "drafter" / "sps_config.json").write_text("{}")
    (run / "train_summary.json").write_text(json.dumps({
        "arch": "sps", "config": {"depth": 4}, "train_seqs": 1, "val_seqs": 1, "steps": 1,
        "train_wall_s": 6.0,
        "final_eval": {"top1": [0.5], "top5": [0.9], "chain_tau": 1.5}}))
    dest = ship(run, None, "M", "cmd", dest_root=tmp_path / "art")
    assert (dest / "sps" / "sps_config.json").is_file()
    assert (dest / "sps" / "CARD.md").read_text().startswith("# SpS draft model (baseline) for M")
    (run / "drafter" / "sps_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no trained sps drafter"):
        ship(run, None, "M", "cmd", dest_root=tmp_path / "art")


def test_cli_choices_come_from_the_registry(registered):
    import argparse

    from dart_ray.config import add_engine_args

    registered(MethodSpec("fake", _build_fake))
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args(["--method", "fake"]).method == "fake"
    with pytest.raises(SystemExit):
        p.parse_args(["--method", "nope"])


def test_spec_validation(registered):
    build = lambda model, target, ngram: None  # noqa: E731
    with pytest.raises(ValueError, match="config_file and artifact_dir"):
        MethodSpec("x", build, model="m:C")
    with pytest.raises(ValueError, match="need a network"):
        MethodSpec("x", build, objective="x")
    with pytest.raises(ValueError, match="identifier"):
        MethodSpec("a-b", build)
    with pytest.raises(ValueError, match="already registered"):
        register(MethodSpec("dart", build))
    registered(MethodSpec("x", build))
    with pytest.raises(ValueError, match="already registered"):
        register(MethodSpec("x", build))


# ---- a method added by one registry entry ----------------------------------------------------


@dataclasses.dataclass
class FakeCfg:
    target_id: str
    checked: list = dataclasses.field(default_factory=list)

    def check_target(self, args, model_id: str) -> None:
        self.checked.append(model_id)
        if model_id != self.target_id:
            raise ValueError(f"fake net is for {self.target_id}, not {model_id}")


class FakeNet:
    """A network class as the registry names it: ``load(path, dtype=, device=)`` and a ``cfg``."""

    def __init__(self, cfg: FakeCfg, path: Path | None = None) -> None:
        self.cfg, self.path = cfg, path

    @classmethod
    def load(cls, path, dtype=None, device="cpu") -> FakeNet:
        return cls(FakeCfg(Path(path, "fake_config.json").read_text().strip()), Path(path))


class FakeDrafter(NGramDrafter):
    name = "fake"

    def __init__(self, net, ngram) -> None:
        super().__init__(ngram)
        self.net = net


def _build_fake(model, target, ngram):
    return FakeDrafter(model, ngram)


def test_fake_method_without_network_reaches_make_drafter(registered):
    registered(MethodSpec("fake", _build_fake))
    assert "fake" in method_names()
    cfg = EngineConfig(method="fake", ngram="none")                 # config validation accepts it
    drafter = make_drafter(cfg, SimpleNamespace(model_id="t", args=None))
    assert isinstance(drafter, FakeDrafter) and drafter.net is None and drafter.ngram is None


def test_fake_method_with_network_loads_it(registered, tmp_path):
    registered(MethodSpec("fakenet", _build_fake, model=f"{__name__}:FakeNet",
                          config_file="fake_config.json", artifact_dir="fakenet",
                          objective="fakenet"))
    target = SimpleNamespace(model_id="t", args=None)
    with pytest.raises(FileNotFoundError, match="train-drafter --arch fakenet"):
        make_drafter(EngineConfig(method="fakenet", dtype="fp32", drafter=str(tmp_path)), target)
    (tmp_path / "fake_config.json").write_text("t")
    drafter = make_drafter(EngineConfig(method="fakenet", dtype="fp32", drafter=str(tmp_path)),
                           target)
    assert isinstance(drafter.net, FakeNet) and drafter.net.path == tmp_path
    assert drafter.net.cfg.checked == ["t"]
    (tmp_path / "fake_config.json").write_text("other")
    with pytest.raises(ValueError, match="not t"):
        make_drafter(EngineConfig(method="fakenet", dtype="fp32", drafter=str(tmp_path)), target)


def test_fake_method_runs_in_the_engine_and_is_lossless(registered, tiny_dirs):
    from dart_ray import Engine
    from dart_ray.models import load_target

    registered(MethodSpec("fake", _build_fake))
    target = load_target(str(tiny_dirs["llama"]), "fp32", max_seq_len=256)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompt = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2"
    out = {}
    for method in ("none", "fake"):
        cfg = EngineConfig(method=method, ngram="none", dtype="fp32", max_batch_size=1,
                           max_seq_len=256, adaptive=False)
        engine = Engine(target, make_drafter(cfg, target), cfg)
        assert isinstance(engine.drafter, FakeDrafter) == (method == "fake")
        out[method] = engine.generate([prompt], params)[0].token_ids
    assert out["fake"] == out["none"]
