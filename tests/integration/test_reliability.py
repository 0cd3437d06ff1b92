"""Crashes, restarts, hangs and signals, end to end on the bundled tiny task (real Ray, real processes).

A failing run is a `python -m fully_async.main` subprocess where the process is what is checked (its exit code, the
console and the traceback file, the Ray it started shut down with it): the failing engine replica.  Every other
failure is injected into a run in the test's process under the shared Ray (module fixture `ray_session`, ~10 s less
than a subprocess each): a thread watches the run's console and kills (SIGKILL) or stops (SIGSTOP) one of its actors'
processes (reliability_inprocess.py), and the test checks the driver's RunFailed, which the entry point prints as
the one-line cause before it exits 1.  The watchdog's timeouts are set as short as the runs allow.  The timeline
checks run in-process in test_reliability_timeline.py.

Slow: six runs (one a subprocess, ~15-20 s; two of the in-process ones with two rollout replicas, whose actors take
~10 s to start), each failure needing a run of its own, plus the watchdog's own timeouts."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from fully_async.cluster.ray_utils import RunFailed
from fully_async.run.hydra_setup import load_config
import tests_helpers

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(REPO, "tests")


@pytest.fixture(scope="module")
def ray_session():
    yield from tests_helpers.ray_session(num_cpus=3)


def run_here(tmp_path, monkeypatch, *overrides) -> dict:
    """The run in this process under the shared Ray, its TensorBoard run in tmp_path/tb; its summary."""
    from fully_async.run.main import run

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    return run(load_config(["trainer.progress_bar=false", *overrides]))


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

    def wait_for(self, pattern, timeout=400):   # a loaded 2-core machine may take minutes to start the actors
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


def actors_ready_at(caplog) -> float:
    """time.time() of the run's "actors ready" log line."""
    return next(r.created for r in caplog.records if r.getMessage().startswith("actors ready in"))


