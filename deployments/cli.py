"""``dart-ray serve``: the OpenAI-compatible server on a local Ray instance."""

from __future__ import annotations

import argparse
import sys

from dart_ray.config import METHOD_ALIASES, add_engine_args, engine_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dart-ray serve",
                                description="Serve an OpenAI-compatible API (Ray Serve) on a local "
                                            "Ray instance.")
    p.add_argument("--config", default=None,
                   help="Serve config YAML (default: deployments/serve_default.yaml)")
    p.add_argument("--host", default=None, help="HTTP host (default: the config's, else 127.0.0.1)")
    p.add_argument("--port", type=int, default=None,
                   help="HTTP port (default: the config's, else 8000)")
    p.add_argument("--temp-dir", default=None, help="Ray temp/session directory (default: Ray's)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance")
    p.add_argument("--drain-timeout", type=float, default=30.0, dest="drain_timeout_s",
                   help="on Ctrl-C / SIGTERM, seconds the requests in flight may take to finish "
                        "(new ones get 503) before Serve shuts down; 0: none (default 30; a "
                        "second signal stops waiting)")
    r = p.add_argument_group("Ray (a local instance binds 127.0.0.1 and keeps token auth)")
    r.add_argument("--address", default=None,
                   help="join this running Ray cluster instead (its settings are left alone)")
    r.add_argument("--ray-node-ip", default="127.0.0.1", dest="ray_node_ip",
                   help="address the local Ray's processes bind (default 127.0.0.1; a routable "
                        "address opens them to the network, e.g. to let other nodes join)")
    r.add_argument("--insecure-no-ray-auth", action="store_true",
                   help="start the local Ray without token authentication "
                        "(same as RAY_AUTH_MODE=disabled)")
    add_engine_args(p, title="engine overrides of every application's args.engine "
                             "(default: the config's)")
    g = p.add_argument_group("overrides of every application's args")
    g.add_argument("--profile", default=None)
    g.add_argument("--replica-cpus", type=float, default=None, dest="num_cpus_replica",
                   help="CPUs reserved per replica (args.num_cpus)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--served-model-name", default=None)
    return p


def overrides_from(a: argparse.Namespace) -> dict:
    """The args every application gets on top of its config: engine flags as flat engine keys
    (``ServeArgs.from_dict`` routes them into ``engine``, over the config's), and the
    server's own."""
    engine = engine_args(a)
    if engine.get("method") == "auto":
        raise ValueError("dart-ray serve: name the --method "
                         "(auto is resolved by generate/bench/batch only)")
    if "method" in engine:
        engine["method"] = METHOD_ALIASES.get(engine["method"], engine["method"])
    keys = {"profile": "profile", "num_cpus_replica": "num_cpus", "api_key": "api_key",
            "served_model_name": "served_model_name"}
    return {**engine,
            **{dst: getattr(a, src) for src, dst in keys.items() if getattr(a, src) is not None}}


def serve_cli(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from deployments.run import run_local

    try:
        overrides = overrides_from(a)
        run_local(a.config, host=a.host, port=a.port, temp_dir=a.temp_dir, blocking=True,
                  overrides=overrides, num_cpus=a.num_cpus, address=a.address,
                  ray_auth=False if a.insecure_no_ray_auth else None, node_ip_address=a.ray_node_ip,
                  drain_timeout_s=a.drain_timeout_s)
    except (FileNotFoundError, ValueError, TypeError, NotImplementedError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:             # interrupted twice while starting: stopped, cleaned up
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(serve_cli())
