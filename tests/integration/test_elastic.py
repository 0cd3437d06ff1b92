"""Elastic trainer devices (async_training.placement=elastic) on logical CPU devices: the engines beside the trainer
ranks generate in the rollouter's pool while the trainer waits; the run learns the bundled task as well as sync at
equal steps and trains every sample once; reclaiming them parks their in-flight responses, which continue on the
rollout replica, and a run stopped at a checkpoint resumes losing and repeating nothing."""
import os

import pytest

from fully_async.run.hydra_setup import load_config
import tests_helpers
from tests_helpers import SYNC_LEARNING as COMMON, SYNC_LEARNING_STEPS as STEPS, read_scalars

pytestmark = [pytest.mark.integration, pytest.mark.alone]   # timing: see suite_budget.machine_share
# one group (rollout.n=8) per engine at a time: the rollout replica alone cannot keep up, so the trainer waits and
# lends its engine
ELASTIC = ["async_training.placement=elastic", "actor_rollout_ref.rollout.max_num_seqs=8"]


@pytest.fixture(scope="module")
def ray_session():
    yield from tests_helpers.ray_session(num_cpus=3)



def total(scalars, tag):
    return sum(v for _, v in scalars.get(tag, []))


def test_elastic_learns_as_sync_does_and_trains_each_sample_once(ray_session, sync_learning_run, tmp_path,
                                                                monkeypatch):
    from fully_async.run.main import run

    got = {}
    sync_summary, got["sync"] = sync_learning_run   # the same COMMON, mode=sync (conftest.SYNC_LEARNING)
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "elastic"))
    summary = run(load_config([*COMMON, *ELASTIC, f"trainer.default_local_dir={tmp_path}/ck_elastic"]))
    got["elastic"] = tests_helpers.first_and_last_val(str(tmp_path / "elastic"))
    for mode, run_summary in (("sync", sync_summary), ("elastic", summary)):
        ids = run_summary["trained_sample_ids"]
        assert run_summary["steps"] == STEPS and len(ids) == len(set(ids)) == STEPS * 16 * 8, mode
    (sync_before, sync_after), (el_before, el_after) = got["sync"], got["elastic"]
    assert el_after - el_before > 0.3, got                     # it learns
    assert el_after >= sync_after - 0.1, got                    # as well as sync at equal steps
    scalars = read_scalars(str(tmp_path / "elastic"))
    assert total(scalars, "fully_async/elastic/tokens") > 0, "the trainer's engine never generated"
    assert total(scalars, "fully_async/elastic/finished") > 0
    assert total(scalars, "fully_async/rollouter/engine_1/tokens") > 0   # the lent engine, in the rollout pool
    idle = dict(scalars["trainer/idle_ratio"])
    left = dict(scalars["fully_async/elastic/trainer_idle_ratio"])
    assert all(left[s] <= idle[s] + 1e-6 for s in left)          # lending only takes idle time away


def test_elastic_preemption_parks_partials_that_resume_and_a_checkpoint_resumes(ray_session, tmp_path, monkeypatch):
    """Two trainer ranks (both engines lent; rank 1's in its worker), responses long enough to be in flight when the
    trainer's batch is ready: reclaiming parks them and they finish on the rollout replica.  A 6-step run saves at
    every step; a second run resumes from the first checkpoint that holds partial responses for 8 steps: its first
    steps are the first run's, and it trains every sample once.  (Which step's checkpoint holds some depends on the
    machine's speed: at step 2 the rollouter has sometimes finished everything the staleness bound admits.)"""
    from fully_async.core.checkpoint import ROLLOUT_STATE, read_state
    from fully_async.run.main import run

    base = [*ELASTIC, "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=fsdp2",
            "benchmark.ignore_eos=true", "benchmark.response_length=lognormal", "data.max_response_length=48",
            "trainer.progress_bar=false",
            "trainer.test_freq=-1", "trainer.save_freq=1", f"trainer.default_local_dir={tmp_path}/ck",
            "trainer.val_before_train=false",
            "async_training.staleness_threshold=2"]   # far ahead: responses in flight at every reclaim and save
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "first"))
    first = run(load_config([*base, "trainer.total_training_steps=6", "trainer.resume_mode=disable"]))
    scalars = read_scalars(str(tmp_path / "first"))
    assert total(scalars, "fully_async/elastic/parked") > 0, "no response was in flight on a reclaimed engine"
    assert total(scalars, "fully_async/rollouter/engine_2/tokens") > 0   # rank 1's engine generated too
    assert len(first["trained_sample_ids"]) == len(set(first["trained_sample_ids"])) == 6 * 16 * 8
    partials = {}
    for k in range(1, 6):   # mid-run checkpoints: the first one saved with responses in flight
        pending = read_state(os.path.join(tmp_path, "ck", f"global_step_{k}", ROLLOUT_STATE))["pending"]
        assert all(len(p.versions) == len(p.token_ids) for p in pending)
        partials[k] = sum(bool(p.token_ids) for p in pending)
    saved = next((k for k, n in partials.items() if n), None)
    assert saved is not None, f"no partial response in any mid-run checkpoint: {partials}"
    ckpt = os.path.join(tmp_path, "ck", f"global_step_{saved}")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "second"))
    second = run(load_config([*base, "trainer.total_training_steps=8", "trainer.resume_mode=resume_path",
                              f"trainer.resume_from_path={ckpt}"]))
    ids = second["trained_sample_ids"]   # the resumed trainer continues the checkpoint's list
    assert second["steps"] == 8 and ids[:saved * 16 * 8] == first["trained_sample_ids"][:saved * 16 * 8]
    assert len(ids) == len(set(ids)) == 8 * 16 * 8
