"""torch_npu.profiler's interface (profile, ProfilerActivity with CPU and NPU, tensorboard_trace_handler) over
torch.profiler: NPU activity records the backend's kernels (CUDA's on the CUDA backend; the CPU backend's ops are
host ops).  What the package asked for goes to the stand-in's log."""
from __future__ import annotations

import enum

import torch.profiler as _tp

from torch_npu import _standin


class ProfilerActivity(enum.Enum):
    CPU = "CPU"
    NPU = "NPU"


def tensorboard_trace_handler(dir_name: str, worker_name=None, analyse_flag: bool = True):
    return _tp.tensorboard_trace_handler(dir_name, worker_name)


def profile(activities=None, schedule=None, on_trace_ready=None, record_shapes=False, profile_memory=False,
            with_stack=False, with_flops=False, with_modules=False, experimental_config=None):
    asked = [a.value for a in (activities or list(ProfilerActivity))]
    _standin.log("profiler", activities=asked, record_shapes=record_shapes)
    ours = [_tp.ProfilerActivity.CPU] if "CPU" in asked else []
    if "NPU" in asked and _standin.BACKEND == "cuda":
        ours.append(_tp.ProfilerActivity.CUDA)
    return _tp.profile(activities=ours or [_tp.ProfilerActivity.CPU], schedule=schedule,
                       on_trace_ready=on_trace_ready, record_shapes=record_shapes, profile_memory=profile_memory,
                       with_stack=with_stack, with_flops=with_flops, with_modules=with_modules)
