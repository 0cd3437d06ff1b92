"""The rollouter's own metrics: its idle ratio per trainer step, computed where the counters live, and its
validation results, which go into its outbox for the driver (not through the queue)."""
import time

import pytest

from fully_async.run.hydra_setup import load_config
from fully_async.telemetry.metrics import rollouter_window_metrics
from fake_engine import FakeQueue


def counters(wall_s, idle_s, samples=0, tokens=0, busy_s=0.0):
    return {"wall_s": wall_s, "idle_s": idle_s, "generated_samples": samples, "staleness_samples": samples,
            "bound_pauses": 0, "engines": [{"tokens": tokens, "busy_s": busy_s, "iterations": 0, "engine_s": 0.0}]}


def test_window_metrics_idle_ratio_per_step():
    assert rollouter_window_metrics({}, {}) == {}          # nothing pushed yet: no metrics
    first = rollouter_window_metrics(counters(10.0, 2.0, samples=8, tokens=100, busy_s=5.0), {})
    assert "fully_async/rollouter/idle_ratio" not in first  # the first window has no idle ratio (as before)
    assert first["fully_async/count/total_generated_samples"] == 8
    assert first["fully_async/rollouter/engine_0/tokens"] == 100
    assert first["fully_async/rollouter/engine_0/busy_ratio"] == pytest.approx(0.5)
    assert first["fully_async/rollouter/num_engines"] == 1
    second = rollouter_window_metrics(counters(14.0, 3.0, samples=16, tokens=180, busy_s=8.0),
                                      counters(10.0, 2.0, samples=8, tokens=100, busy_s=5.0))
    assert second["fully_async/rollouter/idle_ratio"] == pytest.approx(0.25)   # 1 s idle of 4 s
    assert second["fully_async/rollouter/engine_0/tokens"] == 80
    assert second["fully_async/rollouter/engine_0/busy_ratio"] == pytest.approx(0.75)
    same = rollouter_window_metrics(counters(14.0, 3.0), counters(14.0, 3.0))
    assert "fully_async/rollouter/idle_ratio" not in same   # no push in between: an empty window


@pytest.fixture(scope="module")
def rollouter():
    import fully_async.actors.rollouter as ro
    from fully_async.run.prepare import prepare

    cfg = load_config(["actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       "trainer.total_training_steps=7", "async_training.trigger_parameter_sync_step=2",
                       "data.max_response_length=4"])
    prep = prepare(cfg)
    original, ro.ray_get = ro.ray_get, (lambda x: x)
    try:
        yield ro.Rollouter(prep.cfg, FakeQueue(), prep.train, prep.val[:2], prep.eos_token_ids,
                           prep.pad_token_id)
    finally:
        ro.ray_get = original


def test_validation_goes_to_the_outbox_at_the_step_of_its_version(rollouter):
    metrics = rollouter._validate(3)
    assert any(k.startswith("val-core/") for k in metrics)
    assert metrics["rollouter/validate_time"] == metrics["timing_s/testing"] > 0
    [(step, emitted)] = rollouter.pop_metrics()
    assert step == 6 and emitted == dict(metrics, _wall_time=emitted["_wall_time"])   # version 3 x trigger 2
    assert time.time() - 60 < emitted["_wall_time"] <= time.time()       # stamped when produced: the step's end
    assert rollouter.pop_metrics() == []
    assert any(k.startswith("val-core/") for k in rollouter.validate())
    assert rollouter.pop_metrics() == []                   # the driver's own validation comes back to it
    assert set(rollouter.queue.q.get_batch(1, timeout_s=0.01)) == {"groups", "closed"}


