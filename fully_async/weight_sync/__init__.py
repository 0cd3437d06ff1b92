"""How the trainer's weights reach the rollout engines (layer 4): one file per transport -- object store, collective
broadcast (NCCL / HCCL / gloo), device IPC, in-process for the colocated sync loop and elastic's engines.  Which one
a run takes is its placement's `weight_sync_route` (fully_async/placement/).  It imports core, the domain packages,
cluster and placement; rollout/, train/ and the actors import it."""
from typing import Any

from fully_async.weight_sync.local import ElasticWeightSync, LocalWeightSync
from fully_async.weight_sync.object_store import ObjectStoreWeightSync


def build_weight_sync(cfg: Any, backend: Any, rollouter: Any, device: Any) -> Any:
    """The route of the run's placement (`Placement.weight_sync_route`; actor_rollout_ref.rollout.weight_sync when
    named).  auto = device_ipc for colocated async on the CUDA devices of one node
    with the embedded engine (CUDA IPC handles, no copy through the host; on several devices every trainer rank packs
    on its own device and each engine opens the one beside it: 0.02 s to pack and 0.005 s to load an update, 0.5B
    shape, 1x H100; a 0.034 s switch per step on 2x H200, where the object store took ~10 s per update on 2x H100),
    else collective on accelerators, object store on CPU and on a shared device pool (multi_job.pool, colocated
    async on other accelerators included: the rollouter takes an update while it waits for its lease and loads it at
    its next turn, which a collective cannot wait for)."""
    from fully_async.placement import placement_of

    rollout = cfg.actor_rollout_ref.rollout
    kind = placement_of(cfg).weight_sync_route(device)   # the placement says which route applies
    if kind == "local":
        raise ValueError("mode=sync loads each rank's weights into the engine beside it (LocalWeightSync): there is "
                         "no rollouter to send them to")
    if kind == "device_ipc":
        from fully_async.device import parse_dtype
        from fully_async.weight_sync.device_ipc import DeviceIpcWeightSync
        return DeviceIpcWeightSync(backend, rollouter, parse_dtype(rollout.dtype))
    if kind == "collective":
        from fully_async.device import parse_dtype
        from fully_async.weight_sync.collective import CollectiveWeightSync
        return CollectiveWeightSync(backend, rollouter, device, rollout.update_weights_bucket_megabytes,
                                    parse_dtype(rollout.dtype))
    return ObjectStoreWeightSync(backend, rollouter)


__all__ = ["ElasticWeightSync", "LocalWeightSync", "ObjectStoreWeightSync", "build_weight_sync"]
