"""scripts/bench_engines.py on the tiny model: every contender generates exactly c x new tokens."""
import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def test_engine_and_generate_baselines_same_workload(random_model_dir, tmp_path, capsys):
    import bench_engines

    out = tmp_path / "b.json"
    assert bench_engines.main(["--model", random_model_dir, "--concurrency", "4", "8", "--new-tokens", "6",
                               "--baselines", "generate,generate_static", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["contenders"]) == {"hf", "generate", "generate_static"}
    for name, r in res["contenders"].items():
        for c in (4, 8):
            assert r[str(c)]["first"]["tokens"] == r[str(c)]["warm"]["tokens"] == c * 6, name
            assert r[str(c)]["warm"]["tokens_per_s"] > 0 and r[str(c)]["ms_per_step"] > 0
    assert "partial_update" in res["contenders"]["hf"]
    assert res["floor"] is None                      # the cpu has no bandwidth row: no floor unless --hbm-gbs
    table = capsys.readouterr().out
    assert "generate_static" in table and "warm tok/s" in table


def test_the_decode_step_is_set_against_the_memory_bandwidth_floor(random_model_dir, tmp_path, capsys):
    import bench_engines

    from fully_async.planner.hardware import Shape
    from fully_async.planner.stage_costs import decode_floor_s

    out = tmp_path / "b.json"
    assert bench_engines.main(["--model", random_model_dir, "--concurrency", "4", "--new-tokens", "6", "--baselines",
                               "", "--repeats", "1", "--no-updates", "--hbm-gbs", "50", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    r = res["contenders"]["hf"]["4"]
    shape = Shape.from_dir(random_model_dir)
    assert res["floor"] == {"hbm_gbs": 50.0, "source": "--hbm-gbs", "mean_context": 16 + 3.5}
    assert r["floor_ms"] == 1e3 * decode_floor_s(shape, 50.0, 4, 19.5, 4)        # float32: 4 bytes
    assert r["floor_fraction"] == r["floor_ms"] / r["ms_per_step"]
    assert "floor ms" in capsys.readouterr().out


def test_the_decode_floor_of_the_seed_shape_on_an_h200():
    """The issue's arithmetic: 0.5B-shaped (64-row vocabulary), 256 sequences at ~1,516 positions, bf16: ~0.72 GB
    of weights and ~4.8 GB of KV a step, ~1.14 ms at 4.8 TB/s."""
    from fully_async.planner.hardware import DEVICES, MODEL_SHAPES, Shape
    from fully_async.planner.stage_costs import decode_floor_s

    shape = Shape.of(dict(MODEL_SHAPES["Qwen2.5-0.5B"], vocab_size=64))
    assert shape.kv_bytes_per_token(2) == 12288
    floor = decode_floor_s(shape, DEVICES["h200"].hbm_gbs, 256, 1516)
    assert 1.10e-3 < floor < 1.18e-3
    assert decode_floor_s(shape, 4800.0, 0, 1516) == 2 * shape.matmul_params() / 4.8e12   # the weights alone


def test_resume_burst_reprefills_the_same_partials_under_each_budget(random_model_dir, tmp_path):
    """An abort update at full occupancy: every budget resumes the same partial responses (the budget applies from
    the resume on) and generates exactly what was left of them."""
    import bench_engines

    out = tmp_path / "b.json"
    assert bench_engines.main(["--model", random_model_dir, "--concurrency", "4", "--new-tokens", "24",
                               "--baselines", "", "--repeats", "1", "--no-updates", "--resume-budgets", "0", "40",
                               "--resume-after-steps", "6", "--out", str(out)]) == 0
    unbounded, budgeted = json.loads(out.read_text())["contenders"]["hf"]["resume_burst"]
    assert (unbounded["budget"], budgeted["budget"]) == (None, 40)
    for key in ("resumed", "prefix_tokens_mean", "prefix_tokens_max", "remaining_tokens"):
        assert unbounded[key] == budgeted[key], key
    assert unbounded["generated_tokens"] == unbounded["remaining_tokens"] == budgeted["generated_tokens"]
    assert unbounded["resumed"] > 0 and unbounded["prefix_tokens_max"] > 16   # prompts 16 + a partial response
    # with 8 requests on 4 slots, a 40-token budget admits fewer prefixes per step than no budget
    assert budgeted["collect_calls"] >= unbounded["collect_calls"]
    assert unbounded["admitted_s"] is not None and unbounded["finish_after_resume_s"] > 0
