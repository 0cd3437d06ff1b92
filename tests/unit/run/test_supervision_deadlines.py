"""The driver never blocks on an actor: a stopped actor (SIGSTOP) is named by the watchdog, with the last state it
reported, and every other call from the driver (outboxes, the checkpoint ask, stop) returns within its deadline."""
import os
import re
import signal
import time

import pytest
import ray

from fully_async.cluster.ray_utils import Calls, RunFailed, Unresponsive
from fully_async.run.launcher import serve_checkpoint
from fully_async.run.watchdog import Watchdog


@ray.remote(num_cpus=0)
class Side:
    def __init__(self):
        self.step = 0

    def pid(self):
        return os.getpid()

    def progress(self):
        self.step += 1 if self.step < 3 else 0  # moves three times, then stands still
        return {"step": self.step, "queue": 2}

    def pop_metrics(self):
        return [(self.step, {"x": 1.0})]

    def checkpoint_wanted(self):
        return None


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def test_a_stopped_actor_is_named_by_the_watchdog_and_blocks_nothing(ray_local):
    trainer, rollouter = Side.remote(), Side.remote()
    pid = ray.get(trainer.pid.remote())
    dog = Watchdog({"trainer": trainer, "rollouter": rollouter}, timeout_s=3.0, poll_s=0.5)
    dog.check()
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        calls = Calls()
        assert serve_checkpoint(None, {"trainer": trainer}, "trainer", calls=calls) is False  # asked, no answer
        done, _ = calls.poll("trainer.pop_metrics", trainer.pop_metrics.remote, 0.2)
        assert not done and time.monotonic() - t0 < 2.0
        with pytest.raises(Unresponsive, match=r"trainer.pop_metrics did not answer within 0.5s.*stopped"):
            calls.get("trainer.pop_metrics", trainer.pop_metrics.remote, 0.5)
        with pytest.raises(RunFailed) as err:
            while time.monotonic() - t0 < 30:
                dog.check()
                time.sleep(0.2)
        elapsed = time.monotonic() - t0
        msg = str(err.value)
        assert "trainer is not responding (its process is stopped" in msg, msg
        assert "its last state: {'step': 1, 'queue': 2}" in msg, msg
        assert "rollouter" in msg and "progress_timeout_s=3" in msg
        assert elapsed < 12, elapsed
        assert sorted(calls.pending) == ["trainer.checkpoint_wanted", "trainer.pop_metrics"]  # one each, not a queue
        assert list(dog.calls.pending) == ["trainer.progress"]
    finally:
        os.kill(pid, signal.SIGCONT)
    # once it answers again, the outstanding call's result is not lost
    done, batch = calls.poll("trainer.pop_metrics", trainer.pop_metrics.remote, 10)
    assert done and batch == [(1, {"x": 1.0})]


@ray.remote(num_cpus=0)
class Queue:
    def get(self):
        return 1


@ray.remote(num_cpus=0)
class Consumer:
    def __init__(self, queue):
        self.queue = queue

    def run(self):
        while True:
            ray.get(self.queue.get.remote())
            time.sleep(0.05)


def test_a_dead_queue_is_reported_as_such_not_as_the_trainer(ray_local):
    from fully_async.cluster.ray_utils import supervise

    queue = Queue.remote()
    trainer = Consumer.remote(queue)
    runs = {trainer.run.remote(): "trainer"}
    time.sleep(1)
    ray.kill(queue, no_restart=True)
    with pytest.raises(RunFailed, match=r"^queue died: .*\(then trainer failed calling it\)"):
        supervise(runs, until="trainer", on_tick=lambda: None, helpers={"queue": queue})


def test_a_constructor_error_read_from_a_dead_actor_is_named_without_its_traceback():
    # an actor whose __init__ raised, called after it died: Ray keeps only the RayTaskError's text, traceback and all
    import ray.exceptions as rex

    from fully_async.cluster.ray_utils import describe

    text = ("The actor died because of an error raised in its creation task, ray::SyncWorker.__init__() (pid=1)\n"
            "  File \"/x/fully_async/placement/device_pool.py\", line 316, in release\n"
            "    raise _unwrap(exc) from None\n"
            "fully_async.placement.leases.LeaseExpired: e/colocated: lease of [0] for phase 'setup' revoked after "
            "0.5s\n")
    assert describe(rex.RayActorError("ab" * 8, text, True)) == \
        "LeaseExpired: e/colocated: lease of [0] for phase 'setup' revoked after 0.5s"
    assert describe(ValueError("bad: value")) == "ValueError: bad: value"
    died = rex.RayActorError("ab" * 8, "The actor died unexpectedly before finishing this task.", False)
    assert describe(died).startswith("RayActorError: ")


@ray.remote(num_cpus=0, max_concurrency=2)   # as the rollouter: its run() and the driver's calls share the process
class GilHolder:
    """A reward function in the actor's own process (rewards' timeout_s=null) stuck in C code that never releases
    the GIL: catastrophic regex backtracking."""

    def __init__(self):
        self.step = 0

    def progress(self):
        return {"step": self.step}

    def pop_metrics(self):
        return []

    def checkpoint_wanted(self):
        return None

    def hold_gil(self, n):
        import re

        self.step += 1
        return bool(re.match(r"(a+)+$", "a" * n + "b"))


def test_an_actor_whose_reward_holds_the_gil_is_named_and_the_driver_never_blocks(ray_local):
    holder, other = GilHolder.remote(), Side.remote()
    ray.get([holder.progress.remote(), other.progress.remote()])
    dog = Watchdog({"rollouter": holder, "trainer": other}, timeout_s=3.0, poll_s=0.5)
    dog.check()
    stuck = holder.hold_gil.remote(32)   # 2^32 backtracking steps: minutes, all inside one C call
    t0 = time.monotonic()
    try:
        with pytest.raises(RunFailed) as err:
            while time.monotonic() - t0 < 40:
                dog.check()
                assert serve_checkpoint(None, {"rollouter": holder}, "rollouter", calls=dog.calls) is False
                time.sleep(0.2)
        msg = str(err.value)
        assert "rollouter is not responding" in msg and re.search(r"its last state: \{'step': [01]\}", msg), msg
        assert time.monotonic() - t0 < 20
    finally:
        ray.kill(holder)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(stuck, timeout=30)


@ray.remote(num_cpus=0)
class Beating:
    def __init__(self):
        from fully_async.cluster import heartbeat

        heartbeat.start("engine1", period_s=0.2)

    def pid(self):
        return os.getpid()


def test_a_stopped_actor_stops_beating_and_the_driver_names_it(ray_local):
    """The heartbeat through Ray's key-value store (cluster/heartbeat.py): how the watchdog sees an actor it holds
    no handle of, or one still in its constructor."""
    from fully_async.cluster.heartbeat import Heartbeats

    beats = Heartbeats()
    beats.kv.clear()
    actor = Beating.remote()
    pid = ray.get(actor.pid.remote())
    t0 = time.monotonic()
    while "engine1" not in beats.roles() and time.monotonic() - t0 < 10:
        beats.poll()
        time.sleep(0.1)
    os.kill(pid, signal.SIGSTOP)
    try:
        while not beats.stalled(1.0) and time.monotonic() - t0 < 15:
            beats.poll()
            time.sleep(0.2)
        stalled = beats.stalled(1.0)
    finally:
        os.kill(pid, signal.SIGCONT)
        ray.kill(actor)
    assert len(stalled) == 1 and stalled[0].startswith(f"engine1 (pid {pid} on "), stalled
