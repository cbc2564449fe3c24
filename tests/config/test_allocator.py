"""The process-start allocator setting: what is added, what is kept, when the CLI re-executes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dart_ray import allocator
from dart_ray.allocator import (
    GLIBC_HUGETLB,
    JEMALLOC_CONF,
    MARKER,
    allocator_in_use,
    fast_allocator_env,
    find_jemalloc,
    reexec_argv,
)

JE = "/opt/lib/libjemalloc.so.2"

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux settings")


@linux_only
def test_jemalloc_preloaded_with_kept_pages_and_other_preloads_kept():
    assert fast_allocator_env({}, jemalloc=JE) == {"LD_PRELOAD": JE, "MALLOC_CONF": JEMALLOC_CONF}
    env = fast_allocator_env({"LD_PRELOAD": "/x/libfoo.so", "MALLOC_CONF": "narenas:2"},
                             jemalloc=JE)
    assert env == {"LD_PRELOAD": f"{JE} /x/libfoo.so", "MALLOC_CONF": "narenas:2"}


@linux_only
def test_glibc_gets_the_huge_page_tunable_added_to_its_tunables():
    assert fast_allocator_env({}, jemalloc=False) == {"GLIBC_TUNABLES": GLIBC_HUGETLB}
    env = fast_allocator_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, jemalloc=None)
    assert env == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{GLIBC_HUGETLB}"}
    given = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}       # the user's choice stands
    assert fast_allocator_env(given, jemalloc=False) == given


@linux_only
def test_a_preloaded_allocator_and_the_opt_out_are_respected():
    pre = {"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}
    assert fast_allocator_env(pre, jemalloc=JE) == pre
    assert fast_allocator_env({"DART_RAY_ALLOCATOR": "system"}, jemalloc=JE) == {}
    assert fast_allocator_env({"DART_RAY_ALLOCATOR": "auto"}, jemalloc=JE)["LD_PRELOAD"] == JE
    with pytest.raises(ValueError, match="DART_RAY_ALLOCATOR"):
        fast_allocator_env({"DART_RAY_ALLOCATOR": "tcmalloc"})


@linux_only
def test_reexec_once_and_only_when_something_changes():
    args, env = reexec_argv(["bench", "--limit", "2"], {"PATH": "/bin"}, jemalloc=JE)
    assert args[0] == sys.executable
    assert args[-5:] == ["-m", "dart_ray.cli", "bench", "--limit", "2"]
    assert env["LD_PRELOAD"] == JE and env["PATH"] == "/bin" and env[MARKER] == "1"
    assert reexec_argv(["bench"], env, jemalloc=JE) is None              # the re-executed process
    already = {"LD_PRELOAD": JE, "MALLOC_CONF": JEMALLOC_CONF}           # e.g. the Makefile's env
    assert reexec_argv(["bench"], already, jemalloc=JE) is None
    assert reexec_argv(["bench"], {"DART_RAY_ALLOCATOR": "system"}, jemalloc=JE) is None


def test_find_jemalloc_takes_the_first_installed(tmp_path: Path):
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    assert find_jemalloc([str(tmp_path / "missing.so"), str(lib)]) == str(lib)
    assert find_jemalloc([str(tmp_path / "missing.so")]) is None


def test_allocator_in_use_reads_the_mapped_libraries():
    maps = "7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n"
    assert allocator_in_use(maps, {}) == "jemalloc"
    libc = "7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    assert allocator_in_use(libc, {}) == "glibc"
    assert allocator_in_use(libc, {"GLIBC_TUNABLES": GLIBC_HUGETLB}) == "glibc+hugetlb"


@linux_only
def test_cli_entry_execs_the_plan(monkeypatch):
    from dart_ray import cli

    calls = []

    def fake_execve(path, args, env):
        calls.append((path, args, env))
        raise SystemExit(0)

    monkeypatch.setattr(cli.os, "execve", fake_execve)
    monkeypatch.setattr(allocator, "find_jemalloc", lambda *a: JE)
    for k in ("LD_PRELOAD", "MALLOC_CONF", MARKER, "DART_RAY_ALLOCATOR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(sys, "argv", ["dart-ray", "prompts", "--help"])
    with pytest.raises(SystemExit):
        cli.entry()
    (path, args, env), = calls
    assert path == sys.executable and args[-2:] == ["prompts", "--help"]
    assert env["LD_PRELOAD"] == JE and env[MARKER] == "1"


@linux_only
def test_console_script_runs_through_the_reexec():
    """The installed ``dart-ray`` re-executes itself (python -P -m dart_ray.cli) and still works."""
    exe = (shutil.which("dart-ray", path=str(Path(sys.executable).parent))
           or shutil.which("dart-ray"))
    if exe is None:
        pytest.skip("dart-ray console script not installed")
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "MALLOC_CONF", MARKER, "DART_RAY_ALLOCATOR")}
    out = subprocess.run([exe, "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: dart-ray" in out.stdout
