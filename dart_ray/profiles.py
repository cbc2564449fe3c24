"""Decoding profiles: per-workload schedules of :class:`DecodingConfig` by batch size.

Every engine holds one :class:`DecodingSchedule` (``Engine.schedule``): a constant one of
``EngineConfig.decoding`` until a profile is applied, then the profile's. Steps, per-request lanes
of the server and its metrics all read that one schedule.

A profile (written by ``dart-ray tune``, loaded by the engine, server and batch jobs) is YAML::

    workload: code
    schedule:
      - {max_batch_size: 1,  decoding: {draft_depth: 8, top_k: 25, beam_width: 20,
                                        tree_budget: 60, ...}}
      - {max_batch_size: 4,  decoding: {...}}
      - {max_batch_size: 1024, decoding: {...}}
    meta: {...}            # how it was tuned, measured gains; meta.fingerprint = the machine

The engine asks ``schedule.for_batch_size(B)`` every step: the first entry whose
``max_batch_size >= B`` wins (entries sorted ascending; the last one covers larger batches).
Profiles are referenced by path or by name (``$DART_RAY_PROFILES`` dir, then the shipped
``dart_ray/artifacts/profiles``). A name may have one variant per CPU class, ``NAME@CLASS.yaml``
beside ``NAME.yaml``: the name resolves to the variant whose ``meta.fingerprint`` names this
machine's CPU model and ISA (and family/model numbers, where recorded), else to ``NAME.yaml``.
A profile written before the ``chunk_len`` -> ``draft_depth`` rename still loads, with a
:class:`~dart_ray.config.RenamedWarning` (one release).

**Hardware.** A profile is a measurement of one machine: ``dart-ray tune`` records the measuring
engine's :class:`~dart_ray.hardware.Fingerprint` in ``meta.fingerprint`` (and a readable
``meta.cpu``). :func:`apply_profile` (CLI, server, batch) compares it with the engine it is applied
to via :func:`check_profile_hardware`, which warns once per (profile, machine) pair naming the
fields that differ (or saying that the profile records no hardware). The knobs still apply: they are
the adaptive controller's starting point and cap; ``dart-ray tune --for-this-machine`` re-tunes them
here.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dart_ray.config import DecodingConfig, RenamedAttribute

SHIPPED = Path(__file__).resolve().parent / "artifacts" / "profiles"


@dataclass(frozen=True)
class DecodingSchedule:
    workload: str
    """Name of the workload this schedule was tuned for."""
    entries: tuple[tuple[int, DecodingConfig], ...]
    """(max_batch_size, config) sorted by max_batch_size."""
    meta: dict = field(default_factory=dict)
    """How it was made (free-form); ``meta.fingerprint`` = the tuning machine
    (``Fingerprint.to_dict()``)."""
    source: str = field(default="", compare=False)
    """Where it was loaded from ('' when built in memory); not part of equality or of the YAML."""

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("a decoding schedule needs at least one entry")
        sizes = [b for b, _ in self.entries]
        if sizes != sorted(sizes) or len(set(sizes)) != len(sizes) or sizes[0] < 1:
            raise ValueError("schedule max_batch_size values must be increasing and >= 1, got "
                             f"{sizes}")
        bad = [type(c).__name__ for _, c in self.entries if not isinstance(c, DecodingConfig)]
        if bad:
            raise TypeError(f"schedule entries must hold DecodingConfig, got {bad}")

    def for_batch_size(self, batch_size: int) -> DecodingConfig:
        for b, cfg in self.entries:
            if batch_size <= b:
                return cfg
        return self.entries[-1][1]

    @property
    def max_draft_depth(self) -> int:
        """The deepest ``draft_depth`` of any entry: the draft positions a server lists."""
        return max(cfg.draft_depth for _, cfg in self.entries)

    def max_positions(self, lookups: bool) -> int:
        """The deepest position a draft tree can reach under any entry: its ``draft_depth``, or,
        where prompt-lookup paths are merged into the tree (``lookups``: DART's
        ``lookup_paths``), their ``lookup_len`` when that is deeper."""
        return max(max(cfg.draft_depth, cfg.lookup_len if lookups and cfg.lookup_paths else 0)
                   for _, cfg in self.entries)

    max_chunk_len = RenamedAttribute("max_draft_depth")

    @classmethod
    def constant(cls, cfg: DecodingConfig, workload: str = "default") -> DecodingSchedule:
        return cls(workload, ((1 << 30, cfg),))

    def to_dict(self) -> dict:
        return {"workload": self.workload,
                "schedule": [{"max_batch_size": b, "decoding": c.to_dict()}
                             for b, c in self.entries],
                "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: dict) -> DecodingSchedule:
        """From the YAML/JSON form; unknown keys (top level or in an entry), a non-integer
        ``max_batch_size`` and bad knobs are errors that name them."""
        if not isinstance(d, Mapping):
            raise ValueError(f"malformed decoding profile: expected a mapping, got "
                             f"{type(d).__name__}")
        unknown = set(d) - {"workload", "schedule", "meta"}
        if unknown:
            raise ValueError(f"malformed decoding profile: unknown keys {sorted(unknown)} "
                             "(expected workload, schedule, meta)")
        if not isinstance(d.get("schedule"), list):
            got = type(d.get("schedule")).__name__
            raise ValueError("malformed decoding profile: 'schedule' must be a list of entries "
                             f"{{max_batch_size, decoding}}, got {got}")
        try:
            entries = []
            for e in d["schedule"]:
                if not isinstance(e, Mapping):
                    raise ValueError("malformed decoding profile: a schedule entry must be a "
                                     f"mapping {{max_batch_size, decoding}}, got {e!r}")
                extra = set(e) - {"max_batch_size", "decoding"}
                if extra:
                    raise ValueError(f"malformed decoding profile: unknown keys {sorted(extra)} in "
                                     "a schedule entry (expected max_batch_size, decoding)")
                b = e["max_batch_size"]
                if not isinstance(b, numbers.Integral) or isinstance(b, bool):
                    raise ValueError(f"malformed decoding profile: max_batch_size must be an "
                                     f"integer, got {b!r}")
                entries.append((int(b), DecodingConfig.from_dict(e["decoding"])))
            entries.sort(key=lambda e: e[0])        # duplicates: __post_init__ says so
            return cls(str(d.get("workload", "unnamed")), tuple(entries),
                       dict(d.get("meta") or {}))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed decoding profile: missing/invalid {e}") from None


def save_profile(schedule: DecodingSchedule, path: str | Path) -> Path:
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(yaml.safe_dump(schedule.to_dict(), sort_keys=False))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


PROFILE_SUFFIXES = (".yaml", ".yml", ".json")
"""File suffixes that make a profile reference a path rather than a name."""


def resolve_profile(ref: str | Path) -> Path:
    p = Path(ref).expanduser()
    if p.is_file():
        return p
    if p.suffix in PROFILE_SUFFIXES or os.sep in str(ref):   # a path ("chat.v2" is a name)
        raise FileNotFoundError(f"decoding profile not found: {p}")
    dirs = [Path(os.environ["DART_RAY_PROFILES"])] if os.environ.get("DART_RAY_PROFILES") else []
    others = []
    for d in dirs + [SHIPPED]:
        cand = d / f"{ref}.yaml"
        variants = sorted(d.glob(f"{ref}@*.yaml"))
        if variants:
            mine = _tuned_on_this_cpu(variants)
            if mine is not None:
                return mine
        if cand.is_file():
            return cand
        others += variants
    if others:           # tuned on another CPU class only: the first directory's first variant
        return others[0]
    raise FileNotFoundError(f"no decoding profile named {ref!r} in "
                            f"{[str(d) for d in dirs + [SHIPPED]]}")


def _tuned_on_this_cpu(paths: list[Path]) -> Path | None:
    """The first of ``paths`` whose recorded fingerprint (:func:`profile_fingerprint`) names this
    machine's CPU model and ISA, and its family/model numbers where the profile recorded them (the
    CPU class: the trade-offs a profile measures differ between classes, and "AMD EPYC" with
    AVX-512 names both a Zen 4 and a Zen 5), else None. Unreadable variants are skipped here
    (loading one by path still fails)."""
    from dart_ray.hardware import Fingerprint

    here = Fingerprint.current("cpu")
    for p in paths:
        try:
            fp = profile_fingerprint(load_profile(p))
        except (ValueError, TypeError, OSError):
            continue
        if fp is not None and fp.same_cpu(here):
            return p
    return None


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
    try:
        sched = DecodingSchedule.from_dict(data)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{path}: {e}") from e              # name the file the error is in
    return dataclasses.replace(sched, source=str(path.resolve()))


# ---- hardware ----------------------------------------------------------------------------------

class ProfileHardwareWarning(UserWarning):
    """A profile applied on a machine other than the one it was tuned on (or on unknown
    hardware)."""


NO_FINGERPRINT = ("no hardware recorded (profile predates meta.fingerprint; re-tune with "
                  "--for-this-machine)")

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def profile_fingerprint(schedule: DecodingSchedule):
    """The :class:`~dart_ray.hardware.Fingerprint` a profile was tuned on, or None if it records
    none.

    Raises TypeError / ValueError when ``meta.fingerprint`` is present but malformed."""
    from dart_ray.hardware import Fingerprint

    raw = schedule.meta.get("fingerprint")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise TypeError(f"profile {schedule.workload!r}: meta.fingerprint must be a mapping, got "
                        f"{type(raw).__name__}")
    return Fingerprint.from_dict(raw)


def fingerprint_differences(recorded: dict, here: dict) -> list[str]:
    """``field: recorded != here`` per differing field of two ``Fingerprint.to_dict()`` records; a
    field one of them was recorded without (added later, e.g. ``cpu_id``) is not a difference.
    Raises TypeError / ValueError for a malformed record."""
    from dart_ray.hardware import Fingerprint

    return Fingerprint.from_dict(here).differences(Fingerprint.from_dict(recorded))


def hardware_differences(schedule: DecodingSchedule, fingerprint: Any) -> list[str]:
    """``field: recorded != here`` per differing fingerprint field; ``[NO_FINGERPRINT]`` when the
    profile records no hardware; ``[]`` when it was tuned on this very setup.

    ``fingerprint``: a ``Fingerprint`` or its ``to_dict()`` (usually ``engine.fingerprint``)."""
    from dart_ray.hardware import Fingerprint

    here = Fingerprint.from_dict(fingerprint) if isinstance(fingerprint, dict) else fingerprint
    try:
        recorded = profile_fingerprint(schedule)
    except (TypeError, ValueError) as e:
        return [f"unreadable meta.fingerprint ({e})"]
    if recorded is None:
        return [NO_FINGERPRINT]
    return here.differences(recorded)


def check_profile_hardware(schedule: DecodingSchedule, fingerprint: Any) -> list[str]:
    """Warn (:class:`ProfileHardwareWarning`, once per profile and machine per process) when
    ``schedule`` was tuned on other hardware than ``fingerprint`` describes; return the differences.

    The profile is not rejected: its knobs are still a sound starting point and cap for the adaptive
    controller, just not a measured optimum here."""
    diffs = hardware_differences(schedule, fingerprint)
    if not diffs:
        return diffs
    here = fingerprint if isinstance(fingerprint, dict) else fingerprint.to_dict()
    name = schedule.source or f"<{schedule.workload}>"
    key = (name, repr(sorted((k, str(v)) for k, v in here.items()))
           + repr(schedule.meta.get("fingerprint")))
    with _warned_lock:
        if key in _warned:
            return diffs
        _warned.add(key)
    warnings.warn(f"decoding profile {name} (workload {schedule.workload!r}) was tuned on other "
                  "hardware: "
                  + "; ".join(diffs)
                  + ". Its knobs still apply; run `dart-ray tune --for-this-machine` to re-tune "
                    "them here.", ProfileHardwareWarning, stacklevel=2)
    return diffs


def refuse_profile_over_decoding(profile: Any, decoding: DecodingConfig) -> None:
    """A profile replaces the engine's decoding knobs: given both (``--profile`` and
    ``--decoding`` / ``engine.decoding``), the knobs would be dropped without a word. Raises
    ValueError then."""
    if profile is not None and decoding != DecodingConfig():
        raise ValueError("a decoding profile replaces the engine's decoding knobs, and both were "
                         "given (--profile and --decoding / engine.decoding): give one of them")


def apply_profile(engine, profile: str | Path | DecodingSchedule) -> DecodingSchedule:
    """Load ``profile`` (name, path or schedule), check it against ``engine.fingerprint`` (warn once
    on a mismatch) and ``engine.set_decoding`` it. Returns the schedule."""
    sched = profile if isinstance(profile, DecodingSchedule) else load_profile(profile)
    fp = getattr(engine, "fingerprint", None)
    if fp is not None:
        check_profile_hardware(sched, fp)
    engine.set_decoding(sched)
    return sched
