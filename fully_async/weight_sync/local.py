"""In-process weight sync for the colocated sync loop: engine and trainer share one process."""
from __future__ import annotations

import time
from typing import Any

import torch


class LocalWeightSync:
    def __init__(self, engine: Any):
        self.engine = engine

    def push(self, named_tensors: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        start = time.perf_counter()
        self.engine.update_weights(named_tensors, version)
        total = time.perf_counter() - start
        nbytes = sum(t.numel() * t.element_size() for t in named_tensors.values())
        return {"timing_s/param_sync": total, "timing_s/param_sync/load": total,
                "perf/param_sync_gbps": nbytes / 1e9 / max(total, 1e-9)}
