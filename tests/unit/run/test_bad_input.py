"""Every bad input fails early, in the driver, with a message naming the key/file/value."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fully_async.core.config import ConfigError, asset_path
from fully_async.core.data import DataError
from fully_async.run.hydra_setup import load_config
from fully_async.run.prepare import BUNDLED_TASK_OVERRIDES, prepare
from fully_async.rewards import RewardError

MODEL = asset_path("tiny_arithmetic/model")


def prep(*overrides):
    """The bundled task's settings on other data files (naming data.train_files drops the preset)."""
    return prepare(load_config([*BUNDLED_TASK_OVERRIDES, *overrides]))


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def row(prompt="1+2=", gt="3"):
    return {"data_source": "arithmetic", "prompt": [{"role": "user", "content": prompt}],
            "reward_model": {"style": "rule", "ground_truth": gt}}


def test_missing_data_file():
    with pytest.raises(ConfigError, match="data.train_files.*file not found: /nope/train.parquet"):
        prep("data.train_files=/nope/train.parquet")


def test_unreadable_data_file(tmp_path):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"this is not parquet")
    with pytest.raises(DataError, match="broken.parquet"):
        prep(f"data.train_files={bad}")


def test_parquet_without_prompt_key(tmp_path):
    path = write_parquet(tmp_path / "q.parquet", [{"data_source": "arithmetic", "question": "1+2="}])
    with pytest.raises(DataError) as err:
        prep(f"data.train_files={path}")
    assert "prompt" in str(err.value) and "question" in str(err.value) and "data.prompt_key" in str(err.value)


def test_prompt_longer_than_max_with_truncation_error(tmp_path):
    path = write_parquet(tmp_path / "long.parquet", [row("12+34=")] * 8)
    with pytest.raises(DataError) as err:
        prep(f"data.train_files={path}", "data.max_prompt_length=3")
    msg = str(err.value)
    assert "max_prompt_length" in msg and "data.truncation" in msg


def test_empty_dataset(tmp_path):
    schema = pa.table({"data_source": pa.array([], pa.string()), "prompt": pa.array([], pa.string())})
    path = str(tmp_path / "empty.parquet")
    pq.write_table(schema, path)
    with pytest.raises(ConfigError, match="data.train_files.*no prompts"):
        prep(f"data.train_files={path}")


def test_model_path_without_config(tmp_path):
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.path.*no config.json"):
        prep(f"actor_rollout_ref.model.path={tmp_path}")


def test_model_path_with_garbage_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.path.*not a loadable"):
        prep(f"actor_rollout_ref.model.path={tmp_path}")


