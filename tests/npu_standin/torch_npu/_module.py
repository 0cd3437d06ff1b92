"""`torch.npu` over the backend: the calls torch_npu's device module answers, each mapped onto CPU or CUDA."""
from __future__ import annotations

import contextlib
import time
import types
from typing import Any, Optional

import torch

from torch_npu import _standin, _tensor

_state = {"device": 0}


def _index(device: Any = None) -> int:
    if device is None:
        return _state["device"]
    if isinstance(device, torch.device):
        return device.index if device.index is not None else _state["device"]
    if isinstance(device, str):
        return _index(torch.device(device))
    return int(device)


def backend_device(index: Optional[int] = None) -> torch.device:
    """Where a tensor asked for on npu:index lives."""
    i = _state["device"] if index is None else index
    return torch.device("cuda", _standin.cuda_index(i)) if _standin.BACKEND == "cuda" else torch.device("cpu")


def device_count() -> int:
    return len(_standin.visible_ids())


def is_available() -> bool:
    return device_count() > 0


def set_device(device: Any) -> None:
    i = _index(device)
    if not 0 <= i < device_count():
        raise RuntimeError(f"npu set_device({i}): only {device_count()} NPU(s) visible "
                           f"(ASCEND_RT_VISIBLE_DEVICES={_standin.visible_ids()})")
    _state["device"] = i
    if _standin.BACKEND == "cuda":
        torch.cuda.set_device(_standin.cuda_index(i))
    _standin.log("set_device", index=i, visible=_standin.visible_ids())


def current_device() -> int:
    return _state["device"]


def get_device_name(device: Any = None) -> str:
    return "Ascend910B2 (stand-in on %s)" % _standin.BACKEND


class _CpuEvent:
    """Events on a synchronous backend: recorded work is already done."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._t: Optional[float] = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return 1000.0 * ((end._t or 0.0) - (self._t or 0.0))


def _cpu_members() -> dict[str, Any]:
    """Memory on the CPU backend is the host's: allocated/reserved are reported as 0 (no device pool)."""
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        with open("/proc/meminfo") as fh:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh}
        return info.get("MemAvailable", 0), info.get("MemTotal", 0)

    def get_device_properties(device: Any = None) -> Any:   # torch_npu's: name and total_memory among others
        return types.SimpleNamespace(name=get_device_name(device), total_memory=mem_get_info(device)[1])

    zero = lambda device=None: 0  # noqa: E731
    return dict(
        synchronize=lambda device=None: None, empty_cache=lambda: None, mem_get_info=mem_get_info,
        get_device_properties=get_device_properties,
        memory_allocated=zero, memory_reserved=zero, max_memory_allocated=zero, max_memory_reserved=zero,
        reset_peak_memory_stats=lambda device=None: None, reset_max_memory_allocated=lambda device=None: None,
        memory_stats=lambda device=None: {}, Stream=torch.cpu.Stream, current_stream=torch.cpu.current_stream,
        stream=torch.cpu.stream, default_stream=torch.cpu.current_stream, Event=_CpuEvent,
        manual_seed=lambda seed: None, manual_seed_all=lambda seed: None, seed=lambda: None, seed_all=lambda: None,
        get_rng_state=lambda device="npu": torch.empty(0, dtype=torch.uint8),
        set_rng_state=lambda state, device="npu": None, initial_seed=lambda: torch.initial_seed())


def _cuda_members() -> dict[str, Any]:
    """The CUDA backend: torch.cuda's calls, graphs included (NPUGraph is torch_npu's name for CUDAGraph)."""
    c = torch.cuda
    names = ("synchronize", "empty_cache", "mem_get_info", "memory_allocated", "memory_reserved",
             "max_memory_allocated", "max_memory_reserved", "reset_peak_memory_stats", "reset_max_memory_allocated",
             "memory_stats", "Stream", "current_stream", "stream", "default_stream", "Event", "manual_seed",
             "manual_seed_all", "seed", "seed_all", "get_rng_state", "set_rng_state", "initial_seed",
             "graph", "graph_pool_handle")
    members = {n: getattr(c, n) for n in names}
    members["NPUGraph"] = c.CUDAGraph
    members["get_device_name"] = lambda device=None: "Ascend910B2 (stand-in on %s)" % c.get_device_name(_index(device))
    members["get_device_properties"] = lambda device=None: c.get_device_properties(_standin.cuda_index(_index(device)))
    return members


@contextlib.contextmanager
def _device_ctx(device: Any):
    prev = _state["device"]
    set_device(_index(device))
    try:
        yield
    finally:
        set_device(prev)


