"""Outputs a user can find: a refused run leaves no empty folder behind (run_lock removes what it made), a new run
beside an earlier one's TensorBoard events gets a folder of its own, and the summary counts the rollouter's pauses
at the staleness bound (whose per-version lines are at debug level)."""
import contextlib
import io
import logging
import os

from fully_async.run.hydra_setup import load_config
from fully_async.run.launcher import own_tensorboard_dir
from fully_async.run.run_lock import LOCK_NAME, acquire
from fully_async.run.run_logging import RunLogger, fresh_tensorboard_dir


def test_a_released_lock_removes_the_folders_it_made_while_they_are_empty(tmp_path):
    lock = acquire(str(tmp_path / "ckpt" / "proj" / "exp"))
    assert (tmp_path / "ckpt" / "proj" / "exp" / LOCK_NAME).exists()
    lock.release()                                           # refused before it wrote anything: nothing is left
    assert os.listdir(tmp_path) == []
    lock = acquire(str(tmp_path / "ckpt" / "proj" / "exp"))
    (tmp_path / "ckpt" / "proj" / "exp" / "global_step_1").mkdir()
    lock.release()                                           # a run that wrote: its folder stays, lock gone
    assert os.listdir(tmp_path / "ckpt" / "proj" / "exp") == ["global_step_1"]
    (tmp_path / "mine").mkdir()
    acquire(str(tmp_path / "mine")).release()                # a folder the user made is never removed
    assert (tmp_path / "mine").is_dir()


def test_a_tensorboard_folder_with_events_gives_the_next_free_sibling(tmp_path):
    tb = tmp_path / "exp"
    assert fresh_tensorboard_dir(str(tb)) is None            # nothing there yet
    tb.mkdir()
    (tb / "config.json").write_text("{}")
    assert fresh_tensorboard_dir(str(tb)) is None            # no events: the run writes there
    (tb / "events.out.tfevents.1.host").write_text("")
    assert fresh_tensorboard_dir(str(tb)) == f"{tb}_2"
    (tmp_path / "exp_2").mkdir()
    (tmp_path / "exp_2" / "events.out.tfevents.2.host").write_text("")
    assert fresh_tensorboard_dir(str(tb) + os.sep) == f"{tb}_3"


def test_a_new_run_writes_beside_the_earlier_runs_events_and_says_where(tmp_path, monkeypatch, caplog):
    tb = tmp_path / "tb"
    tb.mkdir()
    (tb / "events.out.tfevents.1.host").write_text("")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tb))
    cfg = load_config(["trainer.logger=[console,tensorboard]"])
    caplog.set_level(logging.INFO, logger="fully_async")
    with contextlib.ExitStack() as teardown:
        assert own_tensorboard_dir(cfg, teardown) == f"{tb}_2"
        assert os.environ["TENSORBOARD_DIR"] == f"{tb}_2" and (tmp_path / "tb_2" / LOCK_NAME).exists()
    assert os.environ["TENSORBOARD_DIR"] == str(tb)            # restored at the end of the run
    assert not (tmp_path / "tb_2").exists()                   # it wrote nothing here: no empty folder either
    assert f"this run writes to {tb}_2" in caplog.text
    with contextlib.ExitStack() as teardown:                  # no TensorBoard sink: nothing to choose
        assert own_tensorboard_dir(load_config(["trainer.logger=[console]"]), teardown) is None


def test_the_summary_counts_the_pauses_at_the_staleness_bound(caplog):
    cfg = load_config(["trainer.logger=[console]"])
    run_log = RunLogger(cfg, 2, [], stream=io.StringIO())
    for step, pauses in ((1, 3), (2, 7)):                     # a cumulative counter
        run_log._log(step, {"timing_s/step": 1.0, "fully_async/rollouter/bound_pauses": pauses})
    caplog.set_level(logging.INFO, logger="fully_async")
    summary = run_log.finish(2.0)
    assert summary["rollouter_bound_pauses"] == 7
    assert "rollouter: paused at the staleness bound 7 time(s), each until the trainer's next weight update" \
        in caplog.text


def test_ray_log_prefixes_are_plain_into_a_pipe(monkeypatch):
    import io

    from fully_async.cluster.ray_utils import plain_log_prefixes

    class TTY(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    assert not plain_log_prefixes((TTY(), TTY())) and "RAY_COLOR_PREFIX" not in os.environ   # a terminal: colours
    assert plain_log_prefixes((TTY(), io.StringIO()))                                          # stderr to a pipe
    assert os.environ["RAY_COLOR_PREFIX"] == "0"
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")                                                # the user's choice
    assert not plain_log_prefixes((io.StringIO(), io.StringIO())) and os.environ["RAY_COLOR_PREFIX"] == "1"


def test_sync_configs_get_the_bundled_preset_without_the_async_knobs():
    """--config-name=ppo_trainer (verl's main_ppo users) composes to sync mode: the bundled task's preset leaves out
    the async_training.* keys, which sync mode would warn about although the user never set them."""
    from fully_async.run.hydra_setup import compose_overrides, config_mode

    assert config_mode("ppo_trainer") == "sync" and config_mode("dapo_trainer") == "sync"
    assert config_mode("fully_async_ppo_trainer") == "async" and config_mode("ppo_trainer", ["mode=async"]) == "async"
    for name, overrides in (("ppo_trainer", []), ("fully_async_ppo_trainer", ["mode=sync"])):
        assert not [o for o in compose_overrides(overrides, config_name=name) if o.startswith("async_training.")]
    assert [o for o in compose_overrides([]) if o.startswith("async_training.staleness_threshold")]


def test_cfg_job_runs_the_starts_checks_and_says_what_it_skipped(caplog):
    """`--cfg job` on a command the real run refuses exits 1 naming the key (it printed a config before); passing,
    it says which of a start's steps it did not run."""
    import pytest

    from fully_async.core.config import ConfigError
    from fully_async.run import dry_run
    from fully_async.run.hydra_setup import rewrite_argv

    argv = rewrite_argv(["main", "--cfg", "job", "reward_model.reward_manager=dapo",
                         "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=0"])
    asked = dry_run.wanted(argv)
    assert asked[0] == "fully_async_ppo_trainer" and "reward_model.overlong_buffer.len=0" in asked[2]
    with pytest.raises(ConfigError, match="reward_model.overlong_buffer.len"):
        dry_run.run_checks(*asked)
    with pytest.raises(ConfigError, match="reward_model.overlong_buffer.len"):   # a file not here does not hide it
        dry_run.run_checks(*dry_run.wanted(rewrite_argv(argv + ["data.val_files=/nonexistent/val.parquet"])))
    missing = dry_run.run_checks(*dry_run.wanted(rewrite_argv(["main", "--cfg", "job", "trainer.device=npu",
                                                               "data.val_files=/nonexistent/val.parquet"])))
    assert len(missing) == 2 and "/nonexistent/val.parquet" in missing[0] and "npu" in missing[1].lower()
    assert "not on this machine, so not checked here" in caplog.text
    caplog.clear()
    assert dry_run.wanted(["main", "trainer.device=cpu"]) is None and dry_run.wanted(["main", "--help"]) is None
    assert dry_run.wanted(["main", "--cfg", "hydra"]) is None
    caplog.set_level(logging.INFO, logger="fully_async")
    dry_run.run_checks(*dry_run.wanted(rewrite_argv(["main", "--cfg", "job", "--config-name=ppo_trainer"])))
    assert "the checks a start runs before Ray passed" in caplog.text and "the folder locks" in caplog.text
    assert "has no effect" not in caplog.text                        # sync: no word on keys the user never set
