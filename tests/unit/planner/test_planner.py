"""Split search of the planner: valid splits and the best split against an exhaustive search."""
from fully_async.planner.pipeline_sim import StageCosts
from fully_async.planner.search import PipelineShape, plan_devices, valid_splits
from fully_async.core.workload import LengthProfile


def shape(**kw):
    base = dict(n=4, async_groups=8, sync_groups=8, max_num_seqs=64, rollout_tp=1, trainer_mp=1,
                staleness_threshold=0.5, trigger=1, partial_rollout=True, config_devices=8)
    base.update(kw)
    return PipelineShape(**base)


def test_valid_splits_respect_replica_and_model_parallel_sizes():
    assert valid_splits(8, shape(rollout_tp=2, trainer_mp=4)) == [4]
    assert valid_splits(4, shape()) == [1, 2, 3]
    assert valid_splits(2, shape(rollout_tp=2)) == []


def test_best_split_matches_exhaustive_search_and_batch_scaling():
    costs = StageCosts(decode_step_s=0.005, train_token_s=2e-4, weight_sync_s=0.02, sync_step_s=0.02)
    length = LengthProfile.lognormal(128).target
    big = plan_devices(96, shape(), costs, length, 16, 6)   # > 40 valid splits: coarse grid, then narrowed
    assert big["async_groups_per_step"] == 96
    small = plan_devices(8, shape(), costs, length, 16, 6, scaling="fixed")
    best = max(small["candidates"], key=lambda c: c["steady_tokens_per_s"])
    assert len(small["candidates"]) == 7 and small["best"] == best
    assert small["speedup"] == best["steady_tokens_per_s"] / small["sync"]["steady_tokens_per_s"]
    from fully_async.planner.search import AsyncSetup, Workload, simulate_async
    exhaustive = max(range(1, 96), key=lambda r: simulate_async(
        AsyncSetup(r, 96 - r, 64, 96, 0.5, 1, True), costs, Workload(4, 16, length, 6)).steady_tokens_per_s(2))
    assert big["best"]["rollout_devices"] == exhaustive


def test_no_split_when_the_sizes_do_not_divide():
    costs = StageCosts(decode_step_s=0.005, train_token_s=2e-4)
    out = plan_devices(2, shape(rollout_tp=2), costs, lambda _s: 8, 4, 3)
    assert out["best"] is None and "multiple of 2" in out["reason"]
