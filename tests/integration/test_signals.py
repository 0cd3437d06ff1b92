"""Signals to the whole process group (a batch scheduler, `timeout`, `kill -- -PGID`, a closed terminal) end the
run with a complete checkpoint, no lock, no Ray process behind, within a bounded time (real Ray, real processes).

Ray's processes run in a session of their own, so only the driver receives the group's signal; it stops the run
gracefully (with the default trainer.save_freq=-1: an emergency checkpoint) and shuts Ray down itself.

The three signals' runs start side by side (one module fixture; their start-ups overlap on the CPU's idle waits);
the resume from the SIGTERM checkpoint, where the process is not the point, runs in the test's process on the
shared Ray."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import tests_helpers

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

    def wait_for(self, pattern, timeout=400):   # a loaded 2-core machine may take minutes to start the actors
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


SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT]


@pytest.fixture(scope="module")
def ray_session():
    """The shared Ray, for the in-process run that resumes from the SIGTERM checkpoint."""
    yield from tests_helpers.ray_session(num_cpus=3)


@pytest.fixture(scope="module")
def signalled(tmp_path_factory):
    """One run per signal, started side by side (their start-ups overlap), each sent its signal to its whole process
    group once it trained step 2: {signum: (run, its folder, seconds from the signal to its exit, the processes of
    its Ray session still there 2 s after the exit)}."""
    runs = {}
    for signum in SIGNALS:
        tmp = tmp_path_factory.mktemp(signal.Signals(signum).name)
        # trainer.save_freq stays -1 (the default): an emergency checkpoint
        runs[signum] = (GroupRun(tmp, f"trainer.default_local_dir={tmp / 'ckpt'}", "trainer.total_training_steps=2000",
                                 "data.val_files=null", "trainer.progress_timeout_s=60"), tmp)
    sent = {}
    try:
        for signum, (run, _) in runs.items():
            run.wait_for(r"step 2 \|")
            sent[signum] = time.monotonic()
            os.killpg(run.proc.pid, signum)  # what `timeout`, a scheduler or `kill -- -PGID` does
        ended, left, deadline = {}, {}, time.monotonic() + 90
        while len(left) < len(runs) and time.monotonic() < deadline:
            for signum, (run, _) in runs.items():
                if signum not in ended and run.proc.poll() is not None:
                    ended[signum] = time.monotonic()
                    run.reader.join(10)
                if signum in ended and signum not in left:
                    # the last Ray processes may take a moment to go after the driver exits: 2 s
                    m = re.search(r"session folder (\S+) \(in a 0700 folder\)", run.output)
                    there = ray_processes_of(os.path.basename(m.group(1))) if m else ["no session folder printed"]
                    if not there or time.monotonic() > ended[signum] + 2:
                        left[signum] = there
            time.sleep(0.1)
        out = {signum: (run, tmp, ended.get(signum, float("inf")) - sent[signum], left.get(signum))
               for signum, (run, tmp) in runs.items()}
        yield out
    finally:
        for run, _ in runs.values():
            if run.proc.poll() is None:
                os.killpg(run.proc.pid, signal.SIGKILL)
                run.proc.wait(30)


@pytest.mark.parametrize("signum", SIGNALS)
def test_a_signal_to_the_whole_process_group_ends_in_a_checkpoint(ray_session, signalled, monkeypatch, signum):
    run, tmp_path, took, left = signalled[signum]
    ckpt = tmp_path / "ckpt"
    assert run.proc.returncode == 128 + signum, run.output[-3000:]
    assert took < 60, took
    folder = re.search(r"session folder (\S+) \(in a 0700 folder\)", run.output).group(1)
    private = os.path.dirname(os.path.dirname(folder))  # <tmp>/fully_async-<uid>/ray/session_...
    assert os.stat(private).st_mode & 0o777 == 0o700 and private.endswith(f"fully_async-{os.getuid()}")
    session = os.path.basename(folder)
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
    assert session.startswith("session_") and left == [], left
    if signum != signal.SIGTERM:
        return
    # the checkpoint resumes (in this process, on the shared Ray: the process is not what is checked here): two more
    # steps, every sample trained exactly once over both runs
    from fully_async.run.hydra_setup import load_config
    from fully_async.run.main import run as run_here

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    total = saved[0] + 2
    summary = run_here(load_config(["trainer.progress_bar=false", f"trainer.default_local_dir={ckpt}",
                                    f"trainer.total_training_steps={total}", "data.val_files=null",
                                    "trainer.save_freq=1000"]))
    assert summary["steps"] == total
    state = json.loads((ckpt / f"global_step_{total}" / "trainer_state.json").read_text())
    assert len(state["trained_sample_ids"]) == len(set(state["trained_sample_ids"])) == total * 16 * 8
