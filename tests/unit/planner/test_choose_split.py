"""planner/search.py choose_split: the comparison's split of N devices from one device's rollout-only (R) and
train-only (T) tokens/s, by the planner's own search (_best_split), ties to fewer rollout devices."""
import pytest

from fully_async.planner.search import async_ceiling, choose_split, sync_ceiling


def test_the_split_that_balances_the_stages_wins_and_every_candidate_is_listed():
    s = choose_split(4, 30.0, 100.0)       # r R against (4 - r) T: 30/300, 60/200, 90/100
    assert [c["ceiling"] for c in s["candidates"]] == [30.0, 60.0, 90.0]
    assert (s["rollout"], s["trainer"], s["best"], s["ceiling"]) == (3, 1, 3, 90.0)
    assert s["sync_ceiling"] == pytest.approx(1 / (1 / 120 + 1 / 400))
    assert s["reason"].startswith("r=3 maximises")


def test_a_plateau_goes_to_fewer_rollout_devices_even_past_the_coarse_grid():
    # e = 0.5 keeps a trainer of any size at T: every r with r R >= T ties; the search must still find r = 7
    s = choose_split(29, 10.0, 63.2, 0.5)
    assert s["rollout"] == 7 and s["ceiling"] == pytest.approx(63.2)
    assert "fewer rollout devices wins" in s["reason"]


def test_forced_split_is_reported_against_the_best_and_flags_are_checked():
    s = choose_split(4, 30.0, 100.0, force=1)
    assert (s["rollout"], s["best"], s["ceiling"]) == (1, 3, 30.0) and s["reason"].startswith("forced by --split 1")
    assert choose_split(4, None, None, force=2)["reason"] == "forced by --split 2 (no bench: ceilings not predicted)"
    with pytest.raises(ValueError, match="--split 4 must be in 1..3"):
        choose_split(4, 1.0, 1.0, force=4)
    with pytest.raises(ValueError, match="needs the measured"):
        choose_split(4, None, None)
    with pytest.raises(ValueError, match="--devices 1"):
        choose_split(1, 1.0, 1.0)
    assert async_ceiling(2, 2, 10.0, 10.0, 0.9) == pytest.approx(18.0)
    assert sync_ceiling(1, 10.0, 10.0) == pytest.approx(5.0)
