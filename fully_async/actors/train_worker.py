"""Data-parallel trainer rank >= 1 (layer 6): the thin Ray shell around one rank's backend.

The group itself (rank 0's `GroupBackend`, sharding, spawning and joining the ranks) is `train/group.py`;
this file holds only what needs the actor layer: `TrainWorker`, a plain class that `connect_trainer_group`
makes a Ray actor, which serves the backend methods rank 0 calls (each checked against the TrainBackend
Protocol when the class is defined) and, in sync mode, hosts this rank's rollout engine (EngineHost).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, TypeVar

import torch

from fully_async.core.batch import TrainBatch
from fully_async.core.config import FullyAsyncConfig
from fully_async.rollout.engines.replica import EngineHost
from fully_async.train.backends import MiniBatch, ShardedTrainBackend, StepResult
from fully_async.train.group import build_local_backend, load_trainer_weights

F = TypeVar("F", bound=Callable[..., Any])


def forwards_to_backend(fn: F) -> F:
    """Marks a TrainWorker method that runs the backend method of the same name.  Checked when the class is
    defined: the method must be declared by the backend Protocol, with the Protocol's parameters, so the
    Protocol stays the one list of what crosses into a backend."""
    declared = getattr(ShardedTrainBackend, fn.__name__, None)
    if declared is None or not callable(declared):
        raise TypeError(f"TrainWorker.{fn.__name__} forwards a method the TrainBackend Protocol does not declare "
                        "(fully_async/train/backends/__init__.py)")
    ours, theirs = list(inspect.signature(fn).parameters), list(inspect.signature(declared).parameters)
    if ours != theirs:
        raise TypeError(f"TrainWorker.{fn.__name__}{ours} does not match the Protocol's {theirs}")
    fn.forwards_to_backend = True  # type: ignore[attr-defined]
    return fn


def forwarded_methods(cls: type) -> list[str]:
    """Names of the methods of `cls` marked with @forwards_to_backend."""
    return sorted(name for name, fn in inspect.getmembers(cls, inspect.isfunction)
                  if getattr(fn, "forwards_to_backend", False))


class TrainWorker(EngineHost):
    """Ray actor for data-parallel ranks >= 1: a backend that rank 0 calls method by method (one remote
    method per backend method the group forwards, each checked against the Protocol).

    In sync mode (and async placement=elastic) it also hosts this rank's rollout engine (EngineHost: submit / poll /
    engine_call), so sync mode generates on every trainer device (elastic: while the trainer waits); the engine loads
    this rank's own gathered parameters (`load_trainer_weights`), so no weight crosses processes."""

    def __init__(self, cfg: FullyAsyncConfig, rank: int, world: int, master: tuple[str, int], optimizer_steps: int,
                 engine_args: Optional[tuple[list[int], int, int]] = None):
        from fully_async.actors.actor_setup import actor_init

        self.cfg, self.device = actor_init(cfg, f"trainer-rank{rank}")
        self.backend = build_local_backend(self.cfg, self.device, optimizer_steps, rank, world, master,
                                           engine_beside=engine_args is not None)
        self._ipc: Optional[Any] = None   # device-IPC weight sync: this rank's packed buffers (pack_shared_weights)
        if engine_args is not None:
            from fully_async.rollout.engines import build_engine

            eos_token_ids, pad_token_id, first_replica = engine_args
            engine = build_engine(self.cfg, self.device, eos_token_ids, pad_token_id, replica=first_replica + rank)
            self._host_engine(engine, self.device, f"engine{rank}",
                              extra={"load_trainer_weights": lambda version: load_trainer_weights(
                                  self.backend, engine, version)})

    def ready(self) -> bool:
        return True

    # ------------------------------------------------------------------ the backend, as rank 0 drives it
    @forwards_to_backend
    def compute_log_probs(self, batch: TrainBatch, which: str = "actor",
                          num_micro: Optional[int] = None) -> torch.Tensor:
        if num_micro is None:  # a replicated (megatron) rank runs the whole batch its own way
            return self.backend.compute_log_probs(batch, which)
        return self.backend.compute_log_probs(batch, which, num_micro=num_micro)

    @forwards_to_backend
    def forward_backward(self, mini: MiniBatch) -> dict[str, float]:
        return self.backend.forward_backward(mini)

    @forwards_to_backend
    def optimizer_step(self, finite: bool, which: str = "actor") -> StepResult:
        return self.backend.optimizer_step(finite, which)

    @forwards_to_backend
    def compute_values(self, batch: TrainBatch, num_micro: Optional[int] = None) -> torch.Tensor:
        return self.backend.compute_values(batch, num_micro=num_micro)

    @forwards_to_backend
    def compute_sum_pi_squared(self, batch: TrainBatch, num_micro: Optional[int] = None) -> torch.Tensor:
        return self.backend.compute_sum_pi_squared(batch, num_micro=num_micro)

    @forwards_to_backend
    def compute_rm_scores(self, batch: TrainBatch, num_micro: Optional[int] = None) -> torch.Tensor:
        return self.backend.compute_rm_scores(batch, num_micro=num_micro)

    @forwards_to_backend
    def named_parameters_for_sync(self) -> dict[str, torch.Tensor]:
        return self.backend.named_parameters_for_sync()

    @forwards_to_backend
    def stream_full_parameters(self, consumer: Optional[Callable[[Any], Any]]) -> Any:
        return self.backend.stream_full_parameters(consumer)

    def pack_shared_weights(self, dtype: Any) -> Any:
        """This rank's part of a device-IPC push (GroupBackend.pack_shared_weights): its gathered full parameters
        packed into its own device's buffer (kept across pushes); returns the handle."""
        from fully_async.weight_sync.device_ipc import IpcPacker

        if self._ipc is None:
            self._ipc = IpcPacker(dtype)
        return self._ipc.pack(self.backend.iter_full_parameters())

    @forwards_to_backend
    def save(self, path: str) -> None:
        self.backend.save(path)

    @forwards_to_backend
    def load(self, path: str) -> None:
        self.backend.load(path)

    @forwards_to_backend
    def offload(self) -> None:
        self.backend.offload()

    @forwards_to_backend
    def onload(self) -> None:
        self.backend.onload()
