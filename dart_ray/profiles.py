"""Decoding profiles: per-workload schedules of :class:`DecodingConfig` by batch size.

A profile (written by ``dart-ray tune``, loaded by the engine, server and batch jobs) is YAML::

    workload: code
    schedule:
      - {max_batch_size: 1,  decoding: {chunk_len: 8, top_k: 25, beam_width: 20, tree_budget: 60, ...}}
      - {max_batch_size: 4,  decoding: {...}}
      - {max_batch_size: 1024, decoding: {...}}
    meta: {...}            # free-form: how it was tuned, measured gains

The engine asks ``schedule.for_batch_size(B)`` every step: the first entry whose
``max_batch_size >= B`` wins (entries sorted ascending; the last one covers larger batches).
Profiles are referenced by path or by name (``$DART_RAY_PROFILES`` dir, then the shipped
``dart_ray/artifacts/profiles``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from dart_ray.config import DecodingConfig

SHIPPED = Path(__file__).resolve().parent / "artifacts" / "profiles"


@dataclass(frozen=True)
class DecodingSchedule:
    workload: str
    """Name of the workload this schedule was tuned for."""
    entries: tuple[tuple[int, DecodingConfig], ...]
    """(max_batch_size, config) sorted by max_batch_size."""
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("a decoding schedule needs at least one entry")
        sizes = [b for b, _ in self.entries]
        if sizes != sorted(sizes) or len(set(sizes)) != len(sizes) or sizes[0] < 1:
            raise ValueError(f"schedule max_batch_size values must be increasing and >= 1, got {sizes}")

    def for_batch_size(self, batch_size: int) -> DecodingConfig:
        for b, cfg in self.entries:
            if batch_size <= b:
                return cfg
        return self.entries[-1][1]

    @classmethod
    def constant(cls, cfg: DecodingConfig, workload: str = "default") -> "DecodingSchedule":
        return cls(workload, ((1 << 30, cfg),))

    def to_dict(self) -> dict:
        return {"workload": self.workload,
                "schedule": [{"max_batch_size": b, "decoding": c.to_dict()} for b, c in self.entries],
                "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: dict) -> "DecodingSchedule":
        try:
            entries = tuple(sorted((int(e["max_batch_size"]), DecodingConfig.from_dict(e["decoding"]))
                                   for e in d["schedule"]))
            return cls(str(d.get("workload", "unnamed")), entries, dict(d.get("meta") or {}))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed decoding profile: missing/invalid {e}") from None


def save_profile(schedule: DecodingSchedule, path: str | Path) -> Path:
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(schedule.to_dict(), sort_keys=False))
    os.replace(tmp, path)
    return path


def resolve_profile(ref: str | Path) -> Path:
    p = Path(ref).expanduser()
    if p.is_file():
        return p
    if p.suffix or os.sep in str(ref):
        raise FileNotFoundError(f"decoding profile not found: {p}")
    dirs = [Path(os.environ["DART_RAY_PROFILES"])] if os.environ.get("DART_RAY_PROFILES") else []
    for d in dirs + [SHIPPED]:
        cand = d / f"{ref}.yaml"
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"no decoding profile named {ref!r} in {[str(d) for d in dirs + [SHIPPED]]}")


def load_profile(ref: str | Path) -> DecodingSchedule:
    """Load a profile by path or name."""
    import yaml

    path = resolve_profile(ref)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: invalid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a profile must be a mapping")
    return DecodingSchedule.from_dict(data)
