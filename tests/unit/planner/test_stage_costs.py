"""Stage costs from a bench JSON (the bench's own batches replayed) and from FLOPs and bandwidth."""
import json
import os

import pytest

from fully_async.planner.hardware import DEVICES, MODEL_SHAPES, Shape
from fully_async.planner.stage_costs import bench_lengths, estimate, from_bench

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))


def bench(**over):
    with open(os.path.join(ROOT, "tests", "fixtures", "gpu_runs", "bench_1dev_h200.json")) as fh:
        b = json.load(fh)
    b.update(over)
    return b


def test_a_bench_with_every_response_at_the_max_takes_max_len_steps_per_batch():
    b = bench(workload={"kind": "none", "ignore_eos": True}, batches=2)
    costs, derived = from_bench(b)
    # 16 prompts x 8 = 128 sequences in 128 slots, 256 tokens each: 256 decode steps per batch
    assert derived["decode_steps"] == 2 * 256 and derived["response_tokens"] == 2 * 128 * 256
    assert costs.decode_step_s == pytest.approx(b["rollout"]["seconds"] / 512)
    assert costs.train_token_s == pytest.approx(b["train"]["seconds"] / b["train"]["tokens"])


def test_decode_seq_fraction_splits_the_measured_time():
    b = bench()
    c0, d = from_bench(b, decode_seq_fraction=0.0)
    c1, _ = from_bench(b, decode_seq_fraction=0.25)
    seconds = b["rollout"]["seconds"]
    assert c1.decode_step_s * d["decode_steps"] + c1.decode_seq_s * d["response_tokens"] == pytest.approx(seconds)
    assert c1.decode_step_s == pytest.approx(0.75 * c0.decode_step_s)


def test_bench_without_a_known_workload_is_refused():
    with pytest.raises(ValueError, match="no synthetic workload"):
        from_bench(bench(workload=None))
    with pytest.raises(ValueError, match="ignore_eos"):
        bench_lengths(bench(workload={"kind": "none"}), 256)
    with pytest.raises(ValueError, match="not a bench_pipeline.py JSON"):
        from_bench({"rollout": {}})


def test_estimate_follows_flops_and_bandwidth():
    shape, h100 = Shape.of(MODEL_SHAPES["Qwen2.5-7B"]), DEVICES["h100"]
    c = estimate(shape, h100, assumptions={"bw_eff": 1.0, "launch_s": 0.0, "train_mfu": 0.5, "decode_mfu": 0.5})
    assert c.decode_step_s == pytest.approx(2 * shape.params() / 3350e9)
    assert c.decode_seq_s == pytest.approx(2 * shape.matmul_params() / (989e12 * 0.5))
    assert c.decode_kv_token_s == pytest.approx(shape.kv_bytes_per_token(2) / 3350e9)   # its keys and values, read
    assert c.train_token_s == pytest.approx(6 * shape.matmul_params() / (989e12 * 0.5))
    tp2 = estimate(shape, h100, rollout_tp=2, train_mp=2, checkpointing=True, extra_forwards=1)
    base = estimate(shape, h100)
    assert tp2.decode_kv_token_s == pytest.approx(base.decode_kv_token_s / 2)
    assert tp2.decode_step_s < base.decode_step_s
    assert tp2.train_token_s == pytest.approx(base.train_token_s * 10 / 6 / 2)


def run_scalars(busy, tokens=1000.0, engine_ms=(4.0,)):
    """A sync-less async run: step = gen 0.5 + param_sync 0.1 + the trainer busy seconds given per step."""
    n = len(busy)
    return {"timing_s/step": [0.6 + b for b in busy], "timing_s/gen": [0.5] * n, "timing_s/param_sync": [0.1] * n,
            "perf/total_num_tokens": [tokens] * n, "fully_async/rollouter/engine_0/ms_per_step": list(engine_ms)}


def test_compiling_steps_are_left_out_of_a_runs_stage_costs():
    """Steps 1-2 compile (busy 2.0 s and 1.2 s against a steady 0.4 s per 1000 tokens on 2 devices): averaged in,
    train_token_s would be (2.0 + 1.2 + 6 x 0.4) x 2 / 8000 = 1.4 ms; steady it is 0.4 x 2 / 1000 = 0.8 ms."""
    from fully_async.planner.stage_costs import from_run_scalars

    scalars = run_scalars([2.0, 1.2] + [0.4] * 6, engine_ms=(30.0, 6.0, 5.0, 5.0, 5.0))
    steady = from_run_scalars(scalars, "async", 2)
    assert steady.train_token_s == pytest.approx(0.4 * 2 / 1000)
    assert steady.decode_step_s == pytest.approx(0.00525)   # the engine's 30 ms compile step left out
    assert "steps 1, 2 of 8 left out" in steady.source
    everything = from_run_scalars(scalars, "async", 2, outlier_ratio=None)
    assert everything.train_token_s == pytest.approx((2.0 + 1.2 + 6 * 0.4) * 2 / 8000)
    assert everything.decode_step_s == pytest.approx(51e-3 / 5)
    first = from_run_scalars(scalars, "async", 2, skip_steps=1)  # only the first: step 2's 1.2 s stays
    assert first.train_token_s == pytest.approx((1.2 + 6 * 0.4) * 2 / 7000)


