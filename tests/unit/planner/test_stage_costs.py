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
    c = estimate(shape, h100, mean_context=1000, assumptions={"bw_eff": 1.0, "launch_s": 0.0, "train_mfu": 0.5})
    assert c.decode_step_s == pytest.approx(2 * shape.params() / 3350e9)
    assert c.train_token_s == pytest.approx(6 * shape.matmul_params() / (989e12 * 0.5))
    tp2 = estimate(shape, h100, mean_context=1000, rollout_tp=2, train_mp=2, checkpointing=True, extra_forwards=1)
    base = estimate(shape, h100, mean_context=1000)
    assert tp2.decode_step_s < base.decode_step_s
    assert tp2.train_token_s == pytest.approx(base.train_token_s * 10 / 6 / 2)
