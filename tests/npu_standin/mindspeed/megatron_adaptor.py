"""mindspeed.megatron_adaptor of the stand-in: logs its import, refuses to come after megatron (MindSpeed's
patches would miss modules megatron already bound), and makes the patches of MindSpeed's that megatron-core needs
before it runs on npu tensors:
- `Tensor.type()` names an npu tensor's type as the CUDA one ('torch.npu.BFloat16Tensor' ->
  'torch.cuda.BFloat16Tensor'), which megatron's distributed optimizer and Float16Module check parameters against;
- the gradient norm without apex/Transformer Engine: megatron's local fallback (`local_multi_tensor_l2_norm`) reads
  each norm to the host and returns a tensor on "cuda"; here the norms stay on the gradients' device (rebound
  wherever megatron's modules hold it, as MindSpeed's adaptor patches megatron's functions)."""
import functools
import sys

import torch

from torch_npu import _standin

_standin.log("mindspeed_adaptor", megatron_already_imported="megatron" in sys.modules)
if "megatron" in sys.modules:
    _standin.refuse("mindspeed.megatron_adaptor after megatron", "import order")


def _cuda_type_names(type_fn):
    @functools.wraps(type_fn)
    def type_(self, *args, **kwargs):
        out = type_fn(self, *args, **kwargs)
        if isinstance(out, str) and out.startswith("torch.npu."):
            return "torch.cuda." + out[len("torch.npu."):]
        return out
    return type_


if not getattr(torch.Tensor.type, "_standin_cuda_names", False):
    torch.Tensor.type = _cuda_type_names(torch.Tensor.type)
    torch.Tensor.type._standin_cuda_names = True


def _l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron.core.utils.local_multi_tensor_l2_norm's contract (the l2 norm of every tensor of the lists, as a
    one-element float32 tensor, and None) on the tensors' own device."""
    norms = [torch.linalg.vector_norm(t.float()) for tensors in tensor_lists for t in tensors]
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


try:
    import megatron.core.utils as _megatron_utils
except ImportError:      # no megatron-core here: nothing to patch
    _megatron_utils = None
if _megatron_utils is not None:   # importing megatron.core already bound the fallback where it is used: rebind there
    _local = _megatron_utils.local_multi_tensor_l2_norm
    _megatron_utils.local_multi_tensor_l2_norm = _l2_norm
    for _module in [m for name, m in sys.modules.items() if name.startswith("megatron.")]:
        for _attr in ("l2_norm_impl", "local_multi_tensor_l2_norm"):
            if getattr(_module, _attr, None) is _local:
                setattr(_module, _attr, _l2_norm)
