"""scripts/bench_engine_switch.py on the CPU: both ways (the old sleep, the arenas' stand-in) keep the responses in
flight through two switches and finish them as an engine that never slept does; the JSON says what each switch
cost and freed."""
import importlib.util
import json
import os

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts", "bench_engine_switch.py")


def test_bench_engine_switch_on_cpu(random_model_dir, tmp_path):
    spec = importlib.util.spec_from_file_location("bench_engine_switch", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "switch.json"
    rc = bench.main(["--model", random_model_dir, "--device", "cpu", "--dtype", "float32", "--slots", "4",
                     "--tokens", "30", "--max-len", "64", "--before", "8", "--after", "2", "--ways", "none,standin",
                     "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and list(result["ways"]) == ["none", "standin"]
    for way in result["ways"].values():
        assert way["identical_to_never_slept"] is True and way["responses"] == 4
        for cycle in ("switch_1", "switch_2"):
            c = way[cycle]
            assert c["memory/rollout/swap_gib"] > 0 and c["graph_captures_after_wake"] == 0
            assert c["switch_s"] >= c["sleep_s"] + c["wake_s"] > 0
    assert result["ways"]["standin"]["memory"] == "stand-in"
