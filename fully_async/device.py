"""The one place that knows which accelerator we run on (layer 0).

Ascend NPU, NVIDIA CUDA and plain CPU differ in a handful of names: the torch device module,
the collective backend, the environment variable that limits visible devices and the Ray
resource name.  Everything else in the package asks a `Device` instead of touching
`torch.cuda` or `torch_npu` directly, so adding a platform is a change to this file only.

`torch_npu` is imported here and only when the npu device is requested or probed: with it
installed but CANN missing, importing it fails, and a CPU run must never pay for that.
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import resource
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch


@dataclass(frozen=True)
class Device:
    name: str                   # npu | cuda | cpu
    comm_backend: str           # hccl | nccl | gloo
    visible_devices_env: str    # ASCEND_RT_VISIBLE_DEVICES | CUDA_VISIBLE_DEVICES | ""
    ray_resource: str           # NPU | GPU | "" (cpu needs no accelerator resource)

    @property
    def is_accelerator(self) -> bool:
        return self.name != "cpu"

    def module(self) -> Any:
        """torch.npu / torch.cuda / None."""
        if self.name == "npu":
            _import_torch_npu()
            return torch.npu  # type: ignore[attr-defined]
        if self.name == "cuda":
            return torch.cuda
        return None

    def torch_device(self, index: int = 0) -> torch.device:
        return torch.device("cpu") if self.name == "cpu" else torch.device(self.name, index)

    def set_device(self, index: int = 0) -> None:
        if self.is_accelerator:
            self.module().set_device(index)

    def device_count(self) -> int:
        return self.module().device_count() if self.is_accelerator else 0

    def synchronize(self) -> None:
        if self.is_accelerator:
            self.module().synchronize()

    def uuid(self, index: Optional[int] = None) -> str:
        """The physical identity of device `index` (the current one by default): equal in two processes exactly
        when they use the same device, whatever their visible-device variables number it."""
        mod = self.module()
        return str(mod.get_device_properties(mod.current_device() if index is None else index).uuid)

    def empty_cache(self) -> None:
        if self.is_accelerator:
            self.module().empty_cache()

    def ray_actor_options(self, num_devices: int, num_cpus: float = 1) -> dict:
        """Resources for a Ray actor that drives `num_devices` devices of this kind."""
        opts: dict[str, Any] = {"num_cpus": num_cpus}
        if self.name == "cuda":
            opts["num_gpus"] = num_devices
        elif self.name == "npu":
            opts["resources"] = {self.ray_resource: num_devices}
        return opts

    def attn_implementation(self, packed: bool) -> str:
        """The transformers attention kernel for training here.

        Packed rows (use_remove_padding) need a kernel that attends within each sequence: Ascend's
        fused varlen attention (transformers maps flash_attention_2 onto torch_npu), flash-attn where
        installed, else fully_async's "varlen" (torch's built-in FlashAttention varlen kernel on CUDA,
        per-sequence sdpa on CPU; core/varlen_attention.py)."""
        if not packed:
            return "sdpa"
        if self.name == "npu" or (self.name == "cuda" and importlib.util.find_spec("flash_attn") is not None):
            return "flash_attention_2"
        return "varlen"

    def new_group(self, addr: str, port: int, rank: int, world: int, timeout_s: float = 600.0) -> Any:
        """A process group outside torch.distributed's default world (stateless: its own TCP store).

        Used between trainer rank 0 and the rollout engines, which live in different worlds.  Ray's
        collectives cannot do this on NPU (no HCCL), so we build the group from torch directly."""
        import torch.distributed as dist
        from datetime import timedelta

        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(addr, port, world, is_master=(rank == 0), timeout=timeout)
        if self.name == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            if hasattr(opts, "_timeout"):
                opts._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, world, opts)
        if self.name == "npu":
            _import_torch_npu()
            from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # type: ignore[import-not-found]
            return ProcessGroupHCCL(store, rank, world, timeout)
        return dist.ProcessGroupGloo(store, rank, world, timeout)

    def graphs(self) -> "Optional[DeviceGraphs]":
        """Device-graph capture for this device (CUDA graphs; NPU graphs where torch_npu has them), else None."""
        if not self.is_accelerator:
            return None
        mod = self.module()
        cls = getattr(mod, "CUDAGraph" if self.name == "cuda" else "NPUGraph", None)
        if cls is None or not all(hasattr(mod, n) for n in ("graph", "graph_pool_handle", "Stream", "stream")):
            return None
        # thread_local: device calls of other threads of this process (a Ray actor has several) may go on during a
        # capture; torch_npu's graph takes the same modes (aclmdlRICaptureMode), older ones have no such argument
        local = "capture_error_mode" in inspect.signature(mod.graph).parameters
        return DeviceGraphs(mod, cls, {"capture_error_mode": "thread_local"} if local else {})

    def compile_backend(self) -> Optional[str]:
        """The torch.compile backend that fuses a captured decode step's small kernels on this device, or None
        where we have not measured one that works (inductor needs Triton, which CUDA has; NPU and CPU: None)."""
        if self.name != "cuda":
            return None
        try:
            import triton  # noqa: F401  (inductor's GPU code generator)
        except ImportError:
            return None
        return "inductor"

    def device_name(self, index: int = 0) -> Optional[str]:
        """The accelerator's product name ("NVIDIA H100 80GB HBM3", "Ascend910B2"); None on cpu or none visible."""
        if not self.is_accelerator:
            return None
        mod = self.module()
        return mod.get_device_name(index) if mod.device_count() > index else None

    def compute_capability(self, index: int = 0) -> Optional[tuple[int, int]]:
        """CUDA's (major, minor) of device `index` (9.x: Hopper); None off CUDA or where none is visible."""
        if self.name != "cuda" or self.module().device_count() <= index:
            return None
        return tuple(self.module().get_device_capability(index))

    def total_memory(self, index: int = 0) -> Optional[float]:
        """Bytes of accelerator `index` as its properties state them (asked without a context on it, so the
        driver may ask before any actor holds the device); None on cpu or where none is visible."""
        if not self.is_accelerator:
            return None
        mod = self.module()
        return float(mod.get_device_properties(index).total_memory) if mod.device_count() > index else None

    def runtime_env_vars(self) -> dict[str, str]:
        """Environment every actor of a run gets on this platform (values the user already exported win).

        NPU: HCCL picks its socket ports from a fixed range unless told `auto`, so several processes on one
        NPU (sync mode's colocated trainer rank + engine, a rank's weight-receiving group) collide; verl sets
        the same two variables."""
        if self.name != "npu":
            return {}
        wanted = {"HCCL_HOST_SOCKET_PORT_RANGE": "auto", "HCCL_NPU_SOCKET_PORT_RANGE": "auto"}
        return {k: os.environ.get(k, v) for k, v in wanted.items()}

    def prefer_expandable_segments(self) -> Optional[str]:
        """CUDA, a process that holds a trainer and no engine: torch's allocator maps its memory into segments that grow
        (PyTorch's expandable_segments), so what it reserves stays near what it allocates. Without them the
        packed micro-batches of changing sizes leave cached blocks that fit nothing: 1x H200, seed-003 update,
        37 GiB allocated at most and ~100 GiB held after two steps (from the free memory), which the colocated
        engine could not take back (docs/measurements/engine_slots_async_h200/). Not where the user set
        PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF (theirs wins), not on an NPU or the cpu. Returns what it
        did, for the log, or None."""
        if self.name != "cuda" or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
            return None
        _set_cuda_allocator("expandable_segments:True")
        _EXPANDABLE.append(True)
        return ("the trainer's device allocator uses expandable segments (what it reserves stays near its peak "
                "allocation; set PYTORCH_CUDA_ALLOC_CONF to choose otherwise)")

    @contextlib.contextmanager
    def classic_segments(self) -> Iterator[None]:
        """Inside, this process's allocations come from ordinary (cudaMalloc) segments even where
        `prefer_expandable_segments` turned expandable ones on: what a buffer shared by CUDA IPC needs on every
        torch this package supports (expandable segments can be shared only from torch 2.5 on).  A no-op
        elsewhere."""
        on = self.name == "cuda" and bool(_EXPANDABLE)
        if on:
            _set_cuda_allocator("expandable_segments:False")
        try:
            yield
        finally:
            if on:
                _set_cuda_allocator("expandable_segments:True")

    def pinned_env(self, indices: list[int]) -> dict[str, str]:
        """Environment that shows a process exactly these devices of its node (by the node's numbering), with
        Ray told not to overwrite it: for actors that share devices with other jobs' actors and so request no
        device resource from Ray (a shared device pool, placement/device_pool.py).  Empty on cpu."""
        if not self.is_accelerator:
            return {}
        return {self.visible_devices_env: ",".join(str(i) for i in indices),
                f"RAY_EXPERIMENTAL_NOSET_{self.visible_devices_env}": "1"}

    def memory_stats(self) -> dict[str, float]:
        """Allocated/reserved device memory (GiB) and host RSS (GiB); cpu reports RSS only."""
        stats = {"host_rss_gib": host_rss_gib()}
        if self.is_accelerator:
            mod = self.module()
            stats["allocated_gib"] = mod.memory_allocated() / 2**30
            stats["reserved_gib"] = mod.memory_reserved() / 2**30
            stats["max_allocated_gib"] = mod.max_memory_allocated() / 2**30
            stats["max_reserved_gib"] = mod.max_memory_reserved() / 2**30
            free, total = mod.mem_get_info()
            stats["device_used_gib"] = (total - free) / 2**30   # every process's, and memory outside torch's allocator
        return stats

    def allocator_counts(self) -> dict[str, int]:
        """This process's device allocator so far: segments taken from the driver (`device_mallocs`), given back
        (`device_frees`) and allocations retried after freeing every cached block (`device_alloc_retries`); {} on
        cpu and where the allocator does not count them."""
        if not self.is_accelerator:
            return {}
        stats = self.module().memory_stats()
        names = {"num_device_alloc": "device_mallocs", "num_device_free": "device_frees",
                 "num_alloc_retries": "device_alloc_retries"}
        return {ours: int(stats[theirs]) for theirs, ours in names.items() if theirs in stats}

    def current_index(self) -> int:
        """The index of this process's current device (0 on cpu)."""
        return int(self.module().current_device()) if self.is_accelerator else 0

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of the current device, as its driver counts them (every process's use included);
        on cpu the host's available and total memory (/proc/meminfo)."""
        if self.is_accelerator:
            free, total = self.module().mem_get_info()
            return int(free), int(total)
        return host_memory()

    def memory_room(self) -> tuple[float, float]:
        """(bytes this process could still take, the device's total bytes): on an accelerator its free memory plus
        what this process's allocator already holds (it can reuse that), on cpu the host's available RAM plus this
        process's RSS (over its total RAM)."""
        if self.is_accelerator:
            free, total = self.module().mem_get_info()
            return float(free + self.module().memory_reserved()), float(total)
        return host_available_bytes() + host_rss_gib() * 2**30, host_total_bytes()

    def reset_peak_memory(self) -> None:
        """Start a new max_allocated_gib window (no-op on cpu)."""
        if self.is_accelerator:
            self.module().reset_peak_memory_stats()

    def profiler(self, folder: str, contents: Sequence[str] = ()) -> Any:
        """A profiler of this process's host work and this device's kernels, a context manager whose trace goes to
        `folder` when it stops: torch.profiler's Chrome trace (the CPU; CUDA's kernels too), or on an Ascend NPU
        torch_npu.profiler's (the same interface; it writes its own folder, which MindStudio Insight reads).
        `contents`, as verl's profiler tool_config contents: the device's kernels ("cuda" / "npu") and the host's
        operators always unless others are named, "shapes", "memory", "stack" (and on an NPU "module") when named."""
        wanted = set(contents)
        device_kernels = not wanted or bool(wanted & {"cuda", "npu"})   # either name: this device's kernels
        if self.name == "npu":
            _import_torch_npu()
            import torch_npu.profiler as prof

            kernels = [prof.ProfilerActivity.NPU] if device_kernels else []
            extra = {"with_modules": "module" in wanted}
        else:
            prof = torch.profiler
            kernels = [prof.ProfilerActivity.CUDA] if self.name == "cuda" and device_kernels else []
            extra = {}
        return prof.profile(activities=[prof.ProfilerActivity.CPU] + kernels,
                            on_trace_ready=prof.tensorboard_trace_handler(folder), record_shapes="shapes" in wanted,
                            profile_memory="memory" in wanted, with_stack="stack" in wanted, **extra)


class DeviceGraphs:
    """Captures a function's kernels once and replays them: one launch per call instead of one per kernel.

    A captured function must only read and write tensors that outlive the graph at fixed addresses (its
    inputs and outputs are such buffers, updated in place); every graph of one `DeviceGraphs` shares one
    memory pool, so capture the largest first and replay one at a time."""

    def __init__(self, module: Any, graph_cls: Any, capture_kwargs: Optional[dict] = None):
        self.module, self.graph_cls, self.capture_kwargs = module, graph_cls, capture_kwargs or {}
        # a graph may draw from a torch.Generator of the caller's (each replay then advances it) where the graph
        # class registers generators (CUDA's does); where it cannot, callers keep their random draws outside graphs
        self.rng = hasattr(graph_cls, "register_generator_state")
        self.pool = module.graph_pool_handle()
        # one warm-up stream for every capture: cuBLAS keeps a workspace per (handle, stream) in the caching
        # allocator, so a fresh stream per capture kept ~20 MB per graph alive (1.1 GiB for 56 graphs, 1x H100)
        self.side = module.Stream()

    def capture(self, fn: Callable[[], None], warmup: int = 1, generators: tuple = ()) -> Callable[[], None]:
        """Run `fn` `warmup` times on a side stream (library handles, autotuning), capture it, return replay.
        `generators`: the torch.Generators `fn` draws from (only where `rng`)."""
        mod = self.module
        side = self.side
        side.wait_stream(mod.current_stream())
        with mod.stream(side):
            for _ in range(warmup):
                fn()
        mod.current_stream().wait_stream(side)
        graph = self.graph_cls()
        for generator in generators:
            graph.register_generator_state(generator)
        with mod.graph(graph, pool=self.pool, **self.capture_kwargs):
            fn()
        return graph.replay


_EXPANDABLE: list[bool] = []   # this process turned the CUDA allocator's expandable segments on


def _set_cuda_allocator(setting: str) -> None:
    # torch 2.11 moved the setter (the old name still works there, with a warning)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(setting)


NPU = Device("npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", "NPU")
CUDA = Device("cuda", "nccl", "CUDA_VISIBLE_DEVICES", "GPU")
CPU = Device("cpu", "gloo", "", "")
_BY_NAME = {d.name: d for d in (NPU, CUDA, CPU)}


class DeviceError(RuntimeError):
    pass


def _import_torch_npu() -> None:
    try:
        import torch_npu  # noqa: F401
    except Exception as exc:  # ImportError, or OSError when CANN's libraries are missing
        raise DeviceError(
            "trainer.device=npu needs torch_npu with Huawei CANN: install `pip install fully_async[npu]` "
            "matching your torch version and `source /usr/local/Ascend/ascend-toolkit/set_env.sh` "
            f"(import torch_npu failed: {exc})") from exc


_NPU_CAUSAL_MASKS: dict = {}


def npu_packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                                cu_k: torch.Tensor, scale: float) -> torch.Tensor:
    """torch_npu's fused attention over a packed batch (core/varlen_attention.py's NPU kernel): q (T, Hq, D), k/v
    (S, Hkv, D) in layout TND, grouped kv heads as they are; sparse_mode 3, causal aligned to each sequence's bottom
    right, with the 2048 x 2048 mask that mode takes (as transformers' Ascend flash_attention_2 calls it); the
    sequences' end offsets as host lists, as torch_npu wants them."""
    import torch_npu  # type: ignore[import-not-found]

    mask = _NPU_CAUSAL_MASKS.get(q.device)
    if mask is None:
        mask = _NPU_CAUSAL_MASKS[q.device] = torch.ones(2048, 2048, dtype=torch.bool, device=q.device).triu(1)
    return torch_npu.npu_fusion_attention(q, k, v, q.shape[1], "TND", atten_mask=mask, scale=scale,
                                          actual_seq_qlen=cu_q[1:].tolist(), actual_seq_kvlen=cu_k[1:].tolist(),
                                          sparse_mode=3)[0]


