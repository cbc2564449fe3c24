"""Issue 18: one name per concept at every boundary. ``draft_depth`` (positions drafted per step,
formerly ``chunk_len``) and ``tree_budget`` (draft nodes per tree) are the names in DecodingConfig,
profiles, the tuner's space and the flags; the old spellings still work for one release, with a
:class:`~dart_ray.config.RenamedWarning`, and read to the same config."""

from __future__ import annotations

import argparse
import contextlib
import warnings
from pathlib import Path

import pytest

from dart_ray import DecodingConfig, DecodingSchedule, EngineConfig, load_profile, save_profile
from dart_ray.config import RenamedWarning, add_engine_args, add_renamed_flag
from dart_ray.profiles import SHIPPED

KNOBS = Path(__file__).resolve().parents[2] / "dart_ray" / "bench" / "data" / "knobs"

OLD_PROFILE = """\
workload: old
schedule:
- max_batch_size: 2
  decoding: {chunk_len: 3, top_k: 5, tree_budget: 12}
- max_batch_size: 1024
  decoding: {chunk_len: 5, tree_budget: 20}
meta: {tool: dart-ray tune}
"""


@contextlib.contextmanager
def no_renamed_warning():
    """Any RenamedWarning inside fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RenamedWarning)
        yield


def test_renamed_warning_is_a_deprecation_warning():
    assert issubclass(RenamedWarning, DeprecationWarning)
    fields = DecodingConfig().to_dict()
    assert "draft_depth" in fields and "chunk_len" not in fields


def test_old_key_loads_with_a_warning_to_the_same_config():
    new = DecodingConfig(draft_depth=3, top_k=5)
    with pytest.warns(RenamedWarning, match="'chunk_len' is deprecated.*'draft_depth'"):
        assert DecodingConfig.from_dict({"chunk_len": 3, "top_k": 5}) == new
    with pytest.warns(RenamedWarning, match="chunk_len"):
        assert EngineConfig.from_dict({"decoding": {"chunk_len": 3, "top_k": 5}}).decoding == new
    with pytest.warns(RenamedWarning, match="chunk_len"):
        assert DecodingConfig().replace(chunk_len=3, top_k=5) == new
    with pytest.warns(RenamedWarning, match="chunk_len"):
        assert new.chunk_len == 3                                        # attribute alias
    with pytest.raises(ValueError, match="give only 'draft_depth'"):     # both spellings: ambiguous
        DecodingConfig.from_dict({"chunk_len": 3, "draft_depth": 4})
    with no_renamed_warning():                                           # the new name: silent
        assert DecodingConfig.from_dict({"draft_depth": 3, "top_k": 5}) == new
        assert DecodingConfig.from_dict(new.to_dict()) == new


def test_old_key_in_decoding_json_flag_overrides_the_base():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    base = EngineConfig(decoding=DecodingConfig(draft_depth=6, top_k=7))
    a = parser.parse_args(["--decoding", '{"chunk_len": 3}'])
    with pytest.warns(RenamedWarning, match="chunk_len"):
        got = EngineConfig.from_args(a, base=base)
    assert got.decoding == DecodingConfig(draft_depth=3, top_k=7)


def test_old_profile_loads_with_a_warning_and_is_saved_under_the_new_name(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(OLD_PROFILE)
    with pytest.warns(RenamedWarning, match="chunk_len"):
        old = load_profile(path)
    assert old.entries == ((2, DecodingConfig(draft_depth=3, top_k=5, tree_budget=12)),
                           (1024, DecodingConfig(draft_depth=5, tree_budget=20)))
    out = save_profile(old, tmp_path / "new.yaml")
    assert "chunk_len" not in out.read_text() and "draft_depth: 3" in out.read_text()
    with no_renamed_warning():
        assert load_profile(out) == old


@pytest.mark.parametrize("path", sorted(SHIPPED.glob("*.yaml")) + sorted(KNOBS.glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_profiles_use_the_current_names(path):
    assert "chunk_len" not in path.read_text()
    with no_renamed_warning():
        load_profile(path)


def test_schedule_and_drafter_attribute_aliases():
    from dart_ray.drafters.ngram import NGramDrafter

    sched = DecodingSchedule("s", ((1, DecodingConfig(draft_depth=2)),
                                   (8, DecodingConfig(draft_depth=5))))
    assert sched.max_draft_depth == 5
    with pytest.warns(RenamedWarning, match="max_chunk_len"):
        assert sched.max_chunk_len == 5
    d = NGramDrafter()
    assert d.max_draft_depth == 32
    with pytest.warns(RenamedWarning, match="'max_depth'.*'max_draft_depth'"):
        assert d.max_depth == 32
    with pytest.warns(RenamedWarning, match="max_depth"):
        d.max_depth = 4                                               # an old subclass's assignment
    assert d.max_draft_depth == 4


def test_renamed_flag_is_a_hidden_alias_that_warns():
    p = argparse.ArgumentParser()
    p.add_argument("--tree-budget", type=int, default=60)
    add_renamed_flag(p, "--nodes", "--tree-budget", dest="tree_budget", type=int)
    assert "--nodes" not in p.format_help()
    with no_renamed_warning():
        assert p.parse_args([]).tree_budget == 60
        assert p.parse_args(["--tree-budget", "7"]).tree_budget == 7
    with pytest.warns(RenamedWarning, match="'--nodes' is deprecated.*'--tree-budget'"):
        assert p.parse_args(["--nodes", "7"]).tree_budget == 7


def test_tuner_space_uses_the_config_names():
    pytest.importorskip("optuna")
    from tuning.space import SearchSpace

    for method in ("dart", "eagle", "medusa", "sps", "ngram"):
        names = SearchSpace.for_drafter(method, 8, True).names
        assert "draft_depth" in names and "chunk_len" not in names
        assert set(names) <= set(DecodingConfig().to_dict())
