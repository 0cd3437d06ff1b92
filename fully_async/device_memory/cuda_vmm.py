"""CUDA's virtual memory management, through the driver API (ctypes on libcuda; nothing to compile).

An address range is reserved once; physical memory is created and mapped into it, and later unmapped and released
(given back to the device: another process can use it) while the addresses stay reserved; mapping new physical
memory at the same addresses makes every pointer into the range valid again.  So a device graph captured over
tensors in the range (the embedded engine's decode graphs over its weights and KV cache) replays correctly after a
release and a re-map, with no re-capture.  vLLM's sleep mode does the same through its own C++ allocator
(cumem_allocator.cpp); here only the arenas the engine asks for live in such ranges, through `torch.as_tensor` over
the mapped pointer (`__cuda_array_interface__`), and everything else stays with torch's caching allocator.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any, Optional

import torch

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):   # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):   # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class VmmError(RuntimeError):
    pass


class _Pointer:
    """A device pointer that torch.as_tensor takes as a uint8 tensor (no copy, no ownership)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}


def _load_libcuda() -> ctypes.CDLL:
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda")):
        if name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    raise VmmError("libcuda (the NVIDIA driver library) cannot be loaded")


class CudaVmm:
    """Reserve / map / unmap / free on one CUDA device (`ordinal`, as this process numbers it)."""

    name = "cuda-vmm"

    def __init__(self, ordinal: int, torch_device: torch.device):
        self.lib = _load_libcuda()
        self.torch_device = torch_device
        self._call("cuInit", ctypes.c_uint(0))
        dev = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        self.cu_device = dev.value
        self._ensure_context()
        self.prop = _Prop()
        self.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location = _Location(CU_MEM_LOCATION_TYPE_DEVICE, self.cu_device)
        gran = ctypes.c_size_t()
        self._call("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(self.prop),
                   ctypes.c_int(CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        self.granularity = int(gran.value)
        self.access = _AccessDesc(_Location(CU_MEM_LOCATION_TYPE_DEVICE, self.cu_device),
                                  CU_MEM_ACCESS_FLAGS_PROT_READWRITE)

    def _call(self, fn: str, *args: Any) -> None:
        rc = getattr(self.lib, fn)(*args)
        if rc != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(ctypes.c_int(rc), ctypes.byref(msg))
            raise VmmError(f"{fn} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")

    def _ensure_context(self) -> None:
        """Driver calls need a current context: torch's (the device's primary one), made current on this thread."""
        ctx = ctypes.c_void_p()
        self._call("cuCtxGetCurrent", ctypes.byref(ctx))
        if not ctx.value:
            self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), ctypes.c_int(self.cu_device))
            self._call("cuCtxSetCurrent", ctx)

    def reserve(self, nbytes: int) -> int:
        self._ensure_context()
        ptr = ctypes.c_uint64()
        self._call("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(nbytes), ctypes.c_size_t(0),
                   ctypes.c_uint64(0), ctypes.c_uint64(0))
        return int(ptr.value)

    def map(self, va: int, nbytes: int) -> int:
        """New physical memory of `nbytes` mapped read-write at `va`; returns its handle."""
        self._ensure_context()
        handle = ctypes.c_uint64()
        self._call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(nbytes), ctypes.byref(self.prop),
                   ctypes.c_uint64(0))
        try:
            self._call("cuMemMap", ctypes.c_uint64(va), ctypes.c_size_t(nbytes), ctypes.c_size_t(0), handle,
                       ctypes.c_uint64(0))
        except VmmError:
            self._call("cuMemRelease", handle)
            raise
        self._call("cuMemSetAccess", ctypes.c_uint64(va), ctypes.c_size_t(nbytes), ctypes.byref(self.access),
                   ctypes.c_size_t(1))
        return int(handle.value)

    def unmap(self, va: int, nbytes: int, handle: int) -> None:
        """The physical memory at `va` goes back to the device (the addresses stay reserved)."""
        self._ensure_context()
        self._call("cuMemUnmap", ctypes.c_uint64(va), ctypes.c_size_t(nbytes))
        self._call("cuMemRelease", ctypes.c_uint64(handle))

    def free(self, va: int, nbytes: int) -> None:
        self._call("cuMemAddressFree", ctypes.c_uint64(va), ctypes.c_size_t(nbytes))

    def view(self, va: int, nbytes: int) -> torch.Tensor:
        return torch.as_tensor(_Pointer(va, nbytes), device=self.torch_device)


def cuda_vmm(ordinal: int, torch_device: torch.device) -> tuple[Optional[CudaVmm], str]:
    """(the backend, "") where the driver has VMM, else (None, why not)."""
    try:
        return CudaVmm(ordinal, torch_device), ""
    except (VmmError, AttributeError, OSError) as exc:
        return None, str(exc)
