"""``dart-ray serve``: the OpenAI-compatible server on a local Ray instance."""

from __future__ import annotations

import argparse
import sys

from dart_ray import METHODS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dart-ray serve",
                                description="Serve an OpenAI-compatible API (Ray Serve) on a local Ray instance.")
    p.add_argument("--config", default=None,
                   help="Serve config YAML (default: deployments/serve_default.yaml)")
    p.add_argument("--host", default=None, help="HTTP host (default: the config's, else 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's, else 8000)")
    p.add_argument("--temp-dir", default=None, help="Ray temp/session directory (default: Ray's)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance")
    r = p.add_argument_group("Ray (a local instance binds 127.0.0.1 and keeps token auth)")
    r.add_argument("--address", default=None,
                   help="join this running Ray cluster instead (its settings are left alone)")
    r.add_argument("--ray-node-ip", default="127.0.0.1", dest="ray_node_ip",
                   help="address the local Ray's processes bind (default 127.0.0.1; a routable address "
                        "opens them to the network, e.g. to let other nodes join)")
    r.add_argument("--insecure-no-ray-auth", action="store_true",
                   help="start the local Ray without token authentication (same as RAY_AUTH_MODE=disabled)")
    g = p.add_argument_group("overrides of every application's args")
    g.add_argument("--model", default=None, help="HF model dir or .gguf ('default' = embedded SmolLM2)")
    g.add_argument("--method", choices=METHODS, default=None)
    g.add_argument("--dtype", choices=("auto", "bf16", "fp32", "fp16"), default=None)
    g.add_argument("--drafter", default=None)
    g.add_argument("--ngram", default=None)
    g.add_argument("--profile", default=None)
    g.add_argument("--max-batch-size", type=int, default=None)
    g.add_argument("--max-seq-len", type=int, default=None)
    g.add_argument("--replica-cpus", type=float, default=None, dest="num_cpus_replica",
                   help="CPUs reserved per replica (args.num_cpus)")
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--api-key", default=None)
    g.add_argument("--served-model-name", default=None)
    return p


def overrides_from(a: argparse.Namespace) -> dict:
    keys = {"model": "model", "method": "method", "dtype": "dtype", "drafter": "drafter", "ngram": "ngram",
            "profile": "profile", "max_batch_size": "max_batch_size", "max_seq_len": "max_seq_len",
            "num_cpus_replica": "num_cpus", "num_threads": "num_threads", "api_key": "api_key",
            "served_model_name": "served_model_name"}
    return {dst: getattr(a, src) for src, dst in keys.items() if getattr(a, src) is not None}


def serve_cli(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from deployments.run import run_local

    try:
        run_local(a.config, host=a.host, port=a.port, temp_dir=a.temp_dir, blocking=True,
                  overrides=overrides_from(a), num_cpus=a.num_cpus, address=a.address,
                  ray_auth=False if a.insecure_no_ray_auth else None, node_ip_address=a.ray_node_ip)
    except (FileNotFoundError, ValueError, TypeError, NotImplementedError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(serve_cli())
