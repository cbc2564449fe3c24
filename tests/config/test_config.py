"""Issue 18: one path for engine settings -- ``EngineConfig.from_dict`` / ``to_dict``,
``add_engine_args`` / ``EngineConfig.from_args`` and ``EngineConfig.fingerprint`` -- and every
``dart-ray`` command reading its engine flags from that one declaration."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dart_ray import DecodingConfig, EngineConfig
from dart_ray.config import add_engine_args, engine_args, resolve_method

CUSTOM = EngineConfig(model="/models/x", method="ngram", drafter="/d", ngram="none", dtype="fp32",
                      device="cuda:1", max_batch_size=4, max_seq_len=512, num_threads=3,
                      pack_weights=False, adaptive=False, seed=7,
                      decoding=DecodingConfig(draft_depth=4, tree_budget=12, lookup_paths=0))
"""Every field away from its default."""


def test_every_field_of_custom_differs_from_the_default():
    d, c = EngineConfig().to_dict(), CUSTOM.to_dict()
    assert [k for k in d if d[k] == c[k]] == []


# ---- dict form -----------------------------------------------------------------------------------
def test_from_dict_round_trip_and_plain_data():
    assert EngineConfig.from_dict(CUSTOM.to_dict()) == CUSTOM
    # JSON / YAML safe
    assert EngineConfig.from_dict(json.loads(json.dumps(CUSTOM.to_dict()))) == CUSTOM
    assert isinstance(CUSTOM.to_dict()["decoding"], dict)
    assert EngineConfig.from_dict({}) == EngineConfig()
    assert EngineConfig.from_dict(CUSTOM) is CUSTOM                                 # passes through
    assert EngineConfig.from_dict({"decoding": None}) == EngineConfig()
    assert EngineConfig.from_dict({"decoding": DecodingConfig(top_k=3)}).decoding.top_k == 3
    assert EngineConfig.from_dict({"decoding": {"top_k": 3}}).decoding == DecodingConfig(top_k=3)


def test_from_dict_errors_name_the_field():
    known = r"unknown EngineConfig fields \['modle'\]; known: \['model', 'method'"
    with pytest.raises(ValueError, match=known):
        EngineConfig.from_dict({"modle": "x"})
    with pytest.raises(ValueError, match=r"unknown DecodingConfig fields: \['depth'\]"):
        EngineConfig.from_dict({"decoding": {"depth": 3}})
    with pytest.raises(ValueError, match="mapping"):
        EngineConfig.from_dict(["model"])
    cases = [({"max_batch_size": "8"}, "max_batch_size must be an integer, got '8'"),
             ({"max_seq_len": True}, "max_seq_len must be an integer"),
             ({"num_threads": 1.5}, "num_threads must be an integer or null"),
             ({"seed": None}, "seed must be an integer"),
             ({"model": 3}, "model must be a string or null"),
             ({"device": None}, "device must be a string"),
             ({"adaptive": "yes"}, "adaptive must be a boolean"),
             ({"pack_weights": 1}, "pack_weights must be a boolean or null"),
             ({"method": "eagle9"}, "method must be one of"),
             ({"dtype": "int8"}, "dtype must be one of"),
             ({"max_batch_size": 0}, r"max_batch_size must be in \[1, 1024\]"),
             ({"decoding": {"tree_budget": 0}}, "tree_budget")]
    for d, msg in cases:
        with pytest.raises(ValueError, match=msg):
            EngineConfig.from_dict(d)


def test_decoding_knobs_are_type_checked_and_name_the_knob(tmp_path):
    """A profile's knob of the wrong type once loaded (``draft_depth: 8.5`` failed every row of a
    batch job later, ``true`` became 1); it is refused where it is read, naming the knob."""
    from dart_ray.profiles import load_profile

    for knobs, msg in [({"draft_depth": 8.5}, "draft_depth must be an integer, got 8.5"),
                       ({"tree_budget": True}, "tree_budget must be an integer, got True"),
                       ({"top_k": "8"}, "top_k must be an integer, got '8'"),
                       ({"ngram_weight": "0.5"}, "ngram_weight must be a number"),
                       ({"eps": False}, "eps must be a number")]:
        with pytest.raises(ValueError, match=msg):
            DecodingConfig(**knobs)
    c = DecodingConfig(draft_depth=np.int64(4), ngram_weight=1)
    assert type(c.draft_depth) is int and type(c.ngram_weight) is float
    assert c == DecodingConfig(draft_depth=4, ngram_weight=1.0)

    def profile(text: str) -> Path:
        p = tmp_path / "p.yaml"
        p.write_text(text)
        return p

    entry = "- max_batch_size: {b}\n  decoding: {{draft_depth: {d}}}\n"
    for text, msg in [
        ("schedule:\n" + entry.format(b=4, d=8.5), "draft_depth must be an integer"),
        ("schedule:\n" + entry.format(b=4.9, d=3), "max_batch_size must be an integer, got 4.9"),
        ("schedule:\n" + entry.format(b='"16"', d=3), "max_batch_size must be an integer"),
        ("schedule:\n" + entry.format(b=4, d=3) + entry.format(b=4, d=5),
         "increasing"),
        ("metaa: {}\nschedule:\n" + entry.format(b=4, d=3), r"unknown keys \['metaa'\]"),
        ("schedule:\n- {max_batch_size: 4, decoding: {}, extra_knob: 1}\n",
         r"unknown keys \['extra_knob'\] in a schedule entry")]:
        with pytest.raises(ValueError, match=msg):
            load_profile(profile(text))
    assert load_profile(profile("schedule:\n" + entry.format(b=4, d=3))).entries[0][0] == 4


def test_paths_and_numpy_ints_are_normalised():
    c = EngineConfig(model=Path("/m"), drafter=Path("/d"), max_batch_size=np.int64(4),
                     num_threads=np.int32(2))
    assert (c.model, c.drafter, c.max_batch_size, c.num_threads) == ("/m", "/d", 4, 2)
    assert type(c.max_batch_size) is int and type(c.num_threads) is int
    assert c == EngineConfig(model="/m", drafter="/d", max_batch_size=4, num_threads=2)


# ---- command line --------------------------------------------------------------------------------
def _parser(**defaults) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p, **defaults)
    return p


def _argv(cfg: EngineConfig) -> list[str]:
    """The flags that spell ``cfg`` (every field)."""
    argv = ["--model", cfg.model, "--method", cfg.method, "--drafter", cfg.drafter, "--ngram",
            cfg.ngram, "--dtype", cfg.dtype, "--device", cfg.device, "--max-batch-size",
            str(cfg.max_batch_size), "--max-seq-len", str(cfg.max_seq_len), "--num-threads",
            str(cfg.num_threads), "--pack-weights" if cfg.pack_weights else "--no-pack-weights",
            "--adaptive" if cfg.adaptive else "--no-adaptive", "--drafter-seed", str(cfg.seed),
            "--decoding", json.dumps(cfg.decoding.to_dict())]
    return argv


def test_from_args_round_trip_covers_every_field():
    a = _parser().parse_args(_argv(CUSTOM))
    assert set(engine_args(a)) == set(EngineConfig.field_names())          # one flag per field
    assert EngineConfig.from_args(a) == CUSTOM


def test_relative_paths_that_exist_here_become_absolute(tmp_path, monkeypatch):
    """The config travels to processes with another working directory (a Tune trial runs in its
    trial directory): --model/--drafter/--ngram naming a relative path that exists here are made
    absolute; the words that are not paths, absolute paths and names that are no path here stay."""
    monkeypatch.chdir(tmp_path)
    for d in ("m", "d", "n", "default", "random", "none"):
        (tmp_path / d).mkdir()
    a = _parser().parse_args(["--model", "m", "--drafter", "d", "--ngram", "./n"])
    assert engine_args(a) == {"model": str(tmp_path / "m"), "drafter": str(tmp_path / "d"),
                              "ngram": str(tmp_path / "n")}
    a = _parser().parse_args(["--model", "default", "--drafter", "random", "--ngram", "none"])
    assert engine_args(a) == {"model": "default", "drafter": "random", "ngram": "none"}
    a = _parser().parse_args(["--model", "/abs/m", "--drafter", "not-here"])
    assert engine_args(a) == {"model": "/abs/m", "drafter": "not-here"}


def test_no_flags_means_the_defaults_or_the_base():
    a = _parser().parse_args([])
    assert engine_args(a) == {}
    assert EngineConfig.from_args(a) == EngineConfig()
    assert EngineConfig.from_args(a, base=CUSTOM) == CUSTOM
    assert EngineConfig.from_args(a, base=CUSTOM.to_dict()) == CUSTOM
    # given flags go over the base; --decoding knobs over the base's knobs
    a = _parser().parse_args(["--max-seq-len", "1024", "--decoding", '{"top_k": 5}'])
    got = EngineConfig.from_args(a, base=CUSTOM)
    assert got == CUSTOM.replace(max_seq_len=1024, decoding=CUSTOM.decoding.replace(top_k=5))


def test_old_spellings_aliases_and_command_defaults():
    a = _parser().parse_args(["--threads", "2", "--no-adaptive", "--method", "ar"])
    assert EngineConfig.from_args(a) == EngineConfig(num_threads=2, adaptive=False, method="none")
    a = _parser(method="auto", max_batch_size=1).parse_args(["--drafter", "/d"])
    assert engine_args(a) == {"method": "auto", "max_batch_size": 1, "drafter": "/d"}
    # auto + a drafter: dart
    assert EngineConfig.from_args(a) == EngineConfig(drafter="/d", max_batch_size=1)
    assert resolve_method("ar", None, None) == "none"
    assert resolve_method("eagle", None, None) == "eagle"
    assert _parser().parse_args(["--pack-weights"]).pack_weights is True
    with pytest.raises(SystemExit):
        _parser().parse_args(["--method", "eagle9"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["--decoding", "[1, 2]"])
    with pytest.raises(ValueError, match="unknown EngineConfig fields"):
        add_engine_args(argparse.ArgumentParser(), max_batch=1)
    with pytest.raises(ValueError, match="unknown DecodingConfig fields"):
        EngineConfig.from_args(_parser().parse_args(["--decoding", '{"depth": 2}']))


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {o for act in parser._actions for o in act.option_strings}


def test_every_command_takes_the_same_engine_flags():
    from batch.cli import add_batch_args
    from dart_ray.cli import build_parser as dart_ray_parser
    from deployments.cli import build_parser as serve_parser
    from tuning.cli import build_parser as tune_parser

    engine_flags = _option_strings(_parser()) - {"-h", "--help"}
    sub = next(a for a in dart_ray_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {"generate": sub.choices["generate"], "bench": sub.choices["bench"],
               "batch": add_batch_args(argparse.ArgumentParser()), "tune": tune_parser(),
               "serve": serve_parser()}
    for name, p in parsers.items():
        assert engine_flags <= _option_strings(p), (name, engine_flags - _option_strings(p))


def test_generate_and_batch_build_their_engine_from_the_flags():
    from batch.cli import add_batch_args, config_from_args
    from dart_ray.cli import build_parser

    a = build_parser().parse_args(["generate", "hi", *_argv(CUSTOM)])
    assert EngineConfig.from_args(a) == CUSTOM
    a = build_parser().parse_args(["generate", "hi", "--drafter", "/d"])
    # generate: 1 row
    assert EngineConfig.from_args(a) == EngineConfig(drafter="/d", max_batch_size=1)
    p = add_batch_args(argparse.ArgumentParser())
    a = p.parse_args(["--input", "i.parquet", "--output", "o", *_argv(CUSTOM)])
    assert config_from_args(a).engine == CUSTOM
    assert config_from_args(p.parse_args(["--input", "i", "--output", "o", "--method",
                                          "none"])).engine == \
        EngineConfig(method="none")


def test_bench_refuses_settings_it_fixes_itself(capsys):
    from dart_ray.cli import main

    assert main(["bench", "--prompts", "chat", "--max-batch-size", "4", "--max-seq-len",
                 "512"]) == 2
    assert "bench sets ['max_batch_size', 'max_seq_len'] itself" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["generate", "hi"], ["bench", "--prompts", "chat"],
                                  ["batch", "--input", "i.parquet", "--output", "o"],
                                  ["tune", "--prompts", "chat", "--workload", "w", "--out", "p"]])
def test_a_model_that_is_not_there_is_an_error_of_every_command(argv, tmp_path, capsys):
    """Not a traceback: exit 2 and one line naming the path, before any engine, Ray or trial."""
    from dart_ray.cli import main

    assert main([*argv, "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert f"dart-ray {argv[0]}: error: model path does not exist: {tmp_path / 'nope'}" in err
    assert "Traceback" not in err
    # a model this engine does not run: the same (before any Ray for batch)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    assert main([*argv, "--model", str(tmp_path / "gpt2"), "--method", "ngram"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "unsupported model_type 'gpt2'" in err and "Traceback" not in err


# ---- fingerprint ---------------------------------------------------------------------------------
def test_fingerprint_is_flat_complete_and_json():
    fp = CUSTOM.fingerprint()
    assert list(fp) == sorted(fp)
    expected = {k for k in EngineConfig.field_names() if k != "decoding"} | \
        {f"decoding.{k}" for k in DecodingConfig().to_dict()}
    assert set(fp) == expected
    assert json.loads(json.dumps(fp)) == fp
    assert fp["decoding.draft_depth"] == 4 and fp["num_threads"] == 3 and fp["model"] == "/models/x"


def test_fingerprint_tells_every_setting_apart():
    base = EngineConfig()
    reordered = EngineConfig.from_dict(dict(reversed(list(base.to_dict().items()))))
    assert reordered.fingerprint_digest() == base.fingerprint_digest()
    digests = {base.fingerprint_digest()}
    for name in EngineConfig.field_names():
        changed = base.replace(**{name: getattr(CUSTOM, name)})
        assert changed.fingerprint() != base.fingerprint(), name
        digests.add(changed.fingerprint_digest())
    assert len(digests) == len(EngineConfig.field_names()) + 1
    d = base.fingerprint_digest()
    assert len(d) == 16 and int(d, 16) >= 0


def test_fingerprint_exclude():
    fp = CUSTOM.fingerprint(exclude=("num_threads", "max_batch_size"))
    assert "num_threads" not in fp and "max_batch_size" not in fp and "model" in fp
    assert CUSTOM.replace(num_threads=9).fingerprint_digest(exclude=["num_threads"]) == \
        CUSTOM.fingerprint_digest(exclude=["num_threads"])
    assert not any(k.startswith("decoding.") for k in CUSTOM.fingerprint(exclude=["decoding"]))
    with pytest.raises(ValueError, match="unknown fields"):
        CUSTOM.fingerprint(exclude=["threads"])


def test_fingerprint_digest_is_stable_across_processes():
    code = ("from dart_ray.config import EngineConfig, DecodingConfig; "
            "print(EngineConfig(model='/m', "
            "decoding=DecodingConfig(top_k=3)).fingerprint_digest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == EngineConfig(model="/m", decoding=DecodingConfig(top_k=3)).fingerprint_digest()
