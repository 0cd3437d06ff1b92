"""`python -m fully_async.main key=value ...`: fully asynchronous GRPO/PPO on Ray.

The story: validate and load data (before Ray), start Ray, create the queue, the rollouter and
the trainer, run both until the trainer reaches its last step, validate the final weights,
shut down.  If any actor fails, the others are stopped and the run exits non-zero with that
actor's root-cause error.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Any

import hydra
from omegaconf import DictConfig

from fully_async.hydra_setup import CONFIG_DIR, register

logger = logging.getLogger("fully_async")
register()


def run_async(cfg: Any) -> dict:
    import ray

    from fully_async.device import check_available, get_device
    from fully_async.prepare import prepare
    from fully_async.queue import GroupQueue
    from fully_async.ray_utils import RunFailed, check_resources, kill_all, start_ray, supervise, wait_ready
    from fully_async.rollouter import Rollouter
    from fully_async.run_logging import RunLogger
    from fully_async.trainer import Trainer

    t_start = time.perf_counter()
    prep = prepare(cfg)
    device = get_device(cfg.trainer.device)
    check_available(device)
    started_ray = start_ray(num_cpus_needed=2)
    handles: list[Any] = []
    try:
        n_train = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
        n_roll = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
        check_resources(device, {"trainer": n_train, "rollout": n_roll})
        queue = ray.remote(GroupQueue).options(num_cpus=0, max_concurrency=8).remote()
        rollouter = ray.remote(Rollouter).options(max_concurrency=4, **device.ray_actor_options(n_roll)).remote(
            prep.cfg_dict, queue, prep.train, prep.val, prep.eos_token_ids, prep.pad_token_id)
        trainer = ray.remote(Trainer).options(max_concurrency=2, **device.ray_actor_options(n_train)).remote(
            prep.cfg_dict, queue, rollouter, prep.total_steps, n_train + n_roll, prep.pad_token_id)
        handles = [trainer, rollouter, queue]
        startup_s = wait_ready({"rollouter": rollouter, "trainer": trainer})
        logger.info("actors ready in %.1fs on %s", startup_s, device.name)
        if cfg.actor_rollout_ref.rollout.load_format == "dummy":
            ray.get(trainer.sync_initial_weights.remote())  # the engine holds random weights until now

        run_log = RunLogger(cfg, prep.total_steps, trainer)
        runs = {rollouter.run.remote(): "rollouter", trainer.run.remote(): "trainer"}
        supervise(runs, until="trainer", on_tick=run_log.drain)
        run_log.drain()
        final_val = ray.get(rollouter.validate.remote())
        run_log.log_val(final_val, prep.total_steps)
        ray.get(rollouter.stop.remote())
        supervise({ref: name for ref, name in runs.items() if name == "rollouter"}, until="rollouter",
                  on_tick=lambda: None)
        summary = run_log.finish(time.perf_counter() - t_start)
        return summary
    except RunFailed:
        kill_all(handles)
        raise
    finally:
        if started_ray:
            ray.shutdown()


@hydra.main(config_path=CONFIG_DIR, config_name="fully_async_ppo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    from fully_async.hydra_setup import USER_ERRORS

    try:
        run_async(cfg)
    except USER_ERRORS as exc:
        logger.error("%s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