def test_a_vision_language_model_is_refused_naming_its_family(tmp_path):
    import json

    conf = json.load(open(os.path.join(MODEL, "config.json")))
    conf.update(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"])
    (tmp_path / "config.json").write_text(json.dumps(conf))
    shutil.copy(os.path.join(MODEL, "model.safetensors"), tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"is a qwen2_5_vl model \(Qwen2_5_VLForConditionalGeneration\), which "
                                          r"transformers does not load as a causal LM") as err:
        prep(f"actor_rollout_ref.model.path={tmp_path}")
    assert err.value.key == "actor_rollout_ref.model.path"


def test_model_path_without_weights(tmp_path):
    shutil.copy(os.path.join(MODEL, "config.json"), tmp_path / "config.json")
    with pytest.raises(ConfigError, match="no weight files"):
        prep(f"actor_rollout_ref.model.path={tmp_path}")


def test_tokenizer_without_eos(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(MODEL, model)
    for name in ("tokenizer_config.json", "generation_config.json", "config.json"):
        data = json.loads((model / name).read_text())
        for key in ("eos_token", "eos_token_id"):
            data.pop(key, None)
        (model / name).write_text(json.dumps(data))
    # transformers then invents "<|endoftext|>" with an id past the model's vocabulary: refused too
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.path.*eos_token"):
        prep(f"actor_rollout_ref.model.path={model}")


def test_reward_file_missing():
    with pytest.raises(ConfigError, match="custom_reward_function.path.*file not found"):
        prep("custom_reward_function.path=/nope/reward.py")


def test_reward_function_name_missing(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with pytest.raises(RewardError) as err:
        prep(f"custom_reward_function.path={f}", "custom_reward_function.name=compute_score")
    assert "compute_score" in str(err.value) and "my_score" in str(err.value)


def test_reward_function_returns_non_number(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return 'correct'\n")
    with pytest.raises(RewardError, match="returned .*'correct'"):
        prep(f"custom_reward_function.path={f}")


def test_unknown_data_source_without_custom_reward(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [dict(row(), data_source="my_task")] * 4)
    with pytest.raises(ConfigError, match="my_task"):
        prep(f"data.train_files={path}", "actor_rollout_ref.actor.ppo_mini_batch_size=2")


@pytest.fixture(scope="module")
def refused_runs(tmp_path_factory):
    """The two `python -m fully_async.main` runs refused before Ray (the process's exit code and output are what is
    checked), started side by side: {name: (returncode, stdout + stderr)}."""
    tmp_path = tmp_path_factory.mktemp("refused")
    runs = {"npu": ([sys.executable, "-m", "fully_async.main", "trainer.device=npu", "hydra.run.dir=/tmp/fa_npu"],
                    dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))}
    if importlib.util.find_spec("mlflow") is not None:
        runs["mlflow"] = ([sys.executable, "-m", "fully_async.main", "trainer.logger=[console,mlflow]",
                           f"trainer.default_local_dir={tmp_path}/ckpt", f"hydra.run.dir={tmp_path}/hydra"],
                          dict(os.environ, MLFLOW_TRACKING_URI="nosuchscheme://nowhere",
                               TENSORBOARD_DIR=str(tmp_path / "tb")))
    procs = {name: subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (cmd, env) in runs.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        out[name] = (proc.returncode, stdout + stderr)
    return out


def test_npu_without_torch_npu_names_the_fix(refused_runs):
    returncode, out = refused_runs["npu"]
    assert returncode == 1
    assert "trainer.device=npu needs torch_npu" in out and "set_env.sh" in out
    assert "Started a local Ray instance" not in out


def test_a_tracker_that_cannot_start_stops_the_run_before_ray(refused_runs):
    pytest.importorskip("mlflow")
    returncode, out = refused_runs["mlflow"]
    assert returncode == 1, out[-3000:]
    assert "trainer.logger=mlflow: mlflow did not start" in out and "check MLFLOW_TRACKING_URI" in out
    assert "Started a local Ray instance" not in out and "Traceback" not in out


def test_more_devices_than_ray_has():
    import ray

    from fully_async.device import CUDA
    from fully_async.cluster.ray_utils import RunFailed, check_resources

    ray.init(num_cpus=1, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        with pytest.raises(RunFailed, match="asks for 3 cuda devices .*trainer=2, rollout=1.* has 0 GPU"):
            check_resources(CUDA, {"trainer": 2, "rollout": 1})
    finally:
        ray.shutdown()


def test_nan_loss_skips_update_logs_batch_and_fails_after_max_bad_steps(tmp_path):
    from fully_async.train.backends.torch_backend import TorchBackend
    from fully_async.core.batch import build_batch
    from fully_async.device import CPU
    from fully_async.train.ppo_update import ppo_update
    from fully_async.train.train_step import BadStepsError, check_bad_steps, prepare_batch
    from tests_helpers import tiny_samples

    cfg = load_config([f"trainer.default_local_dir={tmp_path}", "trainer.max_bad_steps=2",
                       "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2"])
    backend = TorchBackend(cfg, CPU, 10)
    samples = tiny_samples()
    before = [p.detach().clone() for p in backend.model.parameters()]
    for step in (1, 2):
        batch = build_batch(samples)
        prepare_batch(backend, cfg, batch, {})
        batch.advantages = torch.full_like(batch.advantages, float("nan"))
        metrics = ppo_update(backend, cfg, batch, 1)
        assert metrics["actor/bad_steps"] == 1.0
        if step == 1:
            check_bad_steps(backend, cfg, step, samples)  # logged, not fatal yet
        else:
            with pytest.raises(BadStepsError, match="2 consecutive.*trainer.max_bad_steps=2"):
                check_bad_steps(backend, cfg, step, samples)
    assert all(torch.equal(a, b) for a, b in zip(before, backend.model.parameters()))  # no update applied
    logged = json.loads((tmp_path / "bad_batches" / "step_1.json").read_text())
    assert [r["sample_id"] for r in logged] == [s.sample_id for s in samples]


def test_megatron_layout_that_does_not_split_the_model():
    from transformers import AutoConfig

    from fully_async.run.prepare import check_parallel_layout

    cfg = load_config(["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
                      config_name="fully_async_ppo_megatron_trainer")
    with pytest.raises(ConfigError, match="megatron.tensor_model_parallel_size.*vocab_size=21 does not split into 2"):
        check_parallel_layout(cfg, AutoConfig.from_pretrained(MODEL))
    with pytest.raises(ConfigError, match="trainer.device.*megatron-core does not run"):
        prep("actor_rollout_ref.actor.strategy=megatron", "trainer.device=cpu")


@pytest.mark.parametrize("override,match", [
    ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.name.*vllm.*embedded engine"),
    ("actor_rollout_ref.actor.fsdp_config.param_offload=true", "fsdp_config.param_offload.*elastic.*stays on"),
    ("actor_rollout_ref.actor.fsdp_config.optimizer_offload=true", "fsdp_config.optimizer_offload"),
    ("actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.actor.strategy.*megatron.*elastic"),
    ("multi_job.pool=p", "multi_job.pool.*elastic.*split"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.tensor_model_parallel_size"),
])
def test_elastic_refuses_what_cannot_work_naming_the_key(override, match):
    """placement=elastic runs an embedded engine beside each trainer rank that loads the rank's parameters in its
    process while the trainer stays on its devices: what contradicts that is refused before anything loads."""
    from fully_async.core.config import ConfigError
    from fully_async.core.config_checks import validate
    from fully_async.run.hydra_setup import load_config

    with pytest.raises(ConfigError, match=match):
        validate(load_config(["async_training.placement=elastic", override]))
