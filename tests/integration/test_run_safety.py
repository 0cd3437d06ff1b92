"""A run's folder is its own (lock), a damaged checkpoint is never resumed, a config change that breaks
the saved state is refused, and Ctrl-C during start-up ends the run cleanly (real processes)."""
import json
import os
import signal
import socket
import time

import pytest

from test_reliability import Run, common, raylets

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


def test_damaged_newest_checkpoint_falls_back_and_config_changes_are_checked(tmp_path):
    args = common(tmp_path, 2) + ["trainer.save_freq=1", "data.val_files=null"]
    first = Run(tmp_path, *args)
    assert first.wait(300) == 0, first.output[-3000:]
    ckpt = tmp_path / "ckpt"
    assert not (ckpt / "fully_async.lock").exists()  # released at exit
    assert (ckpt / "global_step_2" / "manifest.json").exists() and (ckpt / "global_step_2" / "config.json").exists()
    model = next((ckpt / "global_step_2").rglob("model.safetensors"))
    with open(model, "r+b") as fh:
        fh.truncate(model.stat().st_size // 2)
    rel = model.relative_to(ckpt / "global_step_2")

    changed = Run(tmp_path, *args, "actor_rollout_ref.rollout.n=4")
    assert changed.wait(120) == 1, changed.output[-3000:]
    out = changed.output
    assert f"checkpoint {ckpt}/global_step_2 is damaged ({rel}: " in out  # the fallback, then the config check
    assert f"cannot resume from {ckpt}/global_step_1" in out and "actor_rollout_ref.rollout.n: 8 -> 4" in out
    assert "trainer.resume_allow_config_change=[actor_rollout_ref.rollout.n]" in out and "Traceback" not in out

    # one run carries both: it resumes from the fallback (the damaged step 2 was set aside) and the change is accepted
    allowed = Run(tmp_path, *common(tmp_path, 3), "trainer.save_freq=1", "data.val_files=null",
                  "actor_rollout_ref.rollout.n=4", "trainer.resume_allow_config_change=[actor_rollout_ref.rollout.n]")
    assert allowed.wait(300) == 0, allowed.output[-3000:]
    assert "accepted by trainer.resume_allow_config_change: actor_rollout_ref.rollout.n: 8 -> 4" in allowed.output
    assert f"resuming from {ckpt}/global_step_1" in allowed.output
    for step in (2, 3):  # the step the damaged checkpoint held is trained again, and the run goes on past it
        state = json.loads((ckpt / f"global_step_{step}" / "trainer_state.json").read_text())
        assert state["step"] == step and len(set(state["trained_sample_ids"])) == len(state["trained_sample_ids"])


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_start_up_exits_cleanly(tmp_path, signum):
    before = raylets()
    run = Run(tmp_path, *common(tmp_path, 20))
    run.wait_for(r"data: ")
    run.proc.send_signal(signum)
    assert run.wait(120) == 128 + signum, run.output[-3000:]
    out = run.output
    assert f"interrupted by {signal.Signals(signum).name} during start-up" in out
    assert "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "ckpt" / "fully_async.lock").exists()
    deadline = time.monotonic() + 15
    while raylets() > before and time.monotonic() < deadline:  # the Ray it started is shut down with it
        time.sleep(0.2)
    assert raylets() <= before
