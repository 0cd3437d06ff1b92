"""verl keys that change what a run does, end to end on Ray with the bundled tiny task (in this process, under the
shared Ray): actor_rollout_ref.model.external_lib and custom_chat_template (a custom architecture and template),
trainer.val_only (a finished run's checkpoint validated, nothing trained)."""
import json

import pytest

from fully_async.run.hydra_setup import load_config
import tests_helpers
from tests_helpers import read_scalars

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_session():
    yield from tests_helpers.ray_session(num_cpus=3)


def test_a_custom_architecture_and_chat_template_as_verls_model_keys(ray_session, tmp_path, monkeypatch):
    """actor_rollout_ref.model.external_lib imports tests/custom_arch.py in every process (the driver, the rollouter,
    the trainer), whose registration is the only way the model folder's architecture loads; custom_chat_template
    templates every prompt the engine generates from (the trained rows' inputs)."""
    from custom_arch import as_custom_arch

    from fully_async.core.config import asset_path
    from fully_async.run.main import run_async

    model = as_custom_arch(asset_path("tiny_arithmetic/model"), str(tmp_path / "model"))
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    template = "{% for message in messages %}({{ message['content'] }}){% endfor %}"
    cfg = load_config([f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.total_training_steps=2",
                       f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.external_lib=custom_arch",
                       f"actor_rollout_ref.model.custom_chat_template={json.dumps(template)}",
                       "trainer.progress_bar=false", "trainer.val_before_train=false", "data.val_files=null",
                       f"trainer.rollout_data_dir={tmp_path}/rollouts"])
    assert run_async(cfg)["steps"] == 2
    rows = [json.loads(line) for step in (1, 2) for line in open(tmp_path / "rollouts" / f"{step}.jsonl")]
    assert rows and all(r["input"].startswith("(") and r["input"].endswith("=)") for r in rows), rows[0]


def test_val_only_validates_a_finished_checkpoint_and_trains_nothing(ray_session, tmp_path, monkeypatch):
    """verl's trainer.val_only: a run resumed from the checkpoint of a finished 2-step run validates those weights
    (the same reward the run's own final validation gave), trains no step and writes no checkpoint; one pointed at
    an earlier checkpoint (resume_path) validates that one and moves no later checkpoint aside (a training run
    from there would retire them as another timeline's)."""
    from fully_async.core.checkpoint import list_checkpoints
    from fully_async.run.main import run_async

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    args = [f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.total_training_steps=2", "trainer.save_freq=1",
            "trainer.progress_bar=false"]
    trained = run_async(load_config(args))
    assert trained["steps"] == 2 and trained["val_last_step"] == 2
    checked = run_async(load_config([*args, "trainer.val_only=true"]))
    assert checked["val_only"] and checked["steps"] == 2 and checked["val_last_step"] == 2
    assert checked["val_last"] == pytest.approx(trained["val_last"])
    earlier = run_async(load_config([*args, "trainer.val_only=true", "trainer.resume_mode=resume_path",
                                     f"trainer.resume_from_path={tmp_path}/ckpt/global_step_1"]))
    assert earlier["val_last_step"] == 1
    assert list_checkpoints(str(tmp_path / "ckpt")) == [1, 2]
    steps = [s for s, _ in read_scalars(str(tmp_path / "tb")).get("actor/pg_loss", [])]
    assert steps == [1, 2]                                  # the first run's steps only