def common(tmp_path, steps):
    return [f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.total_training_steps={steps}"]


def test_trainer_killed_then_resume_loses_and_repeats_nothing(tmp_path, monkeypatch, caplog, ray_session):
    """With 2 rollout replicas the checkpoint holds partial responses interrupted on both engines.  (One replica
    was a second run of this test; the single-replica resume is test_signals' SIGTERM case, exactly-once included.)
    The trainer's process is killed (SIGKILL) after the step-4 checkpoint: the run fails naming it; the resumed run
    goes on from the last checkpoint."""
    from reliability_inprocess import Injection, checkpointed, kill_after

    args = common(tmp_path, 8) + ["trainer.save_freq=2", "data.val_files=null", "rollout.n_gpus_per_node=2"]
    killed_at: list = []
    injection = Injection(monkeypatch, kill_after(checkpointed(str(tmp_path / "ckpt"), 4), "Trainer", killed_at))
    caplog.set_level("INFO", logger="fully_async")
    with pytest.raises(RunFailed, match="trainer failed"):
        injection.run(lambda: run_here(tmp_path, monkeypatch, *args))
    assert killed_at
    from fully_async.core.checkpoint import list_checkpoints, read_state
    saved = list_checkpoints(str(tmp_path / "ckpt"))
    assert saved and saved[-1] < 8
    resumed_from = saved[-1]
    snap = read_state(str(tmp_path / "ckpt" / f"global_step_{resumed_from}" / "rollout_state.json"))
    queued = read_state(str(tmp_path / "ckpt" / f"global_step_{resumed_from}" / "queue_state.json"))

    caplog.clear()
    assert run_here(tmp_path, monkeypatch, *args)["steps"] == 8
    assert f"resuming from {tmp_path}/ckpt/global_step_{resumed_from}" in caplog.text
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


def own_tmpdir() -> str:
    """A short TMPDIR for one run: the local Ray it starts keeps its session (and its raylet's socket paths, at most
    107 characters) under it, so that raylet can be told from the ones of tests running beside it, which start
    and stop their own (a count of every raylet on the machine moves with them)."""
    return tempfile.mkdtemp(prefix="rt")


def raylets(tmpdir: str) -> int:
    """The raylets running whose command line names `tmpdir`: the Ray of a run started with TMPDIR=tmpdir."""
    r = subprocess.run(["pgrep", "-f", f"ray/core/src/ray/raylet/raylet .*{tmpdir}/"], capture_output=True, text=True)
    return len(r.stdout.split())


def test_rollouter_killed_fails_the_run_fast_naming_it(tmp_path, monkeypatch, ray_session):
    """SIGKILL of the rollouter's process: the driver notices within seconds and fails the run naming it (the entry
    point's exit 1 and the Ray shut down with the driver: test_failing_engine_replica_stops_the_run_naming_it)."""
    from reliability_inprocess import Injection, kill_after, printed

    killed_at: list = []
    injection = Injection(monkeypatch, kill_after(printed(r"step 2 \|"), "Rollouter", killed_at))
    with pytest.raises(RunFailed) as failed:
        injection.run(lambda: run_here(tmp_path, monkeypatch, *common(tmp_path, 200), "data.val_files=null"))
    ended = time.monotonic()
    elapsed = ended - killed_at[0]
    print(f"time to fail after the rollouter was killed: {elapsed:.1f}s")
    assert elapsed < 30
    assert re.search(r"rollouter failed: .*(died|ActorDiedError|RayActorError)", str(failed.value)), failed.value


def test_watchdog_fails_a_wedged_engine_with_state(tmp_path, monkeypatch, caplog, ray_session):
    caplog.set_level("INFO", logger="fully_async")
    with pytest.raises(RunFailed) as failed:
        run_here(tmp_path, monkeypatch, *common(tmp_path, 20), "actor_rollout_ref.rollout.name=fakes:HangingEngine",
                 "trainer.progress_timeout_s=4", "trainer.val_before_train=false")
    assert time.time() - actors_ready_at(caplog) < 60   # the watchdog's 4 s and its poll, not the engine's hang
    out = str(failed.value)
    assert "no progress for" in out and "trainer.progress_timeout_s=4" in out
    assert "in_flight_requests" in out and re.search(r"'trainer': \{'step': \d+", out)  # the counters


def test_failing_engine_replica_stops_the_run_naming_it(tmp_path):
    """Two rollout replicas; replica 1's engine raises: the run exits 1 naming the replica and its cause, and the Ray
    it started is shut down with it."""
    tmpdir = own_tmpdir()
    run = Run(tmp_path, *common(tmp_path, 20), "rollout.n_gpus_per_node=2",
              "actor_rollout_ref.rollout.name=fakes:SecondReplicaCrashes", "trainer.val_before_train=false",
              env={"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""), "TMPDIR": tmpdir})
    start, seen, ready = time.monotonic(), 0, None
    while run.proc.poll() is None and time.monotonic() - start < 400:
        seen = max(seen, raylets(tmpdir))   # the run's own Ray, while it runs
        if ready is None and "actors ready in" in run.output:
            ready = time.monotonic()
        time.sleep(0.2)
    assert run.wait(10) == 1, run.output[-3000:]
    # the replica fails at its first generation: the run stops within a minute of its actors being ready (CI's loaded
    # machine once took 144 s to start two replicas' actors)
    assert ready is not None and time.monotonic() - ready < 60, run.output[-3000:]
    assert seen, f"no raylet under {tmpdir} was seen while the run ran"
    assert re.search(r"rollouter failed: ReplicaFailed: rollout engine replica 1 \(engine1\) failed: .*"
                     r"replica exploded on purpose", run.output), run.output[-3000:]
    # the console keeps the one-line cause; the traceback, down to the engine's frame that raised, is in a file
    # beside the run's log, and the console names it
    tb = tmp_path / "hydra" / "failure_traceback.txt"
    assert f"the failing code's traceback: {tb}" in run.output, run.output[-3000:]
    text = tb.read_text()
    assert re.search(r'File ".*fakes\.py", line \d+, in collect', text) and "replica exploded on purpose" in text
    assert "\x1b[" not in text
    deadline = time.monotonic() + 15
    while raylets(tmpdir) and time.monotonic() < deadline:  # the Ray it started is shut down with it
        time.sleep(0.2)
    assert raylets(tmpdir) == 0
    shutil.rmtree(tmpdir, ignore_errors=True)


def test_a_stopped_trainer_is_named_and_the_run_ends(tmp_path, monkeypatch, ray_session):
    """kill -STOP of the trainer (a scheduler's suspend, a debugger, a reward holding the GIL): the watchdog, which
    never waits on an actor, ends the run within trainer.progress_timeout_s plus a poll, naming the trainer."""
    from reliability_inprocess import Injection, actor_pid, ensure_gone

    stopped: list = []

    def stop_the_trainer(console, since):
        console.wait_for(r"step 2 \|")
        # the watchdog polls every 1.5 s here (a quarter of the timeout) and steps take a fraction of a second:
        # stopping the trainer right at step 2 could beat its first answer, and the watchdog would have no last
        # state to name
        time.sleep(4)
        pid = actor_pid("Trainer", since)
        os.kill(pid, signal.SIGSTOP)
        stopped.append((pid, time.monotonic()))

    injection = Injection(monkeypatch, stop_the_trainer)
    try:
        with pytest.raises(RunFailed) as failed:
            injection.run(lambda: run_here(tmp_path, monkeypatch, *common(tmp_path, 1000), "data.val_files=null",
                                           "trainer.progress_timeout_s=6"))
        ended = time.monotonic()
    finally:
        for pid, _ in stopped:
            ensure_gone(pid)
    assert ended - stopped[0][1] < 60
    assert "trainer is not responding (its process is stopped" in str(failed.value), failed.value
    assert "its last state: {" in str(failed.value)
