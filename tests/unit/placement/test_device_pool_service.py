"""The pool service with real threads and the wall clock: a stress test with random phase lengths (injected
delays) finishes without deadlock in bounded time and never puts two jobs on one device; a job that stops
heartbeating while it holds a lease loses it within the timeout; the timeline has a process per job and a
track per device."""
import json
import random
import threading
import time

from fully_async.placement.device_pool import DevicePoolService
from fully_async.placement.leases import LeaseExpired


def test_threaded_stress_random_delays_no_deadlock_exclusive(tmp_path):
    n_dev, jobs, phases = 3, 8, 12
    svc = DevicePoolService("stress", n_dev, max_hold_s=30.0, heartbeat_timeout_s=5.0,
                            timeline_path=str(tmp_path / "timeline.json"), tick_s=0.02, write_every_s=0.2)
    in_use = [0] * n_dev
    lock = threading.Lock()
    violations, finished, errors = [], [], []

    def job(i):
        rng = random.Random(i)
        name = f"job{i}"
        try:
            svc.register(name, n_dev)
            for p in range(phases):
                devs = sorted(rng.sample(range(n_dev), rng.randint(1, n_dev)))
                phase = "rollout" if p % 2 == 0 else "train"
                while svc.acquire(name, f"{name}/x", phase, devs, timeout_s=0.2) is None:
                    svc.heartbeat(name)
                with lock:
                    for d in devs:
                        in_use[d] += 1
                        if in_use[d] > 1:
                            violations.append((name, d))
                start = time.time()
                time.sleep(rng.uniform(0.0, 0.02))                 # the injected phase length
                with lock:
                    for d in devs:
                        in_use[d] -= 1
                svc.release(name, f"{name}/x", [{"name": "work", "start": start, "end": time.time()}])
                time.sleep(rng.uniform(0.0, 0.01))
            svc.unregister(name)
            finished.append(name)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(repr(exc))

    threads = [threading.Thread(target=job, args=(i,)) for i in range(jobs)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    elapsed = time.monotonic() - t0
    assert not errors and not any(th.is_alive() for th in threads), errors
    assert len(finished) == jobs and violations == [] and elapsed < 60
    svc.write_timeline()
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    procs = {e["args"]["name"] for e in trace if e["name"] == "process_name"}
    tracks = {e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    assert procs == {f"job job{i}" for i in range(jobs)} and {"device 0", "device 1", "device 2", "wait"} <= tracks
    spans = [e for e in trace if e["ph"] == "X"]
    assert sum(e["name"] == "work" for e in spans) >= jobs * phases   # one per device of each lease
    svc.stop()


def test_silent_holder_is_dropped_within_the_heartbeat_timeout():
    svc = DevicePoolService("hb", 1, max_hold_s=60.0, heartbeat_timeout_s=0.5, tick_s=0.02)
    svc.register("dead", 1)
    svc.register("alive", 1)
    assert svc.acquire("dead", "dead/x", "train", [0], 1.0) is not None
    t0 = time.monotonic()
    got = None
    while got is None and time.monotonic() - t0 < 5:
        got = svc.acquire("alive", "alive/x", "train", [0], 0.2)   # each call is also alive's heartbeat
    assert got is not None and time.monotonic() - t0 < 1.5
    assert any("job dead sent no heartbeat" in line for line in svc.state()["log"])
    try:
        svc.release("dead", "dead/x")
        raise AssertionError("the dropped job's release must fail")
    except LeaseExpired as exc:
        assert "no heartbeat" in str(exc)
    svc.stop()


class _Remote:
    """A DevicePoolService behind the `.method.remote()` call shape of an actor handle (ray.get passes it on)."""

    def __init__(self, svc):
        self.svc = svc

    def __getattr__(self, name):
        fn = getattr(self.svc, name)
        return type("M", (), {"remote": staticmethod(lambda *a: fn(*a))})()


def test_a_restarted_job_waits_for_its_old_entry_then_joins(monkeypatch):
    import ray

    from fully_async.placement.device_pool import PoolMembership
    from fully_async.placement.leases import LeaseError

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    svc = DevicePoolService("restart", 1, max_hold_s=60.0, heartbeat_timeout_s=0.5, tick_s=0.02)
    svc.register("job", 1)                      # the old driver, now silent
    t0 = time.monotonic()
    member = PoolMembership(_Remote(svc), "job", 1, heartbeat_timeout_s=0.5)
    assert 0.4 < time.monotonic() - t0 < 3 and member.info["num_devices"] == 1
    try:
        PoolMembership(_Remote(svc), "job", 1, heartbeat_timeout_s=0.5)   # a second live one: refused
        raise AssertionError("two live jobs of one name must be refused")
    except LeaseError as exc:
        assert "live job named 'job'" in str(exc)
    member.close()
    svc.stop()


def test_kept_state_is_asked_off_through_the_holders_next_acquire_and_the_waiter_then_gets_the_device():
    """Co-tenancy with threads: job a keeps 60 of 100 GiB between its leases; job b (50) blocks in acquire; a's next
    acquire answers "drop"; once a says it dropped the state, b holds the device and a waits behind it."""
    svc = DevicePoolService("co", 1, max_hold_s=30.0, heartbeat_timeout_s=30.0, tick_s=0.02)
    try:
        for j in "ab":
            svc.register(j, 1)
        got = svc.acquire("a", "a/x", "rollout", [0], 1.0, need_gib=60, capacity_gib=100)
        assert got["shared"] and svc.keep("a", "a/x", 60)
        svc.release("a", "a/x")
        assert svc.state()["memory"][0]["kept"] == {"a/x": 60}
        b_got = []
        waiter = threading.Thread(target=lambda: b_got.append(
            svc.acquire("b", "b/x", "rollout", [0], 10.0, need_gib=50, capacity_gib=100)))
        waiter.start()
        time.sleep(0.2)
        assert not b_got and svc.state()["memory"][0]["evicting"] == ["a/x"]
        assert svc.acquire("a", "a/x", "train", [0], 1.0, need_gib=60) == {"drop": True}
        svc.dropped("a", "a/x", [{"name": "offload", "start": time.time(), "end": time.time()}])
        waiter.join(5)
        assert b_got and b_got[0]["devices"] == [0] and b_got[0]["shared"]
        assert svc.acquire("a", "a/x", "train", [0], 0.2, need_gib=60) is None   # 60 + 50 > 90: behind b
        assert svc.state()["waiting"] == ["a/x"]
    finally:
        svc.stop()
