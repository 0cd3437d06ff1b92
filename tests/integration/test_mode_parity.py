"""Sync and async mode run the same training step: with an on-policy bound (staleness_threshold=0) the async
rollouter admits exactly the batch sync generates, in the same order, from the same seed, so the first steps of
the two modes see the same samples and must log the same reward, loss and gradient norm."""
import os
import subprocess
import sys

import pytest

from tests_helpers import read_scalars

pytestmark = pytest.mark.integration
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ["trainer.total_training_steps=2", "trainer.resume_mode=disable", "trainer.progress_bar=false",
          "trainer.val_before_train=false", "trainer.test_freq=-1", "async_training.staleness_threshold=0",
          "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]


def run(tmp_path, mode):
    env = dict(os.environ, TENSORBOARD_DIR=str(tmp_path / mode))
    r = subprocess.run([sys.executable, "-m", "fully_async.main", f"mode={mode}", *COMMON,
                        f"trainer.default_local_dir={tmp_path}/ckpt_{mode}", f"hydra.run.dir={tmp_path}/h_{mode}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return read_scalars(str(tmp_path / mode))


def test_first_steps_are_identical_in_both_modes(tmp_path):
    a, s = run(tmp_path, "async"), run(tmp_path, "sync")
    for tag in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"):
        got_a, got_s = dict(a[tag]), dict(s[tag])
        assert sorted(got_a) == sorted(got_s) == [1, 2], tag
        for step in (1, 2):
            assert got_a[step] == pytest.approx(got_s[step], rel=1e-6, abs=1e-9), (tag, step, got_a, got_s)
