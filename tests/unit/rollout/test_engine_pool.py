"""Engine pool over scripted replicas (inline and threaded, no Ray): routing, pauses, weights, stats."""
import time

import pytest

from fake_engine import ScriptedEngine, ThreadReplica, expected_response, records
from fully_async.core.data import PromptStream
from fully_async.rollout.engines.pool import EnginePool, ReplicaFailed
from fully_async.rollout.engines.replica import EngineDriver, InlineReplica
from fully_async.rollout.scheduler import RolloutScheduler
from fully_async.core.staleness import StalenessManager
from fully_async.core.types import GenRequest, SamplingParams

PARAMS = SamplingParams(1.0, 1.0, -1, 10)


def reqs(group: str, n: int, prompt=(10, 20, 30)):
    return [GenRequest(f"{group}-s{j}", list(prompt), PARAMS, group_id=group) for j in range(n)]


@pytest.fixture
def thread_pool():
    engines = [ScriptedEngine(max_num_seqs=4) for _ in range(2)]
    replicas = [ThreadReplica(e, f"engine{i}") for i, e in enumerate(engines)]
    pool = EnginePool(replicas, max_num_seqs=4)
    yield pool, engines
    for r in replicas:
        r.close()


def run_all(pool):
    outs = {}
    deadline = time.monotonic() + 20
    while pool.num_in_flight():
        assert time.monotonic() < deadline
        for o in pool.collect(0.01):
            outs[o.request_id] = o
    return outs


def test_group_stays_on_one_replica_and_new_groups_go_least_loaded():
    engines = [ScriptedEngine(max_num_seqs=8) for _ in range(2)]
    pool = EnginePool([InlineReplica(e, None, f"engine{i}") for i, e in enumerate(engines)], max_num_seqs=8)
    pool.submit(reqs("a", 3))
    pool.submit(reqs("b", 2))
    pool.submit(reqs("c", 2))      # 3 vs 2 in flight: the second replica
    pool.submit(reqs("d", 2))      # 3 vs 4: the first
    assert sorted(r.request_id for r in engines[0].waiting) == ["a-s0", "a-s1", "a-s2", "d-s0", "d-s1"]
    assert sorted(r.request_id for r in engines[1].waiting) == ["b-s0", "b-s1", "c-s0", "c-s1"]
    assert pool.capacity == 16 and pool.num_in_flight() == 9


def test_capacity_is_respected_and_a_replica_that_frees_up_takes_the_queue():
    engines = [ScriptedEngine(max_num_seqs=2, fixed_len=2), ScriptedEngine(max_num_seqs=2, fixed_len=9)]
    pool = EnginePool([InlineReplica(e, None) for e in engines], max_num_seqs=2)
    for g in range(6):
        pool.submit(reqs(f"g{g}", 1))
    assert all(e.num_in_flight() == 2 for e in engines) and pool.num_in_flight() == 6  # 2 queued in the pool
    outs = run_all(pool)
    assert len(outs) == 6
    # the fast replica (short responses) served the queue while the slow one was still busy
    assert len(engines[0].served) == 4 and len(engines[1].served) == 2
    assert pool.tokens == [4 * 2, 2 * 9]


def test_threaded_replicas_generate_everything(thread_pool):
    pool, engines = thread_pool
    for g in range(10):
        pool.submit(reqs(f"g{g}", 2))
    outs = run_all(pool)
    assert len(outs) == 20
    for rid, o in outs.items():
        assert o.token_ids == expected_response(rid, 10)
    assert all(e.steps > 0 for e in engines)
    stats = pool.engine_stats()
    assert sum(s["tokens"] for s in stats) == sum(len(o.token_ids) for o in outs.values())
    assert all(s["busy_s"] > 0 for s in stats)
    # each replica's own iterations (collect calls, counted where the engine runs) and time inside them
    assert [s["iterations"] for s in stats] == [e.steps for e in engines]
    assert all(s["engine_s"] > 0 for s in stats)
    from fully_async.telemetry.metrics import engine_metrics

    m = engine_metrics(stats, None, 1.0)
    for i, s in enumerate(stats):
        assert m[f"fully_async/rollouter/engine_{i}/ms_per_step"] == pytest.approx(1e3 * s["engine_s"] / s["iterations"])
        assert m[f"fully_async/rollouter/engine_{i}/seqs_per_step"] == s["tokens"] / s["iterations"]


def test_interrupt_returns_everything_including_queued(thread_pool):
    pool, engines = thread_pool
    for g in range(6):
        pool.submit(reqs(f"g{g}", 2))          # 12 requests, capacity 8: 4 wait in the pool
    got = pool.collect(0.01)
    outs = pool.interrupt()
    ids = [o.request_id for o in got + outs]
    assert sorted(ids) == sorted(f"g{g}-s{j}" for g in range(6) for j in range(2))
    assert pool.num_in_flight() == 0 and all(e.num_in_flight() == 0 for e in engines)
    assert sum(1 for o in outs if o.finish_reason == "abort" and not o.token_ids) >= 4


def test_update_weights_reaches_every_replica_with_one_version(thread_pool):
    pool, engines = thread_pool
    pool.update_weights({"w": 1}, 3)
    assert pool.version == 3 and all(e.version == 3 and e.loads == [3] for e in engines)
    pool.submit(reqs("a", 2))
    with pytest.raises(RuntimeError, match="in flight"):
        pool.update_weights({"w": 1}, 4)
    run_all(pool)
    pool.sleep(1)
    assert all(e.asleep for e in engines)
    pool.wake_up()
    assert not any(e.asleep for e in engines)


