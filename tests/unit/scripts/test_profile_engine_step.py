"""scripts/profile_engine_step.py on the tiny model (CPU): one case per (occupancy, context), its wall time per step
and the ops that take it."""
import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def test_profiles_each_case(random_model_dir, tmp_path, capsys):
    import profile_engine_step

    out = tmp_path / "p.json"
    assert profile_engine_step.main(["--model", random_model_dir, "--concurrency", "2", "4", "--warm", "3", "9",
                                     "--timed", "4", "--profiled", "2", "--eager", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    cases = [(c["concurrency"], c["context"]) for c in res["cases"]]
    assert cases == [(2, 19), (2, 25), (4, 19), (4, 25)] and res["graphs"] is False
    for case in res["cases"]:
        assert case["wall_ms_per_step"] > 0 and case["busy"] == "host ops" and case["busy_ms_per_step"] > 0
        assert case["kernels"] and all(k["ms_per_step"] > 0 and k["calls_per_step"] > 0 for k in case["kernels"])
    assert "c=4 context~25" in capsys.readouterr().out
