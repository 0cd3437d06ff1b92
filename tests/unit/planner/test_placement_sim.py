"""Colocated and elastic async in the pipeline simulation, on workloads worked out by hand, and the staleness
bound in every mode."""
import pytest

from fully_async.core.staleness import max_required_samples
from fully_async.core.workload import LengthProfile
from fully_async.planner.colocated_sim import simulate_colocated
from fully_async.planner.pipeline_sim import AsyncSetup, StageCosts, Workload, simulate_async, simulate_sync

# decode 10 ms a step whatever the batch; a trainer step costs 0.1 s whatever its tokens; no switch, no update
FLAT = StageCosts(decode_step_s=0.01, train_token_s=0.0, train_step_s=0.1)


def one_long_response(sample_id):
    """Prompt 0's response is 100 tokens, every other one 10."""
    return 100 if sample_id.startswith("e0-p0-") else 10


def test_colocated_on_one_device_cuts_the_tail_worked_by_hand():
    """n=1, one group per step, bound 2 groups per version.  Sync: step 1 decodes p0's 100 tokens (1.0 s) + trains
    (0.1 s), then 10 tokens (0.1 s) + 0.1 s per step: 1.1, 1.3, ..., 2.9.  Colocated admits p0 and p1; p1 completes
    after 0.1 s, p0 is parked with 90 tokens left; each later phase resumes p0 and one new group, ending when the
    new group completes (0.1 s), so p0 advances 10 tokens a phase and completes in phase 10 with p9 (trained
    then, p9 is left queued): 0.2 s per step, the 0.9 s of the tail never waited for."""
    work = Workload(n=1, prompt_len=0, length=one_long_response, steps=10)
    colocated = simulate_colocated(1, AsyncSetup(1, 1, 8, required=1, staleness_threshold=1.0), FLAT, work)
    sync = simulate_sync(1, 1, 8, FLAT, work)
    assert sync.step_ends == pytest.approx([1.1 + 0.2 * k for k in range(10)])
    assert colocated.step_ends == pytest.approx([0.2 * (k + 1) for k in range(10)])
    assert colocated.step_tokens == [10] * 9 + [100]
    assert colocated.tokens == sync.tokens == 190
    assert colocated.tokens_per_s / sync.tokens_per_s == pytest.approx(2.9 / 2.0)   # (step x 10 + tail) / step x 10
    assert colocated.interrupted == 9           # p0 parked at the end of phases 1..9
    assert colocated.as_dict()["generate_s_per_step"] == pytest.approx(0.1)
    assert colocated.as_dict()["train_s_per_step"] == pytest.approx(0.1)


def test_colocated_with_no_staleness_is_sync_but_for_the_weight_load_of_its_switch():
    """staleness_threshold=0: exactly one step's groups per version, so each phase waits for all of them, as sync's.
    Sync's switch (0.05 s a step) also loads the weights; colocated's turn switch (0.02 s) sleeps, wakes and scores:
    it loads weights at an update (none priced here)."""
    costs = StageCosts(decode_step_s=0.01, train_token_s=0.001, sync_step_s=0.05, turn_switch_s=0.02)
    work = Workload(n=4, prompt_len=8, length=LengthProfile.lognormal(64).target, steps=6)
    colocated = simulate_colocated(1, AsyncSetup(1, 1, 64, required=4, staleness_threshold=0.0), costs, work)
    sync = simulate_sync(1, 4, 64, costs, work)
    assert colocated.step_ends == pytest.approx([t - 0.03 * k for k, t in enumerate(sync.step_ends, 1)])
    assert colocated.interrupted == 0
    assert colocated.switch_s == pytest.approx(6 * 0.02) and sync.switch_s == pytest.approx(6 * 0.05)


