"""The config rules of placement (layer 0; part of the one validation pass of core/config_checks.py): which
devices each side gets, which placements a config's engine and trainer allow, the shared device pool's keys, and
whether device IPC weight sync applies.  They sit in core, not in fully_async/placement/ (layer 3), because the
validation pass runs before anything above core is imported, and the planner's command asks `placement_refusal`;
the placement objects (fully_async/placement/) ask them too, so each rule is written once."""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

from fully_async.core.algorithm_checks import _at_least, _choice
from fully_async.core.config import PLACEMENTS, ConfigError
from fully_async.core.plan import RunPlan

logger = logging.getLogger(__name__)


def check_placement(cfg: Any) -> None:
    """async_training.placement: one of PLACEMENTS, a placement of mode=async, and the devices it needs."""
    at = cfg.async_training
    _choice("async_training.placement", at.placement, PLACEMENTS)
    if at.placement != "split" and cfg.mode != "async":
        raise ConfigError("async_training.placement", f"{at.placement!r} is a placement of mode=async (mode=sync "
                          "always colocates its engines with the trainer ranks)")
    rollout_devices = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
    if at.placement == "colocated" and cfg.mode == "async" and rollout_devices:
        raise ConfigError("async_training.placement", "colocated runs every engine on the trainer's devices: set "
                          f"rollout.n_gpus_per_node=0 (now rollout.nnodes x n_gpus_per_node = {rollout_devices})")
    if at.placement == "elastic" and cfg.mode == "async":
        check_elastic(cfg)


def check_rollout_devices(cfg: Any) -> None:
    """rollout.*: the rollout side's device counts (colocated async has none of its own) and run lengths."""
    r = cfg.rollout
    colocated = cfg.mode == "async" and cfg.async_training.placement == "colocated"
    _at_least("rollout.nnodes", r.nnodes, 1)
    # colocated async has no rollout devices of its own (0); split and elastic need at least one
    _at_least("rollout.n_gpus_per_node", r.n_gpus_per_node, 0 if colocated else 1)
    if r.total_rollout_steps is not None:
        _at_least("rollout.total_rollout_steps", r.total_rollout_steps, 1)
    if getattr(r, "total_epochs", None) is not None:
        _at_least("rollout.total_epochs", r.total_epochs, 1)


def check_elastic(cfg: Any) -> None:
    """placement=elastic: an embedded engine beside every trainer rank, on that rank's device, loading that rank's
    parameters in its process and lent to the rollout pool while the trainer waits; the trainer stays on its
    devices meanwhile."""
    rollout, fsdp = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor.fsdp_config
    if rollout.name == "vllm":
        raise ConfigError("actor_rollout_ref.rollout.name", "vllm: placement=elastic lends an embedded engine beside "
                          "each trainer rank (it loads the rank's weights in its own process); use hf (or an "
                          "embedded engine class 'package.module:Class'), or placement=split / colocated with vllm")
    tp = rollout.tensor_model_parallel_size
    if tp > 1:
        raise ConfigError("actor_rollout_ref.rollout.tensor_model_parallel_size", f"{tp}: placement=elastic runs one "
                          "engine per trainer device (and on the rollout devices the same engine); use 1")
    for key in ("param_offload", "optimizer_offload"):
        if getattr(fsdp, key):
            raise ConfigError(f"actor_rollout_ref.actor.fsdp_config.{key}", "true: with placement=elastic the trainer "
                              "stays on its devices while their engines generate (the engines sleep while it trains); "
                              "set it false, or use placement=colocated, which offloads between turns")
    from fully_async.core.config import actor_strategy

    if actor_strategy(cfg) == "megatron":
        raise ConfigError("actor_rollout_ref.actor.strategy", "megatron: placement=elastic has each trainer rank's "
                          "engine load that rank's full parameters, which megatron ranks do not hold; use fsdp/fsdp2 "
                          "or torch, or placement=split")
    if cfg.multi_job.pool is not None:
        raise ConfigError("multi_job.pool", f"{cfg.multi_job.pool!r}: placement=elastic lends this run's own trainer "
                          "devices to its rollouter; on a device pool shared with other jobs use placement=split")


