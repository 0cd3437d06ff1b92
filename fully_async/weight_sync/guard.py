"""No non-finite weight reaches a rollout engine.

Why here: every transport (object store, collective broadcast, in-process) passes the trainer's parameters through
this check on their way out, so one rule covers all of them.  A NaN or inf weight (a learning rate far too high,
an optimizer that diverged) would otherwise surface as the rollouter's "probability tensor contains nan", far from
its cause; the trainer fails instead, naming the parameter and the version it was about to push."""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import torch


class NonFiniteWeights(RuntimeError):
    """The trainer's parameters hold NaN or inf: the push is refused."""


def check_tensor(name: str, tensor: torch.Tensor, version: int) -> None:
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise NonFiniteWeights(
            f"refusing to push param version {version} (the weights of the trainer step that made it) to the rollout "
            f"engines: parameter {name} has {bad} non-finite values of {tensor.numel()}.  Training diverged: lower "
            "actor_rollout_ref.actor.optim.lr, set actor_rollout_ref.actor.grad_clip, and resume from the last "
            "checkpoint")


def check_finite(named: Mapping[str, torch.Tensor], version: int) -> None:
    for name, tensor in named.items():
        check_tensor(name, tensor, version)


def finite_stream(params: Iterable[tuple[str, Any]], version: int) -> Iterator[tuple[str, Any]]:
    """`params` as they come, each checked before it is passed on (the streaming transports)."""
    for name, tensor in params:
        check_tensor(name, tensor, version)
        yield name, tensor
