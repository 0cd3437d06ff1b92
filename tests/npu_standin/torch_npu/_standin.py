"""The stand-in's settings, its log, and the torch.cuda poison (CPU backend)."""
from __future__ import annotations

import functools
import json
import os
import sys
import threading
from typing import Any, Callable

BACKEND = os.environ.get("FA_NPU_STANDIN_BACKEND", "cpu")
if BACKEND not in ("cpu", "cuda"):
    raise ImportError(f"FA_NPU_STANDIN_BACKEND={BACKEND!r} is not one of ['cpu', 'cuda']")
# npu tensors: "npu" = PrivateUse1 tensors over backend memory (_tensor.py; what torch_npu makes, and the only kind
# CUDA autograd can train once PrivateUse1 is torch's accelerator), "backend" = the backend's own tensors (faster:
# every op without a Python hop; CPU autograd has no streams to trip on)
TENSORS = os.environ.get("FA_NPU_STANDIN_TENSORS", "npu" if BACKEND == "cuda" else "backend")
if TENSORS not in ("npu", "backend"):
    raise ImportError(f"FA_NPU_STANDIN_TENSORS={TENSORS!r} is not one of ['npu', 'backend']")
NODE_DEVICES = int(os.environ.get("FA_NPU_STANDIN_DEVICES", "2"))
PACKAGE_DIR = os.sep + "fully_async" + os.sep
_lock = threading.Lock()
PROBES = ("is_available",)   # asking whether CUDA exists is fine on an NPU node (the answer there is False)


def visible_ids() -> list[int]:
    """The node's NPU ids this process sees: ASCEND_RT_VISIBLE_DEVICES where set (Ray sets it per actor)."""
    raw = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if raw is None:
        return list(range(NODE_DEVICES))
    return [int(x) for x in raw.split(",") if x.strip() not in ("", "NoDevFiles")]


GPUS = int(os.environ.get("FA_NPU_STANDIN_CUDA_DEVICES", "1"))


def _gpus_of_visible() -> list[int]:
    """The node's GPUs this process's NPUs wrap onto (NPU id modulo the GPU count; several NPUs may share one)."""
    return sorted({i % GPUS for i in visible_ids()})


def cuda_index(npu_index: int) -> int:
    """torch.cuda's index of npu:npu_index (indices into the visible devices on both sides)."""
    gpu = visible_ids()[npu_index] % GPUS
    return _gpus_of_visible().index(gpu) if "ASCEND_RT_VISIBLE_DEVICES" in os.environ else gpu


def _map_cuda_devices() -> None:
    """CUDA backend: show this process the GPUs its visible NPUs wrap onto."""
    if BACKEND == "cuda" and "ASCEND_RT_VISIBLE_DEVICES" in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in _gpus_of_visible())


_map_cuda_devices()


def log(event: str, **fields: Any) -> None:
    path = os.environ.get("FA_NPU_STANDIN_LOG")
    if not path:
        return
    line = json.dumps({"pid": os.getpid(), "event": event, **fields}, default=str)
    with _lock, open(path, "a") as fh:
        fh.write(line + "\n")


def called_from_package(depth: int = 2) -> str:
    """The package file:line that called the function `depth` frames up, or "" when the caller is not ours."""
    frame = sys._getframe(depth)
    name = frame.f_code.co_filename
    return f"{name}:{frame.f_lineno}" if PACKAGE_DIR in name and "npu_standin" not in name else ""


def refuse(what: str, caller: str) -> None:
    log("violation", what=what, caller=caller)
    raise RuntimeError(f"NPU stand-in: the npu path called {what} at {caller} (an NPU node has no CUDA/NCCL)")


def _poisoned(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def guard(*args: Any, **kwargs: Any) -> Any:
        caller = called_from_package()
        if caller:
            refuse(f"torch.cuda.{name}", caller)
        return fn(*args, **kwargs)
    return guard


def poison_cuda() -> None:
    """Every public torch.cuda callable raises when fully_async's own code calls it (torch's internals, which
    probe CUDA on their own, go through)."""
    import torch

    for name in dir(torch.cuda):
        obj = getattr(torch.cuda, name)
        if name.startswith("_") or name in PROBES or isinstance(obj, type(torch)) or not callable(obj):
            continue
        setattr(torch.cuda, name, _poisoned(name, obj) if not isinstance(obj, type) else _poisoned_class(name, obj))


def _poisoned_class(name: str, cls: type) -> Any:
    """Classes (Stream, Event, CUDAGraph) stay classes for isinstance checks; constructing one from the package
    raises."""
    def __new__(klass: type, *args: Any, **kwargs: Any) -> Any:
        caller = called_from_package()
        if caller:
            refuse(f"torch.cuda.{name}", caller)
        return cls(*args, **kwargs)
    try:
        return type(name, (cls,), {"__new__": __new__, "__module__": "torch.cuda"})
    except TypeError:  # a final C class
        return _poisoned(name, cls)
