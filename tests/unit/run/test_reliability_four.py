"""Reliability, round four, at unit level (no Ray run): a run trains the steps it was asked for or fails naming why,
a resume past the end is refused, reward extras are finite, a full disk during a checkpoint is named, and bad paths
and sizes give clear errors."""
import errno
import os
from types import SimpleNamespace

import pytest

from fully_async.core import checkpoint as ck
from fully_async.core.config import ConfigError
from fully_async.core.plan import RunPlan
from fully_async.core.trainer_state import RunTooShort, check_run_length
from fully_async.run.hydra_setup import load_config


@pytest.fixture(autouse=True)
def key(tmp_path, monkeypatch):
    monkeypatch.setenv(ck.KEY_ENV, str(tmp_path / "checkpoint.key"))


# ----------------------------------------------------------------------------------- run length: dynamic sampling
DAPO = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward",
        "trainer.total_training_steps=20", "trainer.total_epochs=3", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]


def test_dynamic_sampling_prompts_are_the_epochs_not_steps_times_groups():
    """The issue's 18-of-20 case: the plan capped the prompts at 20 x 4, so dropped groups were never replaced."""
    cfg = load_config(DAPO)
    assert RunPlan.of(cfg).with_data(cfg, 100).total_prompts == 300          # 3 epochs x 100 prompts
    cfg = load_config(DAPO[2:])                                              # no filter: no prompt goes unused
    assert RunPlan.of(cfg).with_data(cfg, 100).total_prompts == 80


def test_scheduler_replaces_dropped_groups_until_the_steps_groups_are_kept():
    from fake_engine import ScriptedEngine, records
    from fully_async.core.data import PromptStream
    from fully_async.core.staleness import StalenessManager
    from fully_async.core.types import SamplingParams
    from fully_async.rollout.scheduler import RolloutScheduler

    done, kept = [], []
    stream = PromptStream(records(30), shuffle=False, seed=0, total_epochs=1)
    sched = RolloutScheduler(ScriptedEngine(max_num_seqs=4), stream, StalenessManager(2, 1, 100.0, 1), 2,
                             SamplingParams(1.0, 1.0, -1, 6), 100, True, on_complete=done.extend)
    wanted = 6   # 3 steps x 2 groups
    sched.demand = lambda: wanted - len(kept)
    rounds = 0
    while not sched.exhausted and rounds < 50:
        rounds += 1
        sched.admit()
        sched.drain()
        for g in done:   # every other group is dropped, as an all-equal group would be
            if int(g.uid.split("p")[1]) % 2 == 0:
                kept.append(g.uid)
        done.clear()
    assert len(kept) == wanted and stream.num_emitted == 11 and sched.exhausted   # p0..p10: six kept
    assert sched.admit() == 0                                  # nothing more is drawn once the groups are kept


def dapo_cfg(steps_from_data=False, enable=True):
    return SimpleNamespace(
        algorithm=SimpleNamespace(filter_groups=SimpleNamespace(enable=enable, metric="seq_reward")),
        trainer=SimpleNamespace(total_epochs=1, steps_from_data=steps_from_data),
        rollout=SimpleNamespace(total_rollout_steps=80))


def test_a_run_short_of_its_steps_fails_naming_both_numbers_and_why():
    with pytest.raises(RunTooShort) as err:
        check_run_length(18, 20, dapo_cfg(), filtered=7)
    msg = str(err.value)
    assert "after 18 of the 20 steps" in msg and "dropped 7 groups" in msg and "total_epochs" in msg
    with pytest.raises(RunTooShort, match="after 0 of the 20 steps"):     # the filter dropped every group
        check_run_length(0, 20, dapo_cfg(steps_from_data=True))
    with pytest.raises(RunTooShort, match="fill only that many steps"):
        check_run_length(3, 5, dapo_cfg(enable=False))
    assert check_run_length(20, 20, dapo_cfg()) is None
    # steps derived from the data (not asked for): the run ends with its data, as verl's DAPO, and says so
    assert "after 18 of at most 20 steps" in check_run_length(18, 20, dapo_cfg(steps_from_data=True))


