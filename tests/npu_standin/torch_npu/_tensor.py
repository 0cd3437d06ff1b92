"""npu tensors that are PrivateUse1 tensors (FA_NPU_STANDIN_TENSORS=npu, the default on the CUDA backend).

Why: naming PrivateUse1 makes it torch's C++ accelerator (`at::getAccelerator()` prefers a registered PrivateUse1
over CUDA, pytorch/pytorch#161129), and autograd then finds no accelerator stream for a node over CUDA tensors:
any backward over CUDA tensors trips `opt_ready_stream && opt_parent_stream` (engine.cpp).  torch_npu's tensors
are PrivateUse1 tensors, so a stand-in whose npu tensors are CUDA tensors cannot train on a GPU.  Here an npu
tensor is a wrapper subclass on device npu:i holding the backend tensor (`_inner`): every aten op reaches
`__torch_dispatch__` (below autograd), runs on the inner tensors and wraps what comes back, so autograd, the
optimizer and `tensor.device` see npu tensors (streams from the registered PrivateUse1 guard), and the kernels
that run are the backend's.  The backend tensor of an npu tensor: `inner(t)`.  Collectives are given the inner
tensors (_dist.py), `untyped_storage()` is the inner one (FSDP2 frees and refills parameters through it),
`torch.save` writes the plain tensor, and a tensor moved to the host by `param.data = t` / `param.grad = t` reads
device cpu (as a torch_npu tensor so moved is a CPU tensor) until it is moved back.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves, tree_map


class NpuTensor(torch.Tensor):
    _inner: torch.Tensor
    _index: int          # the npu it belongs to
    _on_host: bool       # `param.data = host tensor` moved it to the host (its device reads cpu until moved back)

    @staticmethod
    def __new__(cls, inner: torch.Tensor, index: int = 0) -> "NpuTensor":
        t = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            layout=inner.layout, device=torch.device("npu", index), requires_grad=inner.requires_grad)
        t._inner, t._index, t._on_host = inner, index, False
        return t

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"NpuTensor(npu:{self._index}{', on the host' if self._on_host else ''}, {self._inner!r})"

    @property
    def device(self) -> torch.device:   # type: ignore[override]
        """npu:i, or cpu after `param.data = host tensor` (a torch_npu tensor so moved is a CPU tensor, and code that
        moves it back checks `t.device`, as HostOffload.module_to_device does)."""
        return torch.device("cpu") if self._on_host else torch.device("npu", self._index)

    # what torch refuses on a wrapper subclass but answers for torch_npu's tensors (real tensors with storage)
    def tolist(self) -> Any:
        return self._inner.tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return self._inner.numpy(force=force)

    def data_ptr(self) -> int:
        return self._inner.data_ptr()

    def __reduce_ex__(self, protocol: int) -> Any:
        """torch.save: as the plain tensor it holds, on the host (a checkpoint of torch_npu's tensors loads anywhere
        with map_location, and weights_only loading accepts no tensor subclass)."""
        return self._inner.detach().cpu().__reduce_ex__(protocol)

    def untyped_storage(self) -> Any:   # FSDP2 frees and refills unsharded parameters through it
        return self._inner.untyped_storage()

    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """`param.data = t` (host offload moves parameters so): torch_npu swaps a real tensor's storage, whatever its
        device; a wrapper keeps its type and takes `t`'s backend or host tensor as its inner one."""
        if isinstance(value, NpuTensor):
            torch._C.TensorBase.data.__set__(self, value)
        elif value.shape != self.shape:
            raise RuntimeError(f"NPU stand-in: param.data = a {tuple(value.shape)} tensor on a {tuple(self.shape)} "
                               "npu tensor (only same-shape moves are mapped)")
        self._inner, self._on_host = inner(value), not isinstance(value, NpuTensor)

    @property
    def grad(self) -> Any:   # type: ignore[override]
        g = torch._C.TensorBase.grad.__get__(self)
        return g._inner if isinstance(g, NpuTensor) and g._on_host else g

    @grad.setter
    def grad(self, value: Any) -> None:
        """`param.grad = host tensor` (host offload): kept as an npu tensor over that host memory (autograd checks
        the device a grad is set on) and read back as the host tensor it is, as torch_npu's would be."""
        if value is not None and not isinstance(value, NpuTensor):
            wrapped = NpuTensor(value, self._index)
            wrapped._on_host = True
            value = wrapped
        torch._C.TensorBase.grad.__set__(self, value)

    def __tensor_flatten__(self) -> tuple[list[str], int]:
        return ["_inner"], self._index

    @staticmethod
    def __tensor_unflatten__(inner: dict, index: int, outer_size: Any, outer_stride: Any) -> "NpuTensor":
        return NpuTensor(inner["_inner"], index)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        return _dispatch(func, args, kwargs or {})


