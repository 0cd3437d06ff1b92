"""Training backends (layer 5): the contract every strategy serves, and `build_backend` (implementations lazily).

A backend owns a model, its optimizer and its parallelism; it does not own the PPO loop.  The one update
(`train/ppo_update.py`) drives it through two primitives per optimizer step: `forward_backward` over a
mini-batch's micro-batches (megatron: its pipeline schedule over them) and `optimizer_step`.  The Protocols below
are the exact list of what crosses into a backend: a data-parallel rank >= 1 (`actors/train_worker.TrainWorker`)
serves exactly these methods by name, and `train/group.GroupBackend` implements the same contract over all ranks.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional, Protocol

import torch

from fully_async.algorithms.actor_loss import ActorLossOutput
from fully_async.core.batch import TrainBatch
from fully_async.core.config import FullyAsyncConfig
from fully_async.core.plan import RunPlan

# the loss of one micro-batch (on the backend's device) from the current policy's (B, L) log-probs and entropy,
# normalised to its whole mini-batch (train/ppo_update.MicroBatchLoss)
MicroLoss = Callable[[TrainBatch, torch.Tensor, Optional[torch.Tensor]], ActorLossOutput]


@dataclass
class MiniBatch:
    """One optimizer step's rows as they cross into a backend.

    Cut into data-parallel shards (rank r: rows r::dp of the mini-batch) and each shard into micro-batches; every
    rank has the same number of micro-batches, a rank with fewer real ones runs dummies (its first row with the
    response mask zeroed) so that collectives line up.  Dummies add nothing to gradients, and their metrics are
    dropped.  Tensors stay on the CPU; the backend moves each micro-batch to its device."""

    micro: list[Optional[list[TrainBatch]]]   # [dp rank] -> its micro-batches; None: not sent to this process
    real: list[int]                           # [dp rank] -> how many of them are real (the rest are dummies)
    loss: MicroLoss                           # critic: called with the (B, L) values and no entropy
    model: str = "actor"                      # the model this mini-batch updates: actor | critic

    def shard(self, rank: int) -> tuple[list[TrainBatch], int]:
        """(micro-batches, real count) of data-parallel rank `rank`."""
        micro = self.micro[rank]
        if micro is None:
            raise ValueError(f"data-parallel rank {rank}'s micro-batches were not sent to this process")
        return micro, self.real[rank]

    def for_rank(self, rank: int) -> "MiniBatch":
        """Only rank `rank`'s micro-batches: what is sent to that rank's process."""
        return replace(self, micro=[m if r == rank else None for r, m in enumerate(self.micro)])


@dataclass(frozen=True)
class StepResult:
    """What an optimizer step reports: the global grad norm before clipping (None: the step was skipped and the
    gradients dropped) and the learning rate of the next step (the LR schedule advances only on taken steps)."""

    grad_norm: Optional[float]
    lr: float
    overflow: bool = False     # float16 loss scaling overflowed: skipped and the scale lowered (not a bad step)

    @property
    def skipped(self) -> bool:
        return self.grad_norm is None


class TrainBackend(Protocol):
    """What the trainer, the sync worker and the one PPO update ask of a training backend: every strategy's
    backend and a data-parallel group of them (train/group.GroupBackend) implement it."""

    data_parallel_size: int     # how many data-parallel shards a mini-batch is cut into (MiniBatch.micro)
    rng: random.Random          # the PPO update's shuffle; saved and restored with the backend's checkpoint
    num_bad_steps: int          # optimizer steps skipped for a non-finite loss or grad norm (checkpointed)
    consecutive_bad_steps: int  # ... in a row; the PPO update counts both, train_step fails past max_bad_steps

    def compute_log_probs(self, batch: TrainBatch, which: str = "actor") -> torch.Tensor: ...

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """(B, L) values of `batch` under the critic (algorithm.adv_estimator=gae), 0 off the response."""
        ...

    def forward_backward(self, mini: MiniBatch) -> dict[str, float]:
        """Zero the gradients of `mini.model` (the actor or the critic), then forward + backward `mini.loss` over
        this backend's micro-batches of `mini` (gradients accumulate); returns the additive actor/* (critic/*)
        metrics of the real micro-batches, summed over the mini-batch (every data-parallel rank, every pipeline
        stage)."""
        ...

    def optimizer_step(self, finite: bool, which: str = "actor") -> StepResult:
        """Clip to the grad_clip of `which` (actor | critic) and step its optimizer and LR schedule, unless
        `finite` is False (the loss or a metric was non-finite) or the global grad norm is: then drop the
        gradients.  Every rank gets the same `finite`, so all ranks take or skip the step together."""
        ...

    def named_parameters_for_sync(self) -> dict[str, torch.Tensor]: ...

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]: ...

    def stream_full_parameters(self, consumer: Optional[Callable[[Any], Any]]) -> Any: ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...


class ShardedTrainBackend(TrainBackend, Protocol):
    """One data-parallel rank's backend under train/group.GroupBackend (strategy torch / fsdp2): it runs its shard
    of each batch with the micro-batch count every rank agreed on, so that the collectives line up."""

    def compute_log_probs(self, batch: TrainBatch, which: str = "actor",
                          num_micro: Optional[int] = None) -> torch.Tensor: ...

    def compute_values(self, batch: TrainBatch, num_micro: Optional[int] = None) -> torch.Tensor: ...

    def compute_rm_scores(self, batch: TrainBatch, num_micro: Optional[int] = None) -> torch.Tensor:
        """(B,) reward-model scores (reward_model.enable, torch / fsdp2 only): `batch` holds the reward model's own
        tokens, one row per response, and a score is its output at the row's last token."""
        ...

    def compute_sum_pi_squared(self, batch: TrainBatch, num_micro: Optional[int] = None) -> torch.Tensor:
        """(B, L) sum_v pi_v^2 per position under the actor (actor.calculate_sum_pi_squared, torch / fsdp2 only)."""
        ...

    def iter_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def build_backend(cfg: FullyAsyncConfig, device: Any, total_optimizer_steps: int) -> TrainBackend:
    from fully_async.core.config import actor_strategy

    strategy = actor_strategy(cfg)
    if strategy in ("torch", "fsdp2"):  # fsdp2: the same backend, sharded over the trainer's process group
        from fully_async.train.backends.torch_backend import TorchBackend
        if strategy == "fsdp2" and RunPlan.of(cfg).trainer_devices == 1:   # verl's fsdp on one bf16 device too
            from fully_async.train.backends.fsdp import join_lone_rank
            join_lone_rank(device)
        return TorchBackend(cfg, device, total_optimizer_steps)
    if strategy == "megatron":
        from fully_async.train.backends.megatron_backend import MegatronBackend
        return MegatronBackend(cfg, device, total_optimizer_steps)
    raise ValueError(f"actor_rollout_ref.actor.strategy={strategy!r} is not one of ['fsdp', 'torch', 'fsdp2', 'megatron']")
