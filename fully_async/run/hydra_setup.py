"""Hydra wiring shared by the entry points: schema registration, `${asset:...}`, config dir."""
from __future__ import annotations

import os

from omegaconf import OmegaConf

from fully_async.core.config import ConfigError, FullyAsyncConfig, asset_path

CONFIG_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "hydra_configs"))


def register() -> None:
    """Make the typed schema and the asset resolver known to Hydra (idempotent)."""
    from hydra.core.config_store import ConfigStore

    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", asset_path)
    ConfigStore.instance().store(name="fully_async_schema", node=FullyAsyncConfig)


def _user_errors() -> tuple:
    from fully_async.core.data import DataError
    from fully_async.device import DeviceError
    from fully_async.cluster.ray_utils import RunFailed
    from fully_async.core.checkpoint import CheckpointError
    from fully_async.core.rewards import RewardError
    from fully_async.run.run_lock import RunLocked
    from fully_async.core.leases import LeaseError, LeaseExpired

    return (ConfigError, DataError, DeviceError, RewardError, RunFailed, RunLocked, CheckpointError, LeaseError,
            LeaseExpired)


USER_ERRORS = _user_errors()


def load_config(overrides: list[str] | None = None, config_name: str = "fully_async_ppo_trainer"):
    """Compose a config outside `@hydra.main` (tests, scripts): same schema, same YAML."""
    from hydra import compose, initialize_config_dir

    register()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name=config_name, overrides=list(overrides or []))
