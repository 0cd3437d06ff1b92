"""Refactorings keep behaviour: sync, async (on-policy bound) and sync on two data-parallel ranks, with a fixed seed,
train the same sample ids, in the same order, with the same scores, losses, gradient norms and lengths as the pin
written before the loops were restructured (scripts/pin_behaviour.py; tests/fixtures/behaviour_pin.json).  The same
runs show that sync and async mode run the same training step: with an on-policy bound (staleness_threshold=0) the
async rollouter admits exactly the batch sync generates, in the same order, from the same seed, so every step of
the two modes sees the same samples and logs the same reward, loss and gradient norm."""
import json
import os
import sys

import pytest

import tests_helpers

pytestmark = pytest.mark.integration
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import pin_behaviour  # noqa: E402


@pytest.fixture(scope="module")
def ray_session():
    yield from tests_helpers.ray_session(num_cpus=3)


@pytest.fixture(scope="module")
def fresh(ray_session):
    saved = os.environ.get("TENSORBOARD_DIR")
    try:
        return pin_behaviour.fresh()   # record() sets TENSORBOARD_DIR per mode
    finally:
        if saved is None:
            os.environ.pop("TENSORBOARD_DIR", None)
        else:
            os.environ["TENSORBOARD_DIR"] = saved


def test_sync_and_async_match_the_pinned_behaviour(fresh):
    pinned = json.load(open(pin_behaviour.PIN))
    assert set(pinned) == set(pin_behaviour.RUNS)
    for mode in pinned:   # a pin that could not catch a change would be no pin
        assert len(pinned[mode]["trained_sample_ids"]) == pin_behaviour.STEPS * 16 * 8
        assert all(len(v) == pin_behaviour.STEPS for v in pinned[mode]["scalars"].values())
    assert pin_behaviour.compare(fresh, pinned) == []


def test_every_step_is_identical_in_both_modes(fresh):
    a, s = fresh["async"], fresh["sync"]
    assert a["trained_sample_ids"] == s["trained_sample_ids"]
    for tag in pin_behaviour.TAGS:
        got_a, got_s = a["scalars"][tag], s["scalars"][tag]
        assert sorted(got_a) == sorted(got_s) == [str(i) for i in range(1, pin_behaviour.STEPS + 1)], tag
        for step in got_s:
            assert got_a[step] == pytest.approx(got_s[step], rel=1e-6, abs=1e-9), (tag, step, got_a, got_s)


def test_compare_sees_a_changed_loss_and_a_reordered_batch():
    pinned = json.load(open(pin_behaviour.PIN))
    changed = json.loads(json.dumps(pinned))
    changed["sync"]["scalars"]["actor/pg_loss"]["2"] += 1e-3
    ids = changed["async"]["trained_sample_ids"]
    ids[0], ids[1] = ids[1], ids[0]
    diffs = pin_behaviour.compare(changed, pinned)
    assert any("pg_loss at step 2" in d for d in diffs) and any("async: trained sample ids" in d for d in diffs)
