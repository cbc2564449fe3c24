"""What every Serve replica of this app does to its own process (engine and ingress alike).

* :func:`reset_niceness`: Ray starts workers at nice 15; a replica resets itself to
  ``replica_niceness`` (default 0) so serving is not behind other processes on its host.
* :func:`keep_serve_grpc_on_loopback`: Serve binds each replica's inter-deployment gRPC server to
  every interface; on a loopback-only Ray (``dart-ray serve``) it is rebound to loopback.
* :func:`replica_labels`: the (replica id, node id) labels of its metrics.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("ray.serve")


def reset_niceness(target: int | None) -> int | None:
    """Set every thread of this process to nice ``target`` if it is nicer (Ray starts workers at
    nice 15). Returns the nice value now, or None if ``target`` is None. Raising priority needs
    CAP_SYS_NICE or RLIMIT_NICE; without it a warning is logged and the process stays as it is."""
    if target is None or not hasattr(os, "setpriority"):
        return None
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
        except PermissionError:
            logger.warning("replica runs at nice %d: no permission to lower it to %d "
                           "(grant CAP_SYS_NICE or RLIMIT_NICE, or start Ray with "
                           "worker_niceness=%d)",
                           os.getpriority(os.PRIO_PROCESS, 0), target, target)
            break
        except OSError:                  # the thread ended meanwhile
            continue
    return os.getpriority(os.PRIO_PROCESS, 0)


def keep_serve_grpc_on_loopback() -> bool:
    """Serve starts each replica's inter-deployment gRPC server on ``[::]:0`` (every interface)
    right after the replica's ``__init__``, whatever Ray's node address. On a node whose Ray address
    is loopback (``dart-ray serve``'s local Ray), bind it to that address instead, so nothing of the
    replica listens beyond loopback. Returns True if it did (no-op on a routable node address or a
    Serve without that hook)."""
    import ray

    from deployments.run import is_loopback

    try:
        from ray.serve._private import replica as serve_replica
    except ImportError:
        return False
    ip = ray.util.get_node_ip_address()
    original = getattr(serve_replica, "add_port_to_grpc_server", None)
    if original is None or not is_loopback(ip):
        return False
    if getattr(original, "dart_ray_loopback", False):
        return True

    def add_port(server, address: str):
        if address.startswith("[::]:"):
            address = f"{ip}:{address[len('[::]:'):]}"
        return original(server, address)

    add_port.dart_ray_loopback = True
    serve_replica.add_port_to_grpc_server = add_port
    return True


def replica_labels() -> tuple[str | None, str | None]:
    """(Serve replica id, Ray node id) of this process; (None, None) outside a Serve replica."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        replica = getattr(getattr(ctx, "replica_id", None), "unique_id", None) or ctx.replica_tag
    except Exception:  # noqa: BLE001 - not in a replica (tests construct the classes directly)
        return None, None
    try:
        import ray

        node = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001
        node = None
    return str(replica), node


def prepare_replica_process(niceness: int | None) -> int | None:
    """Run first in a replica's ``__init__``: niceness, then the loopback gRPC binding (Serve starts
    that server right after ``__init__``). Returns the nice value (see :func:`reset_niceness`)."""
    nice = reset_niceness(niceness)
    keep_serve_grpc_on_loopback()
    return nice