_backend: dict[str, Callable[[int], torch.device]] = {}


def install(backend_device: Callable[[int], torch.device]) -> None:
    """`backend_device(i)`: where npu:i's inner tensors live."""
    _backend["device"] = backend_device


def inner(t: Any) -> Any:
    return t._inner if isinstance(t, NpuTensor) else t


def _npu_index(args: tuple, kwargs: dict) -> Any:
    """The npu index an op's results belong to: its npu tensor arguments', or its `device=npu:i`; None when the
    op names another device (`.cpu()`, `.to("cuda")`) or has no npu input."""
    device = kwargs.get("device")
    if device is not None:
        device = torch.device(device)
        return (device.index or 0) if device.type == "npu" else None
    found = [a._index for a in tree_leaves((args, kwargs)) if isinstance(a, NpuTensor)]
    return found[0] if found else None


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    index = _npu_index(args, kwargs)

    def unwrap(x: Any) -> Any:
        if isinstance(x, NpuTensor):
            return x._inner
        if isinstance(x, torch.device) and x.type == "npu":
            return _backend["device"](x.index or 0)
        return x

    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    schema = func._schema
    if schema.returns and all(r.alias_info is not None and r.alias_info.is_write for r in schema.returns):
        # in place / out=: what was written is the caller's npu tensor, returned as itself
        values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
        written = [x for x, a in zip(values, schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        return written[0] if len(written) == 1 else tuple(written)
    if index is None:
        return out
    home = _backend["device"](index)

    def wrap(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, NpuTensor) and x.device == home:
            return NpuTensor(x, index)
        return x

    if (torch.is_inference_mode_enabled() and _is_view(schema) and (base := _first_npu(args)) is not None
            and not base.is_inference()):
        # a view of a normal tensor made under inference mode is a normal tensor sharing its base's version counter
        # (torch's views copy the base's dispatch keys); a wrapper made here would be an inference tensor, on which
        # autograd's view bookkeeping refuses to set that counter (HF's rope indexes its inv_freq buffer so)
        with torch.inference_mode(False):
            return tree_map(wrap, out)
    return tree_map(wrap, out)


def _is_view(schema: Any) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _first_npu(args: tuple) -> NpuTensor | None:
    return next((a for a in tree_leaves(args) if isinstance(a, NpuTensor)), None)


def register_kernels(lib: Any) -> None:
    """aten::empty / empty_strided on PrivateUse1 (every factory and `.to(npu)` allocates through them) return npu
    tensors over backend memory; the copies that reach PrivateUse1 itself (where torch's C++ skips the Python key:
    `torch.tensor(..., device=)` copies through `_copy_from`) run on the inner tensors."""
    def copy_from(self, dst, non_blocking=False):
        inner(dst).copy_(inner(self), non_blocking)
        return dst

    def copy_from_and_resize(self, dst):
        inner(dst).resize_(self.shape).copy_(inner(self))
        return dst

    lib.impl("_copy_from", copy_from, "PrivateUse1")
    lib.impl("_copy_from_and_resize", copy_from_and_resize, "PrivateUse1")

    def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        i = torch.device(device).index or 0
        return NpuTensor(torch.empty(size, dtype=dtype, layout=layout, device=_backend["device"](i),
                                     memory_format=memory_format), i)

    def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
        i = torch.device(device).index or 0
        return NpuTensor(torch.empty_strided(size, stride, dtype=dtype, layout=layout,
                                             device=_backend["device"](i)), i)

    lib.impl("empty.memory_format", empty, "PrivateUse1")
    lib.impl("empty_strided", empty_strided, "PrivateUse1")
