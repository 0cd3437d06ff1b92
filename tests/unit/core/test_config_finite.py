"""NaN and inf are refused for every number of the config, by key, before Ray starts (a comparison with NaN is
false, so no range check catches it; inf turns timeouts and bounds off)."""
import subprocess
import sys

import pytest

from fully_async.core.config import ConfigError
from fully_async.core.config_checks import _numbers, check_finite, validate
from fully_async.core.config import FullyAsyncConfig
from fully_async.run.hydra_setup import load_config

CASES = [
    ("async_training.staleness_threshold=nan", "async_training.staleness_threshold"),
    ("async_training.staleness_threshold=inf", "async_training.staleness_threshold"),
    ("actor_rollout_ref.actor.optim.lr=nan", "actor_rollout_ref.actor.optim.lr"),
    ("actor_rollout_ref.rollout.temperature=nan", "actor_rollout_ref.rollout.temperature"),
    ("trainer.progress_timeout_s=nan", "trainer.progress_timeout_s"),
    ("trainer.progress_timeout_s=inf", "trainer.progress_timeout_s"),
    ("actor_rollout_ref.actor.grad_clip=nan", "actor_rollout_ref.actor.grad_clip"),
    ("actor_rollout_ref.actor.clip_ratio_high=-inf", "actor_rollout_ref.actor.clip_ratio_high"),
    ("actor_rollout_ref.actor.optim.betas=[0.9,nan]", r"actor_rollout_ref.actor.optim.betas\[1\]"),
    ("+actor_rollout_ref.model.override_config.rope_theta=nan", "actor_rollout_ref.model.override_config.rope_theta"),
]


@pytest.mark.parametrize("override,key", CASES)
def test_validate_names_the_non_finite_key(override, key):
    cfg = load_config([override])
    with pytest.raises(ConfigError, match=f"'{key}'.*not a finite number"):
        validate(cfg)


def test_the_walk_reaches_every_float_field_of_the_schema():
    """Generic: every float-typed field of every section is visited (none listed by hand)."""
    import dataclasses
    import typing

    def float_fields(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            sub = next((a for a in (t, *typing.get_args(t)) if dataclasses.is_dataclass(a)), None)
            if sub is not None:
                yield from float_fields(sub, prefix + f.name + ".")
            elif t is float or float in typing.get_args(t):
                yield prefix + f.name

    cfg = load_config([])
    visited = {k.split("[")[0] for k, _ in _numbers(FullyAsyncConfig, cfg, "")}  # a list's items: key[i]
    expected = set(float_fields(FullyAsyncConfig))
    assert len(expected) > 20
    set_fields = {k for k in expected if _get(cfg, k) is not None}
    assert set_fields <= visited, set_fields - visited


def _get(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part, None)
    return cfg


def test_finite_values_pass():
    check_finite(load_config(["actor_rollout_ref.actor.optim.lr=1e-3", "trainer.progress_timeout_s=20"]))


def test_doctor_fails_the_config_row_for_nan():
    r = subprocess.run([sys.executable, "-m", "fully_async.doctor", "--no-ray",
                        "async_training.staleness_threshold=nan"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL  Hydra config" in r.stdout and "async_training.staleness_threshold" in r.stdout
