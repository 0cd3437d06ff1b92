"""The planner's own keys (`plan.*` on the command line), parsed and checked apart from the run's config.

They are not part of the run's schema: `python -m fully_async.plan plan.devices=[8,32] trainer.device=npu ...`
takes the `plan.` overrides out before Hydra composes the rest exactly as `python -m fully_async.main` would.
Every bad value is a ConfigError naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

import yaml

from fully_async.core.config import ConfigError
from fully_async.planner.hardware import DEVICES
from fully_async.planner.stage_costs import ESTIMATE_ASSUMPTIONS

PREFIX = "plan."
# the largest device count planned: the simulation replays every group of every step, and the batch grows with the
# devices (batch_scaling=weak), so its time grows with them (about 20 s for 64 devices on a 2-core machine)
MAX_DEVICES = 1024


@dataclass
class PlanOptions:
    stage_costs: Optional[str] = None     # bench_pipeline.py JSON, or a run's TensorBoard dir; null: estimate
    response_lengths: str = "config"      # config (benchmark.response_length, else lognormal) | lognormal | <json>
    decode_seq_fraction: Optional[float] = None  # share of a measured decode step that grows with the sequences in
    #                                              flight; null: 0 on accelerators (per-step bound, measured), 1 on cpu
    weight_sync_s: Optional[float] = None  # seconds of one async weight update; null: estimated
    sync_step_s: Optional[float] = None   # seconds of the sync loop's per-step switch; null: estimated
    devices: list[int] = field(default_factory=list)  # total device counts to plan for; []: the config's
    sim_steps: int = 16                   # trainer steps simulated per candidate
    batch_scaling: str = "weak"           # weak: groups per step grow with the device count | fixed
    device: Optional[str] = None          # row of the device table (ascend910b, h100, ...); null: from trainer.device
    device_memory_gib: Optional[float] = None
    device_tflops: Optional[float] = None
    device_hbm_gbs: Optional[float] = None
    device_link_gbs: Optional[float] = None
    prompt_length: Optional[int] = None   # mean prompt tokens; null: the bench's, else data.max_prompt_length / 2
    dp_efficiency: float = ESTIMATE_ASSUMPTIONS["dp_efficiency"]
    train_mfu: float = ESTIMATE_ASSUMPTIONS["train_mfu"]
    decode_mfu: float = ESTIMATE_ASSUMPTIONS["decode_mfu"]
    bw_eff: float = ESTIMATE_ASSUMPTIONS["bw_eff"]
    launch_s: Optional[float] = None      # per decode step beyond its reads and products; null: by engine
    context_gib: float = 1.5              # per device: runtime context, allocator slack
    warn_fraction: float = 0.9            # a role over this fraction of device memory is "tight"

    def estimate_assumptions(self, embedded: bool = False) -> dict:
        """The estimate's efficiencies; `embedded`: the rollout runs the embedded engine, whose decode step's fixed
        part was measured (ESTIMATE_ASSUMPTIONS embedded_launch_s), not the generic launch_s."""
        launch = self.launch_s if self.launch_s is not None else \
            ESTIMATE_ASSUMPTIONS["embedded_launch_s" if embedded else "launch_s"]
        return dict({k: v for k, v in ESTIMATE_ASSUMPTIONS.items() if k != "embedded_launch_s"},
                    train_mfu=self.train_mfu, decode_mfu=self.decode_mfu, bw_eff=self.bw_eff, launch_s=launch,
                    dp_efficiency=self.dp_efficiency)


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(plan.* overrides, the rest)."""
    plan = [a for a in argv if a.startswith(PREFIX)]
    return plan, [a for a in argv if not a.startswith(PREFIX)]


def _positive(key: str, value: Any, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, f"{value!r} is not a number")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(key, f"{value!r} must be {'>= 0' if allow_zero else '> 0'}")
    return float(value)


def parse(overrides: list[str]) -> PlanOptions:
    opts = PlanOptions()
    known = {f.name for f in fields(PlanOptions)}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "expected plan.<key>=<value>")
        key, raw = item.split("=", 1)
        name = key[len(PREFIX):]
        if name not in known:
            raise ConfigError(key, f"unknown planner key; known: {', '.join(sorted(PREFIX + k for k in known))}")
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError as exc:
            raise ConfigError(key, f"cannot parse {raw!r}: {exc}") from exc
        setattr(opts, name, _check(key, name, value))
    return opts


def _check(key: str, name: str, value: Any) -> Any:
    if name == "devices":
        value = [value] if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(value, list) or not value or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                                           for v in value):
            raise ConfigError(key, f"{value!r}: expected a positive integer or a list of them, e.g. [8,32,128]")
        big = [v for v in value if v > MAX_DEVICES]
        if big:
            raise ConfigError(key, f"{big[0]} devices: at most {MAX_DEVICES} are planned (the simulation replays "
                              "every group of every step, and its time grows with the devices); plan the devices "
                              f"of one job, at most {MAX_DEVICES}")
        return value
    if name == "device":
        if value is not None and str(value).lower() not in DEVICES:
            raise ConfigError(key, f"{value!r} is not in the device table: {', '.join(sorted(DEVICES))} (or set "
                              "plan.device_memory_gib / plan.device_tflops / plan.device_hbm_gbs yourself)")
        return None if value is None else str(value).lower()
    if name == "batch_scaling":
        if value not in ("weak", "fixed"):
            raise ConfigError(key, f"{value!r}: expected weak (the batch grows with the devices) or fixed")
        return value
    if name in ("stage_costs", "response_lengths"):
        return None if value is None else str(value)
    if value is None:
        if name in ("decode_seq_fraction", "weight_sync_s", "sync_step_s", "prompt_length", "launch_s") or \
                name.startswith("device_"):
            return None
        raise ConfigError(key, "must not be null")
    if name == "sim_steps":
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise ConfigError(key, f"{value!r} must be an integer >= 2")
        return value
    if name == "prompt_length":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(key, f"{value!r} must be a positive integer (tokens)")
        return value
    if name in ("decode_seq_fraction", "dp_efficiency", "train_mfu", "decode_mfu", "bw_eff", "warn_fraction"):
        v = _positive(key, value, allow_zero=name == "decode_seq_fraction")
        if v > 1:
            raise ConfigError(key, f"{value!r} must be at most 1")
        return v
    return _positive(key, value, allow_zero=name in ("weight_sync_s", "sync_step_s", "launch_s", "context_gib"))
