"""An async job on a device pool shared with other jobs (`multi_job.pool` with placement=split; layer 3).

Its rollout and train sides are two holders of the pool's leases (placement/leases.py), each on its own pool
devices (`multi_job.rollout_devices`, `multi_job.job_devices`; they may overlap, then the sides take turns): each
keeps its lease while nobody else wants those devices and gives it back when someone does, the rollouter with its
unfinished responses parked, the trainer offloaded (always, whatever the offload keys: another job needs the
memory).  Every actor is pinned to its pool devices (no device resource from Ray: the leases keep the jobs apart in
time), and the weights go through the object store (the rollouter takes an update while it waits for its lease and
loads it at its next turn).  A sync job on a pool is sync_turns.py's `SyncTurns` inside a lease.

No simulator models it: its pace is set by the other jobs' leases as much as by its own stage costs.
"""
from __future__ import annotations

from typing import Any, Optional

from fully_async.placement.base import Placement


class MultiJobPool(Placement):
    name = "pool"

    @property
    def on_pool(self) -> bool:
        return True

    def simulate(self, costs: Any, work: Any) -> Optional[Any]:
        return None