def npu_available() -> bool:
    """True when torch_npu is installed, imports, and sees at least one NPU."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        _import_torch_npu()
        return torch.npu.is_available()  # type: ignore[attr-defined]
    except DeviceError:
        return False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def get_device(name: str = "auto") -> Device:
    """Resolve `trainer.device`: auto picks npu > cuda > cpu; an explicit accelerator must exist."""
    if name == "auto":
        if npu_available():
            return NPU
        return CUDA if cuda_available() else CPU
    if name not in _BY_NAME:
        raise DeviceError(f"trainer.device={name!r} is not one of ['auto', 'npu', 'cuda', 'cpu']")
    return _BY_NAME[name]


def check_available(device: Device) -> None:
    """Fail early (on the driver) when an explicitly requested accelerator cannot be used."""
    if device.name == "npu":
        _import_torch_npu()
    elif device.name == "cuda" and not cuda_available():
        raise DeviceError("trainer.device=cuda but torch sees no CUDA device "
                          f"(torch {torch.__version__}; check the driver and CUDA_VISIBLE_DEVICES)")


def describe_hardware(device: Device) -> str:
    """One line naming the hardware, for reports ("2x NVIDIA H100 80GB HBM3", "CPU: ... (2 cores)")."""
    if device.is_accelerator:
        mod = device.module()
        count = mod.device_count()
        name = mod.get_device_name(0) if count else "none visible"
        return f"{count}x {name}"
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:
        pass
    return f"CPU: {model or 'unknown'} ({os.cpu_count()} cores)"


def host_rss_gib() -> float:
    """Current resident set size of this process in GiB (falls back to peak RSS)."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _meminfo(field: str) -> float:
    """A /proc/meminfo field in bytes (Linux); the physical pages otherwise."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def host_available_bytes() -> float:
    """The host's RAM a new allocation can take without swapping (MemAvailable)."""
    return _meminfo("MemAvailable")


def host_total_bytes() -> float:
    return _meminfo("MemTotal")


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory (MemAvailable / MemTotal)."""
    return int(host_available_bytes()), int(host_total_bytes())


def parse_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
