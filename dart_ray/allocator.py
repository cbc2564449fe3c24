"""The memory allocator a CPU engine process runs with, chosen before it starts.

A CPU decode step allocates and frees a few MB of activations per layer. glibc's malloc serves
blocks over its mmap threshold with fresh ``mmap`` calls and returns them on free, so every step
page-faults its activations in again, on 4 KiB pages. Measured on a 2-core AMD EPYC Zen 4 (bf16,
SmolLM2-135M, bs 1, 6 HumanEval prompts, ``dart-ray bench``): AR 27.0 tok/s and DART 64.1 with
glibc as is; 32.9 / 84.2 with glibc's transparent-huge-page tunable; 35.5 / 83.4 with jemalloc
keeping freed pages (``dirty_decay_ms:-1``). Both are process-start settings (``LD_PRELOAD``,
``MALLOC_CONF``, ``GLIBC_TUNABLES``): nothing can change them once Python runs. So:

* :func:`fast_allocator_env` says which variables to add: jemalloc (preloaded, keeping freed
  pages) where a ``libjemalloc.so.2`` is installed, else glibc's ``hugetlb`` tunable;
* the ``dart-ray`` CLI re-executes itself once with them (:func:`reexec_argv`), and Ray actors
  that run engines get them through their ``runtime_env``;
* ``DART_RAY_ALLOCATOR=system`` keeps the process as started (no change, no re-exec); an
  ``LD_PRELOAD`` that already names an allocator is respected.

Importing this module has no side effects and does not import torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

JEMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",    # Debian/Ubuntu libjemalloc2
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",                   # Fedora/RHEL/Amazon Linux jemalloc
    "/usr/lib/libjemalloc.so.2",                     # Arch, Alpine
    "/usr/local/lib/libjemalloc.so.2",               # built from source
)
"""Where a system jemalloc is looked for, first found wins."""

JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
"""Keep freed pages mapped (never purge): the next step reuses them without page faults."""

GLIBC_HUGETLB = "glibc.malloc.hugetlb=1"
"""glibc >= 2.35: ``madvise`` its heap and mmap chunks for transparent huge pages."""

OPT_OUT = "DART_RAY_ALLOCATOR"
"""Set to ``system`` to run with the allocator the process was started with."""

MARKER = "DART_RAY_ALLOCATOR_SET"
"""Set in the environment this module builds, so a re-executed process never re-executes."""

_KNOWN_PRELOADS = ("jemalloc", "tcmalloc", "mimalloc")


def find_jemalloc(candidates: Sequence[str] = JEMALLOC_CANDIDATES) -> str | None:
    """The first installed jemalloc shared library, or None."""
    for path in candidates:
        if Path(path).is_file():
            return path
    return None


def fast_allocator_env(environ: Mapping[str, str] | None = None,
                       jemalloc: str | None | bool = True) -> dict[str, str]:
    """The allocator variables a new engine process should start with (empty: none).

    ``environ`` defaults to ``os.environ``; ``jemalloc``: a library path, ``True`` to look for one
    (:func:`find_jemalloc`), or ``False``/``None`` for none. An ``LD_PRELOAD`` that already names
    an allocator is kept as it is (with its ``MALLOC_CONF``); else jemalloc is preloaded where
    installed (keeping other ``LD_PRELOAD`` entries and a user's ``MALLOC_CONF``), else glibc's
    huge-page tunable joins ``GLIBC_TUNABLES``. Empty off Linux and when the user opted out
    (``DART_RAY_ALLOCATOR=system``). The result may repeat what ``environ`` already has: it is
    the whole setting, for a process that does not inherit this one's environment (a Ray actor).
    """
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux"):
        return {}
    choice = env.get(OPT_OUT, "").strip().lower()
    if choice not in ("", "auto", "system"):
        raise ValueError(f"{OPT_OUT} must be 'auto' or 'system', got {env[OPT_OUT]!r}")
    if choice == "system":
        return {}
    preload = env.get("LD_PRELOAD", "").strip()
    conf = env.get("MALLOC_CONF", "")
    if any(name in preload for name in _KNOWN_PRELOADS):
        return {"LD_PRELOAD": preload, **({"MALLOC_CONF": conf} if conf else {})}
    lib = find_jemalloc() if jemalloc is True else (jemalloc or None)
    if lib:
        return {"LD_PRELOAD": f"{lib} {preload}" if preload else lib,
                "MALLOC_CONF": conf or JEMALLOC_CONF}
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" not in tunables:
        tunables = f"{tunables}:{GLIBC_HUGETLB}" if tunables else GLIBC_HUGETLB
    return {"GLIBC_TUNABLES": tunables}


def reexec_argv(argv: Sequence[str], environ: Mapping[str, str] | None = None,
                jemalloc: str | None | bool = True) -> tuple[list[str], dict[str, str]] | None:
    """``(argv, env)`` to re-execute ``python -P -m dart_ray.cli argv`` under a fast allocator,
    or None when the process should go on as it is: it already has the setting, the user opted
    out, or it is itself the re-executed process (``DART_RAY_ALLOCATOR_SET``). ``-P``: the working
    directory does not join ``sys.path``, as for the ``dart-ray`` console script."""
    env = dict(os.environ if environ is None else environ)
    if env.get(MARKER) or not sys.executable:
        return None
    extra = fast_allocator_env(env, jemalloc)
    if all(env.get(k) == v for k, v in extra.items()):
        return None
    env.update(extra)
    env[MARKER] = "1"
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe, "-m", "dart_ray.cli", *argv], env


def allocator_in_use(maps: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """What this process allocates with: ``jemalloc``/``tcmalloc``/``mimalloc`` if one is mapped
    (read from ``/proc/self/maps``), else ``glibc``, with ``+hugetlb`` when glibc's THP tunable is
    set. For benchmark records: throughput on CPU depends on it."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return "unknown"
    for name in _KNOWN_PRELOADS:
        if f"lib{name}" in maps:
            return name
    env = os.environ if environ is None else environ
    return "glibc+hugetlb" if "glibc.malloc.hugetlb=1" in env.get("GLIBC_TUNABLES", "") \
        else "glibc"
