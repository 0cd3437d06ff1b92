"""The watchdog covers every actor of a run from its creation (issue 42): a stopped queue, a trainer stalled in its
constructor (start-up, before its first step), an engine replica the driver holds no handle of -- each is named, with
what it was doing.  Fakes only: a fake clock, fake progress calls and a fake key-value store of heartbeats."""
import threading
import time

import pytest

from fully_async.actors.queue import GroupQueue
from fully_async.cluster import heartbeat
from fully_async.cluster.heartbeat import Heartbeats
from fully_async.cluster.ray_utils import RunFailed
from fully_async.run.watchdog import Watchdog

STOPPED = object()


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class KV:
    """Beats as the actors' heartbeat threads put them: key -> value."""

    def __init__(self):
        self.values = {}

    def beat(self, pid, role, where=()):
        old = self.values.get(f"job/{pid}", {"beat": 0})
        self.values[f"job/{pid}"] = {"role": role, "beat": old["beat"] + 1, "pid": pid, "host": "h",
                                     "where": list(where)}

    def read(self):
        return {k: dict(v) for k, v in self.values.items()}


class Handle:
    """An actor handle whose progress() answers `state` (STOPPED: never answers)."""

    def __init__(self, state):
        self.state = state
        self.progress = self

    def remote(self):
        return self.state


class FakeCalls:
    def __init__(self, clock):
        self.clock, self.pending = clock, {}

    def poll(self, key, start, wait_s=0.0):
        value = start()
        if value is STOPPED:
            self.pending.setdefault(key, self.clock())
            return False, None
        self.pending.pop(key, None)
        return True, value

    def silent(self):
        return {k: self.clock() - t for k, t in self.pending.items()}


def dog(actors, clock, kv=None, beating=()):
    beats = Heartbeats(kv, clock=clock) if kv is not None else None
    return Watchdog(actors, timeout_s=20.0, poll_s=1.0, calls=FakeCalls(clock), beats=beats, beating=beating,
                    clock=clock)


def test_a_stopped_queue_is_named_with_its_last_state():
    clock = Clock()
    queue = Handle({"queued": 3, "put": 7, "taken": 4, "closed": False})
    actors = {"trainer": Handle({"step": 2}), "rollouter": Handle({"engine_steps": 50}), "queue": queue}
    w = dog(actors, clock)
    w.check()
    queue.state = STOPPED   # kill -STOP of the queue's process: the trainer waits on it, the rollouter fills the bound
    for _ in range(21):   # the check that first sees it unanswered starts the count: 20 s more are within the bound
        clock.t += 1.0
        w.check()
    clock.t += 1.0
    with pytest.raises(RunFailed) as err:
        w.check()
    msg = str(err.value)
    assert "no progress for 21s (trainer.progress_timeout_s=20)" in msg, msg
    assert "queue is not responding (its process is stopped" in msg, msg
    assert "its last state: {'queued': 3, 'put': 7, 'taken': 4, 'closed': False}" in msg, msg
    assert "trainer is not responding" not in msg


def test_the_queue_reports_what_went_through_it():
    q = GroupQueue()
    q.put_many(["a", "b", "c"])
    q.get_batch(2)
    assert q.progress() == {"queued": 1, "put": 3, "taken": 2, "closed": False}


def test_a_trainer_stopped_in_its_constructor_is_named_with_where_it_was():
    clock, kv = Clock(), KV()
    w = dog({}, clock, kv, beating=("trainer", "rollouter"))
    kv.beat(11, "trainer", ["actors/trainer.py:88 in __init__"])
    kv.beat(12, "rollouter", ["actors/rollouter.py:70 in __init__"])
    w.check_start()
    for _ in range(30):   # the rollouter keeps beating, the trainer (SIGSTOP) does not
        clock.t += 1.0
        kv.beat(12, "rollouter")
        w.check_start()   # within the bound (the timeout, 20 s, but at least START_FLOOR_S in start-up): nothing
    clock.t += 2.0
    kv.beat(12, "rollouter")
    with pytest.raises(RunFailed) as err:
        w.check_start()
    msg = str(err.value)
    assert msg.startswith("start-up stalled (trainer.progress_timeout_s=20, at least 30s in start-up): trainer "
                          "(pid 11 on h): no heartbeat for 32s, it was at: actors/trainer.py:88 in __init__"), msg
    assert "rollouter" not in msg


def test_an_actor_that_never_beats_is_named_after_the_bound_only():
    """The bound is the timeout (20 s here), but at least START_FLOOR_S (30 s) for a process to start at all."""
    clock, kv = Clock(), KV()
    w = dog({}, clock, kv, beating=("trainer", "rollouter"))
    kv.beat(12, "rollouter")
    for _ in range(30):
        clock.t += 1.0
        kv.beat(12, "rollouter")
        w.check_start()
    clock.t += 1.5
    kv.beat(12, "rollouter")
    with pytest.raises(RunFailed, match=r"at least 30s for a process to start\): trainer gave no sign of life "
                                        r"within 32s of being created"):
        w.check_start()


def test_a_stalled_engine_replica_is_named_when_the_run_stands_still():
    # engine1 lives inside the rollouter (the driver holds no handle of it); stopped, the run stands still
    clock, kv = Clock(), KV()
    actors = {"trainer": Handle({"step": 4}), "rollouter": Handle({"engine_steps": 90, "in_flight_requests": 6})}
    w = dog(actors, clock, kv)
    for pid, role in ((11, "trainer"), (12, "rollouter"), (13, "engine0"), (14, "engine1")):
        kv.beat(pid, role, ["rollout/engines/replica.py:230 in _run"] if role == "engine1" else [])
    w.check()
    for _ in range(22):
        clock.t += 1.0
        for pid, role in ((11, "trainer"), (12, "rollouter"), (13, "engine0")):
            kv.beat(pid, role)
        try:
            w.check()
        except RunFailed as exc:
            err = exc
            break
    msg = str(err)
    assert "no progress for 21s" in msg, msg
    assert "stalled: engine1 (pid 14 on h): no heartbeat for 21s, it was at: rollout/engines/replica.py:230 in _run" \
        in msg, msg
    assert "engine0" not in msg.split("; state:")[0]


def test_a_beat_that_moves_is_not_stalled():
    clock, kv = Clock(), KV()
    beats = Heartbeats(kv, clock=clock)
    for _ in range(30):
        kv.beat(1, "trainer")
        beats.poll()
        clock.t += 1.0
    assert beats.stalled(5.0) == [] and beats.roles() == {"trainer"}
    clock.t += 6.0
    assert beats.stalled(5.0) == ["trainer (pid 1 on h): no heartbeat for 7s, it was at: no frame of ours "
                                  "(outside our code)"]


def test_where_names_the_frame_of_our_code_each_thread_is_in():
    q = GroupQueue()
    t = threading.Thread(target=q.get_batch, args=(1, 5.0), daemon=True)
    t.start()
    time.sleep(0.1)
    try:
        assert any(w.startswith("actors/queue.py:") and w.endswith(" in get_batch") for w in heartbeat.where())
    finally:
        q.close()
        t.join()


def test_no_heartbeat_outside_ray():
    assert heartbeat.start("trainer") is False
