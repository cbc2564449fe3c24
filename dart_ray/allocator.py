"""The memory allocator a CPU engine process runs with, chosen before it starts.

A CPU decode step allocates and frees a few MB of activations per layer. glibc's malloc serves
blocks over its mmap threshold with fresh ``mmap`` calls and returns them on free, so every step
page-faults its activations in again, on 4 KiB pages. Measured on a 2-core AMD EPYC Zen 4 (bf16,
SmolLM2-135M, bs 1, 6 HumanEval prompts, ``dart-ray bench``): AR 27.0 tok/s and DART 64.1 with
glibc as is; 32.9 / 84.2 with glibc's transparent-huge-page tunable; 35.5 / 83.4 with jemalloc
keeping freed pages (``dirty_decay_ms:-1``). Both are process-start settings (``LD_PRELOAD``,
``MALLOC_CONF``, ``GLIBC_TUNABLES``): nothing can change them once Python runs. So:

* :func:`fast_allocator_env` says which variables to add: jemalloc (preloaded, keeping freed
  pages) where a ``libjemalloc.so.2`` is installed, else glibc's ``hugetlb`` tunable (glibc >=
  2.35, transparent huge pages not off);
* the ``dart-ray`` commands that run an engine or training in their own process on CPU
  (``generate``, ``bench``, ``train-drafter``, ``gen-data``, ``gen-prompts``, ``build-ngram``)
  re-execute themselves once with them (:func:`reexec_argv`, the same command line); CPU engine
  actors on Ray get them through their ``runtime_env`` (:func:`actor_allocator_env`: the library's
  soname, which each node's loader resolves). Commands that only drive Ray (``serve``, ``batch``,
  ``tune``) are not re-executed: Ray's own daemons, which they may start, keep Ray's allocator;
  nor is a ``--device cuda`` command (GPU engines are left as they are);
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

JEMALLOC_SONAME = "libjemalloc.so.2"
"""What a Ray actor preloads: the loader searches its node's library paths for it."""

JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
"""Keep freed pages mapped (never purge): the next step reuses them without page faults."""

GLIBC_HUGETLB = "glibc.malloc.hugetlb=1"
"""glibc >= 2.35: ``madvise`` its heap and mmap chunks for transparent huge pages."""

OPT_OUT = "DART_RAY_ALLOCATOR"
"""Set to ``system`` to run with the allocator the process was started with."""

MARKER = "DART_RAY_ALLOCATOR_SET"
"""Set in the environment this module builds, so a re-executed process never re-executes."""

_KNOWN_PRELOADS = ("jemalloc", "tcmalloc", "mimalloc")

REEXEC_COMMANDS = frozenset({"generate", "bench", "train-drafter", "gen-data", "gen-prompts",
                             "build-ngram"})
"""``dart-ray`` subcommands that run their engine or training in the CLI's own process."""


