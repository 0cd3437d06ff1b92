"""Signals to the whole process group (a batch scheduler, `timeout`, `kill -- -PGID`, a closed terminal) end the
run with a complete checkpoint, no lock, no Ray process behind, within a bounded time (real Ray, real processes).

Ray's processes run in a session of their own, so only the driver receives the group's signal; it stops the run
gracefully (with the default trainer.save_freq=-1: an emergency checkpoint) and shuts Ray down itself."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class GroupRun:
    """`python -m fully_async.main` as the leader of a process group of its own (as under a scheduler)."""

    def __init__(self, tmp_path, *overrides):
        self.lines: list[str] = []
        cmd = [sys.executable, "-u", "-m", "fully_async.main", "trainer.progress_bar=false",
               f"hydra.run.dir={tmp_path}/hydra", *overrides]
        env = dict(os.environ, TENSORBOARD_DIR=str(tmp_path / "tb"), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                     env=env, start_new_session=True)
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def wait_for(self, pattern, timeout=180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if any(re.search(pattern, line) for line in list(self.lines)):
                return
            time.sleep(0.1)
        raise AssertionError(f"{pattern!r} never appeared:\n{''.join(self.lines)[-4000:]}")

    @property
    def output(self):
        return "".join(self.lines)


def ray_processes_of(session: str) -> list[str]:
    """Processes whose command line names this run's Ray session (GCS, raylet, agents, workers)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if session in cmd and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd[:120]}")
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_to_the_whole_process_group_ends_in_a_checkpoint(tmp_path, signum):
    ckpt = tmp_path / "ckpt"
    args = [f"trainer.default_local_dir={ckpt}", "trainer.total_training_steps=200", "data.val_files=null",
            "trainer.progress_timeout_s=60"]  # trainer.save_freq stays -1 (the default): an emergency checkpoint
    run = GroupRun(tmp_path, *args)
    run.wait_for(r"step 2 \|")
    folder = re.search(r"session folder (\S+) \(in a 0700 folder\)", run.output).group(1)
    private = os.path.dirname(os.path.dirname(folder))  # <tmp>/fully_async-<uid>/ray/session_...
    assert os.stat(private).st_mode & 0o777 == 0o700 and private.endswith(f"fully_async-{os.getuid()}")
    session = os.path.basename(folder)
    t0 = time.monotonic()
    os.killpg(run.proc.pid, signum)  # what `timeout`, a scheduler or `kill -- -PGID` does
    rc = run.proc.wait(90)
    run.reader.join(10)
    took = time.monotonic() - t0
    assert rc == 128 + signum, run.output[-3000:]
    assert took < 60, took
    m = re.search(rf"interrupted by {signal.Signals(signum).name}; checkpoint: (\S+)", run.output)
    assert m, run.output[-3000:]
    from fully_async.core.checkpoint import find_resume_path, list_checkpoints
    saved = list_checkpoints(str(ckpt))
    assert len(saved) == 1 and m.group(1).endswith(f"global_step_{saved[0]}") and saved[0] >= 2
    assert not [n for n in os.listdir(ckpt) if n.startswith(".tmp_")]
    assert not (ckpt / "fully_async.lock").exists()

    class T:
        resume_mode, default_local_dir, resume_from_path = "auto", str(ckpt), None
    assert find_resume_path(T) == m.group(1)  # complete: its manifest verifies
    state = json.loads((ckpt / f"global_step_{saved[0]}" / "trainer_state.json").read_text())
    assert len(state["trained_sample_ids"]) == len(set(state["trained_sample_ids"])) == saved[0] * 16 * 8
    assert "Failed to connect to GCS" not in run.output
    deadline = time.monotonic() + 2  # the last Ray processes may take a moment to go after the driver exits
    while ray_processes_of(session) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert session.startswith("session_") and not ray_processes_of(session), ray_processes_of(session)
    if signum != signal.SIGTERM:
        return
    # the checkpoint resumes: two more steps, every sample trained exactly once over both runs
    total = saved[0] + 2
    again = subprocess.run([sys.executable, "-m", "fully_async.main", "trainer.progress_bar=false",
                            f"hydra.run.dir={tmp_path}/hydra2", *args[:1], f"trainer.total_training_steps={total}",
                            "data.val_files=null", "trainer.save_freq=1000"], cwd=REPO, capture_output=True,
                           text=True, timeout=300, env=dict(os.environ, TENSORBOARD_DIR=str(tmp_path / "tb")))
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    state = json.loads((ckpt / f"global_step_{total}" / "trainer_state.json").read_text())
    assert len(state["trained_sample_ids"]) == len(set(state["trained_sample_ids"])) == total * 16 * 8
