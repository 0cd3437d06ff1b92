"""The driver's console: a progress bar only on a terminal, plain step lines otherwise, every step line in the
log files (main.log), and a summary that says when a run was resumed or stopped."""
import io
import logging

import pytest

from fully_async.run.hydra_setup import load_config
from fully_async.run.run_logging import RunLogger


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def make(stream, *overrides, total=10):
    cfg = load_config(["trainer.logger=[console]", *overrides])
    return RunLogger(cfg, total, [], stream=stream)


def step_metrics(step):
    return {"critic/score/mean": 0.1 * step, "timing_s/step": 1.0}


def test_no_bar_and_plain_lines_when_stdout_is_not_a_tty():
    out = io.StringIO()
    run_log = make(out)
    assert not run_log.interactive
    for step in (1, 2, 3):
        run_log._log(step, step_metrics(step))
    text = out.getvalue()
    assert "\r" not in text and "it/s" not in text
    assert [line.split(" |")[0] for line in text.splitlines()] == ["step 1", "step 2", "step 3"]


def test_bar_on_a_terminal_only_when_asked():
    assert make(FakeTTY()).interactive
    assert not make(FakeTTY(), "trainer.progress_bar=false").interactive


@pytest.mark.parametrize("stream", [io.StringIO(), FakeTTY()], ids=["pipe", "tty"])
def test_step_lines_reach_the_log_file(tmp_path, stream):
    handler = logging.FileHandler(tmp_path / "main.log")
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        run_log = make(stream)
        for step in (1, 2):
            run_log._log(step, step_metrics(step))
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        handler.close()
    lines = (tmp_path / "main.log").read_text().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 1", "step 2"]
    assert stream.getvalue().count("step 1 |") == 1  # the console got each line once


def summary_lines(caplog, run_log):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fully_async"):
        summary = run_log.finish(5.0)
    return summary, caplog.text


def test_summary_of_a_full_run_compares_before_and_after(caplog):
    run_log = make(io.StringIO(), total=3)
    run_log._log(0, {"val-core/arithmetic/reward/mean@1": 0.1})
    for step in (1, 2, 3):
        run_log._log(step, step_metrics(step))
    run_log._log(3, {"val-core/arithmetic/reward/mean@1": 0.5})
    summary, text = summary_lines(caplog, run_log)
    assert "before 0.100 -> after 0.500" in text and "resumed" not in text and "stopped" not in text
    assert summary["val_before"] == 0.1 and summary["val_after"] == 0.5


def test_summary_after_resume_says_resumed_at_step(caplog):
    run_log = make(io.StringIO(), total=10)
    for step in range(6, 11):  # resumed from the checkpoint of step 5: no validation before training
        run_log._log(step, step_metrics(step))
    run_log._log(10, {"val-core/arithmetic/reward/mean@1": 0.5})
    summary, text = summary_lines(caplog, run_log)
    assert "resumed at step 5" in text and "before" not in text
    assert "validation reward at step 10: 0.500" in text
    assert summary["resumed_at_step"] == 5 and "val_before" not in summary


def test_summary_after_ctrl_c_says_stopped_at_step(caplog):
    run_log = make(io.StringIO(), total=10)
    run_log._log(0, {"val-core/arithmetic/reward/mean@1": 0.1})
    for step in (1, 2, 3, 4):
        run_log._log(step, step_metrics(step))
    summary, text = summary_lines(caplog, run_log)
    assert "run stopped at step 4 (of 10)" in text and "before" not in text and "finished" not in text
    assert summary["stopped_at_step"] == 4 and "val_before" not in summary


def test_sync_and_async_default_run_folders_differ(monkeypatch):
    from fully_async.telemetry.metrics import tensorboard_dir

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)

    def tb(*overrides, config_name="fully_async_ppo_trainer"):
        t = load_config(list(overrides), config_name=config_name).trainer
        return tensorboard_dir(t.project_name, t.experiment_name), t.default_local_dir

    async_dirs, sync_dirs = tb(), tb("mode=sync")
    assert async_dirs[0] != sync_dirs[0] and async_dirs[1] != sync_dirs[1]
    assert async_dirs[0].endswith("tiny_arithmetic_async") and sync_dirs[0].endswith("tiny_arithmetic_sync")
    assert tb(config_name="ppo_trainer") == sync_dirs
    megatron = "fully_async_ppo_megatron_trainer"
    assert tb(config_name=megatron)[0] != tb("mode=sync", config_name=megatron)[0]
    # an explicit experiment_name is the user's choice: both modes use it as given
    assert tb("trainer.experiment_name=mine")[0] == tb("mode=sync", "trainer.experiment_name=mine")[0]


def test_summary_names_where_the_checkpoints_went_or_why_none(caplog, tmp_path):
    """verl's default save_freq=-1 keeps no weights: the summary says so and names the key; with checkpoints it names
    the folder and the newest one."""
    run_log = make(io.StringIO(), f"trainer.default_local_dir={tmp_path}", total=1)
    run_log._log(1, step_metrics(1))
    _, text = summary_lines(caplog, run_log)
    assert "checkpoints: none saved: save_freq=-1; set trainer.save_freq" in text
    caplog.clear()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    run_log = make(io.StringIO(), f"trainer.default_local_dir={tmp_path}", "trainer.save_freq=5", total=1)
    run_log._log(1, step_metrics(1))
    _, text = summary_lines(caplog, run_log)
    assert f"checkpoints: {tmp_path} (latest global_step_7)" in text


def test_a_resumed_colocated_runs_summary_counts_from_the_checkpoints_step(caplog):
    """Issue 42: a colocated rollouter loads the resumed weights at its first turn and reports that version's
    metrics at the checkpoint's own step (5): the summary counts from the step it is told, not from the first one
    logged (which said "resumed at step 4: 6 steps")."""
    cfg = load_config(["trainer.logger=[console]"])
    run_log = RunLogger(cfg, 10, [], stream=io.StringIO(), resumed_at=5)
    run_log._log(5, {"fully_async/rollouter/active_time": 1.0})
    for step in range(6, 11):
        run_log._log(step, step_metrics(step))
    summary, text = summary_lines(caplog, run_log)
    assert summary["resumed_at_step"] == 5 and summary["steps"] == 10 and "stopped_at_step" not in summary
    assert "resumed at step 5: 5 steps in this run" in text and "run finished" in text


def test_a_resumed_run_stopped_before_its_first_step_stands_at_the_checkpoint(caplog):
    cfg = load_config(["trainer.logger=[console]"])
    summary, text = summary_lines(caplog, RunLogger(cfg, 10, [], stream=io.StringIO(), resumed_at=5))
    assert summary["steps"] == 5 and summary["stopped_at_step"] == 5 and summary["resumed_at_step"] == 5
    assert "run stopped at step 5 (of 10)" in text and "resumed at step 5: 0 steps in this run" in text


def test_a_fresh_run_is_never_called_resumed(caplog):
    cfg = load_config(["trainer.logger=[console]"])
    run_log = RunLogger(cfg, 3, [], stream=io.StringIO(), resumed_at=0)
    for step in (2, 3):   # (its step 1 line not drained: still a fresh run)
        run_log._log(step, step_metrics(step))
    summary, text = summary_lines(caplog, run_log)
    assert "resumed_at_step" not in summary and "resumed" not in text
