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
    table = capsys.readouterr().out
    assert "generate_static" in table and "warm tok/s" in table


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
