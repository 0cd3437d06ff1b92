"""PPO with a critic (algorithm.adv_estimator=gae) end to end on CPU with the bundled tiny task: it learns in sync
and in async mode (the trainer computes the values on the staleness-bounded batch), logs verl's critic metrics, and a
run stopped at a checkpoint resumes with the critic's weights, optimizer and schedule."""
import os

import pytest

from fully_async.run.hydra_setup import load_config
import tests_helpers
from tests_helpers import read_scalars

pytestmark = pytest.mark.integration
GAE = ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "trainer.progress_bar=false",
       "trainer.resume_mode=disable"]
CRITIC_METRICS = ["critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr",
                  "critic/values/mean", "critic/returns/mean", "critic/vf_explained_var", "timing_s/values",
                  "timing_s/update_critic", "actor/pg_loss"]


@pytest.fixture(scope="module")
def ray_session():
    yield from tests_helpers.ray_session(num_cpus=3)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_gae_learns_the_tiny_task(ray_session, tmp_path, monkeypatch, mode):
    from fully_async.run.main import run

    steps = 12
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    summary = run(load_config([*GAE, f"mode={mode}", f"trainer.total_training_steps={steps}",
                               "trainer.test_freq=-1", f"trainer.default_local_dir={tmp_path}/ck"]))
    assert summary["steps"] == steps
    scalars = read_scalars(str(tmp_path / "tb"))
    missing = [m for m in CRITIC_METRICS if m not in scalars]
    assert not missing, missing
    val = dict(scalars["val-core/arithmetic/reward/mean@1"])
    assert val[max(val)] - val[0] >= 0.3, val
    values = [v for _, v in sorted(scalars["critic/values/mean"])]
    assert values[-1] > values[0] + 0.2, values     # the critic follows the rising reward


def test_gae_resumes_with_its_critic(ray_session, tmp_path, monkeypatch):
    """A 2-step sync run saving at step 2 holds the critic; the resumed run continues its LR schedule (a warm-up
    over critic.optim.lr_warmup_steps=4) from step 3, not from the start."""
    from fully_async.run.main import run

    base = [*GAE, "mode=sync", "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=2",
            f"trainer.default_local_dir={tmp_path}/ck", "critic.optim.lr_warmup_steps=4",
            "critic.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "first"))
    run(load_config([*base, "trainer.total_training_steps=2"]))
    ckpt = os.path.join(tmp_path, "ck", "global_step_2")
    assert os.path.isdir(os.path.join(ckpt, "critic")) and os.path.isfile(os.path.join(ckpt, "critic_optim.pt"))
    first = read_scalars(str(tmp_path / "first"))
    assert [round(v, 8) for _, v in sorted(first["critic/lr"])] == [5e-4, 7.5e-4]   # lr x (steps + 1) / 4

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "second"))
    second = run(load_config([*base, "trainer.total_training_steps=3", "trainer.resume_mode=auto"]))
    assert second["steps"] == 3
    lrs = dict(read_scalars(str(tmp_path / "second"))["critic/lr"])
    assert sorted(lrs) == [3] and lrs[3] == pytest.approx(1e-3)   # a fresh schedule would be at 5e-4
