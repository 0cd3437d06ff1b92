"""The pipeline simulation on workloads small enough to work out by hand, and its qualitative behaviour:
overlap under a looser staleness bound, interruption vs drain at a weight update, the long tail, scale."""
import time

import pytest

from fully_async.planner.pipeline_sim import AsyncSetup, StageCosts, Workload, generate_time, _group, \
    simulate_async, simulate_sync
from fully_async.core.workload import LengthProfile


def const(length):
    return lambda _sid: length


COSTS = StageCosts(decode_step_s=0.01, train_token_s=0.001, weight_sync_s=0.02, sync_step_s=0.01)


def test_sync_step_is_generation_then_training_worked_by_hand():
    # 2 ranks, 2 groups of n=2 responses of 10 tokens: each rank decodes 10 steps (0.1 s); 40 tokens train on
    # 2 devices (40 x 0.001 / 2 = 0.02 s) and the switch costs 0.01 s
    res = simulate_sync(2, 2, 8, COSTS, Workload(n=2, prompt_len=0, length=const(10), steps=3))
    assert res.step_ends == pytest.approx([0.13, 0.26, 0.39])
    assert res.tokens == 120
    assert res.tokens_per_s == pytest.approx(40 / 0.13)
    assert res.trainer_idle_ratio == pytest.approx(0.1 / 0.13)


def test_strictly_on_policy_async_runs_generate_train_sync_in_series():
    # staleness 0, trigger 1: the rollouter admits one step's 2 groups per version, so each step is
    # generate (0.1) + train (40 tokens x 0.001 = 0.04) + weight update (0.02)
    setup = AsyncSetup(replicas=1, trainer_devices=1, max_num_seqs=8, required=2, staleness_threshold=0.0,
                       trigger_parameter_sync_step=1, partial_rollout=False)
    res = simulate_async(setup, COSTS, Workload(n=2, prompt_len=0, length=const(10), steps=3))
    assert res.step_ends == pytest.approx([0.16, 0.32, 0.48])
    assert res.tokens_per_s == pytest.approx(40 / 0.16)
    assert res.interrupted == 0
    assert res.bound_pauses >= 3


@pytest.mark.parametrize("partial", [False, True])
def test_the_engines_load_after_the_push_delays_generation_worked_by_hand(partial):
    # as the strictly on-policy run above, with a push that does not wait for the engines' load (the object store):
    # the trainer's step ends at its push (0.02 s), then the engines load for 0.03 s before the next version's
    # groups are admitted: generate 0.1 + train 0.04 + push 0.02 = 0.16, then 0.03 + 0.16 a step
    setup = AsyncSetup(replicas=1, trainer_devices=1, max_num_seqs=8, required=2, staleness_threshold=0.0,
                       trigger_parameter_sync_step=1, partial_rollout=partial)
    costs = StageCosts(decode_step_s=0.01, train_token_s=0.001, weight_sync_s=0.02, weight_load_s=0.03)
    res = simulate_async(setup, costs, Workload(n=2, prompt_len=0, length=const(10), steps=3))
    assert res.step_ends == pytest.approx([0.16, 0.35, 0.54])


def test_the_trainer_goes_on_during_the_engines_load_and_its_next_push_waits_for_it():
    """Generation nearly free, a loose bound: every step trains 40 tokens (0.04 s) and pushes (0.01 s).  A 0.03 s
    load after the push is off the trainer's path (0.05 s a step, as without it); a 0.06 s load outlasts the next
    step's training, whose push waits for it: 0.01 + 0.06 = 0.07 s a step after the first."""
    work = Workload(2, 0, const(10), 20)
    ends = {}
    for load in (0.0, 0.03, 0.06):
        costs = StageCosts(decode_step_s=1e-6, train_token_s=0.001, weight_sync_s=0.01, weight_load_s=load)
        ends[load] = simulate_async(AsyncSetup(1, 1, 64, 2, 2.0, 1, True), costs, work).step_ends
    assert ends[0.0] == pytest.approx([0.05 * (k + 1) for k in range(20)], abs=1e-4)
    assert ends[0.03] == pytest.approx(ends[0.0], abs=1e-4)
    assert ends[0.06] == pytest.approx([0.05 + 0.07 * k for k in range(20)], abs=1e-4)


