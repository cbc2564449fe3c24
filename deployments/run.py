"""Run the Serve application on a local Ray instance (what ``dart-ray serve`` does).

A Ray started here is closed to the network and keeps Ray's token authentication:

* every Ray process (GCS, raylet, object manager, workers, agents) binds the loopback address
  (``node_ip_address="127.0.0.1"``); another machine cannot reach them (pass a routable
  ``node_ip_address`` to let other nodes join this head on purpose);
* ``RAY_AUTH_MODE`` is left to the user: unset, Ray enables token auth for a new local cluster and
  keeps the token in ``~/.ray/auth_token``; ``ray_auth=False`` (``--insecure-no-ray-auth``) or
  ``RAY_AUTH_MODE=disabled`` turns it off;
* workers start at nice 0 (Ray's default is 15): the engine is not deprioritised on a host
  dedicated to it.

Joining an existing cluster (``address=...``) changes none of that cluster's settings.
"""

from __future__ import annotations

import contextlib
import importlib
import ipaddress
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

from dart_ray import init_ray, joins_cluster
from deployments.config import ServeArgs

DEFAULT_CONFIG = Path(__file__).resolve().parent / "serve_default.yaml"
LOOPBACK = "127.0.0.1"

logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def _keep_loopback_node_ip(node_ip_address: str):
    """Ray's ``ray.init`` replaces a loopback ``_node_ip_address`` by the host's routable address
    (``services.resolve_ip_for_localhost``), and its gRPC servers bind the node address; keep the
    loopback address for this call so every Ray process binds it."""
    from ray._private import services

    original = getattr(services, "resolve_ip_for_localhost", None)
    if original is None or not is_loopback(node_ip_address):
        yield
        return
    services.resolve_ip_for_localhost = lambda host: host if is_loopback(host) else original(host)
    try:
        yield
    finally:
        services.resolve_ip_for_localhost = original


def start_local_ray(num_cpus: int | None = None, temp_dir: str | None = None,
                    node_ip_address: str = LOOPBACK, ray_auth: bool | None = None,
                    **init_kw: Any) -> None:
    """A new local Ray (:func:`dart_ray.init_ray` with ``address="local"``: its workers at this
    process's priority), closed to the network (see the module docstring).

    ``ray_auth``: None = Ray's default (token auth unless ``RAY_AUTH_MODE`` says otherwise), False
    = disable it (``RAY_AUTH_MODE=disabled`` for this process and its children), True = require it.
    Raises RuntimeError if Ray is already up in this process, or (after shutting that Ray down) if
    Ray did not take the loopback address.
    """
    import ray

    if ray_auth is not None:
        os.environ["RAY_AUTH_MODE"] = "token" if ray_auth else "disabled"
    kw: dict[str, Any] = {"include_dashboard": False, "_node_ip_address": node_ip_address,
                          **init_kw, "address": "local"}
    if num_cpus is not None:
        kw["num_cpus"] = num_cpus
    if temp_dir:
        Path(temp_dir).mkdir(parents=True, exist_ok=True)
        kw["_temp_dir"] = str(Path(temp_dir).resolve())
    if joins_cluster(None):
        logger.warning("RAY_ADDRESS=%s is ignored: this starts its own local Ray (pass --address "
                       "to deploy on that cluster)", os.environ["RAY_ADDRESS"])
    with _keep_loopback_node_ip(node_ip_address):
        if not init_ray(**kw):
            raise RuntimeError("Ray is already running in this process")
    got = ray.util.get_node_ip_address()
    if is_loopback(node_ip_address) and not is_loopback(got):
        ray.shutdown()
        raise RuntimeError(f"Ray took node address {got}, not {node_ip_address}: its ports would "
                           "be open to the network. Pass a routable node_ip_address "
                           "(--ray-node-ip) to accept that.")
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        logger.warning("Ray token authentication is disabled (RAY_AUTH_MODE=disabled): any local "
                       "user can run code on this Ray instance%s", "" if is_loopback(got) else
                       f", and anyone who reaches {got}")


