"""Elastic trainer devices (async_training.placement=elastic; layer 3): split async whose trainer devices each host an
engine that generates for the rollouter while the trainer waits for samples.

The rollout side's residency is `Dedicated`; the trainer's is `residency.Elastic` over the trainer's `lend` /
`reclaim` transitions: its wait loop's `wanted()` / `give_back("waiting")` lend the engines beside its ranks to the
rollout pool and `hold("train")` takes them back (their in-flight responses parked and continued on the rollout
devices).  The trainer hosts those engines (`trainer_hosts_engines`) and loads every push into them in its own
processes (weight_sync.ElasticWeightSync around the split route); it never offloads (config_checks refuses the
offload keys: the trainer stays on its devices while their engines generate).  The planner simulates it as
pipeline_sim's split schedule with one elastic replica per trainer device.
"""
from __future__ import annotations

from typing import Any, Optional

from fully_async.placement.base import SIDES, Placement
from fully_async.placement.residency import Dedicated, Elastic


class ElasticLending(Placement):
    name = "elastic"
    trainer_hosts_engines = True

    @property
    def trainer_offloads(self) -> bool:
        return False

    def residency(self, side: str, **transitions: Any) -> Any:
        """The trainer: `Elastic(lend, reclaim)` (its `lend` / `reclaim` transitions: pass both); the rollout side
        its own devices."""
        if side not in SIDES:
            raise ValueError(f"residency side {side!r}: an elastic run's sides are {SIDES}")
        if side == "rollout":
            return Dedicated()
        if set(transitions) != {"lend", "reclaim"}:
            raise ValueError(f"the elastic trainer's residency needs its lend and reclaim transitions, got "
                             f"{sorted(transitions)}")
        return Elastic(transitions["lend"], transitions["reclaim"])

    def simulate(self, costs: Any, work: Any) -> Optional[Any]:
        from fully_async.planner.pipeline_sim import simulate_async

        return simulate_async(self.async_setup(elastic_replicas=self.plan.trainer_devices), costs, work)
