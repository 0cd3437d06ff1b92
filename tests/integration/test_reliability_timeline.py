"""The run's timeline (trainer.timeline) has every phase, async and sync, end to end on the bundled tiny task.

Moved out of test_reliability.py, whose runs are subprocesses because the process is what they test: here it is
not, so the runs are in-process under the shared Ray (module fixture `ray_session`), ~10 s less each."""
import json

import pytest

from fully_async.run.hydra_setup import load_config
import tests_helpers

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_session():
    yield from tests_helpers.ray_session(num_cpus=3)


@pytest.mark.parametrize("mode,extra,phases", [
    ("async", ["async_training.use_rollout_log_probs=false", "actor_rollout_ref.actor.use_kl_loss=true",
               "trainer.save_freq=2"],
     {"generate", "reward", "queue_wait", "old_log_prob", "ref", "adv", "update_actor", "param_sync", "save",
      "validate"}),
    ("sync", ["actor_rollout_ref.actor.fsdp_config.param_offload=true", "trainer.save_freq=2"],
     {"generate", "reward", "onload", "offload", "adv", "update_actor", "param_sync", "save", "validate"}),
])
def test_timeline_has_every_phase(ray_session, tmp_path, monkeypatch, mode, extra, phases):
    from fully_async.run.main import run

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    summary = run(load_config([f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.total_training_steps=4",
                               "trainer.progress_bar=false", f"mode={mode}", "trainer.timeline=true", *extra]))
    assert summary["steps"] == 4
    trace = json.loads((tmp_path / "tb" / "timeline.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert phases <= names, phases - names
    assert all(e["dur"] >= 0 for e in trace["traceEvents"] if e["ph"] == "X")
