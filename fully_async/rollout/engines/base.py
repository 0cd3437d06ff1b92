"""The `RolloutEngine` contract every rollout engine implements (layer 5).

The rollouter drives an engine from one thread: it submits single-sequence requests, calls
`collect()` in a loop (each call advances generation a bounded amount and returns whatever
finished), and between calls it may `interrupt()` everything in flight to apply a weight
update.  Engines stamp every generated token with the param version they were holding, so a
response resumed across an update records exactly which weights produced which token.

Optional: receiving the collective weight broadcast itself (`DirectWeightReceiver`).  By default
the rollouter joins the trainer's broadcast group (fully_async.weight_sync.collective) as one
rank, receives each bucket into tensors on its own device and hands that stream to
`update_weights()`: right for an engine living in the rollouter's process (the embedded HF
engine).  An engine whose weights live in other processes (vLLM's workers) implements the three
methods below instead; the rollouter then delegates, every one of the engine's processes joins
the group with its own rank and receives the buckets straight into its own device memory, with
no copy through the rollouter.  `receive_weights()` has `update_weights()`'s contract (runs with
nothing in flight unless the engine keeps requests, stamps `version`, sets
`last_update_timings` when it keeps requests).
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Mapping, Optional, Protocol, Union, runtime_checkable

import torch

from fully_async.core.types import GenOutput, GenRequest

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


class VersionedEngine(RolloutEngine, Protocol):
    """What the rollout scheduler drives: an engine, or the pool of replicas (engines/pool.py), that also says which
    param version its weights are."""

    version: int


def run_requests(engine: RolloutEngine, requests: list[GenRequest],
                 timeout_s: Optional[float] = None) -> dict[str, GenOutput]:
    """Submit `requests` and collect until nothing is in flight; the outputs by request id.

    `timeout_s` bounds the wait (TimeoutError naming what is still in flight); None waits."""
    engine.submit(requests)
    outs: dict[str, GenOutput] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while engine.num_in_flight():
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{engine.num_in_flight()} requests still in flight after {timeout_s} s")
        for out in engine.collect():
            outs[out.request_id] = out
    return outs


@runtime_checkable
class DirectWeightReceiver(Protocol):
    """An engine that joins the trainer's weight-broadcast group itself (see the module docstring)."""

    def weight_receivers(self) -> int:
        """How many ranks this engine adds to the group (e.g. one per tensor-parallel worker)."""

    def init_weight_group(self, addr: str, port: int, first_rank: int, world: int) -> None:
        """Join the group as ranks first_rank .. first_rank + weight_receivers() - 1 of `world`; blocks
        until the trainer (rank 0) has joined too."""

    def receive_weights(self, metas: list[Any], buckets: list[list[int]], dtype: str, version: int) -> None:
        """Receive one bucketed broadcast (collective.receive's metas/buckets, dtype like 'torch.bfloat16'),
        load it as it arrives and stamp later tokens with `version`."""


def receives_weights_directly(engine: Any) -> bool:
    """True when `engine` implements DirectWeightReceiver (the rollouter then delegates to it)."""
    return isinstance(engine, DirectWeightReceiver)
