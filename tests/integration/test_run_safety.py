"""A run's folder is its own (lock), a damaged checkpoint is never resumed, a config change that breaks
the saved state is refused, and Ctrl-C during start-up ends the run cleanly.

The lock and the signals are checked on `python -m fully_async.main` processes (the signals' two runs side by side);
the checkpoint runs, where the process is not the point, run in the test's process on the shared Ray."""
import json
import os
import shutil
import signal
import socket
import time

import pytest

from test_reliability import Run, common, own_tmpdir, raylets

pytestmark = pytest.mark.integration


def test_second_run_in_a_locked_folder_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # a live run holds it: this test process
    (ckpt / "fully_async.lock").write_text(json.dumps({"pid": os.getpid(), "hostname": socket.gethostname(),
                                                       "started": time.time(), "command": "python -m x"}))
    run = Run(tmp_path, *common(tmp_path, 2))
    assert run.wait(120) == 1, run.output[-3000:]
    out = run.output
    assert f"{ckpt} (trainer.default_local_dir) is in use by another run: pid {os.getpid()} on host " \
           f"{socket.gethostname()}" in out
    assert "Traceback" not in out and "data:" not in out  # refused before anything was loaded
    assert (ckpt / "fully_async.lock").exists()  # the holder's lock is left alone


@pytest.fixture(scope="module")
def ray_session():
    """The shared Ray, for the damaged-checkpoint runs (in this process: the process is not what they check)."""
    import tests_helpers

    yield from tests_helpers.ray_session(num_cpus=3)


def test_damaged_newest_checkpoint_falls_back_and_config_changes_are_checked(tmp_path, monkeypatch, caplog,
                                                                          ray_session):
    from fully_async.run.hydra_setup import load_config, user_errors
    from fully_async.run.main import run

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    args = ["trainer.progress_bar=false", *common(tmp_path, 2), "trainer.save_freq=1", "data.val_files=null"]
    assert run(load_config(args))["steps"] == 2
    ckpt = tmp_path / "ckpt"
    assert not (ckpt / "fully_async.lock").exists()  # released at the end
    assert (ckpt / "global_step_2" / "manifest.json").exists() and (ckpt / "global_step_2" / "config.json").exists()
    model = next((ckpt / "global_step_2").rglob("model.safetensors"))
    with open(model, "r+b") as fh:
        fh.truncate(model.stat().st_size // 2)
    rel = model.relative_to(ckpt / "global_step_2")

    caplog.set_level("INFO", logger="fully_async")
    # refused with an error the entry point prints as one line (no traceback) before it exits 1
    with pytest.raises(Exception) as refused:
        run(load_config([*args, "actor_rollout_ref.rollout.n=4"]))
    assert isinstance(refused.value, user_errors()), repr(refused.value)   # (asked after: its module is imported)
    out = caplog.text + str(refused.value)
    assert f"checkpoint {ckpt}/global_step_2 is damaged ({rel}: " in out  # the fallback, then the config check
    assert f"cannot resume from {ckpt}/global_step_1" in out and "actor_rollout_ref.rollout.n: 8 -> 4" in out
    assert "trainer.resume_allow_config_change=[actor_rollout_ref.rollout.n]" in str(refused.value)

    # one run carries both: it resumes from the fallback (the damaged step 2 was set aside) and the change is accepted
    caplog.clear()
    allowed = run(load_config(["trainer.progress_bar=false", *common(tmp_path, 3), "trainer.save_freq=1",
                               "data.val_files=null", "actor_rollout_ref.rollout.n=4",
                               "trainer.resume_allow_config_change=[actor_rollout_ref.rollout.n]"]))
    assert allowed["steps"] == 3
    assert "accepted by trainer.resume_allow_config_change: actor_rollout_ref.rollout.n: 8 -> 4" in caplog.text
    assert f"resuming from {ckpt}/global_step_1" in caplog.text
    for step in (2, 3):  # the step the damaged checkpoint held is trained again, and the run goes on past it
        state = json.loads((ckpt / f"global_step_{step}" / "trainer_state.json").read_text())
        assert state["step"] == step and len(set(state["trained_sample_ids"])) == len(state["trained_sample_ids"])


SIGNALS = [signal.SIGINT, signal.SIGTERM]


@pytest.fixture(scope="module")
def interrupted_start_ups(tmp_path_factory):
    """One run per signal, started side by side, each sent its signal once it read its data (during start-up):
    {signum: (run, its tmp folder)}; and the raylets of the Rays they started still running after them (0)."""
    tmpdirs = [own_tmpdir() for _ in SIGNALS]
    runs = {}
    for signum, tmpdir in zip(SIGNALS, tmpdirs):
        tmp = tmp_path_factory.mktemp(f"start_{signal.Signals(signum).name}")
        runs[signum] = (Run(tmp, *common(tmp, 20), env={"TMPDIR": tmpdir}), tmp)
    try:
        waiting, deadline = dict(runs), time.monotonic() + 180
        while waiting:  # each signalled as soon as it printed its data line (the start-up has begun)
            for signum, (run, _) in list(waiting.items()):
                if any("data: " in line for line in list(run.lines)):
                    run.proc.send_signal(signum)
                    del waiting[signum]
                else:
                    assert run.proc.poll() is None and time.monotonic() < deadline, run.output[-4000:]
            time.sleep(0.05)
        for run, _ in runs.values():
            run.wait(120)
        deadline = time.monotonic() + 15
        left = lambda: sum(raylets(d) for d in tmpdirs)   # noqa: E731
        while left() and time.monotonic() < deadline:  # the Rays they started are shut down with them
            time.sleep(0.2)
        yield runs, left()
    finally:
        for run, _ in runs.values():
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait(30)
        for tmpdir in tmpdirs:
            shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.mark.parametrize("signum", SIGNALS)
def test_signal_during_start_up_exits_cleanly(interrupted_start_ups, signum):
    runs, left = interrupted_start_ups
    run, tmp_path = runs[signum]
    assert run.proc.returncode == 128 + signum, run.output[-3000:]
    out = run.output
    assert f"interrupted by {signal.Signals(signum).name} during start-up" in out
    assert "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "ckpt" / "fully_async.lock").exists()
    assert left == 0
