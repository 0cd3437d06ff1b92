"""Colocated async (async_training.placement=colocated) on CPU: the trainer and the rollouter take turns on the
trainer's device through a private device pool; it learns the bundled task as well as sync at equal steps, trains
every sample exactly once, and a run stopped at a checkpoint (responses parked in it) resumes losing and repeating
nothing.

Slow: three colocated Ray runs (a trainer and a rollouter taking turns through a private pool; one of them stopped
at a checkpoint and resumed), ~50 s alone and up to ~95 s beside the suite's other worker."""
import json
import os

import pytest

from fully_async.run.hydra_setup import load_config
import tests_helpers
from tests_helpers import SYNC_LEARNING as COMMON, SYNC_LEARNING_STEPS as STEPS, read_scalars

pytestmark = pytest.mark.integration
COLOCATED = ["async_training.placement=colocated", "rollout.n_gpus_per_node=0"]


@pytest.fixture(scope="module")
def ray_session():
    yield from tests_helpers.ray_session(num_cpus=3)



def test_colocated_learns_as_sync_does_and_trains_each_sample_once(ray_session, sync_learning_run, tmp_path,
                                                                  monkeypatch):
    from fully_async.run.main import run

    got = {}
    sync_summary, got["sync"] = sync_learning_run   # the same COMMON, mode=sync (conftest.SYNC_LEARNING)
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "colocated"))
    summary = run(load_config([*COMMON, *COLOCATED, f"trainer.default_local_dir={tmp_path}/ck_colocated"]))
    got["colocated"] = tests_helpers.first_and_last_val(str(tmp_path / "colocated"))
    for mode, run_summary in (("sync", sync_summary), ("colocated", summary)):
        ids = run_summary["trained_sample_ids"]
        assert run_summary["steps"] == STEPS and len(ids) == len(set(ids)) == STEPS * 16 * 8, mode
    (sync_before, sync_after), (colo_before, colo_after) = got["sync"], got["colocated"]
    assert colo_after - colo_before > 0.3, got                 # it learns
    assert colo_after >= sync_after - 0.1, got                  # as well as sync at equal steps
    scalars = read_scalars(str(tmp_path / "colocated"))
    assert [s for s, _ in scalars["multi_job/rollout/yields"]], "the rollouter never gave its turn back"
    assert max(v for _, v in scalars["fully_async/count/stale_samples_processed"]) > 0   # it ran ahead


def test_colocated_stop_at_a_checkpoint_and_resume_lose_and_repeat_nothing(ray_session, tmp_path, monkeypatch):
    """A 4-step run saves at every version (responses parked in the checkpoint); a second run resumes from it for
    the remaining steps: together they train every sample once."""
    from fully_async.run.main import run

    base = [*COLOCATED, "trainer.progress_bar=false", "trainer.test_freq=-1", "trainer.save_freq=2",
            f"trainer.default_local_dir={tmp_path}/ck", "trainer.val_before_train=false",
            "actor_rollout_ref.rollout.free_cache_engine=false"]
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "first"))
    first = run(load_config([*base, "trainer.total_training_steps=4", "trainer.resume_mode=disable"]))
    ckpt = os.path.join(tmp_path, "ck", "global_step_4")
    assert os.path.isdir(ckpt), os.listdir(tmp_path / "ck")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "second"))
    second = run(load_config([*base, "trainer.total_training_steps=8", "trainer.resume_mode=auto"]))
    ids = second["trained_sample_ids"]   # the resumed trainer continues the checkpoint's list
    assert second["steps"] == 8 and ids[:len(first["trained_sample_ids"])] == first["trained_sample_ids"]
    assert len(ids) == len(set(ids)) == 8 * 16 * 8
    state = json.load(open(os.path.join(ckpt, "trainer_state.json")))
    assert state["step"] == 4


def test_colocated_keep_mode_continues_responses_across_updates(ray_session, tmp_path, monkeypatch):
    """pause_mode=keep with the embedded engine: responses in flight at a weight update continue on the new weights
    without being parked (tokens of two versions in one response), every sample trained once.  Long synthetic
    responses (lognormal up to 48 tokens, EOS ignored), a loose staleness bound and 32 engine slots (fewer than a
    step's 128 responses, so requests queue and the engine is full whenever the trainer takes its turn, however fast
    it decodes) keep responses in flight at every switch.  The engine frees its memory at every turn (free_cache_engine_force): the responses in
    flight go through each trainer turn with their KV swapped to host memory and back, not parked."""
    from fully_async.run.main import run

    steps = 6
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "keep"))
    summary = run(load_config([f"trainer.total_training_steps={steps}", "trainer.progress_bar=false",
                               "trainer.test_freq=-1", "trainer.resume_mode=disable", "trainer.val_before_train=false",
                               *COLOCATED, "actor_rollout_ref.rollout.pause_mode=keep",
                               "actor_rollout_ref.rollout.free_cache_engine_force=true", "data.max_response_length=48",
                               "benchmark.response_length=lognormal", "benchmark.ignore_eos=true",
                               "async_training.staleness_threshold=2", "actor_rollout_ref.rollout.max_num_seqs=32",
                               f"trainer.default_local_dir={tmp_path}/ck_keep"]))
    ids = summary["trained_sample_ids"]
    assert summary["steps"] == steps and len(ids) == len(set(ids)) == steps * 16 * 8
    scalars = read_scalars(str(tmp_path / "keep"))
    assert max(v for _, v in scalars["fully_async/partial/max_partial_span"]) >= 1   # a response spans an update
    assert max(v for _, v in scalars["fully_async/partial/total_partial_num"]) > 0
    assert max(v for _, v in scalars["memory/rollout/swap_gib"]) > 0                  # KV swapped through turns
    assert max(v for _, v in scalars["memory/rollout/freed_switches"]) >= 2         # (a trainer may keep its turn)
    assert max(v for _, v in scalars["fully_async/rollouter/kept_in_flight"]) > 0
    assert all(v == 0 for _, v in scalars["memory/rollout/kept_resident"])          # forced: never kept
