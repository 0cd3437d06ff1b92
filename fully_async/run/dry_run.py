"""`python -m fully_async.main ... --cfg job` runs the checks a real start runs before Ray (layer 6).

Hydra prints the composed config for `--cfg job|all` and returns without calling the task, so a command that the
real run would refuse (a reward manager's bound, a missing data file, a layout that does not divide) printed a
config as if it were fine.  Before Hydra prints, the same config is composed and put through the start's own
checks: the command-line keys that do nothing in this mode (named, as the run names them), `prepare` (the schema
and cross-key checks, the trackers' packages, the model folder, the parallel layout, the attention kernel, the
tokenizer, every data row, the reward function on the data), the device and, for a CPU run on a Ray it would
start, the processes per core.  An error exits 1 naming the key, as the run would.  What a real start does and this
does not -- it changes or starts things -- is said on one line: `SKIPPED`.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

logger = logging.getLogger("fully_async")

SKIPPED = ("the folder locks (trainer.default_local_dir and the TensorBoard run dir: they create the folders), the "
           "checkpoint lookup of trainer.resume_mode (it sets damaged checkpoints aside), starting the trackers of "
           "trainer.logger (wandb, swanlab, mlflow log in), and Ray with its resource checks")


def wanted(argv: list[str]) -> Optional[tuple[str, Optional[str], list[str]]]:
    """(config name, config path, overrides) when `argv` asks Hydra to print the job's config (--cfg job|all) and
    no help; else None."""
    from hydra._internal.utils import get_args_parser

    try:
        args = get_args_parser().parse_args(argv[1:])
    except SystemExit:
        return None
    if args.cfg not in ("job", "all") or args.help or args.hydra_help or args.multirun:
        return None
    return args.config_name or "fully_async_ppo_trainer", args.config_path, list(args.overrides)


def run_checks(config_name: str, config_path: Optional[str], overrides: list[str]) -> None:
    """The start's checks before Ray on the config Hydra will print (module docstring); raises what the run
    raises (one of hydra_setup.USER_ERRORS) for a config it would refuse."""
    from hydra import compose, initialize_config_dir

    from fully_async.cluster.ray_utils import check_cpu_devices
    from fully_async.core.config_checks import inert_overrides
    from fully_async.core.plan import RunPlan
    from fully_async.device import check_available, get_device
    from fully_async.run.hydra_setup import CONFIG_DIR, register
    from fully_async.run.prepare import prepare

    register()
    config_dir = os.path.abspath(config_path) if config_path else CONFIG_DIR
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name=config_name, overrides=overrides)   # already rewritten: verl's keys mapped
    inert_overrides(cfg, overrides)
    prepare(cfg)
    device = get_device(cfg.trainer.device)
    check_available(device)
    plan = RunPlan.of(cfg)
    if not device.is_accelerator and cfg.multi_job.pool is None and not (
            cfg.multi_job.ray_address or os.environ.get("RAY_ADDRESS")):
        check_cpu_devices({"trainer": plan.trainer_devices, "rollout": plan.rollout_devices})
    logger.info("--cfg job: the checks a start runs before Ray passed (config, model, data, reward, device); not "
                "run: %s", SKIPPED)
