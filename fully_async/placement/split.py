"""Split async on dedicated devices (async_training.placement=split, the default; layer 3): the rollout devices and
the trainer's apart, each side holding its own from start to end.

Every answer is the interface's default (placement/base.py): each side's residency is `Dedicated` (its transitions
never run, nothing is kept), the rollout pool is the rollout devices in tensor-parallel groups, the weights go by a
collective broadcast on accelerators (the object store on CPU), and the planner simulates it as pipeline_sim's
split schedule.  Idle time comes from the integer split not matching the stage costs: elastic.py lends the trainer's
devices while it waits.
"""
from __future__ import annotations

from fully_async.placement.base import Placement


class Split(Placement):
    name = "split"