SERVE_KEYS = frozenset({"applications", "http_options", "proxy_location"})
"""Top-level keys of a Serve config that ``dart-ray serve`` applies."""
APPLICATION_KEYS = frozenset({"name", "route_prefix", "import_path", "args"})
"""Keys of an application entry that ``dart-ray serve`` applies (``serve deploy`` applies the
rest of the Serve schema)."""


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
    if not isinstance(cfg, dict) or not isinstance(cfg.get("applications"), list) \
            or not cfg["applications"]:
        raise ValueError(f"{p}: expected a Serve config with a non-empty 'applications' list")
    other = sorted(set(cfg) - SERVE_KEYS)
    if other:
        raise ValueError(f"{p}: `dart-ray serve` applies {sorted(SERVE_KEYS)}, not {other}: "
                         f"deploy this file with Ray's `serve deploy {p}` to apply every Serve "
                         "option")
    for i, a in enumerate(cfg["applications"]):
        if not isinstance(a, dict) or not isinstance(a.get("import_path"), str):
            raise ValueError(f"{p}: applications[{i}] needs an import_path")  # noqa: TRY004
        if a.get("args") is not None and not isinstance(a["args"], dict):
            raise ValueError(f"{p}: applications[{i}].args must be a mapping")
        other = sorted(set(a) - APPLICATION_KEYS)
        if other:
            raise ValueError(
                f"{p}: applications[{i}]: `dart-ray serve` applies {sorted(APPLICATION_KEYS)}, "
                f"not {other} (Serve options of single deployments, such as user_config or "
                f"graceful_shutdown_timeout_s): deploy this file with Ray's `serve deploy {p}`, "
                "or use the args keys (num_replicas, num_cpus, profile, ...)")
    if not isinstance(cfg.get("http_options") or {}, dict):
        raise ValueError(f"{p}: http_options must be a mapping")
    return cfg


def build_application(import_path: str, args: dict | None):
    """``module:attr`` (or ``module.attr``) -> a Serve Application (calling a builder with
    ``args``)."""
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
            raise TypeError(f"{import_path}(args) returned {type(app).__name__}, "
                            "not a serve.Application")
        return app
    raise TypeError(f"{import_path} is neither a serve.Application nor an application builder")


def _readable_here(check, ref, what: str, missing: type[Exception], local: bool) -> None:
    """``check(ref)`` here, before Ray starts. ``missing`` (``ref`` not readable here) is an
    error for a local run (its replicas read the same files) and a warning on a cluster (its
    nodes may hold the files); any other error is raised either way."""
    try:
        check(ref)
    except missing as e:
        if local:
            raise
        logger.warning("%s %r is not readable here (%s); the replicas resolve it on their nodes",
                       what, ref, e)


def check_profile(profile: str | None, local: bool) -> None:
    """Load an application's decoding profile here, before Ray or any replica starts, so a typo
    or a malformed file is an error at the command rather than a replica that fails to start."""
    if profile is not None:
        from dart_ray import load_profile

        _readable_here(load_profile, profile, "profile", FileNotFoundError, local)


def check_app_model(args: dict[str, Any], local: bool) -> None:
    """Check an application's engine model here, before Ray starts
    (:func:`dart_ray.check_model`: no model there, an architecture or GGUF this engine cannot
    run), as :func:`check_profile` does its profile."""
    from dart_ray import ModelLoadError, check_model

    model = ServeArgs.from_dict(args).engine.model
    _readable_here(check_model, model, "model", ModelLoadError, local)


OUR_APP = "deployments.openai_app:build_app"


def check_app_args(import_path: str, args: dict[str, Any]) -> None:
    """Validate the args of a dart-ray application here, before Ray starts (an unknown key, a bad
    TP size or placement is an error at the command, not a replica that never starts)."""
    if import_path != OUR_APP:
        return
    from deployments.engine_factory import check_tensor_parallel
    from deployments.openai_app import deployment_options

    a = ServeArgs.from_dict(args)
    deployment_options(a)                  # its placement (TP bundles, strategy, per-node cap)
    check_tensor_parallel(a)


