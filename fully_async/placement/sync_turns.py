"""Sync mode's turns (mode=sync; layer 3): every trainer rank hosts an engine on its device, and each step is a
rollout phase then a train phase on the same devices.

The one holder is the SyncWorker, whose residency is `residency.Turns` over its two tenants' transitions (engines:
wake / sleep; trainer: onload / offload) inside `Dedicated` devices or, on a device pool shared with other jobs
(multi_job.pool), a `PoolLease` held per phase (holder "colocated").  The trainer offloads while the engines
generate on a pool always, else when the config asks (actor.fsdp_config.param_offload / optimizer_offload); on a
pool the embedded engine takes new weights asleep, into its host copies (`engines_load_asleep`).  The weights go
in-process, each rank's to the engine beside it (weight_sync.LocalWeightSync: route "local").  The planner
simulates it with pipeline_sim's `simulate_sync`.
"""
from __future__ import annotations

from typing import Any, Optional

from fully_async.core.config import num_seqs
from fully_async.placement.base import Placement, pool_lease
from fully_async.placement.residency import Dedicated, Turns


class SyncTurns(Placement):
    name = "sync"

    @property
    def trainer_offloads(self) -> bool:
        off = self.cfg.actor_rollout_ref.actor.fsdp_config
        return bool(self.on_pool or off.param_offload or off.optimizer_offload)

    @property
    def engines_load_asleep(self) -> bool:   # type: ignore[override]
        return self.on_pool and self.cfg.actor_rollout_ref.rollout.name == "hf"

    def engine_layout(self) -> tuple[int, int]:
        return self.plan.trainer_devices, 1

    def residency(self, side: str, **transitions: Any) -> Any:
        """`side` "sync": Turns of the engines and the trainer (pass `engines=(on, off)` and `trainer=(on, off)`, and
        on a pool `measure(phase) -> (GiB the job holds, device GiB)` for co-tenancy)."""
        if side != "sync":
            raise ValueError(f"residency side {side!r}: a sync run's one side is 'sync'")
        outer = pool_lease(self.cfg, "sync") if self.on_pool else Dedicated()
        return Turns(outer, engines=transitions["engines"], trainer=transitions["trainer"],
                     measure=transitions.get("measure"))

    def weight_sync_route(self, device: Any) -> str:
        return "local"

    def simulate(self, costs: Any, work: Any) -> Optional[Any]:
        from fully_async.planner.pipeline_sim import simulate_sync

        return simulate_sync(self.plan.trainer_devices, self.cfg.data.train_batch_size,
                             num_seqs(self.cfg.actor_rollout_ref.rollout), costs, work)
