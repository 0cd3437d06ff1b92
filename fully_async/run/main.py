"""`python -m fully_async.main key=value ...`: fully asynchronous GRPO/PPO on Ray (or `mode=sync`).

The story: validate and load data (before Ray), start Ray, create the queue, the rollouter and
the trainer, run both until the trainer reaches its last step, validate the final weights,
shut down.  If any actor fails, the others are stopped and the run exits non-zero with that
actor's root-cause error.  `mode=sync` (or `--config-name=ppo_trainer`) runs the colocated
synchronous loop of `fully_async.actors.sync_loop` through the same launcher.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional

import hydra
from omegaconf import DictConfig

from fully_async.core import safe_write
from fully_async.core.plan import RunPlan
from fully_async.run.hydra_setup import CONFIG_DIR, register

logger = logging.getLogger("fully_async")
register()


def create_async_actors(cfg: Any, prep: Any, device: Any, resume_path: Optional[str]) -> dict:
    """Queue, rollouter and trainer; resuming, each loads its own part of the checkpoint at `resume_path`."""
    import ray

    from fully_async.actors.queue import GroupQueue
    from fully_async.actors.rollouter import Rollouter
    from fully_async.actors.trainer import Trainer
    from fully_async.placement import placement_of
    from fully_async.placement.groups import in_bundle, make_placement_group

    plan = RunPlan.of(cfg)
    n_train, n_roll = plan.trainer_devices, plan.rollout_devices
    placement = placement_of(prep.cfg)   # (colocated: the private pool the launcher made is in prep.cfg)
    replicas, tp = placement.engine_layout()
    if placement.on_pool and device.is_accelerator:   # a shared pool, or colocated's own
        # a shared pool's jobs take no device resource from Ray: each actor is pinned to its pool devices and the
        # pool's leases keep the jobs apart in time (placement/residency.py)
        from fully_async.placement.device_pool import pinned_actor_options, rollout_devices

        roll_pg = train_pg = None
        roll_opts = (pinned_actor_options(device, prep.cfg, 0, devices=rollout_devices(prep.cfg))
                     if replicas == 1 else {"num_cpus": 0})
        train_opts = pinned_actor_options(device, prep.cfg, 0)
    else:
        # one bundle per engine replica and one per trainer rank, reserved up front (or a named error)
        roll_pg = make_placement_group(device, replicas, tp, f"{replicas} rollout engine replica(s)")
        train_pg = make_placement_group(device, n_train, 1, f"{n_train} trainer rank(s)")
        # one replica: the engine lives in the rollouter (on bundle 0's devices); several: the rollouter is a
        # device-less shell and each replica actor takes its own bundle
        roll_opts = (dict(device.ray_actor_options(tp), **in_bundle(roll_pg, 0)) if replicas == 1
                     else {"num_cpus": 0})
        train_opts = dict(device.ray_actor_options(1), **in_bundle(train_pg, 0))
    # resuming: the groups generated but not trained at the checkpoint are the first the trainer gets
    queue = ray.remote(GroupQueue).options(num_cpus=0, max_concurrency=8).remote(resume_path)
    # threads: its loop, the trainer's weight push and per-step metrics, the driver's calls (and spare)
    rollouter = ray.remote(Rollouter).options(max_concurrency=6, **roll_opts).remote(
        prep.cfg, queue, prep.train, prep.val, prep.eos_token_ids, prep.pad_token_id, resume_path,
        roll_pg if replicas > 1 else None)
    # the trainer actor is data-parallel rank 0 (bundle 0); it spawns ranks 1..n_train-1 into bundles 1..
    # threads: its loop and the driver's calls; elastic, also the rollouter's polls and commands of its engine
    trainer = ray.remote(Trainer).options(max_concurrency=8 if placement.trainer_hosts_engines else 3,
                                          **train_opts).remote(
        prep.cfg, queue, rollouter, prep.total_steps, n_train + n_roll, prep.pad_token_id, resume_path,
        train_pg, prep.eos_token_ids)
    return {"trainer": trainer, "rollouter": rollouter, "queue": queue}


def run_async(cfg: Any) -> dict:
    from fully_async.run.launcher import launch

    return launch(cfg, lambda *args: create_async_actors(cfg, *args), main_actor="trainer")


def run_sync(cfg: Any) -> dict:
    """Driver of mode=sync: one colocated worker (rank 0) that spawns the other trainer ranks."""
    import ray

    from fully_async.actors.sync_loop import SyncWorker
    from fully_async.placement import placement_of
    from fully_async.placement.groups import in_bundle, make_placement_group
    from fully_async.run.launcher import launch

    def create(prep: Any, device: Any, resume_path: Optional[str]) -> dict:
        n_dev = RunPlan.of(cfg).trainer_devices
        shared = placement_of(prep.cfg).on_pool
        # a shared pool's jobs take no device resource from Ray (the pool's leases share the devices in time)
        pg = make_placement_group(device, n_dev, 1, f"{n_dev} trainer rank(s)") \
            if n_dev > 1 and not (shared and device.is_accelerator) else None
        # rank 0 (engine + trainer shard) takes one device, the trainer group spawns the others;
        # on CPU a lone colocated worker gets the cores async mode splits between its two actors
        cpus = 1 if device.is_accelerator or n_dev > 1 else 2
        opts = device.ray_actor_options(1, num_cpus=cpus)
        if shared:
            from fully_async.placement.device_pool import pinned_actor_options

            opts = pinned_actor_options(device, prep.cfg, 0, num_cpus=cpus)
        worker = ray.remote(SyncWorker).options(max_concurrency=2, **opts, **in_bundle(pg, 0)).remote(
            prep.cfg, prep.train, prep.val, prep.total_steps, n_dev, prep.eos_token_ids, prep.pad_token_id,
            resume_path, pg)
        return {"sync": worker}

    return launch(cfg, create, main_actor="sync")


def run(cfg: Any) -> dict:
    return run_sync(cfg) if cfg.mode == "sync" else run_async(cfg)


def main() -> None:
    """verl's keys are mapped, warned or refused on the command line first (hydra_setup.rewrite_argv), so
    `--cfg job` prints what the run gets."""
    from fully_async.core.config import ConfigError
    from fully_async.run.hydra_setup import rewrite_argv

    try:
        sys.argv = rewrite_argv(sys.argv)
    except ConfigError as exc:
        logging.basicConfig(format="%(message)s")
        logger.error("%s", exc)
        sys.exit(1)
    dry_run_checks(sys.argv)
    hydra_main()


def dry_run_checks(argv: list[str]) -> None:
    """`--cfg job|all`: the checks a start runs before Ray, on the config Hydra is about to print (run/dry_run.py);
    a config the run would refuse exits 1 here, naming the key."""
    from fully_async.run import dry_run
    from fully_async.run.hydra_setup import user_errors

    asked = dry_run.wanted(argv)
    if asked is None:
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")   # stderr: stdout stays the config
    try:
        dry_run.run_checks(*asked)
    except user_errors() as exc:
        logger.error("%s", exc)
        sys.exit(1)


@hydra.main(config_path=CONFIG_DIR, config_name="fully_async_ppo_trainer", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    from fully_async.run.hydra_setup import user_errors
    from fully_async.run.launcher import RunInterrupted

    try:
        from hydra.core.hydra_config import HydraConfig

        from fully_async.core.config_checks import inert_overrides

        inert_overrides(cfg, list(HydraConfig.get().overrides.task))
        run(cfg)
    except RunInterrupted as exc:
        logger.error("%s", exc)
        sys.exit(128 + exc.signum)
    except KeyboardInterrupt:  # Ctrl-C before the launcher's handlers were in place
        logger.error("interrupted by SIGINT during start-up; nothing was trained")
        sys.exit(130)
    except user_errors() as exc:
        logger.error("%s", exc)
        details = getattr(exc, "details", "")
        if details:
            try:
                logger.error("the failing code's traceback: %s", write_traceback(details))
            except Exception as err:  # noqa: BLE001 - the run has failed already: its traceback goes to the log
                logger.error("could not write failure_traceback.txt (%s); the failing code's traceback:\n%s",
                             err, details)
        sys.exit(1)


def write_traceback(details: str) -> str:
    """A failure's traceback into failure_traceback.txt beside the run's log (Hydra's output folder), for a bug
    report: the console keeps the one-line cause."""
    from hydra.core.hydra_config import HydraConfig

    path = os.path.join(HydraConfig.get().runtime.output_dir, "failure_traceback.txt")
    safe_write.write_text(path, details)
    return path


if __name__ == "__main__":
    main()