def app_resources(import_path: str, args: dict[str, Any]) -> dict[str, float]:
    """CPUs (and GPUs) every replica of a dart-ray application reserves together: the engine
    replicas (each with its TP bundles) and the ingress replicas."""
    if import_path != OUR_APP:
        return {}
    from deployments.openai_app import deployment_options, ingress_options

    a = ServeArgs.from_dict(args)
    need: dict[str, float] = {}

    def add(res: dict, times: int) -> None:
        for k, key in (("num_cpus", "CPU"), ("num_gpus", "GPU"), ("CPU", "CPU"), ("GPU", "GPU")):
            if res.get(k):
                need[key] = need.get(key, 0.0) + float(res[k]) * times

    engine, ingress = deployment_options(a), ingress_options(a)
    for bundle in engine.get("placement_group_bundles") or [engine["ray_actor_options"]]:
        add(bundle, a.num_replicas)
    add(ingress["ray_actor_options"], a.ingress_num_replicas)
    return need


def check_local_resources(apps: list, available: dict[str, float]) -> None:
    """Refuse applications a Ray started here cannot place (Serve would wait for the resources
    forever): their replicas' CPUs/GPUs against the local Ray's."""
    need: dict[str, float] = {}
    for _, _, import_path, args in apps:
        for k, v in app_resources(import_path, args).items():
            need[k] = need.get(k, 0.0) + v
    short = {k: (v, available.get(k, 0.0)) for k, v in need.items()
             if v > available.get(k, 0.0) + 1e-9}
    if short:
        what = ", ".join(f"{v:g} {k} (it has {have:g})" for k, (v, have) in short.items())
        hint = ("lower num_cpus, tensor_parallel_size or num_replicas, or give Ray more "
                "(--num-cpus)") if "GPU" not in short else \
            ("lower tensor_parallel_size or num_replicas, or run where Ray sees the GPUs "
             "(device cpu runs without)")
        raise ValueError(f"the replicas need {what} of the local Ray: {hint}")


def run_local(config_path: str | os.PathLike | None = None, host: str | None = None,
              port: int | None = None, temp_dir: str | None = None, blocking: bool = True,
              overrides: dict[str, Any] | None = None,
              num_cpus: int | None = None, address: str | None = None, ray_auth: bool | None = None,
              node_ip_address: str = LOOPBACK, drain_timeout_s: float = 30.0) -> dict:
    """Start a local Ray (or join ``address``), Serve on ``host:port`` (default: the config's
    ``http_options``, else 127.0.0.1:8000) and the config's applications.

    ``overrides`` update every application's ``args``. A Ray started here binds ``node_ip_address``
    (loopback by default), keeps token auth unless ``ray_auth=False`` and runs workers at nice 0
    (:func:`start_local_ray`); ``address`` joins an existing cluster and leaves its settings alone.
    With ``blocking=True`` this waits until Ctrl-C / SIGTERM, drains (the requests in flight
    finish for up to ``drain_timeout_s``, new ones get 503: :mod:`deployments.drain`; a second
    signal stops waiting), then shuts Serve and Ray down (Ray only if it started it here). With
    ``blocking=False`` it returns ``{"url", "applications", "started_ray"}``; call
    :func:`shutdown_local` when done.
    """
    cfg = load_serve_config(config_path)
    http = dict(cfg.get("http_options") or {})
    host = host or http.get("host") or "127.0.0.1"
    port = int(port or http.get("port") or 8000)
    apps = []
    for a in cfg["applications"]:
        args = dict(a.get("args") or {})
        args.update(overrides or {})
        apps.append((a.get("name") or "default", a.get("route_prefix", "/"), a["import_path"],
                     args))

    for _, _, import_path, args in apps:
        if import_path == OUR_APP:       # another application's builder checks its own args
            check_app_args(import_path, args)
            check_profile(args.get("profile"), local=address is None)
            check_app_model(args, local=address is None)

    import ray
    from ray import serve

    signals = _Signals() if blocking and threading.current_thread() is threading.main_thread() \
        else None
    if signals is not None:
        signals.install()              # from here on: a SIGTERM during start-up is not a crash
    started_ray = False
    try:
        if address is not None:
            if not ray.is_initialized():
                ray.init(address=address)                  # that cluster's own settings, untouched
        elif not ray.is_initialized():
            start_local_ray(num_cpus=num_cpus, temp_dir=temp_dir,
                            node_ip_address=node_ip_address, ray_auth=ray_auth)
            started_ray = True
        if signals is not None:
            signals.install()          # over the handler ray.init installed
        if started_ray:
            check_local_resources(apps, ray.cluster_resources())
        from deployments.drain import start_control

        control = start_control()         # before the ingress replicas start: they look it up
        serve.start(proxy_location=cfg.get("proxy_location"),
                    http_options={**http, "host": host, "port": port})
        # replicas start in parallel
        serve.run_many([serve.RunTarget(build_application(import_path, args), name=name,
                                        route_prefix=prefix)
                        for name, prefix, import_path, args in apps])
    except BaseException:
        _shutdown(started_ray, signals)
        raise
    url = f"http://{host}:{port}"
    info = {"url": url, "applications": [n for n, *_ in apps], "started_ray": started_ray}
    print(f"dart-ray serving {', '.join(info['applications'])} at {url}/v1 (Ctrl-C to stop)",
          flush=True)
    if signals is None:
        if blocking:                  # not the main thread: no signal handlers; serve until killed
            threading.Event().wait()
        return info
    try:
        while not signals.stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    try:
        _drain(control, drain_timeout_s, signals)
    finally:
        print("shutting down Serve and Ray ...", flush=True)
        _shutdown(started_ray, signals)
    return info


