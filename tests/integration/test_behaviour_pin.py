"""Refactorings keep behaviour: sync, async (on-policy bound) and sync on two data-parallel ranks, with a fixed seed, train the same sample ids, in the same
order, with the same scores, losses, gradient norms and lengths as the pin written before the loops were
restructured (scripts/pin_behaviour.py; tests/fixtures/behaviour_pin.json)."""
import json
import os
import sys

import pytest

pytestmark = pytest.mark.integration
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import pin_behaviour  # noqa: E402


def test_sync_and_async_match_the_pinned_behaviour(monkeypatch):
    monkeypatch.setenv("TENSORBOARD_DIR", "")   # record() sets it per mode; restored afterwards
    pinned = json.load(open(pin_behaviour.PIN))
    assert set(pinned) == set(pin_behaviour.RUNS)
    for mode in pinned:   # a pin that could not catch a change would be no pin
        assert len(pinned[mode]["trained_sample_ids"]) == pin_behaviour.STEPS * 16 * 8
        assert all(len(v) == pin_behaviour.STEPS for v in pinned[mode]["scalars"].values())
    got = pin_behaviour.fresh()
    assert pin_behaviour.compare(got, pinned) == []


def test_compare_sees_a_changed_loss_and_a_reordered_batch():
    pinned = json.load(open(pin_behaviour.PIN))
    changed = json.loads(json.dumps(pinned))
    changed["sync"]["scalars"]["actor/pg_loss"]["2"] += 1e-3
    ids = changed["async"]["trained_sample_ids"]
    ids[0], ids[1] = ids[1], ids[0]
    diffs = pin_behaviour.compare(changed, pinned)
    assert any("pg_loss at step 2" in d for d in diffs) and any("async: trained sample ids" in d for d in diffs)
