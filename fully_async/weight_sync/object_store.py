"""Weight sync through Ray's object store: works on any device and across hosts.

The trainer puts one CPU copy of its parameters into the object store and hands the reference
to the rollouter, which has every engine replica load it between two generation steps.  This is the
portable fallback; the collective (HCCL/NCCL) path avoids the host round-trip.

The push does not wait for the engine to load: the trainer goes on to its next batch while the
rollouter pauses, loads and resumes (the load only has to finish before the next push, a
checkpoint snapshot or the final validation: `flush()`).  The staleness bound is unaffected:
the rollouter counts versions when it applies them.
"""
from __future__ import annotations

import time
from typing import Any, Optional

from fully_async.weight_sync.guard import check_finite


class PendingLoad:
    """The last push's update_weights call, not yet loaded (one at a time): `flush()` waits for it and returns the
    engines' timings of it.  Shared by the transports whose push returns before the engines load."""

    _pending: Optional[Any] = None    # the in-flight update_weights call
    _pending_bytes = 0
    _pending_start = 0.0

    def flush(self) -> dict[str, float]:
        """Wait for the previous push to be loaded; returns its engine-side timings."""
        import ray

        if self._pending is None:
            return {}
        start = time.perf_counter()
        timings = ray.get(self._pending)
        self._pending = None
        out = {f"timing_s/param_sync/{k}": v for k, v in timings.items()}
        out["timing_s/param_sync/wait"] = time.perf_counter() - start
        out["perf/param_sync_gbps"] = self._pending_bytes / 1e9 / max(time.perf_counter() - self._pending_start, 1e-9)
        return out


class ObjectStoreWeightSync(PendingLoad):
    def __init__(self, backend: Any, rollouter: Any):
        self.backend = backend
        self.rollouter = rollouter

    def push(self, version: int) -> dict[str, float]:
        import ray

        start = time.perf_counter()
        out = self.flush()
        named_tensors = self.backend.named_parameters_for_sync()
        check_finite(named_tensors, version)
        gathered = time.perf_counter()
        ref = ray.put(named_tensors)
        # wrapped in a list so Ray hands the reference itself to the rollouter: every engine replica then
        # reads this one copy, and the rollouter never materialises the weights
        self._pending = self.rollouter.update_weights.remote([ref], version)
        self._pending_bytes = sum(t.numel() * t.element_size() for t in named_tensors.values())
        self._pending_start = gathered
        out.update({"timing_s/param_sync": time.perf_counter() - start,
                    "timing_s/param_sync/gather": gathered - start,
                    "timing_s/param_sync/put": time.perf_counter() - gathered})
        return out
