"""What machine are we on, and which dtype is fast on it.

Speculative decoding trades one dear target forward over many tokens for several cheap ones, so
every speed decision depends on the machine: on an AMX Xeon a 61-row bf16 forward costs ~2x a
1-row one, on an AVX2-only EPYC (oneDNN *emulates* bf16 there) a 61-row bf16 linear is ~7x the
fp32 one. Nothing here assumes: dtype ``"auto"`` asks the capability and then measures.

* :class:`Fingerprint` -- device name, CPU model, family/model numbers and ISA flags, threads,
  torch version, dtype and model: the key of every measured cost table (``dart_ray.engine.cost``)
  and of tuned profiles.
* :func:`resolve_dtype` -- ``"auto"`` -> ``"bf16"`` where bf16 is supported *and* measured at
  least as fast as fp32 (CUDA with bf16; CPUs with oneDNN bf16), else ``"fp32"``.

The ISA can be restricted per process (``ONEDNN_MAX_CPU_ISA=AVX2``, ``ATEN_CPU_CAPABILITY=avx2``) to
see the AVX2 behaviour on an AMX machine; both variables are part of the fingerprint.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

log = logging.getLogger(__name__)

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16",
             "amx_int8", "sve", "asimd", "bf16")
"""CPU flags that change which kernels torch/oneDNN run (x86 and Arm); the rest is noise."""

ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
"""Environment variables that restrict the ISA torch uses (recorded as ``VAR=value`` flags;
oneDNN honours its older name ``DNNL_MAX_CPU_ISA`` too: a decision cached without it was reused
under it, and the other way round)."""


def cpuinfo_fields(text: str) -> dict[str, str]:
    """Each key of ``/proc/cpuinfo`` text (lower-cased) with its first value: the first
    processor's, for the keys every processor's block repeats."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, val = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), val.strip())
    return fields


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """:func:`cpuinfo_fields` of this machine (empty where there is no ``/proc/cpuinfo``)."""
    try:
        return cpuinfo_fields(Path("/proc/cpuinfo").read_text())
    except OSError:
        return {}


def cpu_model_and_flags() -> tuple[str, tuple[str, ...]]:
    """(CPU model name, the :data:`ISA_FLAGS` it has) from ``/proc/cpuinfo`` (Linux) or platform."""
    info = _cpuinfo()
    model = (info.get("model name") or platform.processor() or platform.machine() or "unknown")
    flags = set((info.get("flags") or info.get("features") or "").split())
    return model, tuple(f for f in ISA_FLAGS if f in flags)


def cpu_id(cpuinfo: str | None = None) -> str:
    """The CPU's family and model numbers from ``/proc/cpuinfo`` (x86: ``"family 26 model 2"``;
    Arm: ``"implementer 0x41 part 0xd40"``), '' where unknown; ``cpuinfo``: that file's text
    (default: this machine's). The model string does not tell CPU generations apart in every guest:
    two KVM guests on Zen 4 and on Zen 5 both read "AMD EPYC" with the same ISA flags, and their
    decode steps differ 2x (22 vs 10 ms for SmolLM2 in bf16)."""
    fields = _cpuinfo() if cpuinfo is None else cpuinfo_fields(cpuinfo)
    if "cpu family" in fields and "model" in fields:
        return f"family {fields['cpu family']} model {fields['model']}"
    if "cpu implementer" in fields and "cpu part" in fields:
        return f"implementer {fields['cpu implementer']} part {fields['cpu part']}"
    return ""


