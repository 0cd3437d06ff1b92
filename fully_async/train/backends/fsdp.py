"""FSDP2 helpers for the torch backend (layer 5): process group, sharding, gathering, checkpoints.

`fully_shard` is applied to every decoder layer and then to the root, so parameters live sharded
across the data-parallel ranks and are all-gathered layer by layer during forward/backward.  With
`fsdp_config.fsdp_size` below the world (verl's hybrid sharding, HSDP) the ranks form groups of that size:
parameters are sharded within a group and replicated across groups (a 2-D device mesh, replicate x shard),
gradients reduce-scattered within a group and all-reduced across groups: the same averaged gradient as full
sharding, more memory per device, less traffic between groups (nodes).  With
`actor.dtype=bfloat16` the master weights stay float32 and compute runs in bf16
(MixedPrecisionPolicy); `fsdp_config.offload_policy` keeps shards in host memory while training (CPUOffloadPolicy,
as verl's key; `param_offload` is the backend's move to host between phases, as verl's).
Works on every comm backend the device layer names: gloo (CPU, what CI runs), nccl, hccl.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist


STORE_TIMEOUT = timedelta(seconds=900)   # ranks >= 1 may still be loading their model when rank 0 is up


def master_store(addr: str, world: int) -> Any:
    """Rank 0's rendezvous store on a port the OS picks and that stays bound from here on: no other process
    (another job on the same node) can take it between choosing the port and binding it.  `.port` is the port
    the other ranks connect to."""
    return dist.TCPStore(addr, 0, world, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)


def arrived_key(rank: int) -> str:
    """The store key rank `rank` sets when it reaches the rendezvous (train/group.await_ranks)."""
    return f"fully_async/arrived/{rank}"


def init_process_group(device: Any, rank: int, world: int, addr: str, port: int, store: Optional[Any] = None) -> None:
    """The trainer's data-parallel world (one process per device) on the device's comm backend.  Rank 0 passes
    its `master_store`; the other ranks connect to it at addr:port."""
    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    if store is None:
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=STORE_TIMEOUT)
        store.set(arrived_key(rank), "1")   # rank 0 watches for these while it checks that the ranks are alive
    kwargs = {"device_id": device.torch_device()} if device.is_accelerator else {}
    dist.init_process_group(device.comm_backend, store=store, rank=rank, world_size=world, **kwargs)


def join_lone_rank(device: Any) -> None:
    """A one-rank world of this process's own (a private store), unless it is in one already: for a one-device
    fsdp2 backend built outside a trainer group (benches, tests), which has no ranks to meet."""
    if not dist.is_initialized():
        store = master_store("127.0.0.1", 1)
        init_process_group(device, 0, 1, "127.0.0.1", store.port, store=store)


_MESHES: dict[tuple[str, int], Any] = {}


def shard_mesh(device_type: str, shard_size: int) -> Optional[Any]:
    """The replicate x shard device mesh of hybrid sharding (shard groups of `shard_size` consecutive ranks), or None
    for full sharding (-1 or the whole world).  Made once per process (the actor, reference and critic share it);
    config_checks has refused a size that does not divide the world."""
    world = dist.get_world_size()
    if shard_size in (-1, world):
        return None
    key = (device_type, shard_size)
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[key] = init_device_mesh(device_type, (world // shard_size, shard_size),
                                        mesh_dim_names=("replicate", "shard"))
    return _MESHES[key]


def shard_model(model: torch.nn.Module, compute_dtype: torch.dtype, offload: bool,
                mesh: Optional[Any] = None, reshard_after_forward: bool = True,
                per_layer: bool = True) -> torch.nn.Module:
    """FSDP2 over the whole world, or hybrid over `mesh` (shard_mesh); `reshard_after_forward=False` keeps each
    layer's gathered weights from its forward to its backward (fsdp_config.reshard_after_forward).  `per_layer`
    False: one group for the whole model (a lone rank that keeps its layers gathered anyway: one gather and one
    set of hooks a micro-batch instead of one per layer)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mesh is not None:
        kwargs["mesh"] = mesh
    if compute_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model) if per_layer else ():
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of a Hugging Face causal LM (`model.model.layers` and kin)."""
    for path in ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return list(obj)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard with FSDP2")


def full_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter; every rank must iterate (all-gather per parameter)."""
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        yield name, full.detach()


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str, name: str = "fsdp") -> None:
    """Model + optimizer with torch.distributed.checkpoint into path/name: each rank writes its own shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(path, name))


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str, name: str = "fsdp") -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.path.join(path, name))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
