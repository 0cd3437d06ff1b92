"""verl's own launch scripts, ported by changing only module/config name, paths and trainer.device
(recipes/verl_ported/), compose with `--cfg job` and train for 2 steps on CPU when shrunk to the tiny task."""
import os
import stat
import subprocess
import sys

import pytest
import yaml

from fully_async.core.config import asset_path
from fully_async.run.hydra_setup import load_config
import tests_helpers

pytestmark = pytest.mark.integration

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
TINY = {"MODEL_PATH": asset_path("tiny_arithmetic/model"),
        "TRAIN_FILE": asset_path("tiny_arithmetic/data/train.parquet"),
        "TEST_FILE": asset_path("tiny_arithmetic/data/val.parquet")}


def script_argv(tmp_path, script, env=None):
    """The argv the script hands to `python` (a stand-in python on PATH records it)."""
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    for name in ("python", "python3"):
        path = shim / name
        path.write_text('#!/usr/bin/env bash\nprintf \'%s\\0\' "$@" > "$ARGS_OUT"\n')
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "args"
    run_env = dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}", ARGS_OUT=str(out), **(env or {}))
    subprocess.run(["bash", os.path.join(ROOT, "recipes", "verl_ported", script)], env=run_env, check=True,
                   capture_output=True, timeout=60)
    argv = out.read_bytes().decode().split("\0")[:-1]
    assert argv[:2] == ["-m", "fully_async.main"], argv
    return argv[2:]


