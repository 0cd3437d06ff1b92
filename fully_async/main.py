"""`python -m fully_async.main key=value ...`: fully asynchronous GRPO/PPO on Ray (or `mode=sync`).

The story: validate and load data (before Ray), start Ray, create the queue, the rollouter and
the trainer, run both until the trainer reaches its last step, validate the final weights,
shut down.  If any actor fails, the others are stopped and the run exits non-zero with that
actor's root-cause error.  `mode=sync` (or `--config-name=ppo_trainer`) runs the colocated
synchronous loop of `fully_async.sync_loop` through the same launcher.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable

import hydra
from omegaconf import DictConfig

from fully_async.hydra_setup import CONFIG_DIR, register

logger = logging.getLogger("fully_async")
register()


def create_async_actors(cfg: Any, prep: Any, device: Any) -> dict:
    import ray

    from fully_async.queue import GroupQueue
    from fully_async.rollouter import Rollouter
    from fully_async.trainer import Trainer

    n_train = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    n_roll = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
    queue = ray.remote(GroupQueue).options(num_cpus=0, max_concurrency=8).remote()
    rollouter = ray.remote(Rollouter).options(max_concurrency=4, **device.ray_actor_options(n_roll)).remote(
        prep.cfg_dict, queue, prep.train, prep.val, prep.eos_token_ids, prep.pad_token_id)
    trainer = ray.remote(Trainer).options(max_concurrency=2, **device.ray_actor_options(n_train)).remote(
        prep.cfg_dict, queue, rollouter, prep.total_steps, n_train + n_roll, prep.pad_token_id)
    return {"trainer": trainer, "rollouter": rollouter, "queue": queue}


def launch(cfg: Any, create: Callable[[Any, Any], dict], main_actor: str) -> dict:
    """Shared by both modes: prepare, start Ray, create actors, supervise, validate, shut down.

    `create(prep, device)` returns named actor handles; `main_actor` has run()/pop_metrics()/
    validate(); every other actor with a run() method runs beside it and is stopped at the end.
    """
    import ray

    from fully_async.device import check_available, get_device
    from fully_async.prepare import prepare
    from fully_async.ray_utils import RunFailed, check_resources, kill_all, start_ray, supervise, wait_ready
    from fully_async.run_logging import RunLogger

    t_start = time.perf_counter()
    prep = prepare(cfg)
    device = get_device(cfg.trainer.device)
    check_available(device)
    started_ray = start_ray(num_cpus_needed=2)
    actors: dict = {}
    try:
        needs = {"trainer": cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node}
        if cfg.mode == "async":
            needs["rollout"] = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
        check_resources(device, needs)
        actors = create(prep, device)
        runners = {name: a for name, a in actors.items() if name != "queue"}
        logger.info("actors ready in %.1fs on %s", wait_ready(runners), device.name)
        main = actors[main_actor]
        if cfg.mode == "async" and cfg.actor_rollout_ref.rollout.load_format == "dummy":
            ray.get(main.sync_initial_weights.remote())  # the engine holds random weights until now
        run_log = RunLogger(cfg, prep.total_steps, main)
        runs = {a.run.remote(): name for name, a in runners.items()}
        supervise(runs, until=main_actor, on_tick=run_log.drain)
        run_log.drain()
        validator = actors.get("rollouter", main)
        if prep.val and not run_log.has_val_at(prep.total_steps):
            run_log.log_val(ray.get(validator.validate.remote()), prep.total_steps)
        others = {ref: name for ref, name in runs.items() if name != main_actor}
        for name in others.values():
            ray.get(actors[name].stop.remote())
        if others:
            supervise(others, until=next(iter(others.values())), on_tick=lambda: None)
        return run_log.finish(time.perf_counter() - t_start)
    except RunFailed:
        kill_all(list(actors.values()))
        raise
    finally:
        if started_ray:
            ray.shutdown()


def run_async(cfg: Any) -> dict:
    return launch(cfg, lambda prep, device: create_async_actors(cfg, prep, device), main_actor="trainer")


def run(cfg: Any) -> dict:
    if cfg.mode == "sync":
        from fully_async.sync_loop import run_sync
        return run_sync(cfg)
    return run_async(cfg)


@hydra.main(config_path=CONFIG_DIR, config_name="fully_async_ppo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    from fully_async.hydra_setup import USER_ERRORS

    try:
        run(cfg)
    except USER_ERRORS as exc:
        logger.error("%s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