def check_multi_job(cfg: Any) -> None:
    """multi_job.*: only checked when a pool is named (off by default); the Ray address must be known here,
    so a job without a shared cluster fails before loading anything."""
    mj = cfg.multi_job
    if mj.pool is None:
        return
    import re

    if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(mj.pool)):
        raise ConfigError("multi_job.pool", f"{mj.pool!r}: use letters, digits, '_', '.', '-'")
    if mj.job_name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", str(mj.job_name)):
        raise ConfigError("multi_job.job_name", f"{mj.job_name!r}: use letters, digits, '_', '.', '-'")
    _at_least("multi_job.devices", mj.devices, 1)
    _at_least("multi_job.max_lease_s", mj.max_lease_s, 0.0, strict=True)
    _at_least("multi_job.heartbeat_timeout_s", mj.heartbeat_timeout_s, 0.0, strict=True)
    _at_least("multi_job.min_slice_s", mj.min_slice_s, 0.0)
    if mj.device_memory_gib is not None:
        _at_least("multi_job.device_memory_gib", mj.device_memory_gib, 0.0, strict=True)
    if mj.co_tenancy and cfg.mode == "async":
        logger.info("multi_job.co_tenancy=true shares a device between sync jobs whose measured memory fits "
                    "together; this async job's rollout and train sides lease their devices alone")
    plan = RunPlan.of(cfg)
    world = plan.trainer_devices
    from fully_async.device import get_device

    logical = not get_device(cfg.trainer.device).is_accelerator   # on CPU pool devices are labels only
    if cfg.trainer.nnodes != 1 or (cfg.mode == "async" and cfg.rollout.nnodes != 1):
        key = "trainer.nnodes" if cfg.trainer.nnodes != 1 else "rollout.nnodes"
        raise ConfigError(key, "a device pool is one node's devices: use 1")
    if cfg.mode == "sync" and mj.rollout_devices is not None:
        raise ConfigError("multi_job.rollout_devices", "is for mode=async (a sync job's engines sit on its "
                          "multi_job.job_devices): unset it")
    if cfg.mode == "sync" and mj.job_devices is None and not logical and world != mj.devices:
        raise ConfigError("multi_job.job_devices", f"null leases all {mj.devices} pool devices but the job has "
                          f"{world} trainer rank(s): name the pool devices it uses, e.g. "
                          f"multi_job.job_devices={list(range(world))}")
    # async defaults (placement/device_pool.py): the trainer on 0..world-1, the rollout side on the next ones
    if cfg.mode == "async" and ((mj.rollout_devices is None and world + plan.rollout_devices > mj.devices)
                                or (mj.job_devices is None and world > mj.devices)):
        raise ConfigError("multi_job.devices", f"{mj.devices}: the job's trainer ({world}) and rollout "
                          f"({plan.rollout_devices}) devices do not fit; name them with multi_job.job_devices "
                          "and multi_job.rollout_devices (they may overlap: the sides then take turns)")
    for key in ("job_devices", "rollout_devices"):
        devs = getattr(mj, key)
        if devs is None:
            continue
        devs = list(devs)
        if not devs or len(set(devs)) != len(devs) or any(not 0 <= d < mj.devices for d in devs):
            raise ConfigError(f"multi_job.{key}", f"{devs} must be distinct ids in 0..{mj.devices - 1} "
                              f"(multi_job.devices={mj.devices})")
        want, what = ((world, "one pool device per trainer rank (trainer.nnodes x trainer.n_gpus_per_node)")
                      if key == "job_devices" else
                      (plan.rollout_devices, "one pool device per rollout device (rollout.nnodes x "
                       "rollout.n_gpus_per_node)"))
        if not logical and len(devs) != want:
            raise ConfigError(f"multi_job.{key}", f"{devs}: {what}, {want}")
    if cfg.mode == "async" and cfg.actor_rollout_ref.rollout.weight_sync == "collective":
        raise ConfigError("actor_rollout_ref.rollout.weight_sync", "collective needs the trainer and the engines on "
                          "their devices at the same time; on a shared pool the rollouter takes updates while it "
                          "waits for its lease: use object_store (auto picks it)")
    if not cfg.actor_rollout_ref.rollout.free_cache_engine:
        raise ConfigError("actor_rollout_ref.rollout.free_cache_engine", "must be true with multi_job.pool: a job's "
                          "engines free the devices between its rollout phases for the other jobs")
    if not (mj.ray_address or os.environ.get("RAY_ADDRESS")):
        raise ConfigError("multi_job.ray_address", "multi_job.pool needs a Ray cluster the jobs share: start one "
                          "(`ray start --head`) and set RAY_ADDRESS=<host:port> or multi_job.ray_address")


