"""Run the Serve application on a local Ray instance (what ``dart-ray serve`` does)."""

from __future__ import annotations

import importlib
import os
import signal
import threading
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = Path(__file__).resolve().parent / "serve_default.yaml"


def load_serve_config(path: str | os.PathLike | None = None) -> dict:
    """Read a Serve config file (YAML); None = ``deployments/serve_default.yaml``."""
    import yaml

    p = Path(path) if path else DEFAULT_CONFIG
    if not p.is_file():
        raise FileNotFoundError(f"serve config not found: {p}")
    try:
        cfg = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: invalid YAML: {e}") from e
    if not isinstance(cfg, dict) or not isinstance(cfg.get("applications"), list) or not cfg["applications"]:
        raise ValueError(f"{p}: expected a Serve config with a non-empty 'applications' list")
    for i, a in enumerate(cfg["applications"]):
        if not isinstance(a, dict) or not isinstance(a.get("import_path"), str):
            raise ValueError(f"{p}: applications[{i}] needs an import_path")  # noqa: TRY004
        if a.get("args") is not None and not isinstance(a["args"], dict):
            raise ValueError(f"{p}: applications[{i}].args must be a mapping")
    return cfg


def build_application(import_path: str, args: dict | None):
    """``module:attr`` (or ``module.attr``) -> a Serve Application (calling a builder with ``args``)."""
    from ray.serve import Application

    if ":" in import_path:
        mod, _, attr = import_path.partition(":")
    else:
        mod, _, attr = import_path.rpartition(".")
    target = getattr(importlib.import_module(mod), attr)
    if isinstance(target, Application):
        if args:
            raise ValueError(f"{import_path} is an Application already; it takes no args")
        return target
    if callable(target):
        app = target(args or {})
        if not isinstance(app, Application):
            raise TypeError(f"{import_path}(args) returned {type(app).__name__}, not a serve.Application")
        return app
    raise TypeError(f"{import_path} is neither a serve.Application nor an application builder")


def run_local(config_path: str | os.PathLike | None = None, host: str | None = "127.0.0.1", port: int | None = 8000,
              temp_dir: str | None = None, blocking: bool = True, overrides: dict[str, Any] | None = None,
              num_cpus: int | None = None) -> dict:
    """Start a local Ray, Serve on ``host:port`` and the config's applications.

    ``overrides`` update every application's ``args``. With ``blocking=True`` this waits until
    Ctrl-C / SIGTERM, then shuts Serve and Ray down (Ray only if it started it here). With
    ``blocking=False`` it returns ``{"url", "applications", "started_ray"}``; call
    :func:`shutdown_local` when done.
    """
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")          # Ray 2.60 enables token auth by default
    cfg = load_serve_config(config_path)
    http = dict(cfg.get("http_options") or {})
    host = host or http.get("host") or "127.0.0.1"
    port = int(port or http.get("port") or 8000)
    apps = []
    for a in cfg["applications"]:
        args = dict(a.get("args") or {})
        args.update(overrides or {})
        apps.append((a.get("name") or "default", a.get("route_prefix", "/"), a["import_path"], args))

    import ray
    from ray import serve

    if blocking and threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)   # started with SIGINT ignored (`cmd &`)
    started_ray = False
    if not ray.is_initialized():
        init_kw: dict[str, Any] = {"include_dashboard": False}
        if num_cpus is not None:
            init_kw["num_cpus"] = num_cpus
        if temp_dir:
            Path(temp_dir).mkdir(parents=True, exist_ok=True)
            init_kw["_temp_dir"] = str(Path(temp_dir).resolve())
        ray.init(**init_kw)
        started_ray = True
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run_many([serve.RunTarget(build_application(import_path, args), name=name, route_prefix=prefix)
                        for name, prefix, import_path, args in apps])          # replicas start in parallel
    except BaseException:
        shutdown_local(started_ray)
        raise
    url = f"http://{host}:{port}"
    info = {"url": url, "applications": [n for n, *_ in apps], "started_ray": started_ray}
    print(f"dart-ray serving {', '.join(info['applications'])} at {url}/v1 (Ctrl-C to stop)", flush=True)
    if not blocking:
        return info

    stop = threading.Event()
    prev = {}
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C and SIGTERM both stop cleanly (SIGINT explicitly: a shell may start us with it ignored)
        for sig in (signal.SIGINT, signal.SIGTERM):
            prev[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        for sig, handler in prev.items():
            signal.signal(sig, handler)
        print("shutting down Serve and Ray ...", flush=True)
        shutdown_local(started_ray)
    return info


def shutdown_local(shutdown_ray: bool = True) -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        if shutdown_ray and ray.is_initialized():
            ray.shutdown()