def device_name(device: str | torch.device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return cpu_model_and_flags()[0]


@dataclass(frozen=True)
class Fingerprint:
    """Everything a measured speed depends on. Equal fingerprints may share cost tables and
    profiles."""

    device: str
    """Device name: the GPU's name, or the CPU model for ``cpu``."""
    cpu: str
    """CPU model (the host's, also on GPU machines: drafting and tree search run partly on it)."""
    isa: tuple[str, ...]
    """ISA flags that matter (:data:`ISA_FLAGS`) plus any ISA-restricting environment variable."""
    threads: int
    """torch intra-op threads."""
    torch: str
    """torch version."""
    dtype: str
    """Resolved dtype (``fp32``/``bf16``/``fp16``; never ``auto``)."""
    model: str
    """Target model id ('' when the fingerprint is about the machine alone)."""
    cpu_id: str = ""
    """CPU family and model numbers (:func:`cpu_id`): tells apart generations that share a model
    string. '' where unknown, and in fingerprints recorded before the field existed (such a record
    is not said to differ in it)."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("cpu_id",)
    """Fields a recorded fingerprint may lack (added later; read as their default)."""
    UNKNOWN_WHEN_EMPTY: ClassVar[tuple[str, ...]] = ("cpu_id", "model")
    """Fields whose '' means "not known" (not recorded; a machine-only fingerprint's model): never
    a difference."""

    @classmethod
    def current(cls, device: str | torch.device = "cpu", dtype: str = "", model: str = "",
                threads: int | None = None) -> Fingerprint:
        cpu, flags = cpu_model_and_flags()
        env = tuple(f"{k}={os.environ[k]}" for k in ISA_ENV if os.environ.get(k))
        return cls(device=device_name(device), cpu=cpu, isa=flags + env,
                   threads=int(threads or torch.get_num_threads()),
                   torch=torch.__version__.split("+")[0], dtype=dtype, model=model,
                   cpu_id=cpu_id())

    def key(self) -> str:
        """Short stable hash (file names of cached measurements)."""
        return hashlib.sha1(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["isa"] = list(self.isa)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Fingerprint:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(d) - set(cls.OPTIONAL)
        if missing:
            raise ValueError(f"fingerprint is missing {sorted(missing)}")
        return cls(**{k: (tuple(d[k]) if k == "isa" else d[k]) for k in names if k in d})

    def same_cpu(self, other: Fingerprint) -> bool:
        """The same CPU class: model string, ISA and, where both record them, family/model
        numbers."""
        return ((self.cpu, tuple(self.isa)) == (other.cpu, tuple(other.isa))
                and ("" in (self.cpu_id, other.cpu_id) or self.cpu_id == other.cpu_id))

    def differences(self, other: Fingerprint) -> list[str]:
        """Human-readable ``field: ours != theirs`` for every field that differs."""
        out = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name in self.UNKNOWN_WHEN_EMPTY and "" in (a, b):
                continue                                   # not known on one side
            if a != b:
                out.append(f"{f.name}: {b!r} (recorded) != {a!r} (here)")
        return out

    def summary(self) -> str:
        """One line for logs and stats lines: ``CPU model [isa] x threads, dtype``."""
        isa = ",".join(f for f in self.isa if f in ("avx2", "avx512f", "avx512_bf16",
                                                    "amx_bf16") or "=" in f)
        dev = "" if self.device == self.cpu else f"{self.device} / "
        cpu = f"{self.cpu} ({self.cpu_id})" if self.cpu_id else self.cpu
        return f"{dev}{cpu} [{isa or 'no avx2'}] x{self.threads} threads, {self.dtype}"


def hardware_cache_dir() -> Path:
    """``$DART_RAY_CACHE/hardware``: measured dtype decisions and cost tables, keyed by
    fingerprint."""
    from dart_ray.models.loading import cache_root

    return cache_root() / "hardware"


def read_cached(name: str, timings: tuple[str, ...] = ()) -> dict | None:
    """A cached measurement, or None when it is missing, unreadable, not a mapping, or lacks a
    positive number under one of ``timings`` (then the caller measures anew: a hand-edited or
    foreign file must not crash or mislead an engine start)."""
    path = hardware_cache_dir() / name
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not all(is_duration(data.get(k)) for k in timings):
        return None
    return data


def is_duration(v) -> bool:
    """A measured time: a positive number (not a bool, not NaN)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def write_cached(name: str, data: dict) -> None:
    path = hardware_cache_dir() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache costs a re-measurement next time, nothing else
        log.warning("could not cache %s: %s", path, e)


# ---- dtype ---------------------------------------------------------------------------------------

def bf16_supported(device: str | torch.device) -> bool:
    """Does the device run bf16 natively (not emulated)?"""
    dev = torch.device(device)
    if dev.type == "cuda":     # this device, not the current one; emulated bf16 is not native
        if not torch.cuda.is_available():
            return False
        with torch.cuda.device(dev):
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    if dev.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@dataclass(frozen=True)
class DTypeChoice:
    """The dtype ``auto`` resolved to, and why (shown in stats lines, bench JSON, /v1/models)."""

    dtype: str
    requested: str
    reason: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def synchronize(device: str | torch.device) -> None:
    """Wait for the work queued on an asynchronous device (CUDA) before a clock is read; a no-op
    on the CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


DTYPE_PROBE_LINEARS = 24
"""Linears of the dtype probe: 24 x (1536 x 576) = 21M weights (85 MB fp32), a decode step's
working set in miniature. One small linear sits in the cache and hides what decides a decode
step on a CPU, the bytes of weights read per token: on the AMX Xeon one 1536 x 576 linear at 1 row
measured bf16 1.40x *slower* than fp32 (so ``auto`` chose fp32), while SmolLM2's real step ran
bf16 (packed) about 2x faster than fp32."""


def _time_linears(dtype: torch.dtype, device: torch.device, rows: int, reps: int = 5) -> float:
    """Best-of-``reps`` seconds of a chain of :data:`DTYPE_PROBE_LINEARS` MLP-sized linears at
    ``rows`` rows, held the way the engine holds them on this device: oneDNN-prepacked on a CPU
    where that is available for bf16, or measured faster for fp32
    (:func:`dart_ray.models.packing.packing_supported`), else dense."""
    from dart_ray.models.packing import PackedLinear, packing_supported

    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(1536, 576, generator=g).mul_(0.02).to(device=device, dtype=dtype)
          for _ in range(DTYPE_PROBE_LINEARS)]
    pack = packing_supported(device, dtype)
    layers = [PackedLinear(w, None) if pack else functools.partial(torch.nn.functional.linear,
                                                                     weight=w) for w in ws]
    x = torch.randn(rows, 576, generator=g).to(device=device, dtype=dtype)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps + 1):
            synchronize(device)
            t0 = time.perf_counter()
            for layer in layers:
                layer(x)
            synchronize(device)
            best = min(best, time.perf_counter() - t0)
    return best


def measure_bf16_vs_fp32(device: str | torch.device) -> dict[str, float]:
    """Seconds of a model-sized chain of linears at 1 row (a decode step) and 64 rows (a draft
    tree), bf16 and fp32, each held as the engine would hold it here (packed or dense)."""
    dev = torch.device(device)
    return {f"{name}_{rows}": _time_linears(dt, dev, rows)
            for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)) for rows in (1, 64)}


DTYPE_PROBE_VERSION = 3
"""Bumped when the dtype probe changes, so a decision cached by an older probe is measured anew
(v1 timed one cache-resident dense linear; v3: decisions cached before ``DNNL_MAX_CPU_ISA`` was
part of the fingerprint may come from the other ISA setting)."""


def resolve_dtype(requested: str, device: str | torch.device = "cpu") -> DTypeChoice:
    """``auto`` -> bf16 where it is supported and measured at least as fast as fp32, else fp32.

    Capability first (no bf16 hardware -> fp32, no measurement); then a ~0.5 s timing of a
    model-sized chain of linears at 1 and 64 rows (:func:`measure_bf16_vs_fp32`), cached per
    fingerprint under ``$DART_RAY_CACHE/hardware``. A concrete dtype passes through unchanged.
    """
    if requested != "auto":
        return DTypeChoice(requested, requested, "requested")
    if not bf16_supported(device):
        return DTypeChoice("fp32", "auto",
                           "no native bf16 on this device (oneDNN/CUDA report none)")
    fp = Fingerprint.current(device)
    name = f"dtype-v{DTYPE_PROBE_VERSION}-{fp.key()}.json"
    t = read_cached(name, ("bf16_1", "bf16_64", "fp32_1", "fp32_64"))
    if t is None:
        t = measure_bf16_vs_fp32(device)
        write_cached(name, {**t, "fingerprint": fp.to_dict()})
    ratio = max(t["bf16_1"] / t["fp32_1"], t["bf16_64"] / t["fp32_64"])
    if ratio <= 1.1:
        return DTypeChoice("bf16", "auto",
                           f"bf16 supported and measured {1 / ratio:.2f}x fp32 or better")
    return DTypeChoice("fp32", "auto", f"bf16 supported but measured {ratio:.2f}x slower than fp32")
