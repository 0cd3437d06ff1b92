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
