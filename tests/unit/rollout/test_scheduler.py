"""The rollout scheduler alone, with a scripted fake engine: no Ray, no torch, well under 10 s."""
import logging
import pickle

import pytest

from fake_engine import EOS, ScriptedEngine, expected_response, make_lengths, records
from fully_async.core.data import PromptStream
from fully_async.rollout.scheduler import RolloutScheduler
from fully_async.core.staleness import StalenessManager
from fully_async.core.types import SamplingParams

MAX_TOKENS = 10


def make(engine=None, prompts=12, n=2, mini=2, threshold=0.5, trigger=1, partial=True, max_in_flight=8,
         lengths=None):
    done = []
    engine = engine or ScriptedEngine(max_num_seqs=4)
    stream = PromptStream(records(prompts), shuffle=False, seed=0, total_epochs=1)
    sched = RolloutScheduler(engine, stream, StalenessManager(mini, 1, threshold, trigger), n,
                             SamplingParams(1.0, 1.0, -1, MAX_TOKENS), max_in_flight, partial,
                             on_complete=done.extend, lengths=lengths)
    return sched, engine, done


def check_exact(done, n=2):
    """Every group complete once, every response equal to an uninterrupted run's."""
    uids = [g.uid for g in done]
    assert len(uids) == len(set(uids))
    for g in done:
        assert len(g.samples) == n
        for s in g.samples:
            assert s.response_ids == expected_response(s.sample_id, MAX_TOKENS), s.sample_id
            assert len(s.rollout_log_probs) == len(s.versions) == len(s.response_ids)


def test_admission_stops_at_the_bound_and_says_why(caplog):
    caplog.set_level(logging.DEBUG, logger="fully_async.rollout.scheduler")
    sched, engine, done = make(threshold=0.5, mini=2, max_in_flight=100)   # bound: 2 * 1.5 = 3 groups
    assert sched.admit() == 3
    assert engine.num_in_flight() == 6 and sched.at_bound()
    assert sched.admit() == 0 and sched.stats["bound_pauses"] == 1
    sched.drain()
    assert len(done) == 3 and sched.admit() == 0          # still version 0: the bound holds
    sched.apply_weights(lambda: engine.update_weights({}, 1), 1, queued=lambda: 1)
    assert "paused 1 time(s)" in caplog.text and "max_required_samples=3" in caplog.text  # said at the update
    assert sched.staleness.state.admitted == 1            # one group still queued is carried over
    assert sched.admit() == 2


def test_bound_pauses_are_one_line_per_param_version_with_counts(caplog, monkeypatch):
    """Many pauses in a version (the bound lifts and falls again as a test forces it here) make one line, at
    the weight update that ends the version, with the count, the seconds paused and the reason; at debug level (the
    run's count is in its summary), so nothing at info."""
    caplog.set_level(logging.DEBUG, logger="fully_async.rollout.scheduler")
    sched, engine, done = make(prompts=40, threshold=0.5, mini=2, max_in_flight=100)
    for version in (1, 2, 3):
        for _ in range(4):                                 # 4 separate pauses in this version
            sched.admit()
            sched.admit()                                  # still at the bound: the same pause, not a new one
            sched.staleness.state.admitted -= 1            # one slot frees up (as if a group were dropped)
            sched.staleness._paused = False
        sched.drain()
        sched.apply_weights(lambda v=version: engine.update_weights({}, v), version, queued=lambda: 0)
    lines = [r.getMessage() for r in caplog.records if "paused" in r.getMessage()]
    assert len(lines) == 3, lines
    assert {r.levelno for r in caplog.records if "paused" in r.getMessage()} == {logging.DEBUG}
    for version, line in enumerate(lines):
        assert line.startswith("rollouter paused 4 time(s), ") and f"at param version {version}:" in line
        assert "s in all" in line and "staleness bound" in line
    sched.admit()
    sched.log_pauses()                                     # the end of the run: the last version's line
    assert sum("paused 1 time(s)" in r.getMessage() for r in caplog.records) == 1


def test_admission_respects_engine_capacity():
    sched, engine, _ = make(threshold=10, max_in_flight=5, n=2)
    sched.admit()
    assert engine.num_in_flight() == 4                    # a third group (6 > 5) waits for room


def test_abort_mode_update_mid_generation_resumes_exactly():
    sched, engine, done = make(prompts=6, threshold=10)
    sched.admit()
    for _ in range(3):
        sched.step()
    timings = sched.apply_weights(lambda: engine.update_weights({}, 1), 1, queued=lambda: 0)
    assert set(timings) >= {"pause", "load", "resume"}
    assert sched.stats["interrupted_samples"] > 0 and engine.loads == [1]
    while not sched.exhausted:
        sched.admit()
        sched.step()
    check_exact(done)
    interrupted = [s for g in done for s in g.samples if s.num_interruptions]
    mixed = [s for s in interrupted if set(s.versions) == {0, 1}]
    assert mixed, "some response was cut mid-way and finished on the new weights"
    for s in interrupted:  # tokens before the update carry version 0 and its log-prob, later ones version 1
        assert s.versions == sorted(s.versions)
        assert all(lp == pytest.approx(-0.1 * (v + 1)) for lp, v in zip(s.rollout_log_probs, s.versions))


def test_drain_mode_finishes_on_old_weights():
    sched, engine, done = make(prompts=4, threshold=10, partial=False)
    sched.admit()
    sched.step()
    sched.apply_weights(lambda: engine.update_weights({}, 1), 1, queued=lambda: 0)
    assert len(done) == 4 and all(v == 0 for g in done for s in g.samples for v in s.versions)
    assert sched.stats["interrupted_samples"] == 0


