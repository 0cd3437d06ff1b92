"""Device memory that can be given back and taken again at the same addresses (layer 0).

An `Arena` is one tag's memory ("<job>/<tenant>/<kind>", e.g. "run/rollout/kv"): a reserved address range,
bump-allocated into chunks of physical memory.  `release()` gives every chunk's physical memory back to the device
(the contents are lost: what must survive is copied out first), `restore()` maps fresh physical memory at the same
addresses (zeroed), so tensors and device graphs that point into the arena stay valid across a release.

Backends: `CudaVmm` (cuda_vmm.py: the CUDA driver's virtual memory management) and `StandIn`, which keeps host
tensors and poisons their bytes on release (every byte 0xFF: a float read of released memory is NaN), so the
bookkeeping, what survives a release and what does not, runs in CI on the CPU and under the NPU stand-in.  On Ascend
the same structure maps onto ACL's aclrtReserveMemAddress / aclrtMallocPhysical / aclrtMapMem, which this package
does not call yet (an NPU engine sleeps as before: `memory_backend` says why).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

ALIGN = 512            # every allocation starts at a multiple of this (any dtype's alignment, cache-line friendly)
MIN_CHUNK = 64 << 20   # small allocations share chunks of at least this size


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class StandIn:
    """Host tensors standing in for device memory: nothing is really given back, but released bytes are poisoned."""

    name = "stand-in"
    granularity = 2 << 20

    def __init__(self, torch_device: Optional[torch.device] = None):
        self.torch_device = torch_device or torch.device("cpu")
        self._next = 1 << 40
        self._storage: dict[int, torch.Tensor] = {}
        self.mapped_bytes = 0

    def reserve(self, nbytes: int) -> int:
        va, self._next = self._next, self._next + round_up(nbytes, self.granularity) + self.granularity
        return va

    def map(self, va: int, nbytes: int) -> int:
        if va not in self._storage:
            self._storage[va] = torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)
        self.mapped_bytes += nbytes
        return va

    def unmap(self, va: int, nbytes: int, handle: int) -> None:
        self._storage[va].fill_(0xFF)
        self.mapped_bytes -= nbytes

    def free(self, va: int, nbytes: int) -> None:
        for key in [k for k in self._storage if va <= k < va + nbytes]:
            del self._storage[key]

    def view(self, va: int, nbytes: int) -> torch.Tensor:
        return self._storage[va][:nbytes]


@dataclass
class _Chunk:
    offset: int
    size: int
    handle: int
    bytes: torch.Tensor   # uint8 view of the whole chunk (valid while mapped)
    used: int = 0


class Arena:
    """One tag's memory in a reserved range of `reserve` bytes (the range is virtual: reserving is free)."""

    def __init__(self, backend: Any, tag: str, reserve: int):
        self.backend, self.tag = backend, tag
        self.reserved = round_up(max(reserve, 1), backend.granularity)
        self.base = backend.reserve(self.reserved)
        self.chunks: list[_Chunk] = []
        self.mapped = True
        self.closed = False

    @property
    def nbytes(self) -> int:
        """Physical bytes this arena holds while mapped."""
        return sum(c.size for c in self.chunks)

    @property
    def held(self) -> int:
        """Physical bytes it holds now (0 while released)."""
        return self.nbytes if self.mapped else 0

    def alloc(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` and `dtype` in this arena, zeroed."""
        if not self.mapped or self.closed:
            raise RuntimeError(f"arena {self.tag}: alloc while released")
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        need = round_up(max(nbytes, 1), ALIGN)
        chunk = self.chunks[-1] if self.chunks else None
        if chunk is None or chunk.used + need > chunk.size:
            offset = chunk.offset + chunk.size if chunk else 0
            size = round_up(need, self.backend.granularity)
            if size < MIN_CHUNK:   # room for the small allocations that follow, within the reserved range
                size = max(size, min(MIN_CHUNK, self.reserved - offset) // self.backend.granularity *
                           self.backend.granularity)
            if offset + size > self.reserved:
                raise MemoryError(f"arena {self.tag}: {offset + size} bytes asked of a {self.reserved}-byte range")
            va = self.base + offset
            with torch.inference_mode(False):   # plain tensors, writable in and out of inference mode
                chunk = _Chunk(offset, size, self.backend.map(va, size), self.backend.view(va, size))
            self.chunks.append(chunk)
        start = chunk.used
        chunk.used += need
        with torch.inference_mode(False):
            out = chunk.bytes[start:start + nbytes].view(dtype).view(shape)
            out.zero_()
        return out

    def release(self) -> int:
        """Give the physical memory back; returns the bytes released."""
        if not self.mapped:
            return 0
        for c in self.chunks:
            self.backend.unmap(self.base + c.offset, c.size, c.handle)
        self.mapped = False
        return self.nbytes

    def restore(self) -> int:
        """Fresh physical memory at the same addresses, zeroed; returns the bytes mapped."""
        if self.mapped:
            return 0
        for c in self.chunks:
            c.handle = self.backend.map(self.base + c.offset, c.size)
            c.bytes.zero_()
        self.mapped = True
        return self.nbytes

    def close(self) -> None:
        """Release and give the address range back (tensors into it must not be used again)."""
        if self.closed:
            return
        self.release()
        self.backend.free(self.base, self.reserved)
        self.closed = True


def memory_backend(device: Any, kind: str = "auto") -> tuple[Optional[Any], str]:
    """The arenas' backend for `device`: (backend, "") or (None, why the engine sleeps the old way).

    kind: "auto" (CUDA's VMM where the driver has it), "vmm" (the same, required), "standin" (StandIn, for tests
    and the NPU stand-in), "none"."""
    if kind == "none":
        return None, "device_memory=none"
    if kind == "standin":
        return StandIn(device.torch_device()), ""
    if kind not in ("auto", "vmm"):
        raise ValueError(f"device memory backend {kind!r} is not one of ['auto', 'vmm', 'standin', 'none']")
    if device.name != "cuda":
        why = ("no device memory to give back on the cpu" if not device.is_accelerator else
               f"{device.name}: re-mappable device memory (ACL's aclrtMapMem) is not wired here yet")
        if kind == "vmm":
            raise ValueError(f"device memory backend 'vmm' is not available: {why}")
        return None, why
    from fully_async.device_memory.cuda_vmm import cuda_vmm

    backend, why = cuda_vmm(device.current_index(), device.torch_device(device.current_index()))
    if backend is None and kind == "vmm":
        raise ValueError(f"device memory backend 'vmm' is not available: {why}")
    return backend, why
