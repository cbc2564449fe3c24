"""``init_ray``: the ``ray.init`` of dart-ray's batch and tuning commands.

Which Ray: the cluster at ``address`` if one is given; else the one ``RAY_ADDRESS`` names (a Ray
job's driver runs with it set); else a new local Ray of this process -- what the commands document,
even where ``ray start`` left a cluster on this host that a bare ``ray.init()`` would join (and
then refuse the local settings, such as ``num_cpus``, with an error about joining).

A Ray started here does not nice its workers (``worker_niceness`` :data:`WORKER_NICENESS`; Ray
lowers their priority by 15 unless told), as the Serve launcher's
(``deployments.run.start_local_ray``). With Ray's default any process at the command's priority
takes the CPU first: with two busy loops beside a 2-core test cluster, a batch job's engine actors
stayed in ``PENDING_CREATION`` for over a minute and its stall guard stopped the job before one
batch ran. A cluster that is joined keeps its own settings.

Importing this module has no side effects and does not import Ray.
"""

from __future__ import annotations

import os
from typing import Any

WORKER_NICENESS = 0
"""``worker_niceness`` of a Ray dart-ray starts: its workers run at the starting process's
priority (Ray's own default lowers it by 15)."""

LOCAL_ONLY = ("num_cpus", "num_gpus", "resources", "object_store_memory", "_system_config")
"""``ray.init`` arguments that only a new Ray takes (Ray refuses them when it joins a cluster)."""


def local_ray_config(**overrides: Any) -> dict[str, Any]:
    """A new ``_system_config`` for a Ray dart-ray starts (``overrides`` win). A fresh dict per
    call: ``ray.init`` adds its own entries to the one it is given."""
    return {"worker_niceness": WORKER_NICENESS, **overrides}


def joins_cluster(address: str | None) -> bool:
    """Whether ``ray.init(address=address)`` joins a running cluster rather than starting a Ray
    here, by this module's rule: an address other than ``"local"``, or none and a ``RAY_ADDRESS``
    other than ``""``/``"local"``."""
    if address is not None:
        return address != "local"
    return os.environ.get("RAY_ADDRESS", "") not in ("", "local")


def init_ray(**init_kw: Any) -> bool:
    """``ray.init(**init_kw)`` unless Ray is up in this process; returns whether it called it.

    Joining a cluster (:func:`joins_cluster`) passes ``init_kw`` as given, and raises ValueError if
    it holds a setting only a new Ray takes (:data:`LOCAL_ONLY`). Otherwise a new local Ray starts
    (``address="local"``) with :func:`local_ray_config` (``init_kw``'s own ``_system_config``
    entries win)."""
    import ray

    if ray.is_initialized():
        return False
    address = init_kw.get("address")
    if joins_cluster(address):
        local = [k for k in LOCAL_ONLY if init_kw.get(k) is not None]
        if local:
            where = address if address is not None else f"RAY_ADDRESS={os.environ['RAY_ADDRESS']}"
            raise ValueError(f"{', '.join(local)} set for a new local Ray, but {where} joins a "
                             "running cluster, which keeps its own; drop them or unset the address")
        ray.init(**init_kw)
        return True
    config = local_ray_config(**(init_kw.pop("_system_config", None) or {}))
    ray.init(**{**init_kw, "address": "local"}, _system_config=config)
    return True