def glibc_hugetlb_works() -> bool:
    """glibc >= 2.35 (the ``glibc.malloc.hugetlb`` tunable) and transparent huge pages not off."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = (int(x) for x in version.split(".")[:2])
    except (AttributeError, ValueError, OSError):
        return False                                          # not glibc (musl, macOS)
    if name != "glibc" or (major, minor) < (2, 35):
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return True
    return "[never]" not in mode


def find_jemalloc(candidates: Sequence[str] = JEMALLOC_CANDIDATES) -> str | None:
    """The first installed jemalloc shared library, or None."""
    for path in candidates:
        if Path(path).is_file():
            return path
    return None


def fast_allocator_env(environ: Mapping[str, str] | None = None,
                       jemalloc: str | None | bool = True,
                       glibc_thp: bool | None = None) -> dict[str, str]:
    """The allocator variables a new engine process should start with (empty: none).

    ``environ`` defaults to ``os.environ``; ``jemalloc``: a library path, ``True`` to look for one
    (:func:`find_jemalloc`), or ``False``/``None`` for none; ``glibc_thp``: whether glibc's
    huge-page tunable works here (None: :func:`glibc_hugetlb_works`). An ``LD_PRELOAD`` that
    already names an allocator is kept as it is (with its ``MALLOC_CONF``); else jemalloc is
    preloaded where installed (keeping other ``LD_PRELOAD`` entries and a user's ``MALLOC_CONF``),
    else glibc's huge-page tunable joins ``GLIBC_TUNABLES`` where it works. Empty off Linux and
    when the user opted out (``DART_RAY_ALLOCATOR=system``). The result may repeat what
    ``environ`` already has: it is the whole setting, for a process that does not inherit this
    one's environment.
    """
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux"):
        return {}
    if _opted_out(env):
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
    if "glibc.malloc.hugetlb" in tunables:
        return {"GLIBC_TUNABLES": tunables}
    if not (glibc_hugetlb_works() if glibc_thp is None else glibc_thp):
        return {}
    return {"GLIBC_TUNABLES": f"{tunables}:{GLIBC_HUGETLB}" if tunables else GLIBC_HUGETLB}


def is_cpu(device: str) -> bool:
    """Whether an engine on ``device`` (``cpu``, ``cuda:1``, '' = the default, CPU) runs on CPU:
    only CPU engines get the allocator; GPU ones are left as they are (jemalloc never purges, and
    a GPU engine stages its checkpoint in host memory)."""
    return (device or "cpu").split(":", 1)[0] == "cpu"


def actor_allocator_env(environ: Mapping[str, str] | None = None, jemalloc: bool | None = None,
                        device: str = "cpu") -> dict[str, str]:
    """:func:`fast_allocator_env` for a Ray actor running an engine on ``device`` (empty unless
    CPU), which may run on another node: jemalloc by its soname (each node's loader finds its own
    copy; a node without one runs on glibc after ld.so's "cannot be preloaded" line) where this
    machine has one or preloads one, and none of this process's other ``LD_PRELOAD`` entries
    (profilers, shims). ``jemalloc``: None = look here."""
    env = os.environ if environ is None else environ
    if not is_cpu(device):
        return {}
    has = (find_jemalloc() is not None or "jemalloc" in env.get("LD_PRELOAD", "")) \
        if jemalloc is None else jemalloc
    own = {k: env[k] for k in ("MALLOC_CONF", "GLIBC_TUNABLES", OPT_OUT) if k in env}
    return fast_allocator_env(own, jemalloc=JEMALLOC_SONAME if has else False)


def _opted_out(env: Mapping[str, str]) -> bool:
    choice = env.get(OPT_OUT, "").strip().lower()
    if choice not in ("", "auto", "system"):
        raise ValueError(f"{OPT_OUT} must be 'auto' or 'system', got {env[OPT_OUT]!r}")
    return choice == "system"


def reexec_argv(command: str | None, environ: Mapping[str, str] | None = None,
                jemalloc: str | None | bool = True, orig_argv: Sequence[str] | None = None,
                glibc_thp: bool | None = None,
                device: str = "") -> tuple[list[str], dict[str, str]] | None:
    """``(argv, env)`` to re-execute this process's own command line (``sys.orig_argv``:
    interpreter flags, ``-m``, a profiler or debugger in front all kept) under a fast allocator,
    or None when it should go on as it is: ``command`` does not run an engine in this process
    (:data:`REEXEC_COMMANDS`), its ``--device`` is not the CPU, it already has the setting, the
    user opted out, the interpreter is frozen, or this is the re-executed process
    (``DART_RAY_ALLOCATOR_SET``)."""
    env = dict(os.environ if environ is None else environ)
    argv = list(sys.orig_argv if orig_argv is None else orig_argv)
    if (command not in REEXEC_COMMANDS or not is_cpu(device) or env.get(MARKER)
            or not sys.executable or not argv or getattr(sys, "frozen", False)):
        return None
    extra = fast_allocator_env(env, jemalloc, glibc_thp)
    if all(env.get(k) == v for k, v in extra.items()):
        return None
    env.update(extra)
    env[MARKER] = "1"
    return [sys.executable, *argv[1:]], env


def allocator_in_use(maps: str | None = None, environ: Mapping[str, str] | None = None,
                     glibc_thp: bool | None = None) -> str:
    """What this process allocates with: ``jemalloc``/``tcmalloc``/``mimalloc`` if one is mapped
    (read from ``/proc/self/maps``), else ``glibc``, with ``+hugetlb`` when glibc's THP tunable is
    set and works here (:func:`glibc_hugetlb_works`). For benchmark records: throughput on CPU
    depends on it."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return "unknown"
    for name in _KNOWN_PRELOADS:
        if f"lib{name}" in maps:
            return name
    env = os.environ if environ is None else environ
    tuned = "glibc.malloc.hugetlb=1" in env.get("GLIBC_TUNABLES", "")
    works = glibc_hugetlb_works() if glibc_thp is None else glibc_thp
    return "glibc+hugetlb" if tuned and works else "glibc"
