"""LoRA end to end on CPU with the bundled tiny task (actor_rollout_ref.model.lora_rank): the engines get the merged
weights at every update and the run learns in both modes; its last checkpoint holds the merged model and the
adapter in peft's format."""
import os

import pytest

from fully_async.run.hydra_setup import load_config
import tests_helpers
from tests_helpers import first_and_last_val

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_session():
    yield from tests_helpers.ray_session(num_cpus=3)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_lora_learns_the_tiny_task(ray_session, tmp_path, monkeypatch, mode):
    from fully_async.run.main import run

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    summary = run(load_config([f"mode={mode}", "actor_rollout_ref.model.lora_rank=16",
                               "actor_rollout_ref.model.lora_alpha=32", "actor_rollout_ref.actor.optim.lr=3e-3",
                               "trainer.progress_bar=false", "trainer.resume_mode=disable", "trainer.save_freq=40",
                               f"trainer.default_local_dir={tmp_path}/ck"]))
    first, last = first_and_last_val(str(tmp_path / "tb"))
    assert last - first >= 0.5, (first, last)
    ckpt = os.path.join(tmp_path, "ck", f"global_step_{summary['steps']}", "actor")
    assert os.path.isfile(os.path.join(ckpt, "model.safetensors"))
    assert os.path.isfile(os.path.join(ckpt, "lora_adapter", "adapter_config.json"))
