"""DAPO's dynamic sampling with fake scored groups: which groups are dropped, the counts, verl's bound."""
from types import SimpleNamespace

import pytest

from fully_async.algorithms.dynamic_sampling import GroupFilter, TooManyGenBatchesError, keep_group, response_value
from fully_async.core.staleness import StalenessManager


def sample(reward, **extra):
    return SimpleNamespace(sample_id="s", reward=reward, reward_extra=extra)


def group(uid, rewards, **extra_per):
    return SimpleNamespace(uid=uid, samples=[sample(r, **{k: v[i] for k, v in extra_per.items()})
                                             for i, r in enumerate(rewards)])


def test_a_group_is_kept_when_its_values_differ_or_it_has_one_response():
    assert keep_group([0.0, 1.0, 1.0]) and keep_group([1.0]) and keep_group([0.5, 0.5 + 1e-9])
    assert not keep_group([1.0, 1.0, 1.0]) and not keep_group([-1.0, -1.0])


def test_the_metric_picks_the_compared_value():
    s = sample(0.3, acc=True, score=0.7)
    assert response_value(s, "acc") == 1.0 and response_value(s, "score") == 0.7
    assert response_value(s, "seq_reward") == response_value(s, "seq_final_reward") == 0.3
    assert response_value(sample(0.3), "score") == 0.3        # no score key: the reward
    with pytest.raises(ValueError, match="returned no 'acc'.*use seq_reward"):
        response_value(sample(0.3), "acc")


def test_acc_filters_on_accuracy_even_when_rewards_differ():
    # DAPO's reward is acc plus an overlong penalty: rewards differ, the accuracy does not
    f = GroupFilter("acc", required=2)
    kept, dropped = f.split([group("a", [1.0, 0.8], acc=[True, True]), group("b", [1.0, -1.0], acc=[True, False])])
    assert [g.uid for g in kept] == ["b"] and [g.uid for g in dropped] == ["a"]
    f = GroupFilter("seq_reward", required=2)
    assert len(f.split([group("a", [1.0, 0.8], acc=[True, True])])[0]) == 1


def test_counts_and_checkpoint_round_trip():
    f = GroupFilter("seq_reward", required=2, max_num_gen_batches=3)
    f.split([group("a", [1, 1]), group("b", [0, 1]), group("c", [0, 0])])
    assert (f.kept, f.filtered, f.filtered_uids) == (1, 2, ["a", "c"])
    assert (f.window_consumed, f.window_kept) == (3, 1)
    g = GroupFilter("seq_reward", required=2, max_num_gen_batches=3)
    g.load_state_dict(f.state_dict())
    assert g.state_dict() == f.state_dict()
    g.split([group("d", [0, 1])])                # the step is full: the window starts again
    assert (g.kept, g.window_consumed, g.window_kept) == (2, 0, 0)


def test_a_step_short_after_max_num_gen_batches_batches_of_prompts_fails_naming_the_key():
    f = GroupFilter("seq_reward", required=2, max_num_gen_batches=2)
    f.split([group("a", [1, 1]), group("b", [0, 1]), group("c", [0, 0])])   # 3 of the 4 prompts allowed
    with pytest.raises(TooManyGenBatchesError, match="max_num_gen_batches=2"):
        f.split([group("d", [1, 1])])
    unbounded = GroupFilter("seq_reward", required=2, max_num_gen_batches=0)
    unbounded.split([group(str(i), [1, 1]) for i in range(50)])
    assert unbounded.filtered == 50


def test_end_step_starts_a_new_window():
    f = GroupFilter("seq_reward", required=4, max_num_gen_batches=1)
    f.split([group("a", [1, 1]), group("b", [0, 1])])
    f.end_step()
    f.split([group("c", [1, 1]), group("d", [1, 1]), group("e", [0, 1])])   # 3 < 4: within the fresh bound


def test_from_config_is_none_when_disabled():
    off = SimpleNamespace(algorithm=SimpleNamespace(filter_groups=SimpleNamespace(enable=False)))
    assert GroupFilter.from_config(off, 4) is None
    on = SimpleNamespace(algorithm=SimpleNamespace(filter_groups=SimpleNamespace(enable=True, metric="acc",
                                                                                 max_num_gen_batches=5)))
    f = GroupFilter.from_config(on, 4)
    assert (f.metric, f.required, f.max_num_gen_batches) == ("acc", 4, 5)


def test_a_filtered_group_frees_its_admission_slot():
    sm = StalenessManager(ppo_mini_batch_size=2, require_batches=1, staleness_threshold=0.0,
                          trigger_parameter_sync_step=1)
    sm.on_admit(2)
    assert not sm.can_admit() and sm.note_stop()
    sm.on_filtered(1)
    assert sm.can_admit() and sm.state.admitted == 1 and sm.state.total_admitted == 2
    sm.on_admit()
    assert not sm.can_admit() and sm.note_stop()          # a new stretch at the bound is a new pause
    assert sm.state.pauses == 2