def test_rollouter_computes_its_idle_ratio_per_trainer_step(rollouter):
    sched = rollouter.scheduler
    assert rollouter.pop_step_metrics() == {}                # nothing pushed yet
    sched.admit()
    while sched.pending:
        sched.step()
    assert rollouter.queue.q.size() > 0
    first = rollouter.pop_step_metrics()
    assert first["fully_async/count/total_generated_samples"] == sched.stats["generated_samples"] > 0
    assert "fully_async/rollouter/idle_ratio" not in first and first["fully_async/rollouter/num_engines"] == 1
    rollouter.stats["idle_s"] += 1e6                          # idle far longer than any window: ratio capped
    rollouter._push([])                                       # the next push closes the window
    second = rollouter.pop_step_metrics()
    assert second["fully_async/rollouter/idle_ratio"] == 1.0
    assert "fully_async/rollouter/idle_ratio" not in rollouter.pop_step_metrics()  # no push since: empty window


def test_checkpoint_hold_stops_generation_until_release(monkeypatch, tmp_path):
    """While the driver writes the queue's part, the rollouter's loop generates and pushes nothing."""
    import threading
    import time

    import fully_async.actors.rollouter as ro
    from fully_async.core.checkpoint import ROLLOUT_STATE
    from fully_async.run.prepare import prepare

    monkeypatch.setattr(ro, "ray_get", lambda x: x)
    cfg = load_config(["actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       "trainer.total_training_steps=50", "data.val_files=null", "data.max_response_length=64",
                       "async_training.staleness_threshold=100"])
    prep = prepare(cfg)
    r = ro.Rollouter(prep.cfg, FakeQueue(), prep.train, [], prep.eos_token_ids, prep.pad_token_id)
    loop = threading.Thread(target=r.run, daemon=True)
    loop.start()
    try:
        deadline = time.monotonic() + 30
        while r.scheduler.stats["engine_steps"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        r.save_part(str(tmp_path))                     # a command: runs between two engine steps
        assert r.held and (tmp_path / ROLLOUT_STATE).exists()
        steps, queued = r.scheduler.stats["engine_steps"], r.queue.q.size()
        time.sleep(0.5)
        assert (r.scheduler.stats["engine_steps"], r.queue.q.size()) == (steps, queued)
        r.release()
        assert not r.held
        deadline = time.monotonic() + 30
        while r.scheduler.stats["engine_steps"] == steps and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.scheduler.stats["engine_steps"] > steps   # generating again
    finally:
        r.stop()
        loop.join(30)
    assert not loop.is_alive()


def test_param_version_metrics_go_to_the_outbox_at_the_step_that_pushed_the_next_version(rollouter):
    import time

    rollouter.pop_metrics()
    rollouter._end_version(1)
    assert rollouter.pop_metrics() == []                     # before run(): the initial weights end no version
    rollouter._version_mark = (time.perf_counter() - 4.0, rollouter.stats["idle_s"])
    rollouter.stats["idle_s"] += 1.0                          # 1 s of the 4 s version with nothing to generate
    rollouter._end_version(2)
    [(step, m)] = rollouter.pop_metrics()
    assert step == 4                                          # version 2 x trigger_parameter_sync_step 2
    assert m["rollouter/version_time"] == pytest.approx(4.0, abs=0.5)
    assert m["rollouter/active_time"] == pytest.approx(m["rollouter/version_time"] - 1.0)
    assert m["rollouter/idle_ratio"] == pytest.approx(1.0 / m["rollouter/version_time"])
    rollouter._version_mark = (time.perf_counter(), rollouter.stats["idle_s"])
    rollouter._end_version(4)                                 # the final push: 4 x 2 = 8 > the run's 7 steps
    assert [step for step, _ in rollouter.pop_metrics()] == [7]
    rollouter._version_mark = None


class _InFlight:
    """A queue call on its way: it reaches the queue only when somebody waits for it (ray_get), the latest a real
    actor call can arrive."""

    def __init__(self, call):
        self.call, self.arrived, self.value = call, False, None

    def get(self):
        if not self.arrived:
            self.value, self.arrived = self.call(), True
        return self.value


class SlowPutQueue:
    """The GroupQueue behind `.method.remote(...)`: put_many arrives only when waited for, every other call at once."""

    def __init__(self):
        from fully_async.actors.queue import GroupQueue
        self.q = GroupQueue()
        self.puts: list[_InFlight] = []

    def __getattr__(self, name):
        from fake_engine import Remote

        method = getattr(self.q, name)
        if name != "put_many":
            return Remote(method)

        def put(groups):
            self.puts.append(_InFlight(lambda: method(groups)))
            return self.puts[-1]
        return Remote(put)


def _waited(x):
    return x.get() if isinstance(x, _InFlight) else x


@pytest.fixture
def slow_put_rollouter(monkeypatch):
    import fully_async.actors.rollouter as ro
    from fully_async.run.prepare import prepare

    monkeypatch.setattr(ro, "ray_get", _waited)
    cfg = load_config(["actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       "trainer.total_training_steps=2", "data.val_files=null", "data.max_response_length=16",
                       "benchmark.response_length=lognormal", "benchmark.ignore_eos=true",
                       "async_training.staleness_threshold=100"])   # groups complete at different steps
    prep = prepare(cfg)
    return ro.Rollouter(prep.cfg, SlowPutQueue(), prep.train, [], prep.eos_token_ids, prep.pad_token_id)


def test_a_push_does_not_wait_for_the_queue_and_what_reads_the_queue_waits_for_it(slow_put_rollouter, tmp_path):
    """The engine runs in the rollouter's thread: a push hands the groups to the queue without waiting for the
    round trip (one put in flight, so they keep their order); the staleness bound's count of queued groups and a
    checkpoint's queue part see every group pushed."""
    r, queue = slow_put_rollouter, slow_put_rollouter.queue
    sched = r.scheduler
    sched.admit()
    while sched.pending:
        sched.step()
    generated = sched.stats["generated_samples"] // 2   # groups of n=2
    assert generated == 8 and len(queue.puts) >= 2
    assert not queue.puts[-1].arrived                      # the last push did not wait
    assert all(p.arrived for p in queue.puts[:-1])         # each push waited for the one before it
    assert queue.q.size() < generated
    assert r._queued() == generated                        # the bound's carry-over counts the groups pushed
    r._push([])                                            # nothing to push: no put
    assert queue.puts[-1].arrived
    sched.admit()                                          # (the run's prompts are all admitted)
    r._save_part(str(tmp_path))
    assert queue.q.size() == generated and all(p.arrived for p in queue.puts)


def test_the_queue_is_closed_after_the_last_push_arrived(slow_put_rollouter):
    """With every prompt generated the rollouter closes the queue; a put still on its way would reach a closed
    queue and fail the run."""
    import threading
    import time

    r = slow_put_rollouter
    loop = threading.Thread(target=r.run, daemon=True)
    loop.start()
    try:
        deadline = time.monotonic() + 60
        while not r.closed and loop.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.closed and loop.is_alive()
        assert r.queue.q.size() == 8 and r.queue.q.progress()["closed"]
    finally:
        r.stop()
        loop.join(30)
    assert not loop.is_alive()


def test_a_put_that_failed_fails_the_next_push_not_silently(slow_put_rollouter):
    """A hand-off that is not waited for still reports its failure: the queue actor's error is raised at the next
    push (which waits for the one before it), so no group is lost without the run knowing."""
    r, queue = slow_put_rollouter, slow_put_rollouter.queue

    def refused(groups):
        raise RuntimeError("queue refused the groups")

    sched = r.scheduler
    sched.admit()
    while not queue.puts:
        sched.step()
    queue.puts[-1].call = lambda: refused(None)              # that put fails on its way to the queue
    with pytest.raises(RuntimeError, match="refused"):
        for _ in range(10_000):                                # (bounded: a missed failure fails, never hangs)
            sched.step()
        r._flush_puts()
