"""A test-only stand-in for Huawei's `torch_npu`: `torch.npu` over a backend we have (CPU in CI, CUDA on a GPU box).

Never installed with the package and never imported outside tests: tests put tests/npu_standin on sys.path (and on
the PYTHONPATH of the processes and Ray workers of the run they launch, tests/npu_standin_env.py).  Importing it
does what importing torch_npu does, as far as the package can tell:

* the PrivateUse1 backend is named "npu", `torch.npu` is registered (device count, set_device, memory stats,
  synchronize, streams, events, and graphs where the backend has them), so `torch.device("npu", i)` parses;
  tensors asked for on an npu device are PrivateUse1 tensors over backend memory, as torch_npu's are (_tensor.py;
  FA_NPU_STANDIN_TENSORS=npu, the default on the CUDA backend, where autograd cannot train CUDA tensors once
  PrivateUse1 is torch's accelerator), or the backend's own tensors (FA_NPU_STANDIN_TENSORS=backend, the default on
  CPU: no Python hop per op), so a model `.to("npu:0")` runs on CPU/CUDA kernels;
* a process-group backend named `hccl` (over gloo on CPU, nccl on CUDA), `torch.distributed.is_hccl_available`
  and `torch_npu._C._distributed_c10d.ProcessGroupHCCL` with the constructors torch_npu binds
  (store, rank, size, timeout) and (store, rank, size, options);
* `npu_fusion_attention` (BSND and TND layouts, the causal sparse modes transformers uses) over torch's sdpa;
* `ASCEND_RT_VISIBLE_DEVICES` limits the visible devices, as on a node (on CUDA it picks the GPUs).

Environment: FA_NPU_STANDIN_BACKEND=cpu|cuda (default cpu); FA_NPU_STANDIN_TENSORS=npu|backend (above);
FA_NPU_STANDIN_DEVICES: NPUs of the node (default 2);
FA_NPU_STANDIN_CUDA_DEVICES: GPUs the npu ids wrap onto on the CUDA backend (default 1);
FA_NPU_STANDIN_LOG: a file each process appends JSON lines to (what it saw: visible devices, set_device, the
collective backends it built, any torch.cuda / nccl the package called).  On the CPU backend torch.cuda is
poisoned for the package: a call from fully_async's code to any torch.cuda function raises (and is logged), and so
does asking torch.distributed for nccl."""
from __future__ import annotations

import os
import sys

from torch_npu import _standin  # noqa: F401  (sets CUDA_VISIBLE_DEVICES before anything touches CUDA)

import torch

from torch_npu import _attention, _dist, _module, profiler  # noqa: F401 (torch_npu.profiler, as torch_npu's)

__version__ = "2.10.0.post4+standin"

npu_fusion_attention = _attention.npu_fusion_attention
npu = _module.build()
_dist.register_hccl()
_standin.log("import", ASCEND_RT_VISIBLE_DEVICES=os.environ.get("ASCEND_RT_VISIBLE_DEVICES"),
             backend=_standin.BACKEND, argv0=os.path.basename(sys.argv[0]) if sys.argv else "")
if _standin.BACKEND == "cpu":
    _standin.poison_cuda()
del torch