# ----------------------------------------------------------------------------------- resume
def _ckpt(root, step, rollout=None):
    def write(d):
        ck.write_json(os.path.join(d, ck.TRAINER_STATE), {"step": step, "version": step, "trained_sample_ids": []})
        if rollout is not None:
            ck.write_state(os.path.join(d, ck.ROLLOUT_STATE), rollout)
    return ck.atomic_save(str(root), step, write)


ASYNC_STATE = {"stream": {}, "staleness": {}, "groups": {}, "pending": []}


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_resume_at_or_past_the_end_is_refused_naming_both_numbers(tmp_path, mode):
    path = _ckpt(tmp_path, 20, ASYNC_STATE)
    for total in (8, 20):
        with pytest.raises(ck.CheckpointError) as err:
            ck.check_resume_state(path, mode, total)
        assert f"after step 20, and this run trains {total} steps" in str(err.value)
    assert ck.check_resume_state(path, mode, 21) == 20


def test_an_older_rollout_state_without_pending_is_refused_clearly(tmp_path):
    path = _ckpt(tmp_path, 2, {"stream": {}, "staleness": {}, "groups": {}})
    with pytest.raises(ck.CheckpointError) as err:
        ck.check_resume_state(path, "async", 10)
    assert ck.ROLLOUT_STATE in str(err.value) and "'pending'" in str(err.value) and "older" in str(err.value)
    assert ck.check_resume_state(path, "sync", 10) == 2        # sync mode continues from the stream alone


# ----------------------------------------------------------------------------------- reward extras
def test_a_non_finite_extra_is_refused_naming_the_key_and_data_source():
    import numpy as np

    from fully_async.rewards import RewardError, RewardManager

    def nan_acc(**kw):
        return {"score": 1.0, "acc": float("nan")}

    with pytest.raises(RewardError) as err:
        RewardManager(nan_acc, max_response_length=20).score("my_math", "x", "y", None, 3)
    assert "'acc'" in str(err.value) and "'my_math'" in str(err.value) and "nan_acc" in str(err.value)
    with pytest.raises(RewardError, match="'pred_len'.*'gsm8k'"):
        RewardManager(lambda **kw: {"score": 0.0, "pred_len": np.float32("inf")},
                      max_response_length=20).score("gsm8k", "x", "y", None, 3)
    with pytest.raises(RewardError, match="score nan.*'gsm8k'"):
        RewardManager(lambda **kw: {"score": float("nan")}, max_response_length=20).score("gsm8k", "x", "y", None, 3)
    ok = RewardManager(lambda **kw: {"score": 1.0, "acc": True, "note": "text"}, max_response_length=20)
    assert ok.score("gsm8k", "x", "y", None, 3) == (1.0, {"acc": 1.0})
    # verl's prime manager scores a refused response 0.0 (as a non-finite score), counted
    prime = RewardManager(nan_acc, max_response_length=20, reward_manager="prime")
    assert prime.score("my_math", "x", "y", None, 3) == (0.0, {"acc": 0.0, "score_failed": 1.0})


# ----------------------------------------------------------------------------------- a full disk at a checkpoint
class _Actor:
    def __init__(self, write):
        self.save_part = SimpleNamespace(remote=write)
        self.release = SimpleNamespace(remote=lambda: None)
        self.checkpoint_wanted = SimpleNamespace(remote=lambda: None)


def test_full_disk_during_a_checkpoint_names_the_space_and_removes_the_temporary(tmp_path):
    from fully_async.run.launcher import take_checkpoint

    root = tmp_path / "ck"
    _ckpt(root, 2)
    trainer_cfg = SimpleNamespace(default_local_dir=str(root), max_ckpt_to_keep=None)

    def full(folder):
        with open(os.path.join(folder, "actor_optim.pt"), "wb") as fh:
            fh.write(b"x" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ck.CheckpointError) as err:
        take_checkpoint(trainer_cfg, {"trainer": _Actor(full)}, "trainer", 4, get=lambda x: x)
    msg = str(err.value)
    assert "no space left" in msg and str(root) in msg and "global_step_4" in msg
    assert "(the size of global_step_2)" in msg and "free there" in msg and "removed" in msg
    assert not os.path.exists(root / ".tmp_global_step_4") and ck.list_checkpoints(str(root)) == [2]