def cfg_job(argv):
    r = subprocess.run([sys.executable, "-m", "fully_async.main", *argv, "--cfg", "job"], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    return yaml.safe_load(r.stdout), r.stderr


def split_config_name(argv):
    names = [a for a in argv if a.startswith("--config-name")]
    rest = [a for a in argv if not a.startswith("--config-name")]
    name = names[0].split("=", 1)[1].strip("'") if names else "fully_async_ppo_trainer"
    return name.removesuffix(".yaml"), rest


def test_fully_async_megatron_script_composes_as_verl_means_it(tmp_path):
    argv = script_argv(tmp_path, "fully_async_megatron_npu.sh")
    cfg, err = cfg_job(argv + ["actor_rollout_ref.actor.megatron.context_parallel_size=1"])  # refused: not implemented
    arr = cfg["actor_rollout_ref"]
    assert arr["actor"]["strategy"] == "megatron" and cfg["trainer"]["device"] == "npu"
    assert arr["actor"]["megatron"]["tensor_model_parallel_size"] == 2 and arr["rollout"]["n"] == 16
    assert cfg["reward_model"]["overlong_buffer"] == {"enable": True, "len": 4096, "penalty_factor": 1.0,
                                                     "log": False, "max_resp_len": 8192}
    assert arr["actor"]["optim"]["lr_scheduler_type"] == "constant" and arr["actor"]["fsdp_config"]["param_offload"]
    assert cfg["async_training"]["trigger_parameter_sync_step"] == 4 and cfg["rollout"]["nnodes"] == 12
    assert arr["model"]["override_config"] == {"max_position_embeddings": 10240}
    transformer = arr["actor"]["megatron"]["override_transformer_config"]
    assert transformer["apply_rope_fusion"] is True and not any(k.startswith("moe_") for k in transformer)
    assert "actor_rollout_ref.hybrid_engine=False is accepted but has no effect here" in err


def test_sync_gsm8k_script_composes_as_verl_means_it(tmp_path):
    argv = script_argv(tmp_path, "grpo_gsm8k_sync_npu.sh")
    cfg, err = cfg_job(argv)
    assert cfg["mode"] == "sync" and cfg["trainer"]["device"] == "npu" and cfg["trainer"]["logger"] == ["console"]
    assert cfg["data"]["train_batch_size"] == 1024 and cfg["actor_rollout_ref"]["rollout"]["n"] == 5
    assert cfg["actor_rollout_ref"]["actor"]["strategy"] == "fsdp"          # verl's default, unset in the script
    assert cfg["trainer"]["critic_warmup"] == 0                              # a schema key now (PPO with a critic)
    assert "critic_warmup" not in err
    assert "ref.fsdp_config.param_offload=True is accepted but has no effect here" in err


# the scripts' sizes shrunk to the bundled tiny task on this CPU; engines are the embedded one (vLLM-Ascend and
# megatron-core need an NPU), everything else as the script sets it
SHRINK_COMMON = [f"actor_rollout_ref.model.path={TINY['MODEL_PATH']}", f"data.train_files={TINY['TRAIN_FILE']}",
                 f"data.val_files={TINY['TEST_FILE']}", "trainer.device=cpu", "actor_rollout_ref.rollout.name=hf",
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "data.max_prompt_length=16",
                 "data.max_response_length=8", "actor_rollout_ref.rollout.n=4", "trainer.total_training_steps=2",
                 "trainer.progress_bar=false", "trainer.val_before_train=false", "trainer.n_gpus_per_node=1",
                 "trainer.nnodes=1"]


@pytest.fixture(scope="module")
def ray_session():
    yield from tests_helpers.ray_session(num_cpus=3)


def test_fully_async_megatron_script_trains_two_steps_on_cpu(ray_session, tmp_path, monkeypatch):
    from fully_async.run.main import run

    name, argv = split_config_name(script_argv(tmp_path, "fully_async_megatron_npu.sh"))
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    cfg = load_config(argv + SHRINK_COMMON + [
        "actor_rollout_ref.actor.strategy=fsdp",           # megatron-core has no CPU forward pass
        "rollout.nnodes=1", "rollout.n_gpus_per_node=1", "rollout.total_rollout_steps=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "reward_model.overlong_buffer.len=4",
        "reward_model.overlong_buffer.max_resp_len=8", f"trainer.default_local_dir={tmp_path}/ckpt"],
        config_name=name)
    assert cfg.async_training.trigger_parameter_sync_step == 4 and cfg.reward_model.reward_manager == "dapo"
    summary = run(cfg)
    assert summary["steps"] == 2


def test_sync_gsm8k_script_trains_two_steps_on_cpu(ray_session, tmp_path, monkeypatch):
    from fully_async.run.main import run

    name, argv = split_config_name(script_argv(tmp_path, "grpo_gsm8k_sync_npu.sh"))
    assert name == "ppo_trainer"
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    cfg = load_config(argv + SHRINK_COMMON + [
        "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"trainer.default_local_dir={tmp_path}/ckpt"], config_name=name)
    assert cfg.mode == "sync" and cfg.actor_rollout_ref.actor.use_kl_loss
    summary = run(cfg)
    assert summary["steps"] == 2


def test_verl_0_9s_v1_colocate_async_script_trains_two_steps_colocated_on_cpu(ray_session, tmp_path, monkeypatch):
    """verl 0.9's V1 colocate_async recipe (tests/special_e2e/run_v1_colocate_async_disrm.sh, its overrides as
    tests/fixtures/verl_scripts_0_9.tsv holds them), ported as the translation test ports it (paths, device) and shrunk
    to the tiny task before translation (so the V1 pass reads the shrunk batch sizes): it runs on the placement
    verl/v1.py maps colocate_async to, trains 2 steps, and its disaggregated reward model (here a tiny token
    classifier whose every score is 0.375) gives every reward."""
    from fully_async.run.main import run
    from tests_helpers import read_scalars

    sys.path[:0] = [os.path.join(ROOT, "tests", "unit", "run"), os.path.join(ROOT, "tests", "unit", "train")]
    from test_reward_model import make_reward_model
    from test_verl_scripts import ported, rows

    table = os.path.join(ROOT, "tests", "fixtures", "verl_scripts_0_9.tsv")
    (_, _, _, name, overrides), = [r for r in rows(table) if r[1].endswith("run_v1_colocate_async_disrm.sh")]
    assert "trainer.v1.trainer_mode=colocate_async" in overrides and "trainer.v1.colocate_async.num_warmup_batches=1" \
        in overrides
    shrunk = {"data.train_batch_size": "4", "actor_rollout_ref.actor.ppo_mini_batch_size": "2",
              "reward.reward_model.model_path": make_reward_model(tmp_path / "rm", kind="token", bias=0.375)}
    lines = [f"{key}={shrunk[key]}" if key in shrunk else line
             for line, key in ((line, line.split("=", 1)[0]) for line in ported(overrides))]
    import pandas as pd
    pd.read_parquet(TINY["TEST_FILE"]).head(8).to_parquet(tmp_path / "val.parquet")   # the final validation's
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    cfg = load_config(lines + SHRINK_COMMON + [f"trainer.default_local_dir={tmp_path}/ckpt",
                                               f"data.val_files={tmp_path / 'val.parquet'}",
                                               "trainer.logger=[console,tensorboard]"], config_name=name)
    a = cfg.async_training
    # verl/v1.py's colocate_async: colocated, one push per step, a step of train_batch_size / ppo_mini_batch_size
    # mini-batches, partial rollouts, num_warmup_batches train batches admitted ahead
    assert (cfg.mode, a.placement, cfg.rollout.n_gpus_per_node) == ("async", "colocated", 0)
    assert (a.trigger_parameter_sync_step, a.require_batches, a.staleness_threshold, a.partial_rollout) == \
        (1, 2, 1.0, True)
    assert cfg.reward_model.enable and cfg.reward_model.reward_manager == "dapo"
    summary = run(cfg)
    ids = summary["trained_sample_ids"]
    assert summary["steps"] == 2 and len(ids) == len(set(ids)) == 2 * 4 * 4     # steps x (2 x 2 prompts) x n
    scalars = read_scalars(str(tmp_path / "tb"))
    assert [round(v, 4) for _, v in scalars["critic/score/mean"]] == [0.375] * 2   # the reward model's, not 0/1
    assert scalars["multi_job/rollout/yields"], "colocated: the rollouter never gave the device back to the trainer"
    assert [s for s, _ in scalars["actor/pg_loss"]] == [1, 2]
