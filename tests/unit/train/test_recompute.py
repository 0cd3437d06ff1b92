"""An unset actor_rollout_ref.model.enable_gradient_checkpointing is decided per device by the memory model; set, it is
what it says."""
import logging

import pytest

from fully_async.device import CPU, Device
from fully_async.run.hydra_setup import load_config
from fully_async.train.recompute import gradient_checkpointing


def config(model_dir, value):
    return load_config([f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cuda",
                        f"actor_rollout_ref.model.enable_gradient_checkpointing={value}"])


@pytest.mark.parametrize("value, device_gib, on", [
    ("true", 1e4, True), ("false", 1e-6, False),          # set: as set
    ("null", None, True),                                  # the device's memory unknown: verl's default
    ("null", 1e4, False),                                  # a tiny model on a large device: no recompute
    ("null", 1e-6, True)])                                 # nothing fits: recompute
def test_unset_is_decided_by_the_memory_model(random_model_dir, monkeypatch, caplog, value, device_gib, on):
    monkeypatch.setattr(Device, "total_memory", lambda self, index=0: None if device_gib is None else device_gib * 2**30)
    with caplog.at_level(logging.INFO, logger="fully_async"):
        assert gradient_checkpointing(config(random_model_dir, value), CPU) is on
    logged = "enable_gradient_checkpointing unset" in caplog.text
    assert logged == (value == "null")


def test_an_unreadable_model_config_recomputes_as_verl_does(tmp_path, monkeypatch):
    """A config.json that is no dense decoder's (Shape.of_model: None) leaves the decision to verl's default, on."""
    (tmp_path / "config.json").write_text('{"model_type": "mystery"}')
    monkeypatch.setattr(Device, "total_memory", lambda self, index=0: 1e4 * 2**30)
    assert gradient_checkpointing(config(tmp_path, "null"), CPU) is True
