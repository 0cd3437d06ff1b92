"""Weight sync between processes on the same device: CUDA IPC handles instead of copies through the host.

Colocated async (`async_training.placement=colocated`) runs a trainer rank and an engine on every device, in
different processes.  The object store would copy the weights device -> host -> shared memory -> host ->
device on every update (2-3 s for a 0.5B model on an H200, most of it on the trainer's turn).  Here the trainer
packs its full parameters, cast to the rollout dtype, into one flat buffer per dtype on its device and sends a
`SharedWeights` handle (a few kilobytes: CUDA IPC handles and the layout) through Ray; the rollouter's engine
opens the handles in its own process and copies device to device.  On several devices (one node) every trainer
rank packs the full parameters it gathers (FSDP2 all-gathers each one on every rank) into a buffer on its own
device, and the handles of all ranks travel together (`SharedWeightsByDevice`): each engine opens the one packed on
its own device.

Lifetime.  The trainer keeps its buffers and rewrites them in place at the next push.  That is safe because the
two sides take turns on the device under one lease (placement/shared_pool.py colocate()): the trainer packs (and
synchronises) during its turn, the engine loads during its own turn, and `flush()` waits for the previous load
before a buffer is rewritten.  Validity: both processes must see the same physical device; `open()` checks the
device UUID and refuses otherwise, naming it.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any, Iterable, Optional

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


class SharedWeightsByDevice:
    """The handles of every trainer rank (colocated async on several devices): an engine opens the one packed on
    its own device."""

    def __init__(self, handles: list[SharedWeights]):
        self.handles = handles

    def open(self) -> dict[str, Any]:
        here = _cuda().uuid()
        for handle in self.handles:
            if handle.device_uuid == here:
                return handle.open()
        raise RuntimeError(f"actor_rollout_ref.rollout.weight_sync=device_ipc: no trainer rank packed its weights on "
                           f"this engine's device {here} (ranks' devices: "
                           f"{', '.join(h.device_uuid for h in self.handles)}); colocated async puts an engine beside "
                           "every trainer rank (use object_store otherwise)")


def open_weights(named_tensors: Any) -> Any:
    """What an engine loads: a device-IPC handle (or the handles of every rank) opened in this process, anything else
    as it is."""
    return named_tensors.open() if isinstance(named_tensors, (SharedWeights, SharedWeightsByDevice)) else named_tensors


def views(flat: dict[str, Any], layout: list[tuple[str, str, int, tuple[int, ...]]]) -> dict[str, Any]:
    """Each parameter as a view of its dtype's flat buffer."""
    return {name: flat[dt][off:off + math.prod(shape)].view(shape) for name, dt, off, shape in layout}


def _cuda() -> Any:
    from fully_async.device import get_device

    return get_device("cuda")


class IpcPacker:
    """One rank's side: its full parameters, cast to the rollout dtype (floating point only), packed into one flat
    buffer per dtype on its device; the buffers are rewritten in place at every push, the layout and the IPC handles
    made once, at the first."""

    def __init__(self, dtype: Any):
        self.dtype = dtype
        self._flat: dict[str, Any] = {}          # dtype name -> the packed buffer (reused across pushes)
        self.handle: Optional[SharedWeights] = None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._flat.values())

    def pack(self, params: Iterable[tuple[str, Any]]) -> SharedWeights:
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        params = list(params)
        if self.handle is None:
            sizes: dict[str, int] = {}
            layout = []
            for name, t in params:
                dt = str(self._cast_dtype(t)).replace("torch.", "")
                layout.append((name, dt, sizes.get(dt, 0), tuple(t.shape)))
                sizes[dt] = sizes.get(dt, 0) + t.numel()
            device = params[0][1].device
            with _cuda().classic_segments():   # shareable on every torch, whatever the trainer's allocator maps
                self._flat = {dt: torch.empty(n, dtype=getattr(torch, dt), device=device) for dt, n in sizes.items()}
            self.handle = SharedWeights({dt: reduce_tensor(buf) for dt, buf in self._flat.items()}, layout,
                                        _cuda().uuid(device.index), os.getpid())
        for (name, t), (laid, dt, off, shape) in zip(params, self.handle.layout):
            if name != laid or tuple(t.shape) != shape:
                raise RuntimeError(f"device_ipc weight sync: parameter {name} {tuple(t.shape)} does not match the "
                                   f"layout packed at the first push ({laid} {shape})")
            self._flat[dt][off:off + t.numel()].view(shape).copy_(t.detach())
        _cuda().synchronize()   # packed before the lease can pass to the engine
        return self.handle

    def check_finite(self, version: int) -> None:
        """One pass over each flat buffer; only when it fails, per parameter (to name the one that is not)."""
        import torch

        if not all(bool(torch.isfinite(b).all()) for b in self._flat.values() if b.is_floating_point()):
            check_finite(views(self._flat, self.handle.layout), version)

    def _cast_dtype(self, t: Any) -> Any:
        return self.dtype if t.is_floating_point() else t.dtype


class DeviceIpcWeightSync(PendingLoad):
    """The trainer's side (see the module docstring): `push` packs on every rank and sends the handles, `flush` waits
    for the load.  A backend over several ranks (`pack_shared_weights`: train/group.py) packs on each rank at once
    (the gathers are collectives); rank 0's packer lives here."""

    def __init__(self, backend: Any, rollouter: Any, dtype: Any):
        self.backend = backend
        self.rollouter = rollouter
        self.packer = IpcPacker(dtype)    # the rollout dtype (weights are cast once, when packed)

    def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        out = self.flush()
        if hasattr(self.backend, "pack_shared_weights"):
            handles = self.backend.pack_shared_weights(self.packer)
        else:
            handles = [self.packer.pack(self.backend.iter_full_parameters())]
        self.packer.check_finite(version)   # every rank packed the same full weights: rank 0's copy is checked
        packed = time.perf_counter()
        handle = handles[0] if len(handles) == 1 else SharedWeightsByDevice(handles)
        self._pending = self.rollouter.update_weights.remote(handle, version)
        self._pending_start = packed
        self._pending_bytes = self.packer.nbytes
        out.update({"timing_s/param_sync": time.perf_counter() - start,
                    "timing_s/param_sync/gather": packed - start,
                    "timing_s/param_sync/put": time.perf_counter() - packed})
        return out
