"""Lent replicas (async_training.placement=elastic) in the engine pool and the scheduler, with the scripted fake
engine: a replica lent by the trainer takes requests, hands back its partial responses when reclaimed, and those
continue exactly on the pool's own replica; weight loads, sleep and wake-up never reach a lent replica."""
from fake_engine import ScriptedEngine, expected_response, records
from fully_async.core.data import PromptStream
from fully_async.core.staleness import StalenessManager
from fully_async.core.types import SamplingParams
from fully_async.rollout.engines.pool import EnginePool
from fully_async.rollout.engines.replica import InlineReplica
from fully_async.rollout.scheduler import RolloutScheduler

MAX_TOKENS = 10


def setup(prompts=12):
    own, lent = ScriptedEngine(max_num_seqs=4), ScriptedEngine(max_num_seqs=4)
    pool = EnginePool([InlineReplica(own, None, "engine0")], max_num_seqs=4)
    done = []
    sched = RolloutScheduler(pool, PromptStream(records(prompts), shuffle=False, seed=0, total_epochs=1),
                             StalenessManager(2, 1, 100.0, 1), 2, SamplingParams(1.0, 1.0, -1, MAX_TOKENS),
                             pool.capacity, True, on_complete=done.extend)
    return pool, sched, own, lent, done


def lend(pool, sched, lent):
    indices = pool.join([InlineReplica(lent, None, "trainer_engine0")])
    sched.max_in_flight = pool.capacity
    return indices


def reclaim(pool, sched, indices):
    parked = sched.take_back(pool.leave(indices), resume=True)
    sched.max_in_flight = pool.capacity
    return parked


def test_a_lent_replica_works_then_its_partials_continue_exactly_on_the_own_replica():
    pool, sched, own, lent, done = setup()
    indices = lend(pool, sched, lent)
    assert indices == [1] and pool.capacity == 8 and pool.own == 1
    assert sched.admit() == 4 and own.num_in_flight() == lent.num_in_flight() == 4   # groups spread over both
    sched.step()
    sched.step()
    assert lent.running and all(len(r[1]) for r in lent.running.values())       # partial responses on it
    parked = reclaim(pool, sched, indices)
    assert parked == 4 and not lent.num_in_flight() and pool.capacity == 4
    assert sched.stats["interrupted_samples"] == 4
    assert lend(pool, sched, lent) == [1]                     # lent again: the same replica, the same index
    tokens_before = pool.engine_stats()[1]["tokens"]
    for _ in range(12):                                       # long enough for it to finish responses too
        sched.admit()
        sched.step()
    assert pool.engine_stats()[1]["finished"] > 0
    reclaim(pool, sched, indices)
    assert pool.engine_stats()[1]["tokens"] > tokens_before
    while not sched.exhausted:                                # the rest on the pool's own replica alone
        sched.admit()
        sched.step()
    uids = [g.uid for g in done]
    assert sorted(uids) == sorted(f"e0-p{i}" for i in range(12))
    resumed = [s for g in done for s in g.samples if s.num_interruptions]
    assert len(resumed) >= 4
    for g in done:
        for s in g.samples:                                   # as an uninterrupted run's, tokens and versions
            assert s.response_ids == expected_response(s.sample_id, MAX_TOKENS), s.sample_id
            assert len(s.versions) == len(s.rollout_log_probs) == len(s.response_ids)
    stats = pool.engine_stats()
    assert len(stats) == 2 and stats[1]["tokens"] > 0


def test_weight_loads_sleep_and_wake_up_reach_only_the_pools_own_replicas():
    pool, sched, own, lent, _ = setup()
    indices = lend(pool, sched, lent)
    pool.update_weights({"w": 1}, 3)
    pool.sleep(1)
    pool.wake_up()
    assert own.loads == [3] and lent.loads == [] and not lent.asleep
    assert pool.version == 3
    assert pool.leave(indices) == [] and pool.capacity == 4


def test_partials_parked_from_a_reclaimed_replica_survive_a_checkpoint_and_continue_exactly():
    """A checkpoint right after a reclaim (the trainer saves after its step): the partial responses handed back by
    the lent replica are in the snapshot; a fresh scheduler restored from it finishes them exactly, each group once."""
    import pickle

    pool, sched, own, lent, done = setup()
    indices = lend(pool, sched, lent)
    sched.admit()
    for _ in range(3):
        sched.step()
    sched.take_back(pool.leave(indices), resume=False)        # held: a checkpoint is being taken
    sched.max_in_flight = pool.capacity
    sched.park()
    state = pickle.loads(pickle.dumps(sched.state_dict()))
    partial = [p for p in state["pending"] if p.token_ids]
    assert partial and all(p.num_interruptions for p in partial)
    before = [g.uid for g in done]
    pool2, sched2, _, _, done2 = setup()
    sched2.load_state_dict(state)
    sched2.resume()
    while not sched2.exhausted:
        sched2.admit()
        sched2.step()
    uids = before + [g.uid for g in done2]
    assert sorted(uids) == sorted(f"e0-p{i}" for i in range(12))
    for g in done + done2:
        for s in g.samples:
            assert s.response_ids == expected_response(s.sample_id, MAX_TOKENS), s.sample_id


class _Method:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def remote(self, *args):
        """A submit's object ref; an engine call's ref with .future(), as Ray's."""
        self.log.append((self.name, args))
        ref = f"ref-{len(self.log)}"
        if self.name == "engine_call":
            return type("Ref", (), {"future": lambda _self: ref})()
        return ref


class _Actor:
    def __init__(self, log):
        self.submit, self.engine_call = _Method("submit", log), _Method("engine_call", log)


def test_a_command_to_a_threaded_engine_host_waits_for_the_submissions_before_it(monkeypatch):
    """The elastic trainer's rank 0 runs calls on several threads, out of order: an interrupt must not overtake the
    requests it has to hand back, so its replica waits for the earlier submissions first (others need not)."""
    import ray

    from fully_async.rollout.engines.replica import RemoteReplica

    log = []
    monkeypatch.setattr(ray, "get", lambda refs: log.append(("get", tuple(refs))))
    threaded = RemoteReplica(_Actor(log), "trainer_engine0", threaded=True)
    threaded.submit(["a"])
    threaded.submit(["b"])
    threaded.call("interrupt")
    assert [e[0] for e in log] == ["submit", "submit", "get", "engine_call"]
    assert log[2] == ("get", ("ref-1", "ref-2"))
    threaded.call("sleep", 1)
    assert log[-2][0] == "engine_call" and log[-1][0] == "engine_call"   # nothing left to wait for
    log.clear()
    plain = RemoteReplica(_Actor(log), "engine1")
    plain.submit(["a"])
    plain.call("interrupt")
    assert [e[0] for e in log] == ["submit", "engine_call"]   # an actor of one thread runs calls in order
