"""Where actors run (layer 3, the placement package): Ray placement groups for the rollout replicas and the trainer
ranks.

verl's keys, verl's meaning: async mode has `rollout.nnodes x rollout.n_gpus_per_node` rollout devices,
split into K = devices / `actor_rollout_ref.rollout.tensor_model_parallel_size` engine replicas, and
`trainer.nnodes x trainer.n_gpus_per_node` trainer ranks (one device each).  Each replica is one bundle
(its tensor-parallel devices stay on one node) and each trainer rank is one bundle; bundles are PACKed,
so replicas and ranks fill a node before spilling to the next.  Ray reserves a group atomically: either
every bundle fits or the run stops with a message naming what was asked and what the cluster has,
instead of leaving actors pending forever.  On CPU a "device" is one core.  How many replicas and ranks a run has
is its placement's `engine_layout()` / `layout()` (placement/base.py).
"""
from __future__ import annotations

from typing import Any, Optional


def bundle_resources(device: Any, devices: int) -> dict[str, float]:
    res: dict[str, float] = {"CPU": 1}
    if device.is_accelerator:
        res[device.ray_resource] = devices
    return res


_CREATED: list[Any] = []  # groups this driver reserved; released when its run ends (launcher.launch)


def release_placement_groups() -> None:
    """Give back every group this process reserved (they outlive their actors otherwise)."""
    from ray.util.placement_group import remove_placement_group

    while _CREATED:
        pg = _CREATED.pop()
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - Ray already shut down: nothing is held
            pass


def make_placement_group(device: Any, count: int, devices_each: int, what: str, timeout_s: float = 120.0) -> Any:
    """`count` PACKed bundles of `devices_each` devices (+1 CPU); waits until Ray reserved them."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from fully_async.cluster.ray_utils import RunFailed

    bundles = [bundle_resources(device, devices_each) for _ in range(count)]
    total = ray.cluster_resources()
    short = {k: v * count for k, v in bundles[0].items() if v * count > total.get(k, 0)}
    if short:  # can never fit: say so now instead of waiting
        raise RunFailed(f"could not place {what}: {count} bundle(s) of {bundles[0]} need {short} but the Ray "
                        f"cluster has {({k: total.get(k, 0) for k in short})}; lower the device counts "
                        "(trainer.n_gpus_per_node, rollout.n_gpus_per_node) or add nodes")
    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - GetTimeoutError: the cluster cannot hold it
        remove_placement_group(pg)
        raise RunFailed(f"could not place {what}: {count} bundle(s) of {bundles[0]} not available within "
                        f"{timeout_s:.0f}s (cluster has {ray.cluster_resources()}, free "
                        f"{ray.available_resources()}); lower the device counts or add nodes") from exc
    _CREATED.append(pg)
    return pg


def in_bundle(pg: Optional[Any], index: int) -> dict:
    """Actor options that put an actor into bundle `index` of `pg` (nothing when pg is None)."""
    if pg is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=False)}