def test_scheduler_over_the_pool_completes_every_group_exactly(thread_pool):
    pool, engines = thread_pool
    done = []
    stream = PromptStream(records(16), shuffle=False, seed=0, total_epochs=1)
    sched = RolloutScheduler(pool, stream, StalenessManager(2, 1, 1.0, 1), 2, PARAMS, pool.capacity, True,
                             on_complete=done.extend)
    version = 0
    while not sched.exhausted:
        sched.admit()
        if sched.in_flight():
            sched.step(0.01)
        if sched.at_bound() or not sched.in_flight():
            version += 1
            sched.apply_weights(lambda: pool.update_weights({}, version), version, queued=lambda: 0)
    assert sorted(g.uid for g in done) == sorted(f"e0-p{i}" for i in range(16))
    for g in done:
        for s in g.samples:
            assert s.response_ids == expected_response(s.sample_id, 10)
    assert all(e.steps > 0 for e in engines) and version > 1


def test_a_failing_replica_is_named():
    class Broken(ScriptedEngine):
        def collect(self, timeout_s=0.05):
            raise ValueError("kernel exploded")

    replica = ThreadReplica(Broken(), "engine1")
    pool = EnginePool([InlineReplica(ScriptedEngine(), None), replica], max_num_seqs=1)
    pool.submit(reqs("a", 2))
    with pytest.raises(ReplicaFailed, match=r"replica 1 \(engine1\).*kernel exploded"):
        run_all(pool)
    replica.close()


def test_driver_runs_calls_in_order_between_steps():
    engine = ScriptedEngine(max_num_seqs=2)
    driver = EngineDriver(engine)
    driver.submit(reqs("a", 2))
    outs = []
    deadline = time.monotonic() + 10
    while len(outs) < 2 and time.monotonic() < deadline:
        outs += driver.poll(0.05)
    assert sorted(o.request_id for o in outs) == ["a-s0", "a-s1"]
    driver.submit(reqs("b", 1))
    assert driver.call(lambda e: e.num_in_flight()).result(timeout=5) in (0, 1)
    partial = driver.interrupt()
    assert [o.request_id for o in partial] == ["b-s0"]  # finished (unpolled) or cut: never lost
    driver.close()


def test_an_inline_replica_is_not_held_up_by_slow_remote_ones():
    """Sync mode's rank 0 engine runs in the pool's thread: collect() must keep stepping it instead of
    waiting for remote polls (that idled it up to timeout_s per step)."""
    class Slow(ScriptedEngine):
        def collect(self, timeout_s=0.05):
            time.sleep(0.2)
            return super().collect(timeout_s)

    fast = ScriptedEngine(max_num_seqs=1, fixed_len=40)
    slow = ThreadReplica(Slow(max_num_seqs=1, fixed_len=3), "engine1")
    pool = EnginePool([InlineReplica(fast, None), slow], max_num_seqs=1)
    long = SamplingParams(1.0, 1.0, -1, 40)
    pool.submit([GenRequest("a-s0", [10, 20, 30], long, group_id="a"), GenRequest("b-s0", [10, 20, 30], long, "b")])
    start = time.monotonic()
    while not fast.served:
        pool.collect(0.05)
    # 40 inline steps: ~0 s of waiting (before the fix each step waited for a remote poll, ~1.2-2 s in all)
    assert time.monotonic() - start < 0.4, "the inline engine waited on the remote polls"
    run_all(pool)
    slow.close()


def test_a_held_driver_keeps_its_requests_without_advancing_them():
    """Colocated async on several devices: while the trainer has its turn, the engines in their own actors hold their
    requests (in flight, not advanced) and go on when released; calls still run while held."""
    class Slow(ScriptedEngine):
        def collect(self, timeout_s=0.05):
            time.sleep(0.01)
            return super().collect(timeout_s)

    engine = Slow(max_num_seqs=2, fixed_len=30)
    driver = EngineDriver(engine)
    long = SamplingParams(1.0, 1.0, -1, 40)
    driver.submit([GenRequest(f"a-s{j}", [10, 20, 30], long, group_id="a") for j in range(2)])
    driver.hold(True).result(timeout=5)
    before = driver.counters.iterations
    time.sleep(0.3)
    assert driver.counters.iterations == before
    assert driver.call(lambda e: e.num_in_flight()).result(timeout=5) == 2   # kept, and calls still run
    assert driver.poll(0.05) == []
    driver.hold(False).result(timeout=5)
    outs = []
    deadline = time.monotonic() + 10
    while len(outs) < 2 and time.monotonic() < deadline:
        outs += driver.poll(0.05)
    assert sorted(o.request_id for o in outs) == ["a-s0", "a-s1"] and driver.counters.iterations > before
    driver.close()


def test_the_pool_holds_engines_in_their_own_threads_and_leaves_inline_ones_to_their_caller():
    remote = ThreadReplica(ScriptedEngine(max_num_seqs=2, fixed_len=30), "engine1")
    pool = EnginePool([InlineReplica(ScriptedEngine(max_num_seqs=2), None), remote], max_num_seqs=2)
    pool.hold()
    assert remote.driver._held
    pool.release()
    assert not remote.driver._held
    remote.close()