def check_rollout_layout(cfg: Any) -> None:
    """Async: rollout devices split into replicas of tensor_model_parallel_size devices (placement.py).
    Sync: one engine per trainer rank, on that rank's device."""
    rollout = cfg.actor_rollout_ref.rollout
    tp = rollout.tensor_model_parallel_size
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    _at_least(key, tp, 1)
    if cfg.mode == "sync":
        # tensor parallelism shards how an engine generates, not what: the same model samples the same
        # distribution on one device per engine (run/prepare.py builds them at 1 and refuses a model whose weights
        # fit no single device)
        if tp > 1:
            logger.warning("%s=%d: mode=sync runs one engine on each trainer device, each generating its share of "
                           "the step on that one device (tensor parallel 1); the responses' distribution is the "
                           "same, the model's weights and KV cache must fit one device", key, tp)
        return
    if tp > 1 and rollout.name == "hf":
        raise ConfigError(key, f"{tp}: the embedded engine (rollout.name=hf) has no tensor parallelism; use 1 "
                          "(every rollout device runs its own replica) or rollout.name=vllm")
    if cfg.async_training.placement == "colocated":
        if tp > 1:
            raise ConfigError(key, f"{tp}: colocated async runs one engine per trainer rank on that "
                              "rank's device; use 1")
        return
    devices = RunPlan.of(cfg).rollout_devices
    if devices % tp:
        raise ConfigError(key, f"{tp} does not divide the {devices} rollout devices "
                          "(rollout.nnodes x rollout.n_gpus_per_node)")
    if tp > cfg.rollout.n_gpus_per_node:
        raise ConfigError(key, f"{tp} > rollout.n_gpus_per_node={cfg.rollout.n_gpus_per_node}: a replica's "
                          "tensor-parallel ranks must share one node")


def placement_refusal(cfg: Any, placement: str) -> Optional[str]:
    """Why the run would refuse async_training.placement=`placement` for this config's engine and trainer (None: it
    would run it): the planner recommends only placements the runtime takes."""
    try:
        if placement == "elastic":
            check_elastic(cfg)
        elif placement == "colocated" and cfg.actor_rollout_ref.rollout.tensor_model_parallel_size > 1:
            raise ConfigError("actor_rollout_ref.rollout.tensor_model_parallel_size",
                              f"{cfg.actor_rollout_ref.rollout.tensor_model_parallel_size}: colocated async runs one "
                              "engine per trainer rank on that rank's device; use 1")
    except ConfigError as exc:
        return str(exc)
    return None


def device_ipc_applies(cfg: Any) -> bool:
    """Device IPC weight sync joins each trainer rank and the engine on its CUDA device: colocated async on one node,
    ranks that gather full parameters, engines that load a dict of device tensors in their own process."""
    from fully_async.core.config import actor_strategy

    return (cfg.mode == "async" and cfg.async_training.placement == "colocated" and cfg.trainer.device == "cuda"
            and cfg.trainer.nnodes == 1 and actor_strategy(cfg) in ("torch", "fsdp2")
            and cfg.actor_rollout_ref.rollout.name != "vllm")
