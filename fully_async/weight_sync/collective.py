"""Weight sync by collective broadcast: trainer rank 0 -> every rollout engine, bucketed.

Why: the object-store path copies every weight through host memory and Ray's object store twice;
a broadcast moves device memory to device memory (NCCL on CUDA, HCCL on NPU, gloo on CPU) and
never materialises the full model on the host.  The group is stateless (its own TCP store,
fully_async.device.Device.new_group) because the trainer's FSDP world and the engines are
different processes and worlds.

Who receives: the trainer asks the rollouter how many ranks it contributes.  An engine that
receives itself (engines.base.DirectWeightReceiver: every vLLM worker, one rank per TP/PP rank)
makes the world 1 + its worker count, and each worker loads the buckets into its own model;
otherwise the rollouter actor is the single rank 1 and hands its engine the received stream.

Protocol, per update: the sender publishes the parameter list (name, shape, dtype) once, groups
it into buckets of `update_weights_bucket_megabytes`, gathers full parameters (all FSDP ranks
take part), packs each bucket into one flat tensor of the rollout dtype and broadcasts it.  The
receiver posts the broadcast of bucket k+1 before it loads bucket k into its engine, so transfer
and load overlap.  The object-store path stays as the fallback (`rollout.weight_sync=object_store`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from fully_async.weight_sync.guard import finite_stream


@dataclass
class ParamMeta:
    name: str
    shape: tuple[int, ...]
    numel: int


def plan_buckets(metas: list[ParamMeta], bucket_bytes: int, elem_bytes: int) -> list[list[int]]:
    """Consecutive parameters grouped so each bucket stays under bucket_bytes (one may exceed alone)."""
    buckets: list[list[int]] = [[]]
    size = 0
    for i, m in enumerate(metas):
        nbytes = m.numel * elem_bytes
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return [b for b in buckets if b]


def _broadcast(pg: Any, tensor: torch.Tensor) -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([tensor], opts)


def send(pg: Any, params: Iterator[tuple[str, torch.Tensor]], metas: list[ParamMeta], buckets: list[list[int]],
         dtype: torch.dtype) -> int:
    """Rank 0 of the weight group: pack and broadcast; returns bytes sent.  `params` yields in meta order."""
    sent = 0
    it = iter(params)
    for bucket in buckets:
        parts = []
        for i in bucket:
            name, tensor = next(it)
            if name != metas[i].name:
                raise RuntimeError(f"weight order changed: expected {metas[i].name}, got {name}")
            parts.append(tensor.to(dtype).reshape(-1))
        flat = torch.cat(parts)
        _broadcast(pg, flat).wait()
        sent += flat.numel() * flat.element_size()
    return sent


def receive(pg: Any, metas: list[ParamMeta], buckets: list[list[int]], dtype: torch.dtype,
            device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) as buckets arrive; the next bucket is in flight while one is consumed."""

    def post(k: int) -> tuple[torch.Tensor, Any]:
        buf = torch.empty(sum(metas[i].numel for i in buckets[k]), dtype=dtype, device=device)
        return buf, _broadcast(pg, buf)

    pending = post(0) if buckets else None
    for k in range(len(buckets)):
        buf, work = pending
        work.wait()
        if k + 1 < len(buckets):
            pending = post(k + 1)
        offset = 0
        for i in buckets[k]:
            m = metas[i]
            yield m.name, buf[offset:offset + m.numel].view(m.shape)
            offset += m.numel


class CollectiveWeightSync:
    """Trainer side: owns the group's rank 0 and drives one broadcast per weight update."""

    def __init__(self, backend: Any, rollouter: Any, device: Any, bucket_mb: int, dtype: torch.dtype):
        self.backend = backend
        self.rollouter = rollouter
        self.device = device
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.dtype = dtype
        self.pg = None
        self.metas: list[ParamMeta] = []
        self.buckets: list[list[int]] = []

    def _connect(self) -> None:
        import ray

        from fully_async.cluster.network import free_port, node_ip

        addr, port = node_ip(), free_port()
        world = 1 + ray.get(self.rollouter.weight_receivers.remote())
        joined = self.rollouter.init_weight_group.remote(addr, port, 1, world)
        self.pg = self.device.new_group(addr, port, 0, world)
        ray.get(joined)
        self.metas = [ParamMeta(n, tuple(s), int(torch.Size(s).numel())) for n, s in self.backend.param_shapes()]
        elem = torch.empty(0, dtype=self.dtype).element_size()
        self.buckets = plan_buckets(self.metas, self.bucket_bytes, elem)

    def flush(self) -> dict[str, float]:
        """Pushes complete before push() returns (the trainer takes part in the broadcast)."""
        return {}

    def push(self, version: int) -> dict[str, float]:
        """Gather parameters and send them bucket by bucket."""
        import ray

        if self.pg is None:
            self._connect()
        start = time.perf_counter()
        done = self.rollouter.receive_weights.remote(self.metas, self.buckets, str(self.dtype), version)
        nbytes = self.backend.stream_full_parameters(
            lambda params: send(self.pg, finite_stream(params, version), self.metas, self.buckets, self.dtype))
        timings = ray.get(done)
        total = time.perf_counter() - start
        out = {f"timing_s/param_sync/{k}": v for k, v in timings.items()}
        out.update({"timing_s/param_sync": total, "perf/param_sync_gbps": nbytes / 1e9 / max(total, 1e-9),
                    "perf/param_sync_buckets": len(self.buckets)})
        return out
