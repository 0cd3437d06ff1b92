"""`python -m fully_async.main ... --cfg job` runs the checks a real start runs before Ray (layer 7).

Hydra prints the composed config for `--cfg job|all` and returns without calling the task, so a command that the
real run would refuse (a reward manager's bound, a missing data file, a layout that does not divide) printed a
config as if it were fine.  Before Hydra prints, the same config is composed and put through the start's own
checks: the command-line keys that do nothing in this mode (named, as the run names them), `prepare` (the schema
and cross-key checks, the trackers' packages, the model folder, the parallel layout, the attention kernel, the
tokenizer, every data row, the reward function on the data), the device and, for a CPU run on a Ray it would
start, the processes per core.  An error exits 1 naming the key, as the run would.  What a real start does and this
does not -- it changes or starts things -- is said on one line: `SKIPPED`.  A command written for another machine
(data, model or accelerator not here) is checked as far as this machine allows, and what could not be checked here
is named (`here_only`).
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


def here_only(exc: Exception) -> bool:
    """Whether a check failed only because this machine lacks what the config names (a data or code file, the model
    folder, the accelerator): a command written for a cluster is checked from a laptop as far as it can be."""
    from fully_async.core.config import ConfigError
    from fully_async.device import DeviceError

    if isinstance(exc, DeviceError):
        return True
    return isinstance(exc, ConfigError) and (
        ("file not found" in str(exc) and exc.key in FILE_KEYS)
        or (exc.key == "actor_rollout_ref.model.path" and "not a local Hugging Face model folder" in str(exc)))


FILE_KEYS = ("data.train_files", "data.val_files", "data.custom_cls.path", "custom_reward_function.path")


def run_checks(config_name: str, config_path: Optional[str], overrides: list[str]) -> list[str]:
    """The start's checks before Ray on the config Hydra will print (module docstring); raises what the run raises
    (one of hydra_setup.user_errors()) for a config it would refuse.  A check that fails only for want of this
    machine's files or devices (`here_only`) is named instead, with the checks that need them; returns those."""
    from hydra import compose, initialize_config_dir

    from fully_async.cluster.ray_utils import check_cpu_devices
    from fully_async.core import config_checks
    from fully_async.core.plan import RunPlan
    from fully_async.device import check_available, get_device
    from fully_async.run.hydra_setup import CONFIG_DIR, register
    from fully_async.run.prepare import prepare

    register()
    config_dir = os.path.abspath(config_path) if config_path else CONFIG_DIR
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name=config_name, overrides=overrides)   # already rewritten: verl's keys mapped
    config_checks.inert_overrides(cfg, overrides)
    missing = []
    config_checks.check_finite(cfg)
    for check in config_checks.SECTION_CHECKS + config_checks.CROSS_SECTION_CHECKS:
        try:
            check(cfg)
        except Exception as exc:
            if not here_only(exc):
                raise
            missing.append(str(exc))
    device = None
    try:
        device = get_device(cfg.trainer.device)
        check_available(device)
    except Exception as exc:
        if not here_only(exc):
            raise
        missing.append(str(exc))
    if missing:
        logger.warning("--cfg job: not on this machine, so not checked here: %s; skipped with them: the model's "
                       "layout, attention kernel and tokenizer, every data row and the reward on the data (the run "
                       "checks them where it starts)", "; ".join(missing))
    else:
        prepare(cfg)
        plan = RunPlan.of(cfg)
        if not device.is_accelerator and cfg.multi_job.pool is None and not (
                cfg.multi_job.ray_address or os.environ.get("RAY_ADDRESS")):
            check_cpu_devices({"trainer": plan.trainer_devices, "rollout": plan.rollout_devices})
    logger.info("--cfg job: the checks a start runs before Ray passed%s; not run: %s",
                " (but those named above)" if missing else " (config, model, data, reward, device)", SKIPPED)
    return missing