def test_a_full_disk_in_the_driver_ends_as_run_failed_with_a_traceback_for_the_file(tmp_path, monkeypatch):
    """serve_checkpoint: the RunFailed carries the traceback that the entry point writes to failure_traceback.txt."""
    import ray

    from fully_async.cluster.ray_utils import RunFailed
    from fully_async.run.launcher import serve_checkpoint

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(ck, "write_manifest", lambda folder: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    calls = SimpleNamespace(poll=lambda name, fn, t: (True, 6))
    trainer = _Actor(lambda d: ck.write_json(os.path.join(d, ck.TRAINER_STATE), {"step": 6, "version": 6}))
    trainer_cfg = SimpleNamespace(default_local_dir=str(tmp_path), max_ckpt_to_keep=None)
    with pytest.raises(RunFailed) as err:
        serve_checkpoint(trainer_cfg, {"trainer": trainer}, "trainer", calls=calls, deadline_s=5)
    assert "checkpoint global_step_6 failed: CheckpointError: no space left on the device of" in str(err.value)
    assert "No space left on device" in err.value.details and "Traceback" in err.value.details
    assert not os.path.exists(tmp_path / ".tmp_global_step_6")


# ----------------------------------------------------------------------------------- paths and sizes
def test_data_paths_that_are_folders_loops_empty_or_not_utf8(tmp_path):
    from fully_async.core.data import DataError, path_problem, read_rows

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.parquet").write_bytes(b"")
    assert "is a folder" in path_problem(str(tmp_path / "d")) and "train.parquet" in path_problem(str(tmp_path / "d"))
    os.symlink(tmp_path / "loop.jsonl", tmp_path / "loop.jsonl")
    assert "loops" in path_problem(str(tmp_path / "loop.jsonl"))
    os.symlink(tmp_path / "gone.jsonl", tmp_path / "dangling.jsonl")
    assert "does not exist" in path_problem(str(tmp_path / "dangling.jsonl"))
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.jsonl is empty \(0 bytes\)"):
        read_rows([str(tmp_path / "empty.jsonl")])
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"blank\.jsonl is empty"):
        read_rows([str(tmp_path / "blank.jsonl")])
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin\.jsonl: line 2 is not UTF-8 text \(byte 0xe9 at column 16\)"):
        read_rows([str(tmp_path / "latin.jsonl")])


def test_data_files_key_names_the_folder_problem(tmp_path):
    from fully_async.core.config_checks import validate

    (tmp_path / "data").mkdir()
    with pytest.raises(ConfigError, match=r"data.train_files.*is a folder, not a data file"):
        validate(load_config([f"data.train_files={tmp_path / 'data'}"]))


def test_checkpoint_folder_that_is_a_file_or_read_only(tmp_path, monkeypatch):
    from fully_async.run.run_lock import acquire

    (tmp_path / "ck").write_text("")
    with pytest.raises(ConfigError, match=r"trainer.default_local_dir.*is a file, not a folder"):
        acquire(str(tmp_path / "ck"))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p).endswith("ro") else real_access(p, mode))
    with pytest.raises(ConfigError, match=r"TensorBoard.*ro is not writable"):
        acquire(str(tmp_path / "ro"), "TensorBoard run dir")


def test_tensorboard_dir_equal_to_the_checkpoint_dir_does_not_lock_the_run_out(tmp_path, monkeypatch):
    from fully_async.run.launcher import run_locks

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "run") + "/")
    cfg = SimpleNamespace(trainer=SimpleNamespace(default_local_dir=str(tmp_path / "run"), logger=["tensorboard"],
                                                  timeline=False, project_name="p", experiment_name="e"))
    locks = run_locks(cfg)
    assert len(locks) == 1 and os.path.isfile(tmp_path / "run" / "fully_async.lock")
    locks[0].release()
    assert not os.path.exists(tmp_path / "run" / "fully_async.lock")


def test_plan_refuses_absurd_device_counts_at_once():
    import time

    from fully_async.run.plan_options import MAX_DEVICES, parse

    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"plan.devices.*100000000 devices: at most {MAX_DEVICES}"):
        parse(["plan.devices=[8,100000000]"])
    assert time.perf_counter() - t0 < 1.0
    assert parse([f"plan.devices=[8,{MAX_DEVICES}]"]).devices == [8, MAX_DEVICES]
