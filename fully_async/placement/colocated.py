"""Colocated async (async_training.placement=colocated; layer 3): every trainer device also hosts an engine replica,
and the two take turns on it without waiting for the step's tail.

It is a use of the pool lease, not a loop of its own: the launcher makes the trainer's devices a private device pool
(placement/shared_pool.py `colocate`) whose two holders are this run's rollouter and trainer, and writes its name into
the actors' config, so each side's residency is a `PoolLease` (base.py).  What differs from a pool of several jobs:
  * `keeps_in_flight`: with engines that keep their memory while asleep (rollout.free_cache_engine=false) the
    rollouter's responses wait through the trainer's turn held in the engines' KV cache instead of being parked;
    `holds_through_turns`: with free_cache_engine=true they are held too whenever the engines keep their memory
    (the trainer fits beside them: device_memory/policy.py) or swap what is in flight to host memory and back
    (the embedded engine): no weights change in the trainer's turn (its update loads after the wake), so holding
    is exact, and an update then parks them (pause_mode=abort) or continues them (keep);
  * `trainer_offloads`: only when the config asks (actor.fsdp_config.param_offload / optimizer_offload), as sync
    mode: the engines sleep, the trainer stays;
  * the engine pool is one replica per trainer device, tensor parallel 1;
  * weight sync `auto` is device IPC on the CUDA devices of one node with the embedded engine
    (core/placement_checks.device_ipc_applies; each engine opens the handle of the trainer rank beside it), else
    the object store;
  * the planner simulates it with colocated_sim.py.
"""
from __future__ import annotations

from typing import Any, Optional

from fully_async.core.placement_checks import device_ipc_applies
from fully_async.placement.base import Placement


class ColocatedAsync(Placement):
    name = "colocated"
    private_pool = True

    holds_through_turns = True

    @property
    def keeps_in_flight(self) -> bool:   # type: ignore[override]
        return not self.cfg.actor_rollout_ref.rollout.free_cache_engine

    @property
    def trainer_offloads(self) -> bool:
        off = self.cfg.actor_rollout_ref.actor.fsdp_config
        return bool(off.param_offload or off.optimizer_offload)

    def engine_layout(self) -> tuple[int, int]:
        return self.plan.trainer_devices, 1

    def _auto_route(self, device: Any) -> str:
        if device_ipc_applies(self.cfg) and device.name == "cuda":
            return "device_ipc"
        return super()._auto_route(device)

    def simulate(self, costs: Any, work: Any) -> Optional[Any]:
        from fully_async.planner.colocated_sim import simulate_colocated

        return simulate_colocated(self.plan.trainer_devices, self.async_setup(), costs, work)
