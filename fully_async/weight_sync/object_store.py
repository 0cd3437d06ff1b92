"""Weight sync through Ray's object store: works on any device and across hosts.

The trainer puts one CPU copy of its parameters into the object store and hands the reference
to the rollouter, which loads it into its engine between two generation steps.  This is the
portable fallback; the collective (HCCL/NCCL) path avoids the host round-trip.
"""
from __future__ import annotations

import time
from typing import Any


class ObjectStoreWeightSync:
    def __init__(self, backend: Any, rollouter: Any):
        self.backend = backend
        self.rollouter = rollouter

    def push(self, version: int) -> dict[str, float]:
        import ray

        start = time.perf_counter()
        named_tensors = self.backend.named_parameters_for_sync()
        gather_s = time.perf_counter() - start
        ref = ray.put(named_tensors)
        put_s = time.perf_counter() - start - gather_s
        timings = ray.get(self.rollouter.update_weights.remote(ref, version))
        total = time.perf_counter() - start
        nbytes = sum(t.numel() * t.element_size() for t in named_tensors.values())
        out = {f"timing_s/param_sync/{k}": v for k, v in timings.items()}
        out.update({"timing_s/param_sync": total, "timing_s/param_sync/gather": gather_s,
                    "timing_s/param_sync/put": put_s,
                    "perf/param_sync_gbps": nbytes / 1e9 / max(total, 1e-9)})
        return out
