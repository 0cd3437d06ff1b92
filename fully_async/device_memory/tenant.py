"""What a tenant holds on its device, by kind (layer 0): the bytes of groups of tensors, each storage once.

The engine's memory lives in tagged arenas (arena.py); a trainer's lives in torch's allocator, so it is counted from
its tensors instead: `held_bytes({"weights": ..., "grads": ..., "optimizer": ...}, "cuda")`.  A storage shared by
several tensors (views into megatron's contiguous buffers, tied weights) counts once, in the first group naming it;
a DTensor (FSDP2) counts its local shard; a storage resized to 0 (an offloaded megatron buffer) counts 0; tensors
on another device type (offloaded to the host) do not count.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)   # DTensor
    return to_local() if callable(to_local) else t


def held_bytes(groups: dict[str, Iterable[Optional[torch.Tensor]]], device_type: str) -> dict[str, int]:
    """Per group, the bytes its tensors' storages hold on devices of `device_type` (module docstring)."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for name, tensors in groups.items():
        total = 0
        for t in tensors:
            if t is None:
                continue
            t = _local(t)
            if t.device.type != device_type:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
        out[name] = total
    return out


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    """The tensors an optimizer keeps (its moments, steps and masters), not the parameters it updates."""
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value
