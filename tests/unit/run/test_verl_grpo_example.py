"""verl's GRPO example (examples/grpo_trainer/run_qwen2-7b.sh, the one docs/algo/grpo.md shows), ported as the README
says (recipes/verl_ported/grpo_gsm8k_main_ppo.sh: module, config name, model path, trainer.device), translates and
validates as verl means it, and so does the 2-step CPU run its header gives (shrunk to the bundled tiny task).
No run here: the header's command was run by hand (2 steps on a 2-core CPU)."""
import os
import re
import stat
import subprocess

import pytest

from fully_async.core.config import asset_path
from fully_async.core.config_checks import validate
from fully_async.core.plan import RunPlan
from fully_async.run.hydra_setup import load_config

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
SCRIPT = os.path.join(ROOT, "recipes", "verl_ported", "grpo_gsm8k_main_ppo.sh")


def script_argv(tmp_path, env, home=None):
    """What the script hands to python (a stand-in python3 on PATH records its argv)."""
    shim = tmp_path / "shim"
    shim.mkdir()
    fake = shim / "python3"
    fake.write_text('#!/usr/bin/env bash\nprintf \'%s\\0\' "$@" > "$ARGS_OUT"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "args"
    extra = header_overrides()
    subprocess.run(["bash", SCRIPT, *extra[1]] if env == "cpu" else ["bash", SCRIPT], check=True, capture_output=True,
                   timeout=30, env=dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}", ARGS_OUT=str(out),
                                        **(extra[0] if env == "cpu" else {"HOME": str(home)})))
    argv = out.read_bytes().decode().split("\0")[:-1]
    assert argv[:3] == ["-m", "fully_async.main", "--config-name=ppo_trainer"], argv[:3]
    return argv[3:]


def header_overrides():
    """(env, overrides) of the CPU command the script's header gives, $A the bundled task."""
    header = open(SCRIPT).read().split("set -x")[0]
    lines = [ln.lstrip("# ").rstrip(" \\") for ln in header.splitlines() if ln.startswith("#   ")]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("DEVICE=cpu"))
    words = " ".join(lines[start:]).replace("$A", asset_path("tiny_arithmetic")).split()
    env = dict(w.split("=", 1) for w in words[:2])
    assert words[2:4] == ["bash", "recipes/verl_ported/grpo_gsm8k_main_ppo.sh"]
    return env, words[4:]


def test_verls_grpo_example_composes_as_main_ppo_means_it(tmp_path, caplog):
    import pandas as pd

    row = {"prompt": [{"role": "user", "content": "1+1?"}], "data_source": "openai/gsm8k",
           "reward_model": {"ground_truth": "2", "style": "rule"}, "extra_info": {"index": 0}}
    for name in ("train", "test"):   # verl's paths under $HOME (validate checks that the files exist and hold rows)
        os.makedirs(tmp_path / "data" / "gsm8k", exist_ok=True)
        pd.DataFrame([row]).to_parquet(tmp_path / "data" / "gsm8k" / f"{name}.parquet")
    model = tmp_path / "models" / "Qwen2-7B-Instruct"   # the model folder the script names (its config only)
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], '
                                       '"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, '
                                       '"num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064}')
    argv = script_argv(tmp_path, "gpu", home=tmp_path)
    cfg = load_config(argv, config_name="ppo_trainer")
    assert cfg.mode == "sync" and cfg.algorithm.adv_estimator == "grpo" and cfg.trainer.device == "cuda"
    actor = cfg.actor_rollout_ref.actor
    assert (actor.use_kl_loss, actor.kl_loss_coef, actor.kl_loss_type) == (True, 0.001, "low_var_kl")
    assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, actor.ppo_mini_batch_size) == (1024, 5, 256)
    assert list(cfg.trainer.logger) == ["console", "wandb"] and cfg.trainer.total_epochs == 15
    validate(cfg)
    assert "has no effect in sync mode" not in caplog.text     # no word on async keys the script never set


def test_the_headers_cpu_command_is_two_sync_grpo_steps_on_the_tiny_task(tmp_path):
    argv = script_argv(tmp_path, "cpu")
    assert [a for a in argv if a.startswith("trainer.device=")] == ["trainer.device=cpu"]
    cfg = load_config(argv, config_name="ppo_trainer")
    validate(cfg)
    assert cfg.mode == "sync" and cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.actor.use_kl_loss
    assert cfg.actor_rollout_ref.model.path == asset_path("tiny_arithmetic/model")
    plan = RunPlan.of(cfg)
    assert (plan.trainer_devices, plan.groups_per_step, cfg.trainer.total_training_steps) == (1, 8, 2)
    assert re.fullmatch(r"console", ",".join(cfg.trainer.logger))


@pytest.mark.parametrize("key", ["data.train_batch_size", "actor_rollout_ref.rollout.n", "trainer.device"])
def test_the_header_overrides_only_sizes_paths_engine_and_device(key):
    env, overrides = header_overrides()
    assert env["DEVICE"] == "cpu" and os.path.isdir(env["MODEL_PATH"])
    assert sum(o.startswith(key + "=") for o in overrides) == (0 if key == "trainer.device" else 1)
