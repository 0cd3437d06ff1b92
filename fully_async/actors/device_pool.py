"""The device pool as a named, detached Ray actor (layer 5, a thin shell over cluster/device_pool.py).

The first job of a pool creates it (`get_or_create_pool`); later jobs find it by name in the
`fully_async_pools` namespace, whatever their own namespaces.  Detached: it outlives the job that created
it, so the other jobs keep their leases when that one ends or dies; `ray stop` (or `ray.kill`) ends it.
Threaded (max_concurrency): a job blocked in `acquire` does not block the others' releases and heartbeats.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from fully_async.cluster.device_pool import POOL_NAMESPACE, DevicePoolService, pool_actor_name


class DevicePool(DevicePoolService):
    def __init__(self, name: str, num_devices: int, max_hold_s: float, heartbeat_timeout_s: float,
                 timeline_path: Optional[str]):
        logging.basicConfig(level=logging.INFO, format=f"[pool {name}] %(message)s", force=True)
        super().__init__(name, num_devices, max_hold_s, heartbeat_timeout_s, timeline_path)

    def ready(self) -> bool:
        return True


def get_or_create_pool(name: str, num_devices: int, max_hold_s: float, heartbeat_timeout_s: float,
                       timeline_path: Optional[str], detached: bool = True) -> Any:
    """The pool actor `name`; created (no resources; detached unless it is one run's private pool) when no job
    created it yet."""
    import ray

    handle = ray.remote(DevicePool).options(
        name=pool_actor_name(name), namespace=POOL_NAMESPACE, lifetime="detached" if detached else None,
        get_if_exists=True,
        num_cpus=0, max_concurrency=64, max_restarts=0).remote(name, num_devices, max_hold_s, heartbeat_timeout_s,
                                                              timeline_path)
    ray.get(handle.ready.remote(), timeout=120)
    return handle