def test_a_runs_decode_step_is_split_at_the_batch_it_logged():
    """engine_0/seqs_per_step logged: the measured step (4 ms at 100 sequences) is what a sequence costs (20 us) times
    the batch plus the rest (2 ms); a per-sequence cost above the step's share stops at it; without the batch, or
    without a cost, the step stays whole."""
    from fully_async.planner.stage_costs import from_run_scalars

    scalars = run_scalars([0.4] * 4, engine_ms=(4.0,) * 4)
    scalars["fully_async/rollouter/engine_0/seqs_per_step"] = [100.0] * 4
    split = from_run_scalars(scalars, "async", 1, seq_cost_s=20e-6)
    assert split.decode_seq_s == pytest.approx(20e-6) and split.decode_step_s == pytest.approx(2e-3)
    assert split.decode_step_s + 100 * split.decode_seq_s == pytest.approx(4e-3)   # the run's own step, as measured
    assert "split at its mean 100 sequences" in split.source
    capped = from_run_scalars(scalars, "async", 1, seq_cost_s=1e-3)
    assert capped.decode_seq_s == pytest.approx(4e-5) and capped.decode_step_s == pytest.approx(0.0)
    whole = from_run_scalars(scalars, "async", 1)
    assert whole.decode_step_s == pytest.approx(4e-3) and whole.decode_seq_s == 0.0
    del scalars["fully_async/rollouter/engine_0/seqs_per_step"]
    assert from_run_scalars(scalars, "async", 1, seq_cost_s=20e-6).decode_step_s == pytest.approx(4e-3)


def test_the_engines_load_after_a_push_that_did_not_wait_for_it():
    """The object store's push returns before the engines load (the next push logs its wait for that load,
    timing_s/param_sync/wait): weight_load_s is the mean logged load; a collective push waits for the load itself
    (no wait logged: the load is inside timing_s/param_sync); colocated adds it to the update, as before."""
    from fully_async.planner.sim_engine import StageCosts
    from fully_async.planner.stage_costs import from_run_scalars

    scalars = run_scalars([0.4] * 4)
    scalars["timing_s/param_sync/load"] = [0.0, 0.02, 0.04, 0.03]   # logged from the second push on
    collective = from_run_scalars(scalars, "async", 1)
    assert collective.weight_sync_s == pytest.approx(0.1) and collective.weight_load_s == 0.0
    scalars["timing_s/param_sync/wait"] = [0.0, 1e-4, 1e-4, 1e-4]
    store = from_run_scalars(scalars, "async", 1)
    assert store.weight_sync_s == pytest.approx(0.1) and store.weight_load_s == pytest.approx(0.03)
    colocated = from_run_scalars(scalars, "async", 1, placement="colocated")
    assert colocated.weight_sync_s == pytest.approx(0.13) and colocated.weight_load_s == 0.0
    with pytest.raises(ValueError, match="weight_load_s"):
        StageCosts(decode_step_s=0.01, train_token_s=0.001, weight_load_s=-0.1)


def test_a_long_step_that_trained_more_tokens_is_not_an_outlier():
    from fully_async.planner.stage_costs import from_run_scalars, steady_steps

    scalars = run_scalars([0.4, 0.4, 1.2, 0.4])
    scalars["perf/total_num_tokens"][2] = 3000.0                    # three times the tokens, three times the time
    costs = from_run_scalars(scalars, "async", 1)
    assert costs.train_token_s == pytest.approx(2.4 / 6000) and "left out" not in costs.source
    assert steady_steps([5.0, 5.0, 5.0]) == [0, 1, 2] and steady_steps([9.0], skip_steps=3) == [0]


def test_the_decode_steps_fixed_part_is_the_engines():
    """plan.launch_s unset: the embedded engine's measured graph-captured step (0.7 ms beyond its reads and products
    on 1x H200), 4 ms for engines not measured here (vLLM, vLLM-Ascend); a value that is set is used for both."""
    from fully_async.run.plan_options import PlanOptions

    assert PlanOptions().estimate_assumptions(embedded=True)["launch_s"] == pytest.approx(7e-4)
    assert PlanOptions().estimate_assumptions()["launch_s"] == pytest.approx(4e-3)
    assert "embedded_launch_s" not in PlanOptions().estimate_assumptions()
    for embedded in (True, False):
        assert PlanOptions(launch_s=0.002).estimate_assumptions(embedded=embedded)["launch_s"] == 0.002
