"""Admission bound and carry-over arithmetic (DESIGN.md, staleness semantics)."""
from fully_async.core.staleness import StalenessManager, max_required_samples


def admit_until_blocked(m: StalenessManager) -> int:
    n = 0
    while m.can_admit():
        m.on_admit()
        n += 1
    m.note_stop()
    return n


def test_strictly_on_policy_admits_exactly_one_step():
    m = StalenessManager(ppo_mini_batch_size=4, require_batches=1, staleness_threshold=0.0,
                         trigger_parameter_sync_step=1)
    assert m.required == 4 and m.max_admitted == 4
    assert admit_until_blocked(m) == 4
    # the trainer consumed all 4 and nothing is in flight or queued: a clean slate
    m.on_version(1, in_flight=0, queued=0)
    assert admit_until_blocked(m) == 4
    assert m.state.total_admitted == 8


def test_threshold_half_allows_documented_surplus_and_carries_over():
    m = StalenessManager(4, 1, 0.5, 1)
    assert m.max_admitted == 6                       # 4 * 1.5 * 1
    assert admit_until_blocked(m) == 6               # surplus = required * threshold = 2
    assert "max_required_samples=6" in m.pause_reason()
    # trainer took 4; 2 groups still queued are carried over into version 1's budget
    m.on_version(1, in_flight=0, queued=2)
    assert m.state.admitted == 2 and m.state.carried_over == 2
    assert admit_until_blocked(m) == 4
    # in-flight groups count the same as queued ones
    m.on_version(2, in_flight=1, queued=1)
    assert admit_until_blocked(m) == 4


def test_trigger_and_require_batches_scale_the_bound():
    m = StalenessManager(ppo_mini_batch_size=2, require_batches=3, staleness_threshold=0.2,
                         trigger_parameter_sync_step=4)
    assert m.required == 6
    assert m.max_admitted == max_required_samples(6, 0.2, 4) == 28  # floor(6 * 1.2 * 4 = 28.8)


def test_pause_counted_once_per_pause_and_state_round_trip():
    m = StalenessManager(2, 1, 0.0, 1)
    admit_until_blocked(m)
    before = m.state_dict()
    assert not m.can_admit() and not m.can_admit()
    assert m.state_dict() == before                  # asking changes nothing
    assert not m.note_stop() and m.state.pauses == 1  # the same stretch at the bound: one pause
    m.on_version(1, 0, 0)
    admit_until_blocked(m)
    assert m.state.pauses == 2
    m2 = StalenessManager(2, 1, 0.0, 1)
    m2.load_state_dict(m.state_dict())
    assert m2.state == m.state
