"""Training backends (layer 2): `TrainBackend` implementations, imported lazily by name."""
from __future__ import annotations

from typing import Any, Protocol

import torch

from fully_async.batch import TrainBatch


class TrainBackend(Protocol):
    def compute_log_probs(self, batch: TrainBatch, which: str = "actor") -> torch.Tensor: ...

    def train_step(self, batch: TrainBatch, num_mini_batches: int) -> dict[str, float]: ...

    def named_parameters_for_sync(self) -> dict[str, torch.Tensor]: ...

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]: ...

    def stream_full_parameters(self, consumer: Any) -> Any: ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...


def build_backend(cfg: Any, device: Any, total_optimizer_steps: int) -> TrainBackend:
    strategy = cfg.actor_rollout_ref.actor.strategy
    if strategy in ("torch", "fsdp2"):  # fsdp2: the same backend, sharded over the trainer's process group
        from fully_async.backends.torch_backend import TorchBackend
        return TorchBackend(cfg, device, total_optimizer_steps)
    if strategy == "megatron":
        from fully_async.backends.megatron_backend import MegatronBackend
        return MegatronBackend(cfg, device, total_optimizer_steps)
    raise ValueError(f"actor_rollout_ref.actor.strategy={strategy!r} is not one of ['torch', 'fsdp2', 'megatron']")
