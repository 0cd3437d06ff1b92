"""Training backends (layer 3): `TrainBackend` implementations, imported lazily by name."""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Protocol

import torch

from fully_async.core.config import FullyAsyncConfig
from fully_async.core.batch import TrainBatch


class TrainBackend(Protocol):
    """What a trainer (or the sync worker) asks of its training backend: every strategy's backend, and a
    data-parallel group of them (train_group.GroupBackend), implement it.  This is the one list of the calls
    that cross into a backend; a trainer rank >= 1 (train_group.TrainWorker) serves exactly these by name."""

    consecutive_bad_steps: int  # optimizer steps skipped in a row for a non-finite loss or grad norm

    def compute_log_probs(self, batch: TrainBatch, which: str = "actor") -> torch.Tensor: ...

    def train_step(self, batch: TrainBatch, num_mini_batches: int) -> dict[str, float]: ...

    def named_parameters_for_sync(self) -> dict[str, torch.Tensor]: ...

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]: ...

    def stream_full_parameters(self, consumer: Optional[Callable[[Any], Any]]) -> Any: ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...


class ShardedTrainBackend(TrainBackend, Protocol):
    """One data-parallel rank's backend under train_group.GroupBackend (strategy torch / fsdp2): it runs its
    shard of each batch with the micro-batch count every rank agreed on, so that the collectives line up, and
    the group's PPO loop drives its optimizer one mini-batch at a time."""

    scheduler: Any  # the LR scheduler, stepped by the group's PPO loop through rank 0's backend

    def compute_log_probs(self, batch: TrainBatch, which: str = "actor",
                          num_micro: Optional[int] = None) -> torch.Tensor: ...

    def train_mini_batch(self, mini: TrainBatch, denom: float, loss_scale: float = 1.0,
                         num_micro: Optional[int] = None, rows_total: Optional[int] = None) -> dict[str, float]: ...

    def iter_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def build_backend(cfg: FullyAsyncConfig, device: Any, total_optimizer_steps: int) -> TrainBackend:
    from fully_async.core.config import actor_strategy

    strategy = actor_strategy(cfg)
    if strategy in ("torch", "fsdp2"):  # fsdp2: the same backend, sharded over the trainer's process group
        from fully_async.train.backends.torch_backend import TorchBackend
        return TorchBackend(cfg, device, total_optimizer_steps)
    if strategy == "megatron":
        from fully_async.train.backends.megatron_backend import MegatronBackend
        return MegatronBackend(cfg, device, total_optimizer_steps)
    raise ValueError(f"actor_rollout_ref.actor.strategy={strategy!r} is not one of ['fsdp', 'torch', 'fsdp2', 'megatron']")