def _shutdown(started_ray: bool, signals: _Signals | None) -> None:
    """:func:`shutdown_local`, with signals only acknowledged meanwhile, then given back."""
    if signals is not None:
        signals.phase = "shutting down"
    try:
        shutdown_local(started_ray)
    finally:
        if signals is not None:
            signals.restore()


class _Signals:
    """Ctrl-C / SIGTERM of a blocking ``dart-ray serve``: the first asks it to stop (start-up
    finishes, then the drain); another one while starting or draining stops that
    (KeyboardInterrupt); during the shutdown that follows they are only acknowledged. SIGINT is
    handled even when a shell started the process with it ignored (``cmd &``)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.phase = "running"
        self.prev: dict = {}

    def install(self) -> None:
        """Take SIGINT and SIGTERM (again after ``ray.init``, which installs its own SIGTERM
        handler in the driver: one that aborts the process)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            prev = signal.signal(sig, self._on_signal)
            self.prev.setdefault(sig, prev)

    def restore(self) -> None:
        for sig, handler in self.prev.items():
            signal.signal(sig, handler)
        self.prev = {}

    def _on_signal(self, *_) -> None:
        if self.phase == "shutting down":
            print("shutting down already; please wait", flush=True)
        elif self.stop.is_set():
            raise KeyboardInterrupt
        else:
            self.stop.set()


def _drain(control, timeout_s: float, signals: _Signals) -> None:
    """Let the requests in flight finish (new ones get 503) for up to ``timeout_s`` (a further
    Ctrl-C / SIGTERM stops waiting), then cancel what is still open, so that Serve's shutdown has
    nothing left to wait for."""
    from deployments.drain import cut, drain

    left = None                    # open requests when the waiting ended (None: it did not wait)
    signals.phase = "draining"
    try:
        if timeout_s > 0:
            left = drain(control, timeout_s)
    except KeyboardInterrupt:
        print("interrupted again: not waiting for the open requests", flush=True)
    except Exception as e:  # noqa: BLE001 - never block the shutdown on the drain
        logger.warning("drain failed (%r); shutting down", e)
    finally:
        signals.phase = "shutting down"
    if left == 0:
        return
    try:
        still = cut(control)
    except Exception as e:  # noqa: BLE001
        logger.warning("cancelling the open requests failed (%r); shutting down", e)
        return
    if left:
        print(f"drain timeout ({timeout_s:g} s): {left} open request(s) cancelled"
              + (f", {still} still open" if still else ""), flush=True)


def shutdown_local(shutdown_ray: bool = True) -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        if shutdown_ray and ray.is_initialized():
            ray.shutdown()
