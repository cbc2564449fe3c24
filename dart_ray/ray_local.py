"""``init_ray``: the ``ray.init`` of dart-ray's batch and tuning commands.

Which Ray: the cluster at ``address`` if one is given; else the one ``RAY_ADDRESS`` names (a Ray
job's driver runs with it set); else a new local Ray of this process -- what the commands document,
even where ``ray start`` left a cluster on this host that a bare ``ray.init()`` would join (and
then refuse the local settings, such as ``num_cpus``, with an error about joining).

A Ray started here runs its workers at the command's priority (``worker_niceness``
:data:`WORKER_NICENESS`), as the Serve launcher's (``deployments.run.start_local_ray``). Ray's own
default, nice 15, lets any nice-0 process on the node take the CPU first: with two busy loops
beside a 2-core test cluster, a batch job's engine actors stayed in ``PENDING_CREATION`` for over a
minute and its stall guard stopped the job before one batch ran. A cluster joined by address keeps
its own settings.

Importing this module has no side effects and does not import Ray.
"""

from __future__ import annotations

import os
from typing import Any

WORKER_NICENESS = 0
"""Nice value of the workers of a Ray started by :func:`init_ray` (Ray's own default is 15)."""


def init_ray(**init_kw: Any) -> bool:
    """``ray.init(**init_kw)`` unless Ray is up in this process; returns whether it called it.

    Without an ``address`` (or with ``"local"``) and without ``RAY_ADDRESS`` it starts a new local
    Ray whose workers run at :data:`WORKER_NICENESS` (``init_kw``'s own ``_system_config``
    entries win); otherwise it joins that cluster as given."""
    import ray

    if ray.is_initialized():
        return False
    address = init_kw.get("address")
    if address not in (None, "local") or (address is None and os.environ.get("RAY_ADDRESS")):
        ray.init(**init_kw)
        return True
    # a fresh dict each call: ray.init adds its own entries to the one it is given
    config = {"worker_niceness": WORKER_NICENESS, **(init_kw.pop("_system_config", None) or {})}
    ray.init(**{**init_kw, "address": "local"}, _system_config=config)
    return True
