"""Hydra wiring shared by the entry points: schema registration, `${asset:...}`, config dir."""
from __future__ import annotations

import os

from omegaconf import OmegaConf

from fully_async.core.config import ConfigError, FullyAsyncConfig, asset_path

CONFIG_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "hydra_configs"))


def _whole_quotient(a: int, b: int) -> int:
    """`${fa_div:a,b}`: a / b when b divides a, else a ConfigError naming both (one_step_off_*.yaml's
    require_batches = data.train_batch_size / ppo_mini_batch_size)."""
    if int(b) < 1 or int(a) % int(b):
        raise ConfigError("data.train_batch_size", f"{a} prompts per step must be a multiple of "
                          f"actor_rollout_ref.actor.ppo_mini_batch_size={b} (one-step-off: one step is "
                          "train_batch_size / ppo_mini_batch_size mini-batches)")
    return int(a) // int(b)


def register() -> None:
    """Make the typed schema and the asset resolver known to Hydra (idempotent)."""
    from hydra.core.config_store import ConfigStore

    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", asset_path)
    if not OmegaConf.has_resolver("fa_div"):  # one_step_off_*.yaml: mini-batches per step = batch / mini-batch
        OmegaConf.register_new_resolver("fa_div", _whole_quotient)
    store = ConfigStore.instance()
    if "fully_async_schema.yaml" not in store.repo:   # building the schema node costs ~0.1 s: once a process
        store.store(name="fully_async_schema", node=FullyAsyncConfig)


# the errors an entry point reports as one line and exit 1 (a user's input, not a bug): (module, class)
_USER_ERRORS = (("fully_async.core.config", "ConfigError"), ("fully_async.core.data", "DataError"),
                ("fully_async.device", "DeviceError"), ("fully_async.rewards", "RewardError"),
                ("fully_async.cluster.ray_utils", "RunFailed"), ("fully_async.run.run_lock", "RunLocked"),
                ("fully_async.core.checkpoint", "CheckpointError"),
                ("fully_async.telemetry.tracking", "TrackerStartError"), ("fully_async.placement.leases", "LeaseError"),
                ("fully_async.placement.leases", "LeaseExpired"), ("fully_async.core.safe_write", "PlantedLinkError"))


def user_errors() -> tuple:
    """The user-error classes (`_USER_ERRORS`) for an `except user_errors() as exc:` clause, which Python evaluates only
    when an exception reaches it.  Only those whose module is imported are looked up: an exception of a class whose
    module was never imported cannot have been raised, and a config error is then reported without importing torch
    (fully_async.device) or Ray's modules for the tuple (~2 s of a refused start)."""
    import sys

    found = (getattr(sys.modules.get(module), name, None) for module, name in _USER_ERRORS)
    return (ConfigError, *(cls for cls in found if cls is not None and cls is not ConfigError))


def config_mode(config_name: str, overrides: list[str] = ()) -> str:
    """The mode a config composes to: the last `mode=` override, else the YAML's own `mode:` (followed through its
    first default: dapo_trainer -> ppo_trainer says sync), else async (the schema's default)."""
    import yaml

    given = [o.split("=", 1)[1] for o in overrides if o.lstrip("+~").split("=", 1)[0] == "mode" and "=" in o]
    if given:
        return given[-1]
    name, seen = config_name, set()
    while name and name not in seen:
        seen.add(name)
        try:
            with open(os.path.join(CONFIG_DIR, f"{name}.yaml")) as fh:
                doc = yaml.safe_load(fh) or {}
        except OSError:
            break
        if "mode" in doc:
            return str(doc["mode"])
        name = next((d for d in doc.get("defaults") or [] if isinstance(d, str) and d != "_self_"), None)
    return "async"


def compose_overrides(overrides: list[str], bundled_preset: bool = True,
                      config_name: str = "fully_async_ppo_trainer") -> list[str]:
    """What Hydra composes for these command-line overrides: the bundled task's preset first (when no
    data.train_files is given; without the async knobs when the config composes to sync mode), then the overrides
    with verl's keys mapped, warned or refused (verl/compat.py; a refused or unknown key raises ConfigError).  The
    entry point, the doctor and load_config all go through here."""
    from fully_async.verl.compat import translate
    from fully_async.run.prepare import bundled_task_overrides

    preset = bundled_task_overrides(overrides, config_mode(config_name, overrides)) if bundled_preset else []
    return translate(preset + list(overrides)).overrides


def rewrite_argv(argv: list[str]) -> list[str]:
    """sys.argv for @hydra.main with its overrides passed through compose_overrides (flags kept as they are).
    A --config-path config is the user's own: no bundled preset."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv[1:])
    overrides = list(args.overrides)
    rest, pending = [], list(overrides)
    for item in argv[1:]:
        if pending and item == pending[0]:
            pending.pop(0)
        else:
            rest.append(item)
    own_config = args.config_path is not None
    return [argv[0], *rest, *compose_overrides(overrides, bundled_preset=not own_config,
                                               config_name=args.config_name or "fully_async_ppo_trainer")]


def load_config(overrides: list[str] | None = None, config_name: str = "fully_async_ppo_trainer"):
    """Compose a config outside `@hydra.main` (tests, scripts): same schema, same YAML, same override handling."""
    from hydra import compose, initialize_config_dir

    register()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name=config_name, overrides=compose_overrides(list(overrides or []),
                                                                            config_name=config_name))
