"""The `hccl` process-group backend over gloo (CPU) / nccl (CUDA), and a guard on the package naming nccl."""
from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torch_npu import _standin


def make_backend(store: Any, rank: int, size: int, timeout: Any) -> Any:
    """What ProcessGroupHCCL is on this backend: a c10d Backend over gloo (CPU) or nccl (CUDA)."""
    timeout = timeout if isinstance(timeout, timedelta) else getattr(timeout, "_timeout", timedelta(minutes=30))
    _standin.log("backend", name="hccl", rank=rank, size=size, over=_standin.BACKEND)
    if _standin.BACKEND == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class _Options:
    """ProcessGroupHCCL.Options: the fields torch_npu binds."""

    def __init__(self) -> None:
        self._timeout = timedelta(minutes=30)
        self.is_high_priority_stream = False
        self.global_ranks_in_group: list[int] = []
        self.group_id = ""
        self.hccl_config: dict = {}


class _ProcessGroupHCCLMeta(type):
    def __call__(cls, store: Any, rank: int, size: int, timeout: Any = timedelta(minutes=30)) -> Any:
        backend = make_backend(store, rank, size, timeout)
        return _InnerTensorGroup(backend) if _standin.TENSORS == "npu" else backend


class _InnerTensorGroup:
    """A process group built as `ProcessGroupHCCL(...)` (the package's weight-sync group) when npu tensors are
    PrivateUse1 tensors: its methods (`broadcast([t], opts)`, ...) are given their backend tensors."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._backend, name)
        return _on_inner_tensors(attr) if callable(attr) else attr


class ProcessGroupHCCL(metaclass=_ProcessGroupHCCLMeta):
    """torch_npu._C._distributed_c10d.ProcessGroupHCCL: (store, rank, size, timeout) or (..., Options)."""
    Options = _Options


def _creator(store: Any, rank: int, size: int, timeout: Any) -> Any:
    return make_backend(store, rank, size, timeout)


def _guard_nccl(fn: Any) -> Any:
    @functools.wraps(fn)
    def guard(*args: Any, **kwargs: Any) -> Any:
        backend = kwargs.get("backend", args[0] if args else None)
        caller = _standin.called_from_package()
        if caller and backend is not None and "nccl" in str(backend).lower():
            _standin.refuse(f"torch.distributed.{fn.__name__}(backend={backend!r})", caller)
        if caller:
            _standin.log("init_process_group", backend=str(backend), caller=caller)
        device_id = kwargs.get("device_id")
        if _standin.BACKEND == "cuda" and getattr(device_id, "type", None) == "npu":
            if _standin.TENSORS == "npu":
                # torch wants device_id of its accelerator (npu) and would bind nccl to it: nccl binds a CUDA
                # device, so the stand-in leaves the binding out (nccl connects at the first collective, on the
                # inner CUDA tensors, whose device the package's set_device made current)
                kwargs.pop("device_id")
            else:   # npu tensors are CUDA tensors, torch's accelerator is CUDA: nccl binds that device
                kwargs["device_id"] = torch.device("cuda", _standin.cuda_index(device_id.index or 0))
        return fn(*args, **kwargs)
    return guard


COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv",
               "isend", "irecv")


def _on_inner_tensors(fn: Any) -> Any:
    """A collective given the backend tensors of npu tensors (PrivateUse1 tensors, _tensor.py): ProcessGroupHCCL
    takes torch_npu's tensors; gloo and nccl take CPU and CUDA ones.  Results land in the npu tensors' memory."""
    from torch.utils._pytree import tree_map

    from torch_npu import _tensor

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*tree_map(_tensor.inner, args), **tree_map(_tensor.inner, kwargs))
    return call


def _unwrap_collectives() -> None:
    import copy

    from torch_npu import _tensor

    for mod in (dist, dist.distributed_c10d):
        for name in COLLECTIVES:
            setattr(mod, name, _on_inner_tensors(getattr(mod, name)))
    batch = dist.batch_isend_irecv

    def batch_isend_irecv(ops: list) -> Any:
        inner_ops = []
        for op in ops:
            op = copy.copy(op)
            op.tensor = _tensor.inner(op.tensor)
            inner_ops.append(op)
        return batch(inner_ops)
    dist.batch_isend_irecv = dist.distributed_c10d.batch_isend_irecv = batch_isend_irecv


def register_hccl() -> None:
    devices = ["npu", "cuda"] if _standin.BACKEND == "cuda" else ["npu", "cpu"]
    if "hccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hccl", _creator, devices=devices)
    dist.is_hccl_available = lambda: True
    if _standin.TENSORS == "npu":
        _unwrap_collectives()
    dist.init_process_group = _guard_nccl(dist.init_process_group)
    dist.new_group = _guard_nccl(dist.new_group)
    if _standin.BACKEND == "cpu" and hasattr(dist, "ProcessGroupNCCL"):
        nccl = dist.ProcessGroupNCCL

        class ProcessGroupNCCL(nccl):  # type: ignore[misc, valid-type]
            def __new__(klass: type, *args: Any, **kwargs: Any) -> Any:
                caller = _standin.called_from_package()
                if caller:
                    _standin.refuse("torch.distributed.ProcessGroupNCCL", caller)
                return nccl(*args, **kwargs)
        dist.ProcessGroupNCCL = ProcessGroupNCCL
