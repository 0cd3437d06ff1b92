"""The `RolloutEngine` contract every rollout engine implements (layer 2).

The rollouter drives an engine from one thread: it submits single-sequence requests, calls
`collect()` in a loop (each call advances generation a bounded amount and returns whatever
finished), and between calls it may `interrupt()` everything in flight to apply a weight
update.  Engines stamp every generated token with the param version they were holding, so a
response resumed across an update records exactly which weights produced which token.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Protocol, Union

import torch

from fully_async.types import GenOutput, GenRequest

NamedTensors = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


class RolloutEngine(Protocol):
    version: int

    def submit(self, requests: list[GenRequest]) -> None:
        """Queue requests; they join the running batch as capacity frees (continuous batching)."""

    def collect(self, timeout_s: float = 0.05) -> list[GenOutput]:
        """Advance generation a bounded amount; return the requests that finished (maybe none)."""

    def num_in_flight(self) -> int:
        """Requests submitted and not yet returned by collect() or interrupt()."""

    def interrupt(self) -> list[GenOutput]:
        """Stop every in-flight request now; return partial outputs (finish_reason 'abort')."""

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Load new weights (nothing may be in flight) and stamp later tokens with `version`."""

    def sleep(self, level: int = 1) -> None:
        """Free device memory (1: offload weights, drop KV cache; 2: drop weights too)."""

    def wake_up(self) -> None:
        """Restore what sleep() freed."""