def test_elastic_turns_trainer_idle_into_rollout_time_worked_by_hand():
    """1 rollout + 1 trainer device, one slot per replica, 10-token responses, 2 groups per step.  Split: the
    replica makes a group per 0.1 s, so step 1 ends at 0.2 + 0.05 s training; the trainer waits 0.2 of every
    0.25 s.  Elastic: the trainer's engine generates the second group meanwhile, step 1 ends at 0.1 + 0.05."""
    costs = StageCosts(decode_step_s=0.01, train_token_s=0.0, train_step_s=0.05)
    work = Workload(n=1, prompt_len=0, length=lambda _s: 10, steps=8)
    split = simulate_async(AsyncSetup(1, 1, 1, 2, 1.0, 1), costs, work)
    elastic = simulate_async(AsyncSetup(1, 1, 1, 2, 1.0, 1, elastic_replicas=1), costs, work)
    assert split.step_ends[0] == pytest.approx(0.25) and elastic.step_ends[0] == pytest.approx(0.15)
    assert split.step_ends[1:] == pytest.approx([0.25 + 0.2 * k for k in range(1, 8)])
    assert split.trainer_idle_ratio > 0.7
    assert elastic.mode == "elastic" and elastic.trainer_engines == 1
    assert elastic.tokens_per_s > 1.4 * split.tokens_per_s
    assert elastic.trainer_idle_ratio < split.trainer_idle_ratio
    assert elastic.interrupted > 0              # pre-empted responses, resumed elsewhere


def test_elastic_pays_its_switch_only_when_its_engines_were_awake():
    """Generation nearly free: the batch is always ready when a step ends, the trainer's engines stay asleep."""
    costs = StageCosts(decode_step_s=1e-6, train_token_s=0.001, sync_step_s=0.5)
    work = Workload(n=2, prompt_len=0, length=lambda _s: 10, steps=6)
    elastic = simulate_async(AsyncSetup(1, 1, 64, 2, 1.0, 1, elastic_replicas=1), costs, work)
    assert elastic.switch_s == pytest.approx(0.5)   # once, before the first step (the engines start awake)


def test_elastic_beats_split_when_rollout_capacity_is_short_not_when_the_bound_stalls():
    """1 rollout replica of 64 slots for 16 groups x 8 a step: the trainer idles waiting for slots, its 2 engines
    add them.  With 2 replicas of 128 slots the staleness bound is what stalls admission: more engines do not
    help and the pre-emption's switch costs."""
    costs = StageCosts(decode_step_s=0.004, decode_seq_s=1e-5, train_token_s=2e-5, weight_sync_s=0.05,
                       sync_step_s=0.05)
    work = Workload(8, 16, LengthProfile.lognormal(256).target, 10)
    split = simulate_async(AsyncSetup(1, 2, 64, 16, 0.5, 1, True), costs, work)
    elastic = simulate_async(AsyncSetup(1, 2, 64, 16, 0.5, 1, True, elastic_replicas=2), costs, work)
    assert split.trainer_idle_ratio > 0.8 and elastic.trainer_idle_ratio < 0.1
    assert elastic.steady_tokens_per_s(2) > 1.15 * split.steady_tokens_per_s(2)
    bound_split = simulate_async(AsyncSetup(2, 2, 128, 16, 0.5, 1, True), costs, work)
    bound_elastic = simulate_async(AsyncSetup(2, 2, 128, 16, 0.5, 1, True, elastic_replicas=2), costs, work)
    assert bound_split.bound_pauses >= 9
    assert bound_elastic.steady_tokens_per_s(2) < bound_split.steady_tokens_per_s(2)


@pytest.mark.parametrize("threshold,trigger", [(0.0, 1), (0.5, 2), (0.2, 4)])
def test_the_staleness_bound_holds_in_every_mode(threshold, trigger):
    """Groups counted against a param version (carry-over included) never pass required x (1 + threshold) x
    trigger, and the bound binds (it is reached)."""
    work = Workload(4, 8, LengthProfile.lognormal(128).target, 8)
    costs = StageCosts(decode_step_s=0.005, train_token_s=1e-5, weight_sync_s=0.02, sync_step_s=0.02)
    bound = max_required_samples(4, threshold, trigger)
    setup = AsyncSetup(2, 1, 64, 4, threshold, trigger)
    runs = [simulate_async(setup, costs, work), simulate_async(AsyncSetup(2, 1, 64, 4, threshold, trigger,
                                                                          elastic_replicas=1), costs, work),
            simulate_colocated(2, setup, costs, work)]
    for res in runs:
        assert res.max_admitted == bound, res.mode
        assert res.steps == 8 and res.bound_pauses > 0


