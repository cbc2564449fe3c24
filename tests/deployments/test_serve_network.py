"""`dart-ray serve` as a user starts it: Ray closed to the network, token auth on, replica
not niced; SIGTERM drains it (the stream in flight finishes, new requests get 503).

Runs the CLI in a subprocess with ``RAY_AUTH_MODE`` unset (Ray's default: token auth for a new
local cluster; the token goes to ``$HOME/.ray/auth_token``, HOME is a temp dir here) and checks,
with psutil, every listening socket of the process tree (GCS, raylet, object manager, workers,
agents, Serve's controller/proxy/replica and its HTTP port) is on loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parents[2]


def _is_loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _tree(pid: int):
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _listening(procs) -> list[tuple[str, str, int]]:
    import psutil

    out = []
    for p in procs:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.append((p.name(), c.laddr.ip, c.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


@pytest.fixture(scope="module")
def tiny_model(tiny_dirs):
    return tiny_dirs["llama"]


def _post(url: str, body: dict, timeout: float = 120):
    req = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def _check_sigterm_drains(proc, url: str) -> None:
    """SIGTERM while a stream runs: the stream ends as usual (its finish_reason, [DONE]), a
    request sent during the drain gets 503 shutting_down, and the CLI then exits 0."""
    import threading

    lines: list[str] = []
    first = threading.Event()

    def stream() -> None:
        with _post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 1500,
                                             "ignore_eos": True, "stream": True}) as r:
            for raw in r:
                if raw.strip():
                    lines.append(raw.decode().strip())
                    first.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert first.wait(60)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.5)                                   # the ingress learns of the drain
    with pytest.raises(urllib.error.HTTPError) as refused:
        _post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 3}, timeout=30)
    assert refused.value.code == 503 and refused.value.headers["Retry-After"]
    assert json.loads(refused.value.read())["error"]["code"] == "shutting_down"
    t.join(120)
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2], lines[-3:]
    assert sum(1 for ln in lines if "\"text\"" in ln) > 1000    # not cut at the signal
    assert proc.wait(90) == 0


def test_dart_ray_serve_binds_loopback_with_auth_and_unniced_replica(tiny_model):
    import psutil

    home = Path(tempfile.mkdtemp(prefix="drh-", dir="/tmp"))
    temp = tempfile.mkdtemp(prefix="drn-", dir="/tmp")  # short: Ray's socket paths must fit
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}  # Ray's default: token auth
    env.update(HOME=str(home), PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "dart_ray.cli", "serve", "--port", str(port), "--temp-dir", temp,
           "--num-cpus", "2", "--model", str(tiny_model), "--method", "none", "--dtype", "fp32",
           "--max-seq-len", "2048", "--max-batch-size", "1", "--num-threads", "1",
           "--replica-cpus", "0.5"]
    log = open(home / "serve.log", "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, (home / "serve.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, (home / "serve.log").read_text()[-4000:]
            time.sleep(1.0)
        req = urllib.request.Request(url + "/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "hi", "max_tokens": 3}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            # served with token auth on
            assert json.loads(r.read())["usage"]["completion_tokens"] >= 1
        assert (home / ".ray" / "auth_token").is_file()  # Ray generated the token

        procs = _tree(proc.pid)
        socks = _listening(procs)
        names = {n for n, _, _ in socks}
        assert any(p == port for _, _, p in socks), socks  # Serve's HTTP port is there
        assert any("gcs_server" in n for n in names) and any("raylet" in n for n in names), names
        exposed = [s for s in socks if not _is_loopback(s[1])]
        assert not exposed, f"listening beyond loopback: {exposed}"
        replicas = [p for p in procs
                    if "ServeReplica" in " ".join(p.cmdline()) or "ServeReplica" in p.name()]
        assert replicas, [p.name() for p in procs]
        assert all(p.nice() == 0 for p in replicas), [(p.name(), p.nice()) for p in replicas]
        _check_sigterm_drains(proc, url)
    finally:
        proc.send_signal(signal.SIGTERM)  # the CLI stops Serve and Ray
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()
        for p in psutil.process_iter(["cmdline"]):  # stray Ray processes of this run
            try:
                if any(temp in part for part in (p.info["cmdline"] or [])):
                    p.kill()
            except psutil.Error:
                continue
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(temp, ignore_errors=True)
