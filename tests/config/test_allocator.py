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
    JEMALLOC_SONAME,
    MARKER,
    actor_allocator_env,
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
def test_glibc_gets_the_huge_page_tunable_where_it_works():
    want = {"GLIBC_TUNABLES": GLIBC_HUGETLB}
    assert fast_allocator_env({}, jemalloc=False, glibc_thp=True) == want
    env = fast_allocator_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, jemalloc=None,
                             glibc_thp=True)
    assert env == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{GLIBC_HUGETLB}"}
    given = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}       # the user's choice stands
    assert fast_allocator_env(given, jemalloc=False, glibc_thp=True) == given
    # glibc < 2.35, musl, or THP off: nothing to set (and so nothing to restart for)
    assert fast_allocator_env({}, jemalloc=False, glibc_thp=False) == {}
    assert reexec_argv("bench", {}, jemalloc=False, orig_argv=["py", "x"], glibc_thp=False) is None


@linux_only
def test_a_preloaded_allocator_and_the_opt_out_are_respected():
    pre = {"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}
    assert fast_allocator_env(pre, jemalloc=JE) == pre
    assert fast_allocator_env({"DART_RAY_ALLOCATOR": "system"}, jemalloc=JE) == {}
    assert fast_allocator_env({"DART_RAY_ALLOCATOR": "auto"}, jemalloc=JE)["LD_PRELOAD"] == JE
    with pytest.raises(ValueError, match="DART_RAY_ALLOCATOR"):
        fast_allocator_env({"DART_RAY_ALLOCATOR": "tcmalloc"})


@linux_only
def test_actors_get_the_soname_and_none_of_this_process_preloads():
    env = actor_allocator_env({"LD_PRELOAD": "/opt/prof/libprofiler.so"}, jemalloc=True)
    assert env == {"LD_PRELOAD": JEMALLOC_SONAME, "MALLOC_CONF": JEMALLOC_CONF}
    mine = {"LD_PRELOAD": JE, "MALLOC_CONF": "narenas:1"}     # this process preloads jemalloc
    assert actor_allocator_env(mine) == {"LD_PRELOAD": JEMALLOC_SONAME, "MALLOC_CONF": "narenas:1"}
    assert actor_allocator_env({"DART_RAY_ALLOCATOR": "system"}, jemalloc=True) == {}


@linux_only
def test_reexec_repeats_the_command_line_once_and_only_for_engine_commands():
    orig = ["/venv/bin/python", "-X", "faulthandler", "/venv/bin/dart-ray", "bench", "--limit", "2"]
    args, env = reexec_argv("bench", {"PATH": "/bin"}, jemalloc=JE, orig_argv=orig)
    assert args == [sys.executable, *orig[1:]]                 # flags and script kept
    assert env["LD_PRELOAD"] == JE and env["PATH"] == "/bin" and env[MARKER] == "1"
    assert reexec_argv("bench", env, jemalloc=JE, orig_argv=orig) is None   # the re-executed one
    already = {"LD_PRELOAD": JE, "MALLOC_CONF": JEMALLOC_CONF}           # e.g. the Makefile's env
    assert reexec_argv("bench", already, jemalloc=JE, orig_argv=orig) is None
    assert reexec_argv("bench", {"DART_RAY_ALLOCATOR": "system"}, jemalloc=JE,
                       orig_argv=orig) is None
    for command in ("serve", "batch", "tune", "prompts", None):   # they only drive Ray, or nothing
        assert reexec_argv(command, {}, jemalloc=JE, orig_argv=orig) is None


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
    tuned = {"GLIBC_TUNABLES": GLIBC_HUGETLB}
    assert allocator_in_use(libc, tuned, glibc_thp=True) == "glibc+hugetlb"
    assert allocator_in_use(libc, tuned, glibc_thp=False) == "glibc"     # old glibc, THP off


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
    monkeypatch.setattr(sys, "argv", ["dart-ray", "bench", "--help"])
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "/venv/bin/dart-ray", "bench", "--help"])
    with pytest.raises(SystemExit):
        cli.entry()
    (path, args, env), = calls
    assert path == sys.executable and args[1:] == ["/venv/bin/dart-ray", "bench", "--help"]
    assert env["LD_PRELOAD"] == JE and env[MARKER] == "1"
    # a CUDA engine, or an exec that fails, runs in this process instead
    monkeypatch.setattr(sys, "argv", ["dart-ray", "bench", "--device", "cuda", "--help"])
    with pytest.raises(SystemExit):
        cli.entry()
    assert len(calls) == 1


@linux_only
def test_console_script_runs_its_engine_under_the_fast_allocator(tiny_dirs):
    """End to end: the installed ``dart-ray`` restarts itself and its generate stats line names
    the allocator the engine ran under."""
    exe = (shutil.which("dart-ray", path=str(Path(sys.executable).parent))
           or shutil.which("dart-ray"))
    if exe is None:
        pytest.skip("dart-ray console script not installed")
    ours = ("LD_PRELOAD", "MALLOC_CONF", MARKER, "DART_RAY_ALLOCATOR", "GLIBC_TUNABLES")
    env = {k: v for k, v in os.environ.items() if k not in ours}
    want = fast_allocator_env(env)
    expect = ("jemalloc" if want.get("LD_PRELOAD") else "glibc+hugetlb" if want else "glibc")
    out = subprocess.run([exe, "generate", "hello", "--model", str(tiny_dirs["llama"]),
                          "--method", "none", "--dtype", "fp32", "--max-new-tokens", "3"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"allocator {expect}" in out.stdout
