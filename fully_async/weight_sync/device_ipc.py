"""Weight sync between two processes on the same device: CUDA IPC handles instead of copies through the host.

Colocated async on one device (`async_training.placement=colocated`) runs the trainer and the rollouter as two
processes on the same GPU.  The object store would copy the weights device -> host -> shared memory -> host ->
device on every update (2-3 s for a 0.5B model on an H200, most of it on the trainer's turn).  Here the trainer
packs its full parameters, cast to the rollout dtype, into one flat buffer per dtype on its device and sends a
`SharedWeights` handle (a few kilobytes: CUDA IPC handles and the layout) through Ray; the rollouter's engine
opens the handles in its own process and copies device to device.

Lifetime.  The trainer keeps its buffers and rewrites them in place at the next push.  That is safe because the
two sides take turns on the device under one lease (run/shared_pool.py colocate()): the trainer packs (and
synchronises) during its turn, the engine loads during its own turn, and `flush()` waits for the previous load
before a buffer is rewritten.  Validity: both processes must see the same physical device; `open()` checks the
device UUID and refuses otherwise, naming it.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any, Optional

from fully_async.weight_sync.guard import check_finite
from fully_async.weight_sync.object_store import PendingLoad


class SharedWeights:
    """A picklable handle to the trainer's packed weights: {dtype name: reduced CUDA tensor} plus the layout
    (name, dtype name, offset, shape) of every parameter inside its dtype's buffer."""

    def __init__(self, buffers: dict[str, Any], layout: list[tuple[str, str, int, tuple[int, ...]]],
                 device_uuid: str, owner_pid: int):
        self.buffers = buffers
        self.layout = layout
        self.device_uuid = device_uuid
        self.owner_pid = owner_pid

    def open(self) -> dict[str, Any]:
        """The named tensors, as views of the trainer's buffers mapped into this process (no copy)."""
        if os.getpid() == self.owner_pid:
            raise RuntimeError("SharedWeights.open() in the process that packed them: CUDA IPC joins two processes "
                               "(actor_rollout_ref.rollout.weight_sync=device_ipc is for colocated async)")
        here = _cuda().uuid()
        if here != self.device_uuid:
            raise RuntimeError(f"actor_rollout_ref.rollout.weight_sync=device_ipc: the trainer packed its weights on "
                               f"device {self.device_uuid} but this engine runs on {here}; device IPC needs both on "
                               "the same device (use object_store)")
        return views({dt: rebuild(*args) for dt, (rebuild, args) in self.buffers.items()}, self.layout)


def open_weights(named_tensors: Any) -> Any:
    """What an engine loads: a SharedWeights handle opened in this process, anything else as it is."""
    return named_tensors.open() if isinstance(named_tensors, SharedWeights) else named_tensors


def views(flat: dict[str, Any], layout: list[tuple[str, str, int, tuple[int, ...]]]) -> dict[str, Any]:
    """Each parameter as a view of its dtype's flat buffer."""
    return {name: flat[dt][off:off + math.prod(shape)].view(shape) for name, dt, off, shape in layout}


def _cuda() -> Any:
    from fully_async.device import get_device

    return get_device("cuda")


class DeviceIpcWeightSync(PendingLoad):
    """The trainer's side (see the module docstring): `push` packs and sends a handle, `flush` waits for the load."""

    def __init__(self, backend: Any, rollouter: Any, dtype: Any):
        self.backend = backend
        self.rollouter = rollouter
        self.dtype = dtype                       # the rollout dtype (weights are cast once, when packed)
        self._flat: dict[str, Any] = {}          # dtype name -> the packed buffer (reused across pushes)
        self._handle: Optional[SharedWeights] = None

    def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        out = self.flush()
        handle = self._pack()
        self._check_finite(version)
        packed = time.perf_counter()
        self._pending = self.rollouter.update_weights.remote(handle, version)
        self._pending_start = packed
        self._pending_bytes = sum(b.numel() * b.element_size() for b in self._flat.values())
        out.update({"timing_s/param_sync": time.perf_counter() - start,
                    "timing_s/param_sync/gather": packed - start,
                    "timing_s/param_sync/put": time.perf_counter() - packed})
        return out

    def _pack(self) -> SharedWeights:
        """Copy every full parameter (cast to the rollout dtype; floating point only is cast) into the flat
        buffers; the layout and the IPC handles are made once, at the first push."""
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        params = list(self.backend.iter_full_parameters())
        if self._handle is None:
            sizes: dict[str, int] = {}
            layout = []
            for name, t in params:
                dt = str(self._cast_dtype(t)).replace("torch.", "")
                layout.append((name, dt, sizes.get(dt, 0), tuple(t.shape)))
                sizes[dt] = sizes.get(dt, 0) + t.numel()
            device = params[0][1].device
            self._flat = {dt: torch.empty(n, dtype=getattr(torch, dt), device=device) for dt, n in sizes.items()}
            self._handle = SharedWeights({dt: reduce_tensor(buf) for dt, buf in self._flat.items()}, layout,
                                         _cuda().uuid(device.index), os.getpid())
        for (name, t), (laid, dt, off, shape) in zip(params, self._handle.layout):
            if name != laid or tuple(t.shape) != shape:
                raise RuntimeError(f"device_ipc weight sync: parameter {name} {tuple(t.shape)} does not match the "
                                   f"layout packed at the first push ({laid} {shape})")
            self._flat[dt][off:off + t.numel()].view(shape).copy_(t.detach())
        _cuda().synchronize()   # packed before the lease can pass to the engine
        return self._handle

    def _check_finite(self, version: int) -> None:
        """One pass over each flat buffer; only when it fails, per parameter (to name the one that is not)."""
        import torch

        if not all(bool(torch.isfinite(b).all()) for b in self._flat.values() if b.is_floating_point()):
            check_finite(views(self._flat, self._handle.layout), version)

    def _cast_dtype(self, t: Any) -> Any:
        return self.dtype if t.is_floating_point() else t.dtype
