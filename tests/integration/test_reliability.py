"""Crashes, restarts, hangs and signals, end to end on the bundled tiny task (real Ray, real processes).

Slow: six `python -m fully_async.main` subprocesses (~15-20 s of fixed cost each), one per failure, since the process
is what each test checks (SIGKILL of an actor, SIGSTOP, exit codes, Ray shut down with the driver), plus the watchdog's
own timeouts, set as short as the runs allow.  The timeline checks, where the process is not the point, run
in-process in test_reliability_timeline.py."""
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
TESTS = os.path.join(REPO, "tests")


class Run:
    """`python -m fully_async.main` in a subprocess whose output is watched line by line."""

    def __init__(self, tmp_path, *overrides, env=None):
        self.lines: list[str] = []
        self.pids: dict[str, int] = {}
        cmd = [sys.executable, "-u", "-m", "fully_async.main", "trainer.progress_bar=false",
               f"hydra.run.dir={tmp_path}/hydra", *overrides]
        full_env = dict(os.environ, TENSORBOARD_DIR=str(tmp_path / "tb"), PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                     env=full_env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"\((Trainer|Rollouter) pid=(\d+)", line)
            if m:
                self.pids.setdefault(m.group(1).lower(), int(m.group(2)))

    def wait_for(self, pattern, timeout=180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(re.search(pattern, line) for line in list(self.lines)):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{pattern!r} never appeared:\n{self.output[-4000:]}")

    def wait(self, timeout=300):
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        return rc

    @property
    def output(self):
        return "".join(self.lines)


def common(tmp_path, steps):
    return [f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.total_training_steps={steps}"]


def test_trainer_killed_then_resume_loses_and_repeats_nothing(tmp_path):
    """With 2 rollout replicas the checkpoint holds partial responses interrupted on both engines.  (One replica
    was a second run of this test; the single-replica resume is test_signals' SIGTERM case, exactly-once included.)"""
    args = common(tmp_path, 8) + ["trainer.save_freq=2", "data.val_files=null", "rollout.n_gpus_per_node=2"]
    first = Run(tmp_path, *args)
    first.wait_for(r"checkpoint .*global_step_4")
    first.wait_for(r"\(Trainer pid=")
    os.kill(first.pids["trainer"], signal.SIGKILL)
    assert first.wait(120) == 1
    assert "trainer failed" in first.output
    from fully_async.core.checkpoint import list_checkpoints, read_state
    saved = list_checkpoints(str(tmp_path / "ckpt"))
    assert saved and saved[-1] < 8
    resumed_from = saved[-1]
    snap = read_state(str(tmp_path / "ckpt" / f"global_step_{resumed_from}" / "rollout_state.json"))
    queued = read_state(str(tmp_path / "ckpt" / f"global_step_{resumed_from}" / "queue_state.json"))

    second = Run(tmp_path, *args)
    assert second.wait(300) == 0, second.output[-4000:]
    assert f"resuming from {tmp_path}/ckpt/global_step_{resumed_from}" in second.output
    state = json.loads((tmp_path / "ckpt" / "global_step_8" / "trainer_state.json").read_text())
    ids = state["trained_sample_ids"]
    assert len(ids) == len(set(ids)) == 8 * 16 * 8          # nothing trained twice, nothing lost
    assert len({i.rsplit("-s", 1)[0] for i in ids}) == 8 * 16  # each prompt once: data position continued
    carried = {p.sample_id for p in snap["pending"]} | {s.sample_id for g in queued for s in g.samples}
    assert carried <= set(ids)                               # queued and partial responses were trained
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    versions = [(e.step, e.value) for e in acc.Scalars("fully_async/count/current_param_version")]
    resumed = [v for s, v in versions if s > resumed_from]
    assert resumed[0] == resumed_from                        # the param version continued


def raylets() -> int:
    r = subprocess.run(["pgrep", "-f", "ray/core/src/ray/raylet/raylet"], capture_output=True, text=True)
    return len(r.stdout.split())


def test_rollouter_killed_exits_nonzero_fast_naming_it(tmp_path):
    before = raylets()
    run = Run(tmp_path, *common(tmp_path, 200), "data.val_files=null")
    run.wait_for(r"step 2 \|")
    run.wait_for(r"\(Rollouter pid=")
    start = time.monotonic()
    os.kill(run.pids["rollouter"], signal.SIGKILL)
    rc = run.wait(60)
    elapsed = time.monotonic() - start
    print(f"time to exit after the rollouter was killed: {elapsed:.1f}s")
    assert rc == 1 and elapsed < 30
    assert re.search(r"rollouter failed: .*(died|ActorDiedError|RayActorError)", run.output), run.output[-3000:]
    deadline = time.monotonic() + 15
    while raylets() > before and time.monotonic() < deadline:  # the Ray it started is shut down with it
        time.sleep(0.2)
    assert raylets() == before


def test_watchdog_fails_a_wedged_engine_with_state(tmp_path):
    run = Run(tmp_path, *common(tmp_path, 20), "actor_rollout_ref.rollout.name=fakes:HangingEngine",
              "trainer.progress_timeout_s=6", "trainer.val_before_train=false",
              env={"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")})
    start = time.monotonic()
    assert run.wait(120) == 1
    assert time.monotonic() - start < 90
    out = run.output
    assert "no progress for" in out and "trainer.progress_timeout_s=6" in out
    assert "in_flight_requests" in out and re.search(r"'trainer': \{'step': \d+", out)  # the counters


def test_failing_engine_replica_stops_the_run_naming_it(tmp_path):
    """Two rollout replicas; replica 1's engine raises: the run exits 1 naming the replica and its cause."""
    run = Run(tmp_path, *common(tmp_path, 20), "rollout.n_gpus_per_node=2",
              "actor_rollout_ref.rollout.name=fakes:SecondReplicaCrashes", "trainer.val_before_train=false",
              env={"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")})
    start = time.monotonic()
    assert run.wait(180) == 1, run.output[-3000:]
    assert time.monotonic() - start < 150
    assert re.search(r"rollouter failed: ReplicaFailed: rollout engine replica 1 \(engine1\) failed: .*"
                     r"replica exploded on purpose", run.output), run.output[-3000:]
    # the console keeps the one-line cause; the traceback, down to the engine's frame that raised, is in a file
    # beside the run's log, and the console names it
    tb = tmp_path / "hydra" / "failure_traceback.txt"
    assert f"the failing code's traceback: {tb}" in run.output, run.output[-3000:]
    text = tb.read_text()
    assert re.search(r'File ".*fakes\.py", line \d+, in collect', text) and "replica exploded on purpose" in text
    assert "\x1b[" not in text


def test_a_stopped_trainer_is_named_and_the_run_ends(tmp_path):
    """kill -STOP of the trainer (a scheduler's suspend, a debugger, a reward holding the GIL): the watchdog, which
    never waits on an actor, ends the run within trainer.progress_timeout_s plus a poll, naming the trainer."""
    run = Run(tmp_path, *common(tmp_path, 5000), "data.val_files=null", "trainer.progress_timeout_s=10")
    run.wait_for(r"step 2 \|")
    # the watchdog polls every 2.5 s here (a quarter of the timeout) and steps take a fraction of a second: stopping
    # the trainer right at step 2 could beat its first answer, and the watchdog would have no last state to name
    time.sleep(6)
    assert run.proc.poll() is None, run.output[-3000:]
    pid = run.pids["trainer"]
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        rc = run.wait(60)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert rc == 1, run.output[-3000:]
    assert time.monotonic() - t0 < 60
    assert "trainer is not responding (its process is stopped" in run.output, run.output[-3000:]
    assert "its last state: {" in run.output