def build() -> types.ModuleType:
    """Name PrivateUse1 "npu", register torch.npu and the factory kernels that make npu tensors (PrivateUse1 tensors
    over backend memory, or the backend's own: _standin.TENSORS)."""
    mod = types.ModuleType("torch.npu")
    mod.__dict__.update(
        device_count=device_count, is_available=is_available, set_device=set_device, current_device=current_device,
        get_device_name=get_device_name, device=_device_ctx, is_initialized=lambda: True, _lazy_init=lambda: None,
        _is_in_bad_fork=lambda: False, init=lambda: None, is_bf16_supported=lambda: True)
    mod.__dict__.update(_cuda_members() if _standin.BACKEND == "cuda" else _cpu_members())
    torch.utils.rename_privateuse1_backend("npu")
    torch._register_device_module("npu", mod)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=False)
    _register_factories()
    _register_guard()
    if _standin.TENSORS == "backend":
        _accelerator_is_backend()
    _patch_generator()
    _patch_pinned_empty()
    return mod


def _patch_pinned_empty() -> None:
    """torch.empty(..., pin_memory=True): host memory pinned for the backend (torch_npu pins for the NPU; a Python
    backend cannot register a pinned allocator).  On the CPU backend host memory is the device's: not pinned."""
    empty = torch.empty

    def pinned_empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        out = empty(*args, **kwargs)
        if pin_memory and _standin.BACKEND == "cuda":
            try:  # torch's accelerator here is npu (PrivateUse1, no pinned allocator): name CUDA's
                return out.pin_memory(torch.device("cuda"))
            except (TypeError, RuntimeError) as exc:  # a torch without the argument: pageable, copies synchronous
                _standin.log("pin_memory_unpinned", reason=str(exc)[:200])
        return out

    torch.empty = pinned_empty


def _patch_generator() -> None:
    """torch.Generator(device="npu:i") is a generator of the backend device (torch_npu gives an npu generator);
    isinstance(g, torch.Generator) stays true for every generator."""
    base = torch.Generator

    class _Meta(type(base)):  # type: ignore[misc]
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, base)

    class Generator(base, metaclass=_Meta):  # type: ignore[misc, valid-type]
        def __new__(cls, device: Any = "cpu") -> Any:
            dev = torch.device(device) if not isinstance(device, torch.device) else device
            return base(backend_device(_index(dev)) if dev.type == "npu" else dev)

    torch.Generator = Generator


def _accelerator_is_backend() -> None:
    """torch's device-generic code that places tensors (FSDP2's default mesh) sees the backend the tensors are
    on: with torch_npu it sees npu and npu tensors; here tensors are CPU/CUDA tensors, so it must see those (a
    Python backend cannot register PrivateUse1 hooks with a pinned allocator and device guards)."""
    acc = torch.device("cuda") if _standin.BACKEND == "cuda" else None
    torch._C._get_accelerator = lambda check=False: acc or torch.device("cpu")


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    """torch_npu's hooks, as far as autograd asks them: no npu device holds a primary context (the tensors are
    CUDA's), so a backward stashes no npu streams."""

    def is_available(self) -> bool:
        return True

    def is_built(self) -> bool:
        return True

    def has_primary_context(self, dev_id: int) -> bool:
        return False


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def _register_guard() -> None:
    """A device guard and hooks for PrivateUse1, as torch_npu registers in C++.  Once PrivateUse1 is named, torch's
    C++ accelerator is npu (a registered PrivateUse1 wins over CUDA), and autograd asks the accelerator's guard for
    the streams of a backward over npu tensors -- and, over CUDA tensors, finds none (_tensor.py says why npu tensors
    are PrivateUse1 tensors on the CUDA backend).  A backward over the CPU backend's own tensors touches none."""
    if _standin.BACKEND != "cuda" and _standin.TENSORS == "backend":
        return
    _LIB.extend([_Hooks(), _Guard()])       # kept alive with the registrations
    torch._C._acc.register_python_privateuseone_hook(_LIB[-2])
    torch._C._acc.register_python_privateuseone_device_guard(_LIB[-1])


_LIB: list = []


def _register_factories() -> None:
    """aten::empty / empty_strided on PrivateUse1 return backend tensors (or, with npu tensors, PrivateUse1 tensors
    over them: _tensor.register_kernels): every factory (zeros, full, arange, tensor(..., device=)) and every
    `.to(npu)` (whose copy allocates through empty) ends there."""
    lib = torch.library.Library("aten", "IMPL")
    _LIB.append(lib)  # the registration lives as long as the library object
    if _standin.TENSORS == "npu":
        _tensor.install(backend_device)
        _tensor.register_kernels(lib)
        return

    def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return torch.empty(size, dtype=dtype, layout=layout, device=backend_device(_index(device)),
                           memory_format=memory_format)

    def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
        return torch.empty_strided(size, stride, dtype=dtype, layout=layout, device=backend_device(_index(device)))

    lib.impl("empty.memory_format", empty, "PrivateUse1")
    lib.impl("empty_strided", empty_strided, "PrivateUse1")
