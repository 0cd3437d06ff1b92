"""How devices are shared (layer 3): one object per way of sharing them, and everything that carries it out.

`placement_of(cfg)` returns the run's placement: `Split` (dedicated devices, split.py), `SyncTurns` (mode=sync,
sync_turns.py), `ColocatedAsync` (colocated.py), `ElasticLending` (elastic.py) or `MultiJobPool` (an async job on a
device pool shared with other jobs, pool_lease.py).  Each answers the interface of base.py: the device layout, each
side's residency, whether the rollouter keeps responses in flight through the other tenant's turn, whether the
trainer offloads between turns, the engine pool's layout, the weight-sync route and the planner's simulation.  The
loops, the launcher and weight_sync ask it; nothing tests `placement == "..."` itself.  A new placement is one file
here (a `Placement` subclass) plus its simulation.

What carries the placements out lives here too: residency.py (the one mechanism: Dedicated, PoolLease, Turns,
Elastic), leases.py (the pool's lease rules, pure), device_pool.py (the pool service, its Ray actor and its
clients), shared_pool.py (the driver's side: join a pool, colocate, leave) and groups.py (Ray placement groups).
The config rules of placement are core/placement_checks.py (the validation pass runs before this package loads).

Layer 3: it imports core, the domain packages (planner) and cluster; weight_sync, rollout, train, the actors and run
import it.
"""
from __future__ import annotations

from typing import Any

from fully_async.core.config import PLACEMENTS, ConfigError
from fully_async.placement.base import DeviceLayout, Placement
from fully_async.placement.colocated import ColocatedAsync
from fully_async.placement.elastic import ElasticLending
from fully_async.placement.pool_lease import MultiJobPool
from fully_async.placement.split import Split
from fully_async.placement.sync_turns import SyncTurns

ASYNC_PLACEMENTS: dict[str, type[Placement]] = {"split": Split, "colocated": ColocatedAsync,
                                                 "elastic": ElasticLending}


def placement_of(cfg: Any) -> Placement:
    """The placement of `cfg`: sync mode takes turns; async mode's async_training.placement, a split job on a shared
    device pool (multi_job.pool) being `MultiJobPool`.  Colocated stays colocated on the private pool the launcher
    names in the actors' config."""
    if cfg.mode == "sync":
        return SyncTurns(cfg)
    name = cfg.async_training.placement
    if name not in ASYNC_PLACEMENTS:
        raise ConfigError("async_training.placement", f"{name!r}: choose one of {list(PLACEMENTS)}")
    if name == "split" and cfg.multi_job.pool is not None:
        return MultiJobPool(cfg)
    return ASYNC_PLACEMENTS[name](cfg)


__all__ = ["ASYNC_PLACEMENTS", "ColocatedAsync", "DeviceLayout", "ElasticLending", "MultiJobPool", "Placement",
           "Split", "SyncTurns", "placement_of"]
