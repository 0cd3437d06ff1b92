"""Config errors name the key, before any expensive work."""
import subprocess
import sys

import pytest

from fully_async.core.config import ConfigError
from fully_async.core.config_checks import validate, validate_with_data
from fully_async.run.hydra_setup import load_config


def cfg_with(*overrides):
    return load_config(list(overrides))


def test_default_config_is_valid():
    cfg = cfg_with()
    validate(cfg)
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.data.train_files.endswith("tiny_arithmetic/data/train.parquet")


@pytest.mark.parametrize("override,key", [
    ("actor_rollout_ref.rollout.n=1", "actor_rollout_ref.rollout.n"),
    ("actor_rollout_ref.actor.loss_agg_mode=seq-mean", "actor_rollout_ref.actor.loss_agg_mode"),
    ("actor_rollout_ref.actor.kl_loss_type=full", "actor_rollout_ref.actor.kl_loss_type"),
    ("trainer.device=tpu", "trainer.device"),
    ("actor_rollout_ref.rollout.top_p=0", "actor_rollout_ref.rollout.top_p"),
    ("actor_rollout_ref.rollout.top_k=0", "actor_rollout_ref.rollout.top_k"),
    ("async_training.trigger_parameter_sync_step=0", "async_training.trigger_parameter_sync_step"),
    ("async_training.staleness_threshold=-0.1", "async_training.staleness_threshold"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.actor.clip_ratio_c=1.0", "actor_rollout_ref.actor.clip_ratio_c"),
    ("data.train_files=/nonexistent/train.parquet", "data.train_files"),
    ("actor_rollout_ref.model.path=/nonexistent/model", "actor_rollout_ref.model.path"),
    ("trainer.logger=[console,clearml]", "trainer.logger"),
    ("reward_model.reward_manager=batch", "reward_model.reward_manager"),
    ("reward_model.sandbox_fusion.url=localhost:8080/run_code", "reward_model.sandbox_fusion.url"),
    ("reward_model.sandbox_fusion.max_concurrent=0", "reward_model.sandbox_fusion.max_concurrent"),
    ("trainer.device_peak_tflops=0", "trainer.device_peak_tflops"),
    ("global_profiler.tool=nvtx", "global_profiler.tool"),
    ("global_profiler.steps=[0]", "global_profiler.steps"),
    ("global_profiler.contents=[cuda,flops]", "global_profiler.contents"),
    ("global_profiler.contents=[module]", "global_profiler.contents"),    # the npu profiler's, not torch's
    ("trainer.device_peak_tflops=-989", "trainer.device_peak_tflops"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        validate(cfg_with(override))
    assert err.value.key == key and key in str(err.value)


def test_val_only_needs_validation_data():
    with pytest.raises(ConfigError, match="data.val_files is not set") as err:
        validate(cfg_with("trainer.val_only=true", "data.val_files=null"))
    assert err.value.key == "trainer.val_only"


def test_device_peak_override_is_optional():
    assert cfg_with().trainer.device_peak_tflops is None
    cfg = cfg_with("trainer.device_peak_tflops=354")
    validate(cfg)
    assert cfg.trainer.device_peak_tflops == 354.0


def test_mini_batch_larger_than_dataset():
    cfg = cfg_with("actor_rollout_ref.actor.ppo_mini_batch_size=600", "async_training.require_batches=2")
    with pytest.raises(ConfigError, match="1200 prompts but the training data has only 1000"):
        validate_with_data(cfg, 1000)


def run_main(*args):
    return subprocess.run([sys.executable, "-m", "fully_async.main", *args, "hydra.run.dir=/tmp/fa_cfg_test"],
                          capture_output=True, text=True, timeout=120)


def test_cli_unknown_key_and_wrong_type_exit_nonzero_naming_key():
    r = run_main("actor_rollout_ref.rollout.nn=8")
    assert r.returncode != 0 and "actor_rollout_ref.rollout.nn" in r.stderr
    r = run_main("data.max_prompt_length=abc")
    assert r.returncode != 0 and "data.max_prompt_length" in r.stderr


def test_cli_impossible_combination_exits_before_ray():
    r = run_main("actor_rollout_ref.rollout.n=1")
    assert r.returncode == 1
    assert "actor_rollout_ref.rollout.n" in r.stderr + r.stdout
    assert "Started a local Ray instance" not in r.stderr + r.stdout


@pytest.mark.parametrize("overrides,message", [
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "rollout.n_gpus_per_node=2"],
     "embedded engine .* has no tensor parallelism"),
    (["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
      "rollout.n_gpus_per_node=3"], "does not divide the 3 rollout devices"),
    (["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
      "rollout.n_gpus_per_node=2", "rollout.nnodes=2"], "must share one node"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=0"], ">= 1"),
])
def test_rollout_layout_errors_name_the_tp_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(cfg_with(*overrides))
    assert err.value.key == "actor_rollout_ref.rollout.tensor_model_parallel_size"


def test_rollout_devices_split_into_replicas():
    from fully_async.placement import placement_of

    assert placement_of(cfg_with("rollout.n_gpus_per_node=4")).engine_layout() == (4, 1)
    cfg = cfg_with("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                   "rollout.n_gpus_per_node=4", "rollout.nnodes=2")
    validate(cfg)
    assert placement_of(cfg).engine_layout() == (4, 2)   # 8 devices / tp 2, each replica's 2 ranks on one node


def _leaf_keys(cls, prefix=""):
    import dataclasses

    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if default is not None and dataclasses.is_dataclass(default):
            yield from _leaf_keys(type(default), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f.name


def test_every_schema_key_is_read_somewhere():
    """No key of the schema is accepted and then ignored: each leaf's name is read as an attribute (or looked up
    by name) by the package outside the dataclass definitions, or checked by config_checks.validate."""
    import pathlib
    import re

    import fully_async
    from fully_async.core.config import FullyAsyncConfig

    root = pathlib.Path(fully_async.__file__).parent
    source = "\n".join(p.read_text() for p in root.rglob("*.py") if p.name != "config.py")
    config_src = (root / "core" / "config.py").read_text()
    source += config_src[config_src.index("# " + "-" * 83 + " valid values"):]   # the helpers, not the schema
    unread = [key for key, name in _leaf_keys(FullyAsyncConfig)
              if not re.search(rf"\.{name}\b|[\"']{name}[\"']", source)]
    assert unread == []


def test_unimplemented_values_are_refused_or_warned(caplog):
    import logging

    with pytest.raises(ConfigError, match="algorithm.kl_ctrl.type.*'pid' is not one of.*'adaptive'"):
        validate(load_config(["algorithm.kl_ctrl.type=pid"]))
    with pytest.raises(ConfigError, match="algorithm.kl_ctrl.target_kl"):
        validate(load_config(["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0"]))
    with caplog.at_level(logging.WARNING):
        validate(load_config(["actor_rollout_ref.rollout.calculate_log_probs=false"]))
    assert "calculate_log_probs=false has no effect" in caplog.text


def test_sync_mode_accepts_rollout_tp_with_one_warning(caplog):
    """Sync mode runs one engine per trainer device at tensor parallel 1 (run/prepare.py): the same sampling."""
    import logging
    from fully_async.core.config_checks import validate
    with caplog.at_level(logging.WARNING):
        validate(load_config(["mode=sync", "actor_rollout_ref.rollout.name=vllm",
                              "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]))
    named = [r for r in caplog.records if "tensor_model_parallel_size=2" in r.getMessage()]
    assert len(named) == 1 and "one engine on each trainer device" in named[0].getMessage()


def test_fp8_rollout_is_checked_before_anything_starts(caplog):
    import logging

    key = "actor_rollout_ref.rollout.quantization"
    with pytest.raises(ConfigError, match=r"quantization.*'torchao' is not one of \[None, 'fp8'\]"):
        validate(cfg_with(f"{key}=torchao"))
    with pytest.raises(ConfigError, match=r"quantization.*rollout.name=vllm needs vLLM's fp8 kernels.*not on cpu.*"
                                          r"rollout.name=hf emulates.*trainer.device=auto"):
        validate(cfg_with(f"{key}=fp8", "actor_rollout_ref.rollout.name=vllm"))
    with pytest.raises(ConfigError, match=r"not by the user engine my_pkg.engine:Engine"):
        validate(cfg_with(f"{key}=fp8", "actor_rollout_ref.rollout.name=my_pkg.engine:Engine"))
    with caplog.at_level(logging.WARNING):
        validate(cfg_with(f"{key}=fp8"))
    assert "fp8 on the embedded engine: verl's blockwise fp8 arithmetic" in caplog.text


@pytest.mark.parametrize("overrides,said", [
    (["global_profiler.tool=nsys", "global_profiler.steps=[1]"], "global_profiler.tool=nsys has no effect here"),
    (["global_profiler.steps=[1]"], "global_profiler.steps=[1] has no effect: global_profiler.tool is null"),
    (["global_profiler.tool=torch"], "global_profiler.tool=torch has no effect: global_profiler.steps lists no"),
    (["global_profiler.tool=torch", "global_profiler.steps=[3]", "trainer.total_training_steps=2"],
     "steps after trainer.total_training_steps=2 never run"),
    (["trainer.val_only=true", "trainer.val_before_train=false"], "trainer.val_only=true has no effect"),
])
def test_a_setting_that_does_nothing_is_named(overrides, said, caplog):
    """verl's global_profiler: a tool this package cannot run, steps without a tool or a tool without steps profile
    nothing, as in verl; trainer.val_only acts only with val_before_train, as in verl: each warning says so."""
    validate(cfg_with(*overrides))
    assert said in caplog.text
