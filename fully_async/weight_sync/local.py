"""Weight sync of the colocated sync loop: every trainer rank's engine sits in that rank's process.

Sync mode runs one engine per trainer rank (engines/pool.py over the ranks).  With strategy torch or
fsdp2 each rank's engine loads that rank's own full parameters as FSDP2 gathers them
(train/group.load_trainer_weights, all ranks at once): nothing crosses a process.  A backend without
per-rank full parameters (megatron: rank 0 assembles the HF weights) sends rank 0's copy through the
pool instead (one object-store copy read by every other rank).
"""
from __future__ import annotations

import math
import time
from typing import Any

from fully_async.weight_sync.guard import check_finite


class LocalWeightSync:
    def __init__(self, backend: Any, pool: Any, per_rank: bool, elem_bytes: int = 4):
        self.backend = backend
        self.pool = pool
        self.per_rank = per_rank
        self.nbytes = sum(math.prod(shape) for _, shape in backend.param_shapes()) * elem_bytes

    def flush(self) -> dict[str, float]:
        return {}

    def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        if self.per_rank:
            self.pool.load_everywhere("load_trainer_weights", version)
        else:
            named = self.backend.named_parameters_for_sync()
            check_finite(named, version)
            self.pool.update_weights(named, version)
        total = time.perf_counter() - start
        return {"timing_s/param_sync": total, "timing_s/param_sync/load": total,
                "perf/param_sync_gbps": self.nbytes / 1e9 / max(total, 1e-9)}


class ElasticWeightSync:
    """async_training.placement=elastic: every push goes to the rollouter (`remote`: object store or collective) and
    into the engines beside the trainer's ranks (`engines`: their pool), each loading its own rank's parameters in
    its own process (train/group.load_trainer_weights), so those engines always hold exactly the pushed version --
    also after later training steps that push nothing (trigger_parameter_sync_step > 1)."""

    def __init__(self, remote: Any, engines: Any):
        self.remote = remote
        self.engines = engines

    def flush(self) -> dict[str, float]:
        return self.remote.flush()

    def push(self, version: int) -> dict[str, float]:
        out = self.remote.push(version)
        start = time.perf_counter()
        self.engines.load_everywhere("load_trainer_weights", version)
        out["timing_s/param_sync/elastic_load"] = time.perf_counter() - start
        return out
