"""Where a training step's host loses time besides launching its kernels (layer 5): counters read before and after
each step, reported as that step's `perf/*` deltas.

  perf/host_gc_s                 seconds this process spent in Python's garbage collector (gc.callbacks)
  perf/host_gc_full              full (generation 2) collections among them: each walks every live object
  perf/device_mallocs            segments the device allocator took from the driver (each a cudaMalloc / aclrtMalloc)
  perf/device_frees              ... and gave back (each synchronises the device)
  perf/device_alloc_retries      allocations that failed, freed every cached block and retried (a device-wide stall)
  perf/compiled_graphs           graphs torch.compile traced and compiled in the step (a recompilation costs seconds)

An update's kernels run back to back only while the host stays ahead of them; each of these stops the host, and
the device waits.  Device counters come from the trainer device's allocator (none on cpu)."""
from __future__ import annotations

import functools
import gc
import sys
import time
from typing import Any, Optional


class _GcClock:
    """Cumulative time in the collector and full collections of this process, from gc.callbacks (installed once).
    A collection runs to its end under the interpreter lock, so one start time at a time is enough."""

    def __init__(self) -> None:
        self.seconds, self.full = 0.0, 0
        self._began: Optional[float] = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        if self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self._began = None
        if info.get("generation") == 2:
            self.full += 1


@functools.lru_cache(maxsize=None)
def gc_clock() -> _GcClock:
    return _GcClock()


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (0 before anything was compiled)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    if dynamo is None:
        return 0
    return int(dynamo.counters["stats"]["unique_graphs"])


class StepCounters:
    """`start()` before a step, `metrics()` after it: the step's deltas of the counters above."""

    def __init__(self, device: Any):
        self.device = device
        self.clock = gc_clock()
        self._before: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        out = {"perf/host_gc_s": self.clock.seconds, "perf/host_gc_full": float(self.clock.full),
               "perf/compiled_graphs": float(compiled_graphs())}
        counts = self.device.allocator_counts()
        for name in ("device_mallocs", "device_frees", "device_alloc_retries"):
            if name in counts:
                out[f"perf/{name}"] = float(counts[name])
        return out

    def start(self) -> None:
        self._before = self._read()

    def metrics(self) -> dict[str, float]:
        now = self._read()
        return {key: value - self._before.get(key, 0.0) for key, value in now.items()}
