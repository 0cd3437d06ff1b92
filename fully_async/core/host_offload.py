"""Offload to page-locked host buffers kept from one offload to the next (the trainer's and the engine's sleep).

`module.to("cpu")` copies into fresh pageable memory every time: a few GB/s, and a new allocation per offload.
A pinned buffer per tensor, allocated at the first offload and reused after, copies at the link's speed in both
directions (and an onload reads it without staging).  Parameters keep their identity (`.data` is swapped, as
`Module.to` does), so optimizers and compiled code that hold them stay valid.  Sharded (DTensor) parameters are
left to `Module.to`: their `.data` is not a plain tensor.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch


def _dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" or hasattr(t, "_local_tensor")


class HostOffload:
    def __init__(self) -> None:
        self.buffers: dict[Any, torch.Tensor] = {}

    def _host(self, key: Any, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            self.buffers[key] = buf
        buf.copy_(t, non_blocking=True)
        return buf

    @staticmethod
    def _tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        yield from module.named_parameters(remove_duplicate=True)
        yield from module.named_buffers(remove_duplicate=True)

    def supports(self, module: torch.nn.Module) -> bool:
        return not any(_dtensor(t) for _, t in self._tensors(module))

    def module_to_host(self, module: torch.nn.Module) -> None:
        """Every parameter, gradient and buffer of `module` into its pinned buffer (Module.to for sharded ones)."""
        if not self.supports(module):
            module.to("cpu")
            return
        for name, t in self._tensors(module):
            if t.device.type == "cpu":
                continue
            t.data = self._host(("m", name), t.data)
            if isinstance(t, torch.nn.Parameter) and t.grad is not None:
                t.grad = self._host(("g", name), t.grad)

    def module_to_device(self, module: torch.nn.Module, device: torch.device) -> None:
        if not self.supports(module):
            module.to(device)
            return
        for _, t in self._tensors(module):
            if t.device != device:
                t.data = t.data.to(device, non_blocking=True)
                if isinstance(t, torch.nn.Parameter) and t.grad is not None:
                    t.grad = t.grad.to(device, non_blocking=True)

    def state_to_host(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's state tensors (moments) into pinned buffers ('step' counters stay where they are)."""
        for i, state in enumerate(optimizer.state.values()):
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                    state[k] = v.to("cpu") if _dtensor(v) else self._host(("o", i, k), v)

    @staticmethod
    def state_to_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        for state in optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and k != "step" and v.device != device:
                    state[k] = v.to(device, non_blocking=True)
