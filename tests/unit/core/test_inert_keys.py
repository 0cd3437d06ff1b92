"""Keys that do nothing in the chosen mode are warned, by name; a sync resume with another data.train_batch_size is
refused (README: batch-size changes are refused), an async one is not (async mode does not read it)."""
import logging
import os
import subprocess
import sys

import pytest

from fully_async.core import checkpoint as ck
from fully_async.core.config import typed_config
from fully_async.core.config_checks import inert_overrides
from fully_async.run.hydra_setup import load_config
from fully_async.run.launcher import config_dict


def test_async_keys_in_sync_mode_and_megatron_keys_under_fsdp_are_warned(caplog):
    overrides = ["mode=sync", "async_training.staleness_threshold=0.5",
                 "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "data.train_batch_size=8"]
    with caplog.at_level(logging.WARNING):
        found = inert_overrides(load_config(overrides), overrides)
    assert found == ["async_training.staleness_threshold has no effect: mode=sync runs the colocated synchronous "
                     "loop: async_training.* is read only in async mode",
                     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size has no effect: "
                     "actor_rollout_ref.actor.strategy=fsdp: the megatron layout is read only with strategy=megatron"]
    assert "async_training.staleness_threshold has no effect" in caplog.text
    assert inert_overrides(load_config(["async_training.staleness_threshold=0.5"]),
                           ["async_training.staleness_threshold=0.5"]) == []  # async: read


def test_the_doctor_warns_as_the_run_does():
    r = subprocess.run([sys.executable, "-m", "fully_async.doctor", "--no-ray", "mode=sync",
                        "async_training.trigger_parameter_sync_step=2"], capture_output=True, text=True, timeout=180)
    assert "WARN  Hydra config" in r.stdout and "async_training.trigger_parameter_sync_step has no effect" in r.stdout


def _ckpt(root, cfg):
    tmp = ck.begin_checkpoint(root, 1)
    ck.write_json(os.path.join(tmp, ck.TRAINER_STATE), {"version": 1})
    return ck.commit_checkpoint(root, 1, tmp, config=config_dict(typed_config(cfg)))


def test_sync_resume_with_another_train_batch_size_is_refused(tmp_path):
    path = _ckpt(str(tmp_path / "s"), load_config(["mode=sync", "data.train_batch_size=8"]))
    new = config_dict(typed_config(load_config(["mode=sync", "data.train_batch_size=16"])))
    with pytest.raises(ck.CheckpointError, match=r"data.train_batch_size: 8 -> 16.*resume_allow_config_change="
                                                 r"\[data.train_batch_size\]"):
        ck.check_resume_config(path, new)
    ck.check_resume_config(path, new, allow=["data.train_batch_size"])
    path = _ckpt(str(tmp_path / "a"), load_config(["data.train_batch_size=8"]))
    ck.check_resume_config(path, config_dict(typed_config(load_config(["data.train_batch_size=16"]))))


@pytest.mark.parametrize("strategy, warned", [("torch", True), ("fsdp2", False)])
def test_reshard_after_forward_is_named_where_no_fsdp2_reads_it(strategy, warned, caplog):
    from fully_async.core.config_checks import validate

    cfg = typed_config(load_config([f"actor_rollout_ref.actor.strategy={strategy}",
                                    "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false"]))
    with caplog.at_level(logging.WARNING):
        validate(cfg)
    said = "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false has no effect with strategy torch"
    assert (said in caplog.text) == warned