def test_async_counts_the_tokens_of_the_run_s_steps_only():
    """A run of K steps counts K steps' tokens: with a loose bound and a trigger > 1 the queue holds the next step's
    groups when the last one ends, and a step started past the end (its samples counted, its time not) inflated
    tokens/s by one step in K (2x H100, seed-003 shape, 6 steps: +16% tokens, +26% tokens/s against the run)."""
    setup = AsyncSetup(replicas=1, trainer_devices=1, max_num_seqs=64, required=2, staleness_threshold=2.0,
                       trigger_parameter_sync_step=4, partial_rollout=True)
    res = simulate_async(setup, COSTS, Workload(n=2, prompt_len=0, length=const(10), steps=3))
    assert len(res.step_tokens) == len(res.step_ends) == 3
    assert res.tokens == 3 * 40 and res.tokens_per_s == pytest.approx(120 / res.step_ends[-1])


def test_prompt_tokens_count_and_prefill_costs():
    costs = StageCosts(decode_step_s=0.01, train_token_s=0.0, prefill_token_s=0.001)
    t, tokens = generate_time([_group(Workload(2, 5, const(10)), 0)[1]], costs, 8)
    assert tokens == 2 * (5 + 10)
    assert t == pytest.approx(0.1 + 0.001 * 10)


def test_a_group_waits_for_free_slots():
    # 4 sequences of 10 tokens through 2 slots: two rounds of 10 steps
    t, _ = generate_time([_group(Workload(2, 0, const(10)), i)[1] for i in range(2)], COSTS, 2)
    assert t == pytest.approx(0.2)


def test_per_sequence_step_cost():
    costs = StageCosts(decode_step_s=0.01, decode_seq_s=0.001, train_token_s=0.0)
    t, _ = generate_time([_group(Workload(4, 0, const(10)), 0)[1]], costs, 8)
    assert t == pytest.approx(10 * (0.01 + 4 * 0.001))


def test_a_looser_staleness_bound_overlaps_the_stages():
    work = Workload(n=4, prompt_len=4, length=LengthProfile.lognormal(64).target, steps=12)
    serial = simulate_async(AsyncSetup(1, 1, 64, 4, 0.0, 1, False), COSTS, work)
    overlap = simulate_async(AsyncSetup(1, 1, 64, 4, 1.0, 1, True), COSTS, work)
    assert overlap.tokens_per_s > 1.2 * serial.tokens_per_s
    assert overlap.trainer_idle_ratio < serial.trainer_idle_ratio


def test_partial_rollout_interrupts_and_no_partial_drains():
    work = Workload(n=4, prompt_len=4, length=const(50), steps=6)
    costs = StageCosts(decode_step_s=0.01, train_token_s=0.0001, weight_sync_s=0.05)
    partial = simulate_async(AsyncSetup(1, 1, 64, 2, 2.0, 1, True), costs, work)
    drain = simulate_async(AsyncSetup(1, 1, 64, 2, 2.0, 1, False), costs, work)
    assert partial.interrupted > 0
    assert drain.interrupted == 0
    # draining makes the trainer wait for the in-flight responses at every update
    assert partial.tokens_per_s > drain.tokens_per_s


def test_the_long_tail_hurts_sync_more_than_async():
    """Same mean length: a lognormal tail makes each sync step wait for its longest response; async keeps
    generating while the trainer works."""
    profile = LengthProfile.lognormal(256)
    mean = round(profile.stats()["mean"])
    costs = StageCosts(decode_step_s=0.004, train_token_s=2e-5, weight_sync_s=0.05, sync_step_s=0.05)
    tail, flat = Workload(8, 16, profile.target, 8), Workload(8, 16, const(mean), 8)
    sync_tail = simulate_sync(2, 16, 128, costs, tail).tokens_per_s
    sync_flat = simulate_sync(2, 16, 128, costs, flat).tokens_per_s
    async_tail = simulate_async(AsyncSetup(1, 1, 128, 16, 1.0, 1, True), costs, tail).tokens_per_s
    async_flat = simulate_async(AsyncSetup(1, 1, 128, 16, 1.0, 1, True), costs, flat).tokens_per_s
    assert sync_tail < 0.8 * sync_flat
    assert async_tail / async_flat > sync_tail / sync_flat


def test_trainer_bound_async_reaches_the_train_ceiling():
    # generation is nearly free: tokens/s -> tokens / (train + weight update) per step
    costs = StageCosts(decode_step_s=1e-6, train_token_s=0.001, weight_sync_s=0.0)
    res = simulate_async(AsyncSetup(1, 1, 64, 2, 0.5, 1, True), costs, Workload(2, 0, const(10), 20))
    assert res.tokens_per_s == pytest.approx(1000, rel=0.02)