def test_keep_mode_loads_with_requests_in_flight():
    engine = ScriptedEngine(max_num_seqs=8, keeps_in_flight=True)
    sched, engine, done = make(engine=engine, prompts=4, threshold=10)
    sched.admit()
    sched.step()
    in_flight = engine.num_in_flight()
    sched.apply_weights(lambda: engine.update_weights({}, 1), 1, queued=lambda: 0)
    assert engine.num_in_flight() == in_flight and not sched.parked
    while not sched.exhausted:
        sched.step()
    check_exact(done)
    assert any(len(set(s.versions)) == 2 for g in done for s in g.samples)


@pytest.mark.parametrize("phase", ["before_admit", "mid_generation", "at_bound", "after_drain"])
def test_update_in_every_phase_loses_and_duplicates_nothing(phase):
    sched, engine, done = make(prompts=10, threshold=0.5, mini=2)
    version = 0

    def update():
        nonlocal version
        version += 1
        sched.apply_weights(lambda: engine.update_weights({}, version), version,
                            queued=lambda: 0)  # the trainer consumed everything queued

    if phase == "before_admit":
        update()
    sched.admit()
    if phase == "mid_generation":
        sched.step()
        update()
    if phase == "at_bound":
        assert sched.at_bound()
        update()
    if phase == "after_drain":
        sched.drain()
        update()
    for _ in range(1000):
        if sched.exhausted:
            break
        sched.admit()
        if sched.in_flight():
            sched.step()
        else:
            update()
    assert sched.exhausted and len(done) == 10
    check_exact(done)


def test_snapshot_restore_continues_exactly():
    sched, engine, done = make(prompts=8, threshold=10)
    sched.admit()
    sched.step()
    sched.step()
    sched.park()
    state = pickle.loads(pickle.dumps(sched.state_dict()))  # what a checkpoint stores
    assert state["pending"] and any(p.token_ids for p in state["pending"])
    before = {g.uid for g in done}
    # a new process: fresh engine and scheduler, restored from the snapshot
    sched2, engine2, done2 = make(prompts=8, threshold=10)
    sched2.load_state_dict(state)
    assert len(sched2.parked) == len(state["pending"])
    sched2.resume()
    while not sched2.exhausted:
        sched2.admit()
        sched2.step()
    after = {g.uid for g in done2}
    assert not before & after and len(before | after) == 8
    check_exact(done + done2)


def test_synthetic_lengths_end_responses_with_stop():
    lengths = make_lengths(lambda sid: 2)
    sched, engine, done = make(prompts=3, threshold=10, lengths=lengths)
    sched.admit()
    sched.drain()
    for g in done:
        for s in g.samples:
            natural = expected_response(s.sample_id, MAX_TOKENS)
            assert s.response_ids == natural[:2]
            assert s.finish_reason == ("stop" if len(natural) > 2 or natural[-1] == EOS else "length")


def test_unknown_output_is_an_error():
    from fully_async.core.types import GenOutput

    sched, _, _ = make()
    with pytest.raises(RuntimeError, match="not in flight"):
        sched.handle([GenOutput("nope", [], [], [], "stop")])


def test_before_resume_runs_on_new_weights_with_partials_still_parked():
    sched, engine, done = make(prompts=4, threshold=10)
    sched.admit()
    sched.step()
    seen = {}

    def hook():  # what the rollouter's validation sees: nothing in flight, the partials waiting
        seen.update(version=engine.version, in_flight=engine.num_in_flight(), parked=len(sched.parked),
                    unfinished=len(sched.pending))

    sched.apply_weights(lambda: engine.update_weights({}, 1), 1, queued=lambda: 0, before_resume=hook)
    assert seen["version"] == 1 and seen["in_flight"] == 0 and seen["parked"] == seen["unfinished"] > 0
    assert not sched.parked and engine.num_in_flight() == seen["parked"]   # resumed after the hook


def test_remax_generates_one_greedy_baseline_per_group_that_leaves_the_group_with_its_reward():
    """algorithm.adv_estimator=remax: every group also generates `<uid>-b` greedily (temperature 0) beside its n
    sampled responses, and completes with all n + 1; make_group takes the baseline out and hands its reward to
    every response as reward_baseline (verl's reward_baselines); it is never a training sample."""
    from fully_async.core.types import PromptRecord
    from fully_async.rollout.generation import make_group

    engine = ScriptedEngine(max_num_seqs=3)
    done = []
    stream = PromptStream(records(4), shuffle=False, seed=0, total_epochs=1)
    sched = RolloutScheduler(engine, stream, StalenessManager(2, 1, 1.0, 1), 2, SamplingParams(1.0, 1.0, -1, MAX_TOKENS),
                             max_in_flight=6, partial_rollout=True, on_complete=done.extend, baseline=True)
    assert sched.admit() == 2 and engine.num_in_flight() == 6    # 2 groups of 2 sampled + 1 greedy
    greedy = {p.sample_id: p.params.temperature for p in sched.pending.values()}
    assert {sid for sid, t in greedy.items() if t == 0.0} == {"e0-p0-b", "e0-p1-b"}
    sched.drain()
    assert [len(g.samples) for g in done] == [3, 3] and sched.stats["generated_samples"] == 6
    g = done[0]
    for s in g.samples:
        s.reward = 5.0 if s.sample_id.endswith("-b") else 1.0
    group = make_group(g.uid, PromptRecord(0, [1], "x", "1"), g.epoch, 0, g.samples)
    assert [s.sample_id for s in group.samples] == ["e0-p0-s0", "e0-p0-s1"]
    assert [s.reward_baseline for s in group.samples] == [5.0, 5.0]
