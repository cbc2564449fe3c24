"""Decoding profiles for batch jobs: a file of DecodingConfig fields, optionally per batch size.

Accepted file contents (JSON or YAML)::

    {"chunk_len": 6, "tree_budget": 40}                       # one DecodingConfig
    {"decoding": {"chunk_len": 6}}                             # the same, nested
    {"by_batch_size": {"1": {"tree_budget": 60}, "8": {"tree_budget": 24}}}

With ``by_batch_size`` the engine uses the entry of the largest batch size <= the number of running
rows (the smallest entry below that). A name that is not a file is looked up through
``tuning.profiles.load_profile(name)`` when that module provides one.
"""

from __future__ import annotations

import importlib
import json
from bisect import bisect_right
from pathlib import Path

from dart_ray import DecodingConfig


class BatchSizeSchedule:
    """DecodingConfig by batch size (what ``Engine.set_decoding`` accepts as a schedule)."""

    def __init__(self, by_batch_size: dict[int, DecodingConfig]) -> None:
        if not by_batch_size:
            raise ValueError("by_batch_size must not be empty")
        self.sizes = sorted(by_batch_size)
        self.configs = [by_batch_size[b] for b in self.sizes]

    def for_batch_size(self, batch_size: int) -> DecodingConfig:
        return self.configs[max(0, bisect_right(self.sizes, batch_size) - 1)]


def profile_from_dict(d: dict) -> DecodingConfig | BatchSizeSchedule:
    if "by_batch_size" in d:
        return BatchSizeSchedule({int(b): DecodingConfig.from_dict(c) for b, c in d["by_batch_size"].items()})
    return DecodingConfig.from_dict(d.get("decoding", d))


def read_profile(name_or_path: str) -> dict:
    """The profile as a plain dict (picklable; workers turn it into a config with profile_from_dict)."""
    path = Path(name_or_path)
    if path.is_file():
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            d = yaml.safe_load(text)
        else:
            d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError(f"profile {path} must hold a mapping")
        profile_from_dict(d)  # validate now, on the driver
        return d
    try:
        tuning_profiles = importlib.import_module("tuning.profiles")
    except ImportError:
        tuning_profiles = None
    loader = getattr(tuning_profiles, "load_profile", None)
    if loader is None:
        raise FileNotFoundError(f"profile {name_or_path!r} is neither a file nor a known profile name")
    prof = loader(name_or_path)
    if isinstance(prof, DecodingConfig):
        return prof.to_dict()
    if isinstance(prof, dict):
        profile_from_dict(prof)
        return prof
    if hasattr(prof, "to_dict"):
        d = prof.to_dict()
        profile_from_dict(d)
        return d
    raise TypeError(f"tuning.profiles.load_profile returned {type(prof).__name__}; expected a dict")