def test_thousands_of_devices_simulate_in_seconds():
    work = Workload(n=16, prompt_len=256, length=LengthProfile.lognormal(8192).target, steps=4)
    start = time.perf_counter()
    res = simulate_async(AsyncSetup(replicas=256, trainer_devices=256, max_num_seqs=256, required=1024,
                                    staleness_threshold=0.5, trigger_parameter_sync_step=1), COSTS, work)
    assert res.steps == 4 and res.tokens > 0
    assert time.perf_counter() - start < 60


@pytest.mark.parametrize("field,value", [("decode_step_s", -1.0), ("train_token_s", float("nan")),
                                         ("dp_efficiency", 0.0), ("dp_efficiency", 1.5)])
def test_bad_costs_name_the_field(field, value):
    kwargs = dict(decode_step_s=0.01, train_token_s=0.001)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        StageCosts(**kwargs)


def test_bad_setup_is_refused():
    with pytest.raises(ValueError, match="rollout replica"):
        simulate_async(AsyncSetup(0, 1, 8, 1), COSTS, Workload(2, 0, const(4)))
    with pytest.raises(ValueError, match="train_batch_size"):
        simulate_sync(1, 0, 8, COSTS, Workload(2, 0, const(4)))


def test_steady_rate_leaves_out_the_fill():
    setup = AsyncSetup(replicas=1, trainer_devices=1, max_num_seqs=8, required=2, staleness_threshold=0.0,
                       trigger_parameter_sync_step=1, partial_rollout=False)
    res = simulate_async(setup, COSTS, Workload(n=2, prompt_len=0, length=const(10), steps=4))
    assert res.step_tokens == [40, 40, 40, 40]
    assert res.steady_tokens_per_s(2) == pytest.approx(80 / (0.64 - 0.32))
    assert res.steady_tokens_per_s(0) == res.tokens_per_s


def test_data_parallel_efficiency_is_kept_per_doubling_of_the_trainer_devices():
    """2 devices are worth 2e one-device trainers and 4 are worth 4e^2: the 0.5B shape on H200 (fsdp2, per-device
    batch held) cost 5.4 / 6.9 / 8.8 us per device and token at 1 / 2 / 4 devices, 0.78 kept at each doubling."""
    from fully_async.planner.sim_engine import data_parallel_speedup

    assert data_parallel_speedup(1, 0.5) == 1.0 and data_parallel_speedup(2, 0.5) == 1.0
    assert data_parallel_speedup(4, 0.5) == pytest.approx(1.0) and data_parallel_speedup(8, 0.9) == pytest.approx(
        8 * 0.9 ** 3)
    assert data_parallel_speedup(2, 0.8) < data_parallel_speedup(3, 0.8) < data_parallel_speedup(4, 0.8)
    costs = StageCosts(decode_step_s=0.01, train_token_s=5.4e-6, dp_efficiency=0.78)
    for devices, measured_us in ((2, 6.9), (4, 8.8)):
        per_device_token_us = costs.train_time(1_000_000, devices) * devices / 1_000_000 * 1e6
        assert per_device_token_us == pytest.approx(measured_us, rel=0.03)


def test_first_step_compiling_is_paid_once_by_every_mode():
    """StageCosts.first_train_s: the trainer's first step also compiles; each mode's run is longer by exactly that
    in sync and colocated (nothing overlaps their trainer), and the steps after the first are unchanged."""
    from dataclasses import replace

    from fully_async.planner.colocated_sim import simulate_colocated
    from fully_async.planner.pipeline_sim import AsyncSetup, simulate_sync
    from fully_async.planner.sim_engine import StageCosts, Workload

    costs = StageCosts(decode_step_s=0.01, train_token_s=1e-4, weight_sync_s=0.2, sync_step_s=0.1)
    work = Workload(n=4, prompt_len=8, length=lambda sid: 20 + 7 * (sum(map(ord, sid)) % 5), steps=5)
    setup = AsyncSetup(replicas=1, trainer_devices=1, max_num_seqs=16, required=4, staleness_threshold=0.5,
                       trigger_parameter_sync_step=2)
    compiling = replace(costs, first_train_s=3.0)
    for run in (lambda c: simulate_sync(1, 4, 16, c, work), lambda c: simulate_colocated(1, setup, c, work)):
        base, paid = run(costs), run(compiling)
        assert paid.seconds == pytest.approx(base.seconds + 3.0) and paid.tokens == base.tokens
        assert paid.steady_tokens_per_s(1) == pytest.approx(base.steady_tokens_per_s(1))
    with pytest.raises(ValueError, match="first_train_s"):
        StageCosts(decode_step_s=0.01, train_token_s=1e-4, first_train_s=-1.0)