def test_colocated_refuses_nonsense():
    with pytest.raises(ValueError, match="colocated async needs"):
        simulate_colocated(0, AsyncSetup(1, 1, 8, 1), FLAT, Workload(1, 0, one_long_response))


@pytest.mark.parametrize("holds, pause_mode, reprefills", [(True, "keep", False), (True, "abort", True),
                                                           (False, "keep", True)])
def test_a_parked_response_pays_its_prefix_again_only_where_it_lost_its_cache(holds, pause_mode, reprefills):
    """The first test's schedule with a prefill cost (1 ms a token) and a weight update after every step.  p0 is
    parked at the end of phases 1..9 with 10, 20, ... 90 tokens.  The embedded engine holds it through the switch
    (holds_in_flight) and pause_mode=keep continues it over its cache: nothing is prefilled again, the steps end as
    before.  An abort update, or an engine that drops what is in flight at a switch, resumes it from prompt +
    partial response: phase k first prefills its 10 (k - 1) tokens, 0.01 (k - 1) s more."""
    costs = StageCosts(decode_step_s=0.01, train_token_s=0.0, train_step_s=0.1, prefill_token_s=0.001)
    work = Workload(n=1, prompt_len=0, length=one_long_response, steps=10)
    setup = AsyncSetup(1, 1, 8, required=1, staleness_threshold=1.0, pause_mode=pause_mode, holds_in_flight=holds)
    res = simulate_colocated(1, setup, costs, work)
    extra = [0.005 * k * (k - 1) if reprefills else 0.0 for k in range(1, 11)]
    assert res.step_ends == pytest.approx([0.2 * k + e for k, e in zip(range(1, 11), extra)])
    with pytest.raises(ValueError, match="pause_mode='pause'"):
        AsyncSetup(1, 1, 8, required=1, pause_mode="pause")


def test_a_decode_step_pays_for_the_tokens_its_sequences_have_cached():
    """decode_kv_token_s: a step costs its fixed part plus, per token cached by the sequences in flight, what reading
    its keys and values costs; the cached tokens grow by the batch each step and leave with a finished sequence.
    The replica jumps from one completion to the next in closed form: the same times as stepping token by token."""
    from fully_async.planner.sim_engine import _Seq, generate_time

    costs = StageCosts(decode_step_s=0.01, train_token_s=0.0, decode_seq_s=0.002, decode_kv_token_s=0.001)
    t, _ = generate_time([[_Seq("a", 5, 4)]], costs, slots=4)
    assert t == pytest.approx(sum(0.01 + 0.002 + 0.001 * (4 + i) for i in range(5)))
    lengths, prompts = [3, 9, 6, 12, 1], [7, 2, 5, 0, 4]
    t, _ = generate_time([[_Seq(f"s{i}", n, p)] for i, (n, p) in enumerate(zip(lengths, prompts))], costs, slots=8)
    by_step, cached, left = 0.0, list(prompts), list(lengths)
    while any(left):
        running = [i for i in range(5) if left[i]]
        by_step += 0.01 + 0.002 * len(running) + 0.001 * sum(cached[i] for i in running)
        for i in running:
            cached[i], left[i] = cached[i] + 1, left[i] - 1
    assert t == pytest.approx(by_step)
    assert costs.steps_within(costs.steps_time(7, 3, 40.0), 3, 40.0, 100) == 7
    assert costs.steps_within(costs.steps_time(7, 3, 40.0) * 0.999, 3, 40.0, 100) == 6
