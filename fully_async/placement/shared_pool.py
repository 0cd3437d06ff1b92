"""The driver's side of a device pool (layer 3, the placement package; README "Several jobs on one device pool").

A job whose config names `multi_job.pool` joins the shared Ray cluster in a namespace of its own, finds or creates
the pool's scheduler (the detached actor of device_pool.py), registers and heartbeats from a thread
(device_pool.PoolMembership), and at the end unregisters and has the pool write its timeline.
"""
from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


def pool_ray_args(cfg: Any) -> dict:
    """A job on a shared pool joins the shared cluster in a namespace of its own."""
    from fully_async.placement.device_pool import job_name

    return {"address": cfg.multi_job.ray_address or os.environ["RAY_ADDRESS"],
            "namespace": f"fully_async.{job_name(cfg)}"}


def join_pool(cfg: Any, device: Any) -> Any:
    """Find (or create) the pool actor and register this job (refused: another device count, a live job of the
    same name); its driver heartbeats from now on."""
    import ray

    from fully_async.placement.device_pool import (PoolMembership, get_or_create_pool, job_devices, job_name,
                                                   pool_timeline_path, rollout_devices)
    from fully_async.cluster.ray_utils import RunFailed

    mj = cfg.multi_job
    if device.is_accelerator:
        have = int(ray.cluster_resources().get(device.ray_resource, 0))
        if mj.devices > have:
            raise RunFailed(f"multi_job.devices={mj.devices} but the Ray cluster has {have} {device.ray_resource}")
    pool = get_or_create_pool(mj.pool, mj.devices, mj.max_lease_s, mj.heartbeat_timeout_s, pool_timeline_path(cfg),
                              co_tenancy=mj.co_tenancy)
    membership = PoolMembership(pool, job_name(cfg), mj.devices, mj.heartbeat_timeout_s, mj.max_lease_s)
    leases = (f"devices {job_devices(cfg)}" if cfg.mode == "sync" else
              f"devices {job_devices(cfg)} (trainer) and {rollout_devices(cfg)} (rollout)")
    logger.info("device pool %s: job %s leases %s of %d (timeline: %s)", mj.pool, job_name(cfg), leases,
                membership.info["num_devices"], membership.info["timeline"])
    if membership.info.get("co_tenancy", True) != mj.co_tenancy:
        logger.warning("device pool %s: co_tenancy is %s (set by the job that created it), not this job's "
                       "multi_job.co_tenancy=%s", mj.pool, membership.info.get("co_tenancy"), mj.co_tenancy)
    return membership


def colocate(cfg: Any, device: Any) -> Any:
    """async_training.placement=colocated: the run's trainer devices become a private device pool whose two holders
    are this run's own trainer and rollouter (the same leases, residency and parking as jobs sharing a pool, with
    one tenant per side).  `cfg` (the actors' typed config) is pointed at that pool: both sides lease every trainer
    device, the rollouter gives a wanted lease back at once (its unfinished responses parked) and no lease time limit
    applies (the only other holder is this run's own other side).  Returns the driver's membership."""
    import dataclasses
    import uuid

    from fully_async.placement.device_pool import PoolMembership, get_or_create_pool, job_name
    from fully_async.core.plan import RunPlan

    n = RunPlan.of(cfg).trainer_devices
    mj = cfg.multi_job
    from fully_async.device_memory.policy import PRIVATE_POOL_MARK   # (the engines' memory mode reads it)

    name = f"{job_name(cfg)}{PRIVATE_POOL_MARK}{uuid.uuid4().hex[:8]}"
    cfg.multi_job = dataclasses.replace(mj, pool=name, devices=n, job_devices=list(range(n)),
                                        rollout_devices=list(range(n)), min_slice_s=0.0, max_lease_s=1e9)
    timeline = None
    if cfg.trainer.timeline:   # the turns of both sides on every device, beside the run's own timeline
        from fully_async.telemetry.metrics import tensorboard_dir

        timeline = os.path.abspath(os.path.join(tensorboard_dir(cfg.trainer.project_name, cfg.trainer.experiment_name),
                                                "pool_timeline.json"))
    # its two holders take turns: the placement's point (a side's state goes off when the other one wants the device)
    pool = get_or_create_pool(name, n, 1e9, mj.heartbeat_timeout_s, timeline, detached=False, co_tenancy=False)
    membership = PoolMembership(pool, job_name(cfg), n, mj.heartbeat_timeout_s, 1e9)
    logger.info("colocated async: trainer and rollouter take turns on %d %s device(s) (private pool %s)", n,
                device.name, name)
    membership.owned = pool   # the pool actor lives as long as this run
    return membership


def leave_pool(membership: Any) -> None:
    """Unregister (the leases go back) and have the pool write its timeline as it stands."""
    import ray

    try:
        path = ray.get(membership.pool.write_timeline.remote(), timeout=30)
        if path:
            logger.info("device pool timeline (all jobs): %s", path)
    except Exception as exc:  # noqa: BLE001 - the pool writes it again on its next change
        logger.warning("device pool timeline not written: %s", exc)
    membership.close()
    owned = getattr(membership, "owned", None)
    if owned is not None:
        ray.kill(owned, no_restart=True)
