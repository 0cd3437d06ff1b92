"""What every way of sharing devices answers (layer 3): the common interface of the placement objects.

A placement is asked, never tested by name: the loops (Rollouter, Trainer, SyncWorker), the launcher and the weight
sync ask it which devices each side gets, how each side holds them (its residency), whether the rollouter keeps its
responses in flight through the other tenant's turn, whether the trainer offloads between turns, how the engines are
laid out, which weight-sync route applies and how the planner simulates it.  `Placement` answers for a run on its own
devices; each placement file overrides what differs.  Whether a side holds its devices through a pool's leases is
`on_pool` (`multi_job.pool` set: a pool shared with other jobs, or the private pool colocated async makes of the
trainer's devices, whose name the launcher writes into the actors' config).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from fully_async.core.plan import RunPlan
from fully_async.device_memory.policy import PRIVATE_POOL_MARK
from fully_async.placement.residency import Dedicated, PoolLease

logger = logging.getLogger(__name__)

SIDES = ("rollout", "train")   # the holders of an async run; a sync run's one holder is "sync"


@dataclass(frozen=True)
class DeviceLayout:
    """Which devices each side gets."""

    trainer_devices: int             # data-parallel trainer ranks, one device each
    rollout_devices: int             # the rollout side's own devices (0: its engines sit on the trainer's)
    engine_replicas: int             # engine replicas of the rollout pool (sync: one per trainer rank)
    devices_per_replica: int         # rollout tensor-parallel size (1 where the engines sit beside trainer ranks)
    engine_devices: int              # devices hosting an engine (RunPlan.engine_devices)
    trainer_pool_devices: Optional[tuple[int, ...]] = None   # on a pool: what the trainer leases (sync: the job)
    rollout_pool_devices: Optional[tuple[int, ...]] = None   # on a pool: what the rollout side leases (async)


class Placement:
    """A run on its own devices, trainer and engines apart (dedicated): every answer of the interface."""

    name = "split"
    keeps_in_flight = False         # the rollouter keeps its responses in flight (held) through the trainer's turn
    holds_through_turns = False     # ... or asks its engines at each switch: they keep their memory (what fits, with
    #                                 free_cache_engine=true) or swap what is in flight to host memory and back
    trainer_hosts_engines = False   # an engine beside every trainer rank (lent to the rollout pool: elastic)
    engines_load_asleep = False     # sync on a pool: sleeping embedded engines take new weights into host copies
    private_pool = False            # the launcher makes the trainer's devices a pool of this run's two sides

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.plan = RunPlan.of(cfg)

    # ------------------------------------------------------------------ devices
    @property
    def on_pool(self) -> bool:
        """The sides hold their devices through a pool's leases."""
        return self.cfg.multi_job.pool is not None

    def engine_layout(self) -> tuple[int, int]:
        """(replicas, devices per replica) of the rollout pool: the rollout devices in tensor-parallel groups."""
        tp = self.cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
        return max(1, self.plan.rollout_devices // tp), tp

    def layout(self) -> DeviceLayout:
        replicas, tp = self.engine_layout()
        trainer_pool = rollout_pool = None
        if self.on_pool:
            from fully_async.placement.device_pool import job_devices, rollout_devices

            trainer_pool = tuple(job_devices(self.cfg))
            rollout_pool = tuple(rollout_devices(self.cfg)) if self.cfg.mode == "async" else None
        return DeviceLayout(self.plan.trainer_devices, self.plan.rollout_devices, replicas, tp,
                            self.plan.engine_devices, trainer_pool, rollout_pool)

    def rank_options(self, device: Any) -> Optional[Callable[[int], dict]]:
        """Ray options of trainer rank r >= 1: on a pool each rank is pinned to its pool device; else None (the
        device's own, in the trainer placement group)."""
        if not self.on_pool:
            return None
        from fully_async.placement.device_pool import pinned_actor_options

        return lambda rank: pinned_actor_options(device, self.cfg, rank)

    def replica_options(self, device: Any) -> Optional[Callable[[int], dict]]:
        """Ray options of engine replica i: on a pool each replica is pinned to its pool devices; else None (the
        device's own, in the rollout placement group)."""
        if not self.on_pool:
            return None
        from fully_async.placement.device_pool import pinned_actor_options, rollout_devices

        tp, devs = self.engine_layout()[1], rollout_devices(self.cfg)
        return lambda i: pinned_actor_options(device, self.cfg, 0, devices=devs[i * tp:(i + 1) * tp])

    # ------------------------------------------------------------------ residency
    @property
    def trainer_offloads(self) -> bool:
        """Whether the trainer leaves the devices (offload / onload) when it gives them back: on a pool, always."""
        return self.on_pool

    def residency(self, side: str, **transitions: Any) -> Any:
        """How `side` holds its devices: a lease of the pool, or its own devices (Dedicated).  The side attaches
        its on/off transitions to what it gets (`attach`)."""
        if side not in SIDES:
            raise ValueError(f"residency side {side!r}: a {self.name} run's sides are {SIDES}")
        return pool_lease(self.cfg, side) if self.on_pool else Dedicated()

    # ------------------------------------------------------------------ weight sync
    def weight_sync_route(self, device: Any) -> str:
        """actor_rollout_ref.rollout.weight_sync when named; auto: a collective broadcast on accelerators, the object
        store on CPU and on a pool (the rollouter takes an update while it waits for its lease and loads it at its
        next turn, which a collective cannot wait for)."""
        kind = self.cfg.actor_rollout_ref.rollout.weight_sync
        if kind != "auto":
            return kind
        return self._auto_route(device)

    def _auto_route(self, device: Any) -> str:
        return "collective" if device.is_accelerator and not self.on_pool else "object_store"

    # ------------------------------------------------------------------ simulation
    def async_setup(self, elastic_replicas: int = 0) -> Any:
        """The planner's AsyncSetup of this config."""
        from fully_async.planner.search import PipelineShape

        return PipelineShape.of(self.cfg).async_setup(self.engine_layout()[0], self.plan.trainer_devices,
                                                      self.plan.groups_per_step, elastic_replicas)

    def simulate(self, costs: Any, work: Any) -> Optional[Any]:
        """The planner's simulation of this placement (planner/pipeline_sim.py, colocated_sim.py) for stage costs
        and a workload; None where no simulator models it."""
        from fully_async.planner.pipeline_sim import simulate_async

        return simulate_async(self.async_setup(), costs, work)

    def describe(self) -> str:
        lay = self.layout()
        return (f"{self.name}: {lay.trainer_devices} trainer device(s), {lay.engine_replicas} engine replica(s) x "
                f"{lay.devices_per_replica} device(s)" + (" on a device pool" if self.on_pool else ""))


def pool_lease(cfg: Any, side: str) -> PoolLease:
    """The lease of this job's `side` on its device pool (multi_job.pool): the rollout side leases the rollout
    devices, the trainer (and a sync job, holder "colocated") the job's."""
    from fully_async.placement.device_pool import LeaseClient, job_devices, job_name, rollout_devices

    devices = rollout_devices(cfg) if side == "rollout" else job_devices(cfg)
    mj = cfg.multi_job
    if side != "sync" and mj.co_tenancy and PRIVATE_POOL_MARK not in str(mj.pool):
        logger.info("device pool %s: the %s side of this async job leases its devices alone (co-tenancy, "
                    "multi_job.co_tenancy, lets sync jobs whose memory fits share a device; an async job's sides "
                    "declare no need)", mj.pool, side)
    holder = "colocated" if side == "sync" else side
    poll_s = 2.0 if side == "sync" else 0.5
    return PoolLease(LeaseClient(cfg.multi_job.pool, job_name(cfg), devices, side=holder, poll_s=poll_s))
